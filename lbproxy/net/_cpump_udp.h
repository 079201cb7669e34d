/* lbproxy.net._cpump's UDP relay: a UDP virtual server's sessions in the pump's reactor.
 *
 * Not compiled on its own: _cpump.c includes it where it stands in the one translation
 * unit, after the reactor's types and helpers it uses (Reactor, Timed, the deadline
 * heap, the record barrier) and before the reactor's batches and Python face, which
 * call into it. One translation unit keeps every static function visible to the
 * compiler's inlining, as when this was part of _cpump.c.
 */

/* -- UDP: a virtual server's datagram relay ----------------------------------------------
 *
 * One UdpRelay per UDP listening socket, in the reactor's set (SLOT_UDP_LISTEN), and one
 * UdpSession per client address: a connected socket to the real server the Python side
 * picked (SLOT_UDP_SESSION), found by the client's address in the relay's hash table.
 * Client datagrams are read in recvmmsg batches; a datagram from a known client goes out
 * on its session's socket with no Python call. A client without a session costs one
 * Python call, on_open(client) -> session or None (the decision: ACL, caps, throttle,
 * scheduler, lease; it counts its own drops), and a session's end one more,
 * on_end(session, reason). A session's socket gives one datagram per event (level-
 * triggered), sent on to the client from the listening socket; `responses` bounds the
 * replies per request (nginx's proxy_responses: no amplification). A session the Python
 * side gave an `on_reply` (one opened to a failing server: its trial) costs one more
 * call, on_reply(session), at its first reply, which is the server's passive success;
 * every other reply costs the test of that field. The idle timeout is
 * the session's entry in the reactor's deadline heap, moved on only when it rings early.
 * Counts per real server (by the index the Python side gave the session) and the drops
 * met here accumulate in the relay until take_counts() collects them. */

#define UDP_BATCH 32  /* datagrams per recvmmsg */
#define UDP_ROUNDS 2  /* recvmmsg calls per readiness report of the listening socket */
#define UDP_BUFFER 65536 /* more than any UDP payload (65,507 over IPv4): never cut short */

enum { UDP_UNREQUESTED, UDP_SEND_ERROR, UDP_REPLY_ERROR, N_UDP_DROPS };
enum { END_RESPONSES, END_IDLE, END_REFUSED, END_CLOSED, END_STOPPED, END_ERROR, N_ENDS };
static const char *const end_text[N_ENDS] = {"responses", "idle_timeout", "refused",
                                             "closed", "stopped", "error"};
static PyObject *end_str[N_ENDS];
static PyObject *s_where_udp;

/* A client address as the table keys it (zeroed padding: compared with memcmp). */
typedef struct {
    uint16_t family;
    uint16_t port; /* network order */
    uint32_t scope;
    uint8_t addr[16];
} UdpKey;

typedef struct {
    long long datagrams[2], bytes[2]; /* [0]: client -> server, [1]: server -> client */
} UdpCounts;

typedef struct UdpRelay UdpRelay;
typedef struct UdpSession UdpSession;

struct UdpSession {
    PyObject_HEAD
    UdpRelay *relay; /* while in its relay's table (which holds a reference), else NULL */
    Timed timed;
    int fd;          /* the connected socket to the real server; -1 once closed */
    int index;       /* where its relay counts its datagrams */
    uint32_t hash;
    UdpKey key;
    PyObject *client, *server, *lease, *source; /* for the Python side */
    PyObject *on_reply; /* called once, at the first reply; NULL: nothing to call */
    double started, last, idle_timeout, own_idle_timeout;
    long long requests, replies, bytes_in, bytes_out;
};

struct UdpRelay {
    PyObject_HEAD
    Reactor *reactor; /* strong while open; NULL once closed */
    int fd;           /* the listening socket (the Python side owns it) */
    PyObject *on_open, *on_end;
    int responses;    /* replies per request; -1: unlimited */
    UdpSession **table; /* open addressing, linear probing; NULL: a free place */
    size_t table_cap, count;
    UdpCounts *counts;
    int n_counts;
    long long dropped[N_UDP_DROPS];
};

static PyTypeObject UdpRelay_Type;
static PyTypeObject UdpSession_Type;

#define SESSION_OF(t) ((UdpSession *)((char *)(t)-offsetof(UdpSession, timed)))

/* Received datagrams: one buffer per message of a batch, for every relay (a batch is
 * handled before another starts); untouched pages cost no memory. */
static char *udp_buffers;
static struct mmsghdr udp_msgs[UDP_BATCH];
static struct iovec udp_iov[UDP_BATCH];
static struct sockaddr_storage udp_names[UDP_BATCH];

static int
udp_buffers_ready(void)
{
    if (udp_buffers != NULL)
        return 0;
    udp_buffers = PyMem_RawMalloc((size_t)UDP_BATCH * UDP_BUFFER);
    if (udp_buffers == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* The key of an AF_INET/AF_INET6 address: 0, or -1 for another family. */
static int
udp_key(const struct sockaddr *sa, UdpKey *k, uint32_t *hash)
{
    memset(k, 0, sizeof *k);
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)sa;
        k->family = AF_INET;
        k->port = a->sin_port;
        memcpy(k->addr, &a->sin_addr, 4);
    }
    else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)sa;
        k->family = AF_INET6;
        k->port = a->sin6_port;
        k->scope = a->sin6_scope_id;
        memcpy(k->addr, &a->sin6_addr, 16);
    }
    else
        return -1;
    /* FNV-1a over the key, then a final mix: clients of one host differ in the port */
    uint64_t h = 1469598103934665603ULL;
    const uint8_t *b = (const uint8_t *)k;
    for (size_t i = 0; i < sizeof *k; i++)
        h = (h ^ b[i]) * 1099511628211ULL;
    h ^= h >> 29;
    *hash = (uint32_t)(h ^ (h >> 32));
    return 0;
}

/* The sockaddr a reply goes to. */
static socklen_t
udp_sockaddr(const UdpKey *k, struct sockaddr_storage *ss)
{
    memset(ss, 0, sizeof(struct sockaddr_in6));
    if (k->family == AF_INET) {
        struct sockaddr_in *a = (struct sockaddr_in *)ss;
        a->sin_family = AF_INET;
        a->sin_port = k->port;
        memcpy(&a->sin_addr, k->addr, 4);
        return sizeof *a;
    }
    struct sockaddr_in6 *a = (struct sockaddr_in6 *)ss;
    a->sin6_family = AF_INET6;
    a->sin6_port = k->port;
    a->sin6_scope_id = k->scope;
    memcpy(&a->sin6_addr, k->addr, 16);
    return sizeof *a;
}

/* The address as the socket module gives it: (host, port), or (host, port, flowinfo,
 * scope_id) for IPv6. */
static PyObject *
udp_address(const struct sockaddr *sa)
{
    char host[NI_MAXHOST];
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)sa;
        if (inet_ntop(AF_INET, &a->sin_addr, host, sizeof host) == NULL)
            return PyErr_SetFromErrno(PyExc_OSError);
        return Py_BuildValue("(si)", host, ntohs(a->sin_port));
    }
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)sa;
    int e = getnameinfo(sa, sizeof *a, host, sizeof host, NULL, 0, NI_NUMERICHOST);
    if (e != 0) {
        PyErr_SetString(PyExc_OSError, gai_strerror(e));
        return NULL;
    }
    return Py_BuildValue("(siII)", host, ntohs(a->sin6_port), (unsigned int)ntohl(a->sin6_flowinfo),
                         (unsigned int)a->sin6_scope_id);
}

/* -- the table of sessions by client address -- */

static UdpSession *
ut_find(UdpRelay *u, const UdpKey *k, uint32_t hash)
{
    if (u->table_cap == 0)
        return NULL;
    size_t mask = u->table_cap - 1;
    for (size_t i = hash & mask;; i = (i + 1) & mask) {
        UdpSession *s = u->table[i];
        if (s == NULL)
            return NULL;
        if (s->hash == hash && memcmp(&s->key, k, sizeof *k) == 0)
            return s;
    }
}

static void
ut_place(UdpSession **table, size_t cap, UdpSession *s)
{
    size_t mask = cap - 1, i = s->hash & mask;
    while (table[i] != NULL)
        i = (i + 1) & mask;
    table[i] = s;
}

/* s into the table (which takes a reference): 0, or -1 with MemoryError. */
static int
ut_insert(UdpRelay *u, UdpSession *s)
{
    if (2 * (u->count + 1) > u->table_cap) { /* at most half full */
        size_t cap = u->table_cap ? 2 * u->table_cap : 64;
        UdpSession **grown = PyMem_Calloc(cap, sizeof *grown);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (size_t i = 0; i < u->table_cap; i++)
            if (u->table[i] != NULL)
                ut_place(grown, cap, u->table[i]);
        PyMem_Free(u->table);
        u->table = grown;
        u->table_cap = cap;
    }
    ut_place(u->table, u->table_cap, s);
    Py_INCREF(s);
    u->count++;
    return 0;
}

/* s out of the table (linear probing's backward shift: no tombstones); the table's
 * reference is the caller's now. */
static void
ut_remove(UdpRelay *u, UdpSession *s)
{
    size_t mask = u->table_cap - 1, i = s->hash & mask;
    while (u->table[i] != s) {
        if (u->table[i] == NULL)
            return;
        i = (i + 1) & mask;
    }
    u->table[i] = NULL;
    u->count--;
    for (size_t j = (i + 1) & mask; u->table[j] != NULL; j = (j + 1) & mask) {
        size_t home = u->table[j]->hash & mask;
        /* the entry at j may move to the hole at i if its home is not in (i, j] */
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            u->table[i] = u->table[j];
            u->table[j] = NULL;
            i = j;
        }
    }
}

/* -- sessions -- */

/* Out of its relay (table, reactor slot, heap), its socket closed: the table's
 * reference handed to the caller (NULL: it was not in a relay). No Python call. */
static UdpSession *
us_detach(UdpSession *s)
{
    UdpRelay *u = s->relay;
    if (u == NULL)
        return NULL;
    s->relay = NULL;
    ut_remove(u, s);
    Reactor *r = u->reactor;
    if (r != NULL) {
        rx_slot_clear(r, s->fd, (PyObject *)s);
        heap_remove(r, &s->timed);
    }
    if (s->fd >= 0) {
        close(s->fd); /* which takes it out of the epoll set */
        s->fd = -1;
    }
    return s;
}

/* End s: detach, then on_end(session, reason) once (its failure counted). */
static void
us_end(UdpSession *s, int reason)
{
    UdpRelay *u = s->relay;
    if (u == NULL)
        return;
    Py_INCREF(u);
    UdpSession *ref = us_detach(s);
    python_ran++;
    if (u->on_end != NULL) {
        PyObject *args[2] = {(PyObject *)s, end_str[reason]};
        PyObject *res = PyObject_Vectorcall(u->on_end, args, 2, NULL);
        if (res == NULL) {
            if (PyErr_ExceptionMatches(PyExc_Exception))
                rx_record(u->reactor, s_where_connection_end);
            else
                PyErr_WriteUnraisable(u->on_end);
        }
        Py_XDECREF(res);
    }
    /* the lease points back at the session: the cycle is broken here, not by the GC */
    Py_CLEAR(s->lease);
    Py_CLEAR(s->on_reply);
    Py_XDECREF(ref);
    Py_DECREF(u);
}

/* Its idle deadline rang (the reactor's expire): ended if idle that long, else moved. */
static void
us_ring(Reactor *r, UdpSession *s, double now)
{
    double due = s->last + s->idle_timeout;
    if (s->relay == NULL) { /* cannot be: an ended session leaves the heap */
        heap_remove(r, &s->timed);
        return;
    }
    if (now >= due) {
        Py_INCREF(s);
        us_end(s, END_IDLE);
        Py_DECREF(s);
        return;
    }
    s->timed.due = due;
    heap_down(r, s->timed.heap_index);
}

/* s's first reply, when the Python side asked for it: on_reply(session) once. */
static void
us_answered(UdpSession *s)
{
    PyObject *on_reply = s->on_reply;
    s->on_reply = NULL; /* once per session, never per datagram */
    python_ran++;
    PyObject *res = PyObject_CallOneArg(on_reply, (PyObject *)s);
    if (res == NULL) {
        if (PyErr_ExceptionMatches(PyExc_Exception))
            rx_record(s->relay == NULL ? NULL : s->relay->reactor, s_where_udp);
        else
            PyErr_WriteUnraisable(on_reply);
    }
    Py_XDECREF(res);
    Py_DECREF(on_reply);
}

/* A datagram from the real server (s's socket readable, or an error on it). */
static void
us_on_event(UdpSession *s)
{
    UdpRelay *u = s->relay;
    char *buf = udp_buffers;
    ssize_t n = recv(s->fd, buf, UDP_BUFFER, MSG_DONTWAIT);
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
            return;
        us_end(s, errno == ECONNREFUSED ? END_REFUSED : END_ERROR);
        return;
    }
    if (rx_now(u->reactor, &s->last) < 0) {
        rx_record(u->reactor, s_where_udp);
        return;
    }
    if (s->on_reply != NULL) { /* the server answered: even a reply dropped below counts */
        Py_INCREF(s);
        us_answered(s);
        int ended = s->relay != u; /* by on_reply (a health change that closes sessions) */
        Py_DECREF(s);
        if (ended)
            return;
    }
    long long allowed = u->responses < 0 ? -1 : s->requests * u->responses;
    if (allowed >= 0 && s->replies >= allowed) {
        u->dropped[UDP_UNREQUESTED]++; /* no amplification */
        return;
    }
    struct sockaddr_storage to;
    socklen_t len = udp_sockaddr(&s->key, &to);
    if (sendto(u->fd, buf, (size_t)n, MSG_DONTWAIT, (struct sockaddr *)&to, len) < 0) {
        u->dropped[UDP_REPLY_ERROR]++; /* a full buffer or a client gone: it is lost */
        return;
    }
    s->replies++;
    s->bytes_out += n;
    UdpCounts *c = &u->counts[s->index];
    c->datagrams[1]++;
    c->bytes[1] += n;
    if (u->responses > 0 && s->replies >= allowed)
        us_end(s, END_RESPONSES);
}

/* -- the relay -- */

/* A new session for `client` (its sockaddr `sa`): on_open decides. The session, borrowed
 * (its relay's table holds it); NULL with no exception when none opens; NULL with an
 * exception that is not an Exception, which leaves the batch. */
static UdpSession *
ur_open(UdpRelay *u, const struct sockaddr *sa, const UdpKey *k, uint32_t hash, double now)
{
    Reactor *r = u->reactor;
    PyObject *client = udp_address(sa);
    if (client == NULL)
        goto failed;
    python_ran++;
    PyObject *res = PyObject_CallOneArg(u->on_open, client);
    if (res == NULL) {
        Py_DECREF(client);
        goto failed;
    }
    if (res == Py_None) {
        Py_DECREF(res);
        Py_DECREF(client);
        return NULL;
    }
    if (!PyObject_TypeCheck(res, &UdpSession_Type) || ((UdpSession *)res)->relay != NULL ||
        ((UdpSession *)res)->fd < 0) {
        PyErr_SetString(PyExc_TypeError, "on_open() must return a new session or None");
        Py_DECREF(res);
        Py_DECREF(client);
        goto failed;
    }
    UdpSession *s = (UdpSession *)res;
    Py_XSETREF(s->client, client);
    s->key = *k;
    s->hash = hash;
    s->started = s->last = now;
    if (u->reactor != r || r == NULL || r->epfd < 0) { /* closed by on_open */
        python_ran++;
        PyObject *done = u->on_end == NULL ? NULL :
            PyObject_CallFunctionObjArgs(u->on_end, (PyObject *)s, end_str[END_STOPPED], NULL);
        if (done == NULL && PyErr_Occurred())
            rx_record(r, s_where_connection_end);
        Py_XDECREF(done);
        Py_CLEAR(s->lease);
        Py_DECREF(s);
        return NULL;
    }
    if (ut_insert(u, s) < 0) {
        Py_DECREF(s);
        goto failed;
    }
    s->relay = u;
    Py_DECREF(s); /* the table's reference remains */
    if (rx_slot_room(r, s->fd) < 0 || r->slots[s->fd].kind != SLOT_FREE ||
        rx_ctl(r, EPOLL_CTL_ADD, s->fd, EPOLLIN) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetFromErrno(PyExc_OSError);
        rx_record(r, s_where_udp);
        Py_INCREF(s);
        us_end(s, END_ERROR);
        Py_DECREF(s);
        return NULL;
    }
    r->slots[s->fd].kind = SLOT_UDP_SESSION;
    r->slots[s->fd].obj = (PyObject *)s;
    if (rx_arm(r, &s->timed, now + s->idle_timeout) < 0) {
        rx_record(r, s_where_udp);
        Py_INCREF(s);
        us_end(s, END_ERROR);
        Py_DECREF(s);
        return NULL;
    }
    return s;
failed:
    if (PyErr_ExceptionMatches(PyExc_Exception)) {
        rx_record(r, s_where_udp);
        return NULL;
    }
    return NULL; /* the exception stays set */
}

/* One client datagram: to its session's server, a session opened first if need be.
 * 0, or -1 with an exception that is not an Exception. */
static int
ur_datagram(UdpRelay *u, const struct sockaddr *sa, const char *data, size_t len, double now)
{
    UdpKey k;
    uint32_t hash;
    if (udp_key(sa, &k, &hash) < 0)
        return 0;
    UdpSession *s = ut_find(u, &k, hash);
    if (s == NULL) {
        s = ur_open(u, sa, &k, hash, now);
        if (s == NULL)
            return PyErr_Occurred() ? -1 : 0;
    }
    s->requests++;
    s->last = now;
    if (send(s->fd, data, len, MSG_DONTWAIT) < 0) {
        if (errno == ECONNREFUSED) { /* an earlier datagram's ICMP port unreachable */
            Py_INCREF(s);
            us_end(s, END_REFUSED);
            Py_DECREF(s);
        }
        else
            u->dropped[UDP_SEND_ERROR]++;
        return 0;
    }
    s->bytes_in += (long long)len;
    UdpCounts *c = &u->counts[s->index];
    c->datagrams[0]++;
    c->bytes[0] += (long long)len;
    return 0;
}

/* The listening socket is readable: up to UDP_ROUNDS batches of datagrams. 0, or -1
 * with an exception that is not an Exception (it leaves the reactor's batch). */
static int
ur_from_clients(UdpRelay *u)
{
    Py_INCREF(u);
    int result = 0;
    for (int round = 0; round < UDP_ROUNDS && u->reactor != NULL; round++) {
        for (int i = 0; i < UDP_BATCH; i++) {
            udp_iov[i].iov_base = udp_buffers + (size_t)i * UDP_BUFFER;
            udp_iov[i].iov_len = UDP_BUFFER;
            memset(&udp_msgs[i].msg_hdr, 0, sizeof udp_msgs[i].msg_hdr);
            udp_msgs[i].msg_hdr.msg_iov = &udp_iov[i];
            udp_msgs[i].msg_hdr.msg_iovlen = 1;
            udp_msgs[i].msg_hdr.msg_name = &udp_names[i];
            udp_msgs[i].msg_hdr.msg_namelen = sizeof udp_names[i];
        }
        int n = recvmmsg(u->fd, udp_msgs, UDP_BATCH, MSG_DONTWAIT, NULL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            continue; /* EINTR, or an error queued on the socket (read, so cleared) */
        }
        double now;
        if (rx_now(u->reactor, &now) < 0) {
            rx_record(u->reactor, s_where_udp);
            break;
        }
        for (int i = 0; i < n && u->reactor != NULL; i++) {
            if (ur_datagram(u, (struct sockaddr *)&udp_names[i], udp_iov[i].iov_base,
                            udp_msgs[i].msg_len, now) < 0) {
                result = -1;
                break;
            }
        }
        if (result < 0 || n < UDP_BATCH)
            break;
    }
    Py_DECREF(u);
    return result;
}

/* Every session ends; with `callbacks` each one's on_end(session, "stopped") is called,
 * else (a collection) none is. The table is taken as it is now (on_end may end others). */
static void
ur_end_all(UdpRelay *u, int callbacks)
{
    while (u->count > 0) {
        size_t n = 0, cap = u->count;
        UdpSession **all = PyMem_Malloc(cap * sizeof *all);
        if (all == NULL) { /* no room for the list: one at a time, from the start */
            for (size_t i = 0; i < u->table_cap; i++)
                if (u->table[i] != NULL) {
                    all = &u->table[i];
                    break;
                }
            UdpSession *s = all == NULL ? NULL : (UdpSession *)Py_NewRef(*all);
            if (s == NULL)
                return;
            if (callbacks)
                us_end(s, END_STOPPED);
            else
                Py_XDECREF(us_detach(s));
            Py_DECREF(s);
            continue;
        }
        for (size_t i = 0; i < u->table_cap && n < cap; i++)
            if (u->table[i] != NULL)
                all[n++] = (UdpSession *)Py_NewRef(u->table[i]);
        for (size_t i = 0; i < n; i++) {
            if (all[i]->relay == u) {
                if (callbacks)
                    us_end(all[i], END_STOPPED);
                else
                    Py_XDECREF(us_detach(all[i]));
            }
            Py_DECREF(all[i]);
        }
        PyMem_Free(all);
    }
}

/* Out of the reactor: sessions ended, the listening socket out of the set. The caller
 * holds a reference to u (or is its dealloc). */
static void
ur_close(UdpRelay *u, int callbacks)
{
    ur_end_all(u, callbacks);
    Reactor *r = u->reactor;
    if (r != NULL) {
        u->reactor = NULL;
        if (r->epfd >= 0 && u->fd >= 0 && u->fd < r->n_slots &&
            r->slots[u->fd].obj == (PyObject *)u) {
            struct epoll_event ev;
            epoll_ctl(r->epfd, EPOLL_CTL_DEL, u->fd, &ev);
        }
        rx_slot_clear(r, u->fd, (PyObject *)u);
        Py_DECREF(r);
    }
}

/* -- UdpSession's Python face -- */

static int
UdpSession_traverse(UdpSession *s, visitproc visit, void *arg)
{
    Py_VISIT(s->client);
    Py_VISIT(s->server);
    Py_VISIT(s->lease);
    Py_VISIT(s->source);
    Py_VISIT(s->on_reply);
    return 0;
}

static int
UdpSession_clear(UdpSession *s)
{
    Py_CLEAR(s->client);
    Py_CLEAR(s->server);
    Py_CLEAR(s->lease);
    Py_CLEAR(s->source);
    Py_CLEAR(s->on_reply);
    return 0;
}

static void
UdpSession_dealloc(UdpSession *s)
{
    PyObject_GC_UnTrack(s);
    UdpSession_clear(s);
    if (s->fd >= 0) /* never in a relay (on_open failed after making it) */
        close(s->fd);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *
UdpSession_close(UdpSession *s, PyObject *unused)
{
    Py_INCREF(s);
    us_end(s, END_CLOSED);
    Py_DECREF(s);
    Py_RETURN_NONE;
}

static PyObject *
UdpSession_get_flow(UdpSession *s, void *c)
{
    return Py_NewRef(s);
}

/* An idle_timeout attribute's new value (a pump's or a UDP session's): seconds, or
 * math.inf for none; -1 with the exception set for a deletion or a non-number. */
static int
idle_timeout_arg(PyObject *value, double *seconds)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "idle_timeout cannot be deleted");
        return -1;
    }
    *seconds = PyFloat_AsDouble(value);
    if (*seconds == -1.0 && PyErr_Occurred())
        return -1;
    if (isnan(*seconds)) {
        PyErr_SetString(PyExc_ValueError, "idle_timeout must be a number of seconds or math.inf");
        return -1;
    }
    return 0;
}

static PyObject *
UdpSession_get_idle_timeout(UdpSession *s, void *c)
{
    return PyFloat_FromDouble(s->idle_timeout);
}

static int
UdpSession_set_idle_timeout(UdpSession *s, PyObject *value, void *c)
{
    double seconds;
    if (idle_timeout_arg(value, &seconds) < 0)
        return -1;
    s->idle_timeout = seconds;
    UdpRelay *u = s->relay;
    if (u == NULL || u->reactor == NULL)
        return 0;
    /* at once: idle that long already ends it now, else its deadline moves */
    double now;
    if (rx_now(u->reactor, &now) < 0)
        return -1;
    double due = s->last + seconds;
    if (now >= due) {
        Py_INCREF(s);
        us_end(s, END_IDLE);
        Py_DECREF(s);
        return 0;
    }
    return rx_arm(u->reactor, &s->timed, due);
}

static PyObject *
UdpSession_get_on_reply(UdpSession *s, void *c)
{
    return Py_NewRef(s->on_reply == NULL ? Py_None : s->on_reply);
}

static int
UdpSession_set_on_reply(UdpSession *s, PyObject *value, void *c)
{
    if (value == Py_None)
        value = NULL;
    if (value != NULL && !PyCallable_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "on_reply must be callable or None");
        return -1;
    }
    Py_XSETREF(s->on_reply, Py_XNewRef(value));
    return 0;
}

static PyObject *
UdpSession_get_open(UdpSession *s, void *c)
{
    return PyBool_FromLong(s->relay != NULL);
}

static PyMethodDef UdpSession_methods[] = {
    {"close", (PyCFunction)UdpSession_close, METH_NOARGS,
     "close(): end it now (on_end's reason \"closed\"); nothing once it has ended"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef UdpSession_members[] = {
    {"client", T_OBJECT, offsetof(UdpSession, client), READONLY,
     "the client's address, as the socket module gives it"},
    {"server", T_OBJECT, offsetof(UdpSession, server), 0, "the Python side's: its server"},
    {"lease", T_OBJECT, offsetof(UdpSession, lease), 0, "the Python side's: its lease"},
    {"source", T_OBJECT, offsetof(UdpSession, source), 0,
     "the Python side's: what it counts under per source"},
    {"own_idle_timeout", T_DOUBLE, offsetof(UdpSession, own_idle_timeout), 0,
     "the Python side's: its idle timeout when nothing shortens it"},
    {"fd", T_INT, offsetof(UdpSession, fd), READONLY, "its socket to the real server (-1: closed)"},
    {"started", T_DOUBLE, offsetof(UdpSession, started), READONLY, "the run's time it opened"},
    {"last", T_DOUBLE, offsetof(UdpSession, last), READONLY,
     "the run's time of its last datagram either way"},
    {"requests", T_LONGLONG, offsetof(UdpSession, requests), READONLY, "client datagrams"},
    {"replies", T_LONGLONG, offsetof(UdpSession, replies), READONLY,
     "real-server datagrams passed on"},
    {"bytes_in", T_LONGLONG, offsetof(UdpSession, bytes_in), READONLY,
     "client -> real server bytes sent"},
    {"bytes_out", T_LONGLONG, offsetof(UdpSession, bytes_out), READONLY,
     "real server -> client bytes sent"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef UdpSession_getset[] = {
    {"flow", (getter)UdpSession_get_flow, NULL, "itself (what a lease's handle has)", NULL},
    {"idle_timeout", (getter)UdpSession_get_idle_timeout, (setter)UdpSession_set_idle_timeout,
     "seconds without a datagram either way that end it; a new value applies at once", NULL},
    {"open", (getter)UdpSession_get_open, NULL, "in its relay (not ended)", NULL},
    {"on_reply", (getter)UdpSession_get_on_reply, (setter)UdpSession_set_on_reply,
     "called as on_reply(session) at its first reply from the real server, once, then\n"
     "None (a reply dropped as unrequested counts); None: nothing is called", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject UdpSession_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lbproxy.net._cpump.UdpSession",
    .tp_basicsize = sizeof(UdpSession),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One client address's UDP session, made by UdpRelay.session().",
    .tp_dealloc = (destructor)UdpSession_dealloc,
    .tp_traverse = (traverseproc)UdpSession_traverse,
    .tp_clear = (inquiry)UdpSession_clear,
    .tp_methods = UdpSession_methods,
    .tp_members = UdpSession_members,
    .tp_getset = UdpSession_getset,
};

/* -- UdpRelay's Python face -- */

static int
UdpRelay_traverse(UdpRelay *u, visitproc visit, void *arg)
{
    Py_VISIT(u->reactor);
    Py_VISIT(u->on_open);
    Py_VISIT(u->on_end);
    for (size_t i = 0; i < u->table_cap; i++)
        Py_VISIT(u->table[i]);
    return 0;
}

static int
UdpRelay_clear(UdpRelay *u)
{
    ur_close(u, 0);
    Py_CLEAR(u->on_open);
    Py_CLEAR(u->on_end);
    return 0;
}

static void
UdpRelay_dealloc(UdpRelay *u)
{
    PyObject_GC_UnTrack(u);
    UdpRelay_clear(u);
    PyMem_Free(u->table);
    PyMem_Free(u->counts);
    Py_TYPE(u)->tp_free((PyObject *)u);
}

PyDoc_STRVAR(udp_session_doc,
    "session(sockaddr, idle_timeout, index, server, lease, source, own_idle_timeout)\n"
    "    -> UdpSession\n\n"
    "A socket connected to `sockaddr` (what sockaddr() made), for on_open to return; its\n"
    "datagrams count under `index` in take_counts(); server, lease, source and\n"
    "own_idle_timeout are the Python side's, kept on it. Raises OSError when the socket\n"
    "cannot be made or connected.");

static PyObject *
UdpRelay_session(UdpRelay *u, PyObject *args)
{
    Py_buffer addr;
    double idle, own_idle;
    int index;
    PyObject *server, *lease, *source;
    if (!PyArg_ParseTuple(args, "y*diOOOd:session", &addr, &idle, &index, &server, &lease,
                          &source, &own_idle))
        return NULL;
    if (addr.len < (Py_ssize_t)sizeof(sa_family_t) ||
        addr.len > (Py_ssize_t)sizeof(struct sockaddr_storage) || index < 0 ||
        index >= (1 << 20) || isnan(idle)) {
        PyBuffer_Release(&addr);
        PyErr_SetString(PyExc_ValueError, "session(): a sockaddr, seconds and an index");
        return NULL;
    }
    struct sockaddr_storage ss;
    socklen_t len = (socklen_t)addr.len;
    memcpy(&ss, addr.buf, len);
    PyBuffer_Release(&addr);
    if (index >= u->n_counts) {
        int n = u->n_counts ? u->n_counts : 8;
        while (n <= index)
            n *= 2;
        UdpCounts *grown = PyMem_Realloc(u->counts, (size_t)n * sizeof *grown);
        if (grown == NULL)
            return PyErr_NoMemory();
        memset(grown + u->n_counts, 0, (size_t)(n - u->n_counts) * sizeof *grown);
        u->counts = grown;
        u->n_counts = n;
    }
    int fd = socket(ss.ss_family, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if (connect(fd, (struct sockaddr *)&ss, len) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        close(fd);
        return NULL;
    }
    UdpSession *s = PyObject_GC_New(UdpSession, &UdpSession_Type);
    if (s == NULL) {
        close(fd);
        return NULL;
    }
    memset((char *)s + sizeof(PyObject), 0, sizeof(UdpSession) - sizeof(PyObject));
    s->fd = fd;
    s->index = index;
    s->timed.heap_index = -1;
    s->timed.kind = TIMED_SESSION;
    s->idle_timeout = idle;
    s->own_idle_timeout = own_idle;
    s->server = Py_NewRef(server);
    s->lease = Py_NewRef(lease);
    s->source = Py_NewRef(source);
    PyObject_GC_Track(s);
    return (PyObject *)s;
}

static PyObject *
UdpRelay_take_counts(UdpRelay *u, PyObject *unused)
{
    PyObject *rows = PyList_New(0);
    if (rows == NULL)
        return NULL;
    for (int i = 0; i < u->n_counts; i++) {
        UdpCounts *c = &u->counts[i];
        if (!(c->datagrams[0] | c->datagrams[1] | c->bytes[0] | c->bytes[1]))
            continue;
        PyObject *row = Py_BuildValue("(iLLLL)", i, c->datagrams[0], c->datagrams[1],
                                      c->bytes[0], c->bytes[1]);
        if (row == NULL || PyList_Append(rows, row) < 0) {
            Py_XDECREF(row);
            Py_DECREF(rows);
            return NULL;
        }
        Py_DECREF(row);
        memset(c, 0, sizeof *c);
    }
    PyObject *result = Py_BuildValue("(N(LLL))", rows, u->dropped[UDP_UNREQUESTED],
                                     u->dropped[UDP_SEND_ERROR], u->dropped[UDP_REPLY_ERROR]);
    if (result != NULL)
        memset(u->dropped, 0, sizeof u->dropped);
    return result;
}

static PyObject *
UdpRelay_sessions(UdpRelay *u, PyObject *unused)
{
    PyObject *list = PyList_New(0);
    if (list == NULL)
        return NULL;
    for (size_t i = 0; i < u->table_cap; i++)
        if (u->table[i] != NULL && PyList_Append(list, (PyObject *)u->table[i]) < 0) {
            Py_DECREF(list);
            return NULL;
        }
    return list;
}

static PyObject *
UdpRelay_close(UdpRelay *u, PyObject *unused)
{
    ur_close(u, 1);
    Py_RETURN_NONE;
}

static PyObject *
UdpRelay_get_responses(UdpRelay *u, void *c)
{
    if (u->responses < 0)
        Py_RETURN_NONE;
    return PyLong_FromLong(u->responses);
}

static int
UdpRelay_set_responses(UdpRelay *u, PyObject *value, void *c)
{
    if (value == NULL || value == Py_None) {
        u->responses = -1;
        return 0;
    }
    long n = PyLong_AsLong(value);
    if (n == -1 && PyErr_Occurred())
        return -1;
    if (n < 0 || n > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "responses: None or a number from 0");
        return -1;
    }
    u->responses = (int)n;
    return 0;
}

static PyObject *
UdpRelay_get_count(UdpRelay *u, void *c)
{
    return PyLong_FromSize_t(u->count);
}

static PyObject *
UdpRelay_get_closed(UdpRelay *u, void *c)
{
    return PyBool_FromLong(u->reactor == NULL);
}

static PyMethodDef UdpRelay_methods[] = {
    {"session", (PyCFunction)UdpRelay_session, METH_VARARGS, udp_session_doc},
    {"take_counts", (PyCFunction)UdpRelay_take_counts, METH_NOARGS,
     "take_counts() -> ([(index, datagrams_in, datagrams_out, bytes_in, bytes_out)],\n"
     "(unrequested, send_error, reply_error)): what was counted since the last call"},
    {"sessions", (PyCFunction)UdpRelay_sessions, METH_NOARGS,
     "sessions() -> [UdpSession]: the open sessions"},
    {"close", (PyCFunction)UdpRelay_close, METH_NOARGS,
     "close(): every session ends (on_end's reason \"stopped\"), then the listening socket\n"
     "leaves the reactor (the caller still owns it); idempotent"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef UdpRelay_getset[] = {
    {"responses", (getter)UdpRelay_get_responses, (setter)UdpRelay_set_responses,
     "replies passed on per request (None: unlimited; 0: none)", NULL},
    {"count", (getter)UdpRelay_get_count, NULL, "how many sessions are open", NULL},
    {"closed", (getter)UdpRelay_get_closed, NULL, "close() was called", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject UdpRelay_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lbproxy.net._cpump.UdpRelay",
    .tp_basicsize = sizeof(UdpRelay),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A UDP listening socket's sessions in a reactor: made by Reactor.udp().",
    .tp_dealloc = (destructor)UdpRelay_dealloc,
    .tp_traverse = (traverseproc)UdpRelay_traverse,
    .tp_clear = (inquiry)UdpRelay_clear,
    .tp_methods = UdpRelay_methods,
    .tp_getset = UdpRelay_getset,
};


PyDoc_STRVAR(udp_doc,
    "udp(fd, on_open, on_end) -> UdpRelay\n\n"
    "Relay the datagrams of the bound, non-blocking UDP socket `fd` (which the caller\n"
    "keeps, and closes only after the relay's close()): on_open(client) for a client\n"
    "address without a session returns one (UdpRelay.session()) or None (the datagram is\n"
    "dropped); on_end(session, reason) once per session at its end, reason one of\n"
    "\"responses\", \"idle_timeout\", \"refused\" (ICMP port unreachable), \"closed\",\n"
    "\"stopped\", \"error\".");

static PyObject *
Reactor_udp(Reactor *r, PyObject *args)
{
    int fd;
    PyObject *on_open, *on_end;
    if (!PyArg_ParseTuple(args, "iOO:udp", &fd, &on_open, &on_end))
        return NULL;
    if (!PyCallable_Check(on_open) || !PyCallable_Check(on_end)) {
        PyErr_SetString(PyExc_TypeError, "udp(): on_open and on_end must be callable");
        return NULL;
    }
    if (r->epfd < 0) {
        PyErr_SetString(PyExc_ValueError, "the reactor is closed");
        return NULL;
    }
    if (udp_buffers_ready() < 0 || rx_slot_room(r, fd) < 0)
        return NULL;
    if (r->slots[fd].kind != SLOT_FREE) {
        PyErr_SetString(PyExc_ValueError, "udp(): the descriptor is in the reactor already");
        return NULL;
    }
    UdpRelay *u = PyObject_GC_New(UdpRelay, &UdpRelay_Type);
    if (u == NULL)
        return NULL;
    memset((char *)u + sizeof(PyObject), 0, sizeof(UdpRelay) - sizeof(PyObject));
    u->fd = fd;
    u->responses = -1;
    u->on_open = Py_NewRef(on_open);
    u->on_end = Py_NewRef(on_end);
    PyObject_GC_Track(u);
    if (rx_ctl(r, EPOLL_CTL_ADD, fd, EPOLLIN) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(u);
        return NULL;
    }
    u->reactor = (Reactor *)Py_NewRef(r);
    r->slots[fd].kind = SLOT_UDP_LISTEN;
    r->slots[fd].obj = Py_NewRef(u); /* the slot's reference */
    return (PyObject *)u;
}

static int
udp_init(PyObject *m)
{
    for (int i = 0; i < N_ENDS; i++) {
        end_str[i] = PyUnicode_InternFromString(end_text[i]);
        if (end_str[i] == NULL)
            return -1;
    }
    s_where_udp = PyUnicode_InternFromString("connection");
    if (s_where_udp == NULL || PyType_Ready(&UdpRelay_Type) < 0 ||
        PyType_Ready(&UdpSession_Type) < 0)
        return -1;
    Py_INCREF(&UdpRelay_Type);
    if (PyModule_AddObject(m, "UdpRelay", (PyObject *)&UdpRelay_Type) < 0) {
        Py_DECREF(&UdpRelay_Type);
        return -1;
    }
    Py_INCREF(&UdpSession_Type);
    if (PyModule_AddObject(m, "UdpSession", (PyObject *)&UdpSession_Type) < 0) {
        Py_DECREF(&UdpSession_Type);
        return -1;
    }
    return 0;
}
