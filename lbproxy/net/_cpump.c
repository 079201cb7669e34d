/* lbproxy.net._cpump: the connection path in C, optional (lbproxy/net/compiled.py).
 *
 * What every connection and every chunk goes through: the pump and its reactor (one
 * epoll set per trio run, its batches, its wait in trio's place; each pump's two
 * directions with HAProxy's splice-auto -- small chunks copied with recv/send, bulk
 * ones spliced socket -> pipe -> socket through a pipe from a pool), accept4 for the
 * accept loop, the connect to a real server, the run's clock, and the UDP relay (a UDP
 * virtual server's sessions in the same reactor: lbproxy/dataplane/udp.py; its code is in
 * _cpump_udp.h, included below as part of this one translation unit). The pump's API is
 * lbproxy/net/reactor.py's `Reactor` and `Pump` protocols; lbproxy/net/pure_pump.py is
 * the same API in Python, and tests/integration/test_pump_differential.py checks that
 * both behave alike.
 *
 * Python is reached only through what it passes in: callables (a pump's on_end, the
 * reactor's record, wake and splice_refused, a listener's callback, the accept loop's
 * owner), never an attribute looked up by name on a pump's behalf. No error here may
 * take the process down: a Python exception met while handling one pump's event ends
 * that pump ("error") and is counted (record("pump", exc): the exception barrier,
 * lbproxy_internal_errors_total{where="pump"}); only a BaseException that is not an
 * Exception (KeyboardInterrupt, trio's Cancelled) leaves a batch.
 */
#define _GNU_SOURCE /* splice, accept4, pipe2, recvmmsg */

/* What lbproxy/net/compiled.py expects (its C_API): raised with every change to what the
 * Python side calls, so an extension built from an older source -- an editable install
 * not rebuilt after a pull -- is set aside for the pure path instead of failing on a
 * missing name mid-connection. */
#define C_API 4
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <math.h>
#include <limits.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* splice-auto, as HAProxy's: a direction copies its chunks (one recv, one send: no pipe)
 * until a read fills this buffer (HAProxy's bufsize), the sign of a bulk transfer; from
 * then on it splices (socket -> pipe -> socket, zero copy). */
#define COPY_CHUNK (1 << 14)
/* A spliced read asks for more than any pipe holds: it stops at what the pipe takes. */
#define SPLICE_CHUNK (1 << 24)
/* Chunks moved per readiness report at most, while they are big (a splice of BIG_CHUNK,
 * a copy that filled COPY_CHUNK): reading the next at once saves a wait; the bound keeps
 * one busy connection from holding the batch. */
#define BURST 2
#define BIG_CHUNK (1 << 16)
/* Events handled per batch at most. */
#define MAX_BATCH 256

#define IN_OR_FAILED (EPOLLIN | EPOLLERR | EPOLLHUP)
#define OUT_OR_FAILED (EPOLLOUT | EPOLLERR | EPOLLHUP)
#define FAILED (EPOLLERR | EPOLLHUP)

/* -- small helpers ---------------------------------------------------------------------- */

/* Counts the places where Python code may have run since C was called (a callback, a
 * signal handler, a finalizer at a pump's end): the reactor's wait in trio's place
 * asks trio for its next deadline again only then, since only Python code moves it. */
static unsigned long python_ran = 0;

static int
as_int(PyObject *v)
{
    long r = PyLong_AsLong(v);
    if (r == -1 && PyErr_Occurred())
        return -1;
    if (r > INT_MAX || r < INT_MIN) {
        PyErr_SetString(PyExc_OverflowError, "not a descriptor");
        return -1;
    }
    return (int)r;
}

/* An OSError for errno `code` (the subclass os.splice would raise: OSError's own
 * constructor picks it). */
static PyObject *
os_error(int code)
{
    return PyObject_CallFunction(PyExc_OSError, "is", code, strerror(code));
}

/* splice(2), retried on EINTR (as os.splice, which runs signal handlers meanwhile).
 * -1 with errno set, or -2 with a Python exception from a signal handler. */
static ssize_t
do_splice(int in, int out, size_t len)
{
    for (;;) {
        /* Non-blocking both ways (SPLICE_F_NONBLOCK, O_NONBLOCK sockets): no need to
         * let go of the GIL around it. */
        ssize_t n = splice(in, NULL, out, NULL, len, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
        if (n >= 0 || errno != EINTR)
            return n;
        python_ran++;
        if (PyErr_CheckSignals() < 0)
            return -2;
    }
}

/* recv(2) / send(2), retried on EINTR; -1 with errno set, or -2 with a Python exception
 * from a signal handler. Non-blocking sockets: the GIL is kept. */
static ssize_t
do_recv(int fd, char *buf, size_t len)
{
    for (;;) {
        ssize_t n = recv(fd, buf, len, 0);
        if (n >= 0 || errno != EINTR)
            return n;
        python_ran++;
        if (PyErr_CheckSignals() < 0)
            return -2;
    }
}

static ssize_t
do_send(int fd, const char *buf, size_t len)
{
    for (;;) {
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);
        if (n >= 0 || errno != EINTR)
            return n;
        python_ran++;
        if (PyErr_CheckSignals() < 0)
            return -2;
    }
}

/* -- the run's clock ------------------------------------------------------------------ */

/* trio's SystemClock.current_time(), as Python computes it (`offset + perf_counter()`,
 * perf_counter being CLOCK_MONOTONIC on Linux): integer nanoseconds as seconds (a
 * double), plus the offset, into *now: 0; or -1, no exception set: the clock could not
 * be read (then the caller calls the Python clock). The same clock, with no Python
 * frame. */
static int
cp_native_seconds(double offset, double *now)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return -1;
    long long ns = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    double d = (double)ns;
    d /= 1e9;
    *now = offset + d;
    return 0;
}

/* The same as a float; NULL, no exception set: the clock could not be read. */
static PyObject *
cp_native_now(double offset)
{
    double now;
    if (cp_native_seconds(offset, &now) < 0)
        return NULL;
    return PyFloat_FromDouble(now);
}

/* Clock(current_time, offset=None): a callable with no Python frame that returns what
 * current_time() returns -- computed here for trio's SystemClock (the caller passes its
 * offset), else by calling it (trio.testing.MockClock). For the connection handler,
 * which reads its run's clock twice per connection. */
typedef struct {
    PyObject_HEAD
    PyObject *fn;
    double offset;
    int native;
    vectorcallfunc vectorcall;
} CClock;

static PyObject *
CClock_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    CClock *c = (CClock *)self;
    if (PyVectorcall_NARGS(nargsf) != 0 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "Clock() takes no arguments");
        return NULL;
    }
    if (c->native) {
        PyObject *now = cp_native_now(c->offset);
        if (now != NULL || PyErr_Occurred())
            return now;
    }
    if (c->fn == NULL) { /* cleared by the garbage collector (a cycle being freed) */
        PyErr_SetString(PyExc_RuntimeError, "Clock: cleared");
        return NULL;
    }
    return PyObject_CallNoArgs(c->fn);
}

static PyObject *
CClock_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *names[] = {"current_time", "offset", NULL};
    PyObject *fn, *offset = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:Clock", names, &fn, &offset))
        return NULL;
    if (!PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "Clock() takes a callable");
        return NULL;
    }
    double off = 0.0;
    if (offset != Py_None) {
        off = PyFloat_AsDouble(offset);
        if (off == -1.0 && PyErr_Occurred())
            return NULL;
    }
    CClock *c = (CClock *)type->tp_alloc(type, 0);
    if (c == NULL)
        return NULL;
    Py_INCREF(fn);
    c->fn = fn;
    c->offset = off;
    c->native = offset != Py_None;
    c->vectorcall = CClock_vectorcall;
    return (PyObject *)c;
}

static int
CClock_traverse(CClock *c, visitproc visit, void *arg)
{
    Py_VISIT(c->fn);
    return 0;
}

static int
CClock_clear(CClock *c)
{
    Py_CLEAR(c->fn);
    return 0;
}

static void
CClock_dealloc(CClock *c)
{
    PyObject_GC_UnTrack(c);
    CClock_clear(c);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMemberDef CClock_members[] = {
    {"current_time", T_OBJECT, offsetof(CClock, fn), READONLY, NULL},
    {"native", T_INT, offsetof(CClock, native), READONLY, NULL},
    {NULL},
};

static PyTypeObject CClock_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lbproxy.net._cpump.Clock",
    .tp_basicsize = sizeof(CClock),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Clock(current_time, offset=None): current_time() with no Python frame: with\n"
              "an offset (trio's SystemClock's), offset + CLOCK_MONOTONIC computed here;\n"
              "without, current_time called.",
    .tp_new = CClock_new,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(CClock, vectorcall),
    .tp_dealloc = (destructor)CClock_dealloc,
    .tp_traverse = (traverseproc)CClock_traverse,
    .tp_clear = (inquiry)CClock_clear,
    .tp_members = CClock_members,
};

/* == The pump, owned by C ===============================================================
 *
 * A Reactor (one per trio run) owns an epoll set, the table of what each descriptor in
 * it belongs to (a pump, or a Python callback: a listening socket's acceptor, trio's own
 * descriptor), the pumps' idle deadlines (a heap) and the FINs a batch read. A Pump owns
 * both directions of one connection, its two descriptors (closed when it ends), its byte
 * counters, its last activity and idle timeout. Python is told three things, each
 * through a callable it passed in: a pump's end (its on_end), a failure met while
 * handling one (record), and an idle deadline earlier than the one the idle timer sleeps
 * until (wake). Nothing here reads a Python attribute by name.
 */

#define PIPE_SIZE (1 << 17)
#define MAX_IDLE_PIPES 128

enum { OPEN = 0, O_CLOSED, O_IDLE_TIMEOUT, O_CLIENT_RESET, O_SERVER_RESET, O_ERROR, O_CANCELLED,
       O_MAX_DURATION, N_OUTCOMES };
static const char *const outcome_text[N_OUTCOMES] = {
    NULL, "closed", "idle_timeout", "client_reset", "server_reset", "error", "cancelled",
    "max_duration",
};
static PyObject *outcome_str[N_OUTCOMES]; /* [OPEN]: unused */
static PyObject *empty_bytes;
static PyObject *s_where_pump, *s_where_connection_end;

/* -- the pipe pool: process-wide, only empty pipes in it ------------------------------ */

static int pool[MAX_IDLE_PIPES][2];
static int n_pool = 0;
/* Cleared (for every later pump) when the kernel refuses to splice a TCP socket. */
static int splice_ok = 1;

/* A pipe from the pool, else a new one: 0, or an errno (EMFILE, ENFILE). */
static int
pipe_take(int fds[2])
{
    if (n_pool > 0) {
        n_pool--;
        fds[0] = pool[n_pool][0];
        fds[1] = pool[n_pool][1];
        return 0;
    }
    if (pipe2(fds, O_NONBLOCK | O_CLOEXEC) < 0)
        return errno;
    /* EPERM over the user's pipe budget, EINVAL: the default size still works */
    (void)fcntl(fds[1], F_SETPIPE_SZ, PIPE_SIZE);
    return 0;
}

/* An EMPTY pipe back to the pool, or closed when the pool is full. */
static void
pipe_give(int fds[2])
{
    if (n_pool < MAX_IDLE_PIPES) {
        pool[n_pool][0] = fds[0];
        pool[n_pool][1] = fds[1];
        n_pool++;
    }
    else {
        close(fds[0]);
        close(fds[1]);
    }
    fds[0] = fds[1] = -1;
}

/* A pipe that may hold bytes: never reused. */
static void
pipe_discard(int fds[2])
{
    close(fds[0]);
    close(fds[1]);
    fds[0] = fds[1] = -1;
}

/* -- types ----------------------------------------------------------------------------- */

/* What a direction is doing, which decides what its descriptors are watched for. */
enum { READING, WRITING, DONE, HELD };
/* What moving a chunk reports. */
enum { MOVED, BLOCKED, GOT_EOF, SOURCE_FAILED, DESTINATION_FAILED };

typedef struct {
    int state;
    int fin_pending; /* its source sent FIN; the shutdown waits for the batch's end */
    int bulk;        /* a read filled COPY_CHUNK: the next reads splice */
    int spliced;     /* a splice worked: EINVAL is no longer "cannot splice" */
    int copy_only;   /* never splice */
    int err;         /* the errno behind SOURCE_FAILED / DESTINATION_FAILED */
    ssize_t pending; /* bytes read and not yet written: in `pipe` or in `buf` */
    int pipe[2];     /* a spliced chunk's pipe while dst has not taken it all, else -1 */
    char *buf;       /* a copied chunk's rest, likewise */
    ssize_t buf_off;
} Direction;

typedef struct Reactor Reactor;
typedef struct Pump Pump;

/* What the reactor's deadline heap holds: a pump's or a UDP session's entry. */
enum { TIMED_PUMP, TIMED_SESSION };
typedef struct {
    double due;     /* its key in the heap: when to look at it again */
    int heap_index; /* -1: no deadline armed */
    int kind;
} Timed;

struct Pump {
    PyObject_HEAD
    Reactor *reactor; /* strong; NULL once cleared */
    Pump *prev, *next; /* the reactor's open pumps */
    int client_fd, server_fd;
    int client_mask, server_mask; /* -1: not in the epoll set */
    int open_directions;
    int outcome;
    int err;         /* the errno behind a reset or an error */
    PyObject *exc;   /* the exception behind "error" (a bug), or the OSError made for err */
    Direction up;    /* client -> server */
    Direction down;  /* server -> client */
    PyObject *initial; /* bytes for the server before any client byte (bytes) */
    Py_ssize_t initial_off, uncounted;
    long long bytes_in, bytes_out;
    double last_activity, idle_timeout;
    Timed timed;    /* its idle (or lifetime) deadline */
    double ends_at; /* the run's time its lifetime ends (max_duration; inf: never) */
    PyObject *on_end;
};

/* What a descriptor of the set belongs to. `gen` changes whenever the slot does: an
 * event carries the generation it was registered with, so an event read for a
 * descriptor that has since been closed (and its number reused) is dropped. */
enum { SLOT_FREE, SLOT_PUMP, SLOT_CALLBACK, SLOT_UDP_LISTEN, SLOT_UDP_SESSION };
typedef struct {
    uint32_t gen;
    int kind;
    PyObject *obj; /* SLOT_PUMP: the pump (borrowed: the open list holds it); SLOT_CALLBACK:
                    * the callable, strong; SLOT_UDP_LISTEN: the UDP relay, strong;
                    * SLOT_UDP_SESSION: the session (borrowed: its relay's table holds it) */
} Slot;

/* A slot that holds a reference to its object. */
#define SLOT_STRONG(kind) ((kind) == SLOT_CALLBACK || (kind) == SLOT_UDP_LISTEN)

typedef struct {
    Pump *pump; /* strong */
    int up;
} Fin;

struct Reactor {
    PyObject_HEAD
    int epfd;
    Slot *slots;
    int n_slots;
    PyObject *clock;  /* called for the time unless `native` */
    int native;       /* trio's SystemClock: offset + CLOCK_MONOTONIC, read here */
    double offset;
    PyObject *record;         /* record(where, exc) */
    PyObject *wake;           /* wake(when) */
    PyObject *splice_refused; /* splice_refused(exc) */
    Timed **heap;
    int heap_len, heap_cap;
    double armed; /* when the idle timer rings next, as far as this reactor knows */
    Pump *first;  /* open pumps, each holding a reference */
    Fin *fins;
    int n_fins, cap_fins;
    int in_batch;
};

static PyTypeObject Reactor_Type;
static PyTypeObject Pump_Type;

/* -- the reactor's helpers -------------------------------------------------------------- */

#define DIR_SRC(p, d) ((d) == &(p)->up ? (p)->client_fd : (p)->server_fd)
#define DIR_DST(p, d) ((d) == &(p)->up ? (p)->server_fd : (p)->client_fd)
#define TO_SERVER(p, d) ((d) == &(p)->up)
#define EVENT_DATA(gen, fd) (((uint64_t)(gen) << 32) | (uint32_t)(fd))
#define PUMP_OF(t) ((Pump *)((char *)(t)-offsetof(Pump, timed)))

/* The reactor's clock: 0 with the time in *now, or -1 with an exception. */
static int
rx_now(Reactor *r, double *now)
{
    if (r->native && cp_native_seconds(r->offset, now) == 0)
        return 0;
    python_ran++;
    PyObject *t = PyObject_CallNoArgs(r->clock);
    if (t == NULL)
        return -1;
    *now = PyFloat_AsDouble(t);
    Py_DECREF(t);
    if (*now == -1.0 && PyErr_Occurred())
        return -1;
    return 0;
}

/* The exception set now (an Exception), handed to record(where, exc) and cleared. */
static void
rx_record(Reactor *r, PyObject *where)
{
    PyObject *type, *value, *tb;
    python_ran++;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    if (r != NULL && r->record != NULL && value != NULL) {
        PyObject *res = PyObject_CallFunctionObjArgs(r->record, where, value, NULL);
        Py_XDECREF(res);
        PyErr_Clear(); /* record() never raises; if it did, nothing more can be done */
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

static int
rx_slot_room(Reactor *r, int fd)
{
    if (fd < 0 || fd >= (1 << 24)) {
        PyErr_SetString(PyExc_ValueError, "descriptor out of range");
        return -1;
    }
    if (fd < r->n_slots)
        return 0;
    int n = r->n_slots ? r->n_slots : 1024;
    while (n <= fd)
        n *= 2;
    Slot *grown = PyMem_Realloc(r->slots, (size_t)n * sizeof *grown);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(grown + r->n_slots, 0, (size_t)(n - r->n_slots) * sizeof *grown);
    r->slots = grown;
    r->n_slots = n;
    return 0;
}

static void
rx_slot_clear(Reactor *r, int fd, PyObject *obj)
{
    if (fd < 0 || fd >= r->n_slots || r->slots[fd].obj != obj)
        return;
    Slot *s = &r->slots[fd];
    PyObject *held = SLOT_STRONG(s->kind) ? s->obj : NULL;
    s->kind = SLOT_FREE;
    s->obj = NULL;
    s->gen++;
    Py_XDECREF(held);
}

/* epoll_ctl with the slot's generation in the event's data; -1 with errno set. */
static int
rx_ctl(Reactor *r, int op, int fd, uint32_t mask)
{
    struct epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.events = mask;
    ev.data.u64 = EVENT_DATA(r->slots[fd].gen, fd);
    return epoll_ctl(r->epfd, op, fd, &ev);
}

/* -- the idle deadlines: a binary heap of open pumps by `due` ----------------------------- */

static void
heap_set(Reactor *r, int i, Timed *t)
{
    r->heap[i] = t;
    t->heap_index = i;
}

static void
heap_up(Reactor *r, int i)
{
    Timed *t = r->heap[i];
    while (i > 0) {
        int parent = (i - 1) / 2;
        if (r->heap[parent]->due <= t->due)
            break;
        heap_set(r, i, r->heap[parent]);
        i = parent;
    }
    heap_set(r, i, t);
}

static void
heap_down(Reactor *r, int i)
{
    Timed *t = r->heap[i];
    for (;;) {
        int child = 2 * i + 1;
        if (child >= r->heap_len)
            break;
        if (child + 1 < r->heap_len && r->heap[child + 1]->due < r->heap[child]->due)
            child++;
        if (r->heap[child]->due >= t->due)
            break;
        heap_set(r, i, r->heap[child]);
        i = child;
    }
    heap_set(r, i, t);
}

static void
heap_remove(Reactor *r, Timed *t)
{
    int i = t->heap_index;
    if (i < 0)
        return;
    t->heap_index = -1;
    Timed *last = r->heap[--r->heap_len];
    if (last == t)
        return;
    heap_set(r, i, last);
    heap_up(r, i);
    heap_down(r, last->heap_index);
}

/* Arm (or move) t's deadline at `due` (inf: none); the idle timer is woken if it sleeps
 * past it. 0, or -1 with an exception (no room for the heap). */
static int
rx_arm(Reactor *r, Timed *t, double due)
{
    if (!(due < Py_HUGE_VAL)) {
        heap_remove(r, t);
        return 0;
    }
    t->due = due;
    if (t->heap_index >= 0) {
        heap_up(r, t->heap_index);
        heap_down(r, t->heap_index);
    }
    else {
        if (r->heap_len == r->heap_cap) {
            int n = r->heap_cap ? 2 * r->heap_cap : 64;
            Timed **grown = PyMem_Realloc(r->heap, (size_t)n * sizeof *grown);
            if (grown == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            r->heap = grown;
            r->heap_cap = n;
        }
        heap_set(r, r->heap_len++, t);
        heap_up(r, t->heap_index);
    }
    if (due < r->armed) {
        r->armed = due;
        python_ran++;
        PyObject *when = PyFloat_FromDouble(due);
        PyObject *res = when ? PyObject_CallOneArg(r->wake, when) : NULL;
        Py_XDECREF(when);
        if (res == NULL)
            rx_record(r, s_where_pump); /* the timer rings late; nothing else is lost */
        Py_XDECREF(res);
    }
    return 0;
}

/* Arm (or move) p's deadline at `due` (inf: none), or at the end of its lifetime if that
 * comes first. 0, or -1 with an exception. */
static int
pm_arm(Pump *p, double due)
{
    if (p->ends_at < due)
        due = p->ends_at;
    return rx_arm(p->reactor, &p->timed, due);
}

/* -- the end ----------------------------------------------------------------------------- */

static void
dir_release(Direction *d)
{
    if (d->buf != NULL) {
        PyMem_Free(d->buf);
        d->buf = NULL;
    }
    if (d->pipe[0] >= 0) {
        if (d->pending) /* bytes left in it would go to another connection */
            pipe_discard(d->pipe);
        else
            pipe_give(d->pipe);
    }
    d->pending = 0;
}

/* Out of the reactor (its slots, the heap, the open list), both descriptors closed, the
 * pipes back. The reactor's reference is handed to the caller (NULL: it had none). */
static Pump *
pm_detach(Pump *p)
{
    Reactor *r = p->reactor;
    if (r == NULL)
        return NULL;
    rx_slot_clear(r, p->client_fd, (PyObject *)p);
    rx_slot_clear(r, p->server_fd, (PyObject *)p);
    heap_remove(r, &p->timed);
    if (p->prev != NULL)
        p->prev->next = p->next;
    else if (r->first == p)
        r->first = p->next;
    else
        return NULL; /* not in the list: detached already */
    if (p->next != NULL)
        p->next->prev = p->prev;
    p->prev = p->next = NULL;
    dir_release(&p->up);
    dir_release(&p->down);
    /* close(2) takes both out of the epoll set, and sends the FIN of a direction that
     * read one in this batch (both receive queues are empty: a FIN, not an RST) */
    close(p->client_fd);
    close(p->server_fd);
    p->up.fin_pending = p->down.fin_pending = 0;
    return p;
}

/* The outcome is set: detach, then on_end(pump) once; its failure is recorded. */
static void
pm_finish(Pump *p)
{
    Reactor *r = p->reactor;
    Pump *ref = pm_detach(p);
    python_ran++; /* on_end, and whatever dropping the pump's references runs */
    PyObject *on_end = p->on_end;
    p->on_end = NULL;
    if (on_end != NULL) {
        PyObject *res = PyObject_CallOneArg(on_end, (PyObject *)p);
        if (res == NULL) {
            if (PyErr_ExceptionMatches(PyExc_Exception))
                rx_record(r, s_where_connection_end);
            else
                PyErr_WriteUnraisable(on_end); /* KeyboardInterrupt in a callback */
        }
        Py_XDECREF(res);
        Py_DECREF(on_end);
    }
    Py_XDECREF(ref);
}

static void
pm_end(Pump *p, int outcome)
{
    if (p->outcome != OPEN)
        return;
    p->outcome = outcome;
    pm_finish(p);
}

/* A bug met handling p (the exception set now): counted, and p ends with "error". */
static void
pm_crash(Pump *p)
{
    PyObject *type, *value, *tb;
    python_ran++;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    if (p->reactor != NULL && p->reactor->record != NULL && value != NULL) {
        PyObject *res =
            PyObject_CallFunctionObjArgs(p->reactor->record, s_where_pump, value, NULL);
        Py_XDECREF(res);
        PyErr_Clear();
    }
    if (p->outcome == OPEN) {
        Py_XSETREF(p->exc, value);
        value = NULL;
        p->outcome = O_ERROR;
        pm_finish(p);
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

static void
pm_failed(Pump *p, int client_side, int code)
{
    int reset = code == ECONNRESET || code == EPIPE || code == ENOTCONN || code == ECONNABORTED;
    p->err = code;
    p->outcome = reset ? (client_side ? O_CLIENT_RESET : O_SERVER_RESET) : O_ERROR;
}

/* -- moving bytes ------------------------------------------------------------------------ */

/* `n` bytes reached d's destination: counted, and the time noted. */
static int
pm_count(Pump *p, Direction *d, ssize_t n)
{
    if (TO_SERVER(p, d))
        p->bytes_in += n;
    else
        p->bytes_out += n;
    return rx_now(p->reactor, &p->last_activity);
}

/* Where a copied chunk is read: one buffer for every pump (a chunk is written out before
 * anything else runs; what dst does not take is copied into the direction). */
static char chunk_buf[COPY_CHUNK];

static int
dir_hold(Direction *d, const char *data, ssize_t len)
{
    char *b = PyMem_Malloc((size_t)len);
    if (b == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(b, data, (size_t)len);
    d->buf = b;
    d->buf_off = 0;
    d->pending = len;
    return 0;
}

/* The rest of a chunk dst did not take: MOVED, BLOCKED, DESTINATION_FAILED; -1 with an
 * exception. */
static int
pm_write_out(Pump *p, Direction *d)
{
    int dst = DIR_DST(p, d);
    int copied = d->pipe[0] < 0;
    while (d->pending) {
        ssize_t n = copied ? do_send(dst, d->buf + d->buf_off, (size_t)d->pending)
                           : do_splice(d->pipe[0], dst, (size_t)d->pending);
        if (n == -2)
            return -1;
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return BLOCKED;
            d->err = errno;
            return DESTINATION_FAILED;
        }
        d->pending -= n;
        if (copied)
            d->buf_off += n;
        if (pm_count(p, d, n) < 0)
            return -1;
    }
    if (copied) {
        PyMem_Free(d->buf);
        d->buf = NULL;
    }
    else
        pipe_give(d->pipe); /* empty again: an idle connection holds no pipe */
    return MOVED;
}

/* The most one read takes: all a copy buffer holds, or all a pipe does. The one place
 * a chunk's size is decided. */
static size_t
chunk_limit(Direction *d)
{
    return d->bulk ? SPLICE_CHUNK : COPY_CHUNK;
}

/* One chunk: read it (copied: recv into chunk_buf; bulk: splice into a pipe from the
 * pool) and write out what dst takes. *big: the read was as large as a read gets,
 * so more is probably waiting. */
static int
pm_move_one(Pump *p, Direction *d, int *big)
{
    int src = DIR_SRC(p, d), dst = DIR_DST(p, d);
    size_t limit = chunk_limit(d);
    *big = 0;
    if (!d->bulk) {
        ssize_t n = do_recv(src, chunk_buf, limit);
        if (n == -2)
            return -1;
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return MOVED; /* readiness can be stale by the time we read */
            d->err = errno;
            return SOURCE_FAILED;
        }
        if (n == 0)
            return GOT_EOF;
        if ((size_t)n == limit) {
            *big = 1;
            if (!d->copy_only)
                d->bulk = 1; /* splice-auto: a bulk transfer, spliced from the next read */
        }
        ssize_t m = do_send(dst, chunk_buf, (size_t)n);
        if (m == -2)
            return -1;
        if (m < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return dir_hold(d, chunk_buf, n) < 0 ? -1 : BLOCKED;
            d->err = errno;
            return DESTINATION_FAILED;
        }
        if (m < n && dir_hold(d, chunk_buf + m, n - m) < 0)
            return -1;
        if (pm_count(p, d, m) < 0)
            return -1;
        return m < n ? pm_write_out(p, d) : MOVED;
    }
    int code = pipe_take(d->pipe);
    if (code) { /* EMFILE, ENFILE: no descriptor left for a pipe -- ends this connection */
        d->err = code;
        return SOURCE_FAILED;
    }
    ssize_t n = do_splice(src, d->pipe[1], limit);
    if (n < 0) {
        code = errno;
        pipe_give(d->pipe); /* nothing was moved into it */
        if (n == -2)
            return -1;
        if (code == EAGAIN || code == EWOULDBLOCK)
            return MOVED;
        if (!d->spliced && (code == EINVAL || code == ENOSYS)) {
            /* this socket cannot be spliced (nothing was read): copy it, and let every
             * later pump copy only */
            d->copy_only = 1;
            d->bulk = 0;
            if (splice_ok) {
                splice_ok = 0;
                python_ran++;
                PyObject *exc = os_error(code);
                PyObject *res = exc ? PyObject_CallOneArg(p->reactor->splice_refused, exc) : NULL;
                Py_XDECREF(exc);
                if (res == NULL)
                    return -1;
                Py_DECREF(res);
            }
            return pm_move_one(p, d, big); /* the same read, copied */
        }
        d->err = code;
        return SOURCE_FAILED;
    }
    d->spliced = 1;
    if (n == 0) {
        pipe_give(d->pipe);
        return GOT_EOF;
    }
    if ((size_t)n >= BIG_CHUNK)
        *big = 1;
    d->pending = n;
    ssize_t m = do_splice(d->pipe[0], dst, (size_t)n);
    if (m == -2)
        return -1;
    if (m < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return BLOCKED;
        d->err = errno;
        return DESTINATION_FAILED; /* the pipe still holds the chunk: discarded at the end */
    }
    d->pending -= m;
    if (pm_count(p, d, m) < 0)
        return -1;
    if (d->pending)
        return pm_write_out(p, d);
    pipe_give(d->pipe);
    return MOVED;
}

/* A readable source: up to BURST chunks while they are big (a bulk transfer: reading the
 * next one now saves a wait), one otherwise; the bound keeps one connection from holding
 * the batch. */
static int
pm_move(Pump *p, Direction *d)
{
    for (int left = BURST; left > 0; left--) {
        int big;
        int status = pm_move_one(p, d, &big);
        if (status || !big)
            return status;
    }
    return MOVED;
}

/* -- watching ------------------------------------------------------------------------------ */

static int
pm_watch(Pump *p, int fd, int mask, int *current)
{
    Reactor *r = p->reactor;
    if (*current != -1) {
        if (rx_ctl(r, EPOLL_CTL_MOD, fd, (uint32_t)mask) < 0)
            goto fail;
    }
    else if (mask) {
        if (rx_ctl(r, EPOLL_CTL_ADD, fd, (uint32_t)mask) < 0)
            goto fail;
    }
    else
        return 0; /* nothing wanted: no need to add it back yet */
    *current = mask;
    return 0;
fail:
    PyErr_SetFromErrno(PyExc_OSError);
    return -1;
}

/* The descriptors' interest follows the directions: a source is watched for input
 * while its direction reads, a destination for output while a chunk waits for it (and
 * its source is not: back-pressure). Errors and hang-ups are reported regardless. */
static int
pm_update_interest(Pump *p)
{
    int client = (p->up.state == READING ? EPOLLIN : 0) | (p->down.state == WRITING ? EPOLLOUT : 0);
    int server = (p->down.state == READING ? EPOLLIN : 0) |
                 (p->up.state == WRITING || p->up.state == HELD ? EPOLLOUT : 0);
    if (client != p->client_mask && pm_watch(p, p->client_fd, client, &p->client_mask) < 0)
        return -1;
    if (server != p->server_mask && pm_watch(p, p->server_fd, server, &p->server_mask) < 0)
        return -1;
    return 0;
}

/* Bytes for the server before any client byte goes that way (a PROXY header, bytes read
 * before the connect); the first `uncounted` are not client bytes. */
static int
pm_write_initial(Pump *p)
{
    Py_ssize_t len = PyBytes_GET_SIZE(p->initial);
    while (p->initial_off < len) {
        const char *at = PyBytes_AS_STRING(p->initial) + p->initial_off;
        ssize_t n = do_send(p->server_fd, at, (size_t)(len - p->initial_off));
        if (n == -2)
            return -1;
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (p->up.state != HELD) { /* wait for the server; read no client byte */
                    p->up.state = HELD;
                    return pm_update_interest(p);
                }
                return 0;
            }
            pm_failed(p, 0, errno);
            return 0;
        }
        Py_ssize_t counted = n - p->uncounted;
        p->uncounted = counted < 0 ? -counted : 0;
        p->initial_off += n;
        if (counted > 0)
            p->bytes_in += counted;
        if (rx_now(p->reactor, &p->last_activity) < 0)
            return -1;
    }
    Py_CLEAR(p->initial);
    p->initial = Py_NewRef(empty_bytes);
    p->initial_off = 0;
    if (p->up.state == HELD) {
        p->up.state = READING;
        return pm_update_interest(p);
    }
    return 0;
}

static int
pm_send_fin(Pump *p, Direction *d)
{
    if (!d->fin_pending || p->outcome != OPEN)
        return 0;
    d->fin_pending = 0;
    if (shutdown(DIR_DST(p, d), SHUT_WR) < 0) { /* ENOTCONN: reset meanwhile */
        pm_failed(p, !TO_SERVER(p, d), errno);
        pm_finish(p);
        return 0;
    }
    return pm_update_interest(p);
}

/* d's source sent FIN. The last one ends the connection (close(2) passes it on); an
 * earlier one is a half-close, passed on at the end of the batch: a client and a server
 * that close at about the same time (HTTP with Connection: close) then need no shutdown
 * at all, and the source is no longer read. */
static int
pm_pass_fin(Pump *p, Direction *d)
{
    d->state = DONE;
    if (--p->open_directions == 0) {
        p->outcome = O_CLOSED;
        return 0;
    }
    if (rx_now(p->reactor, &p->last_activity) < 0)
        return -1;
    d->fin_pending = 1;
    Reactor *r = p->reactor;
    if (!r->in_batch)
        return pm_send_fin(p, d);
    if (r->n_fins == r->cap_fins) {
        int n = r->cap_fins ? 2 * r->cap_fins : 64;
        Fin *grown = PyMem_Realloc(r->fins, (size_t)n * sizeof *grown);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        r->fins = grown;
        r->cap_fins = n;
    }
    r->fins[r->n_fins].pump = (Pump *)Py_NewRef(p);
    r->fins[r->n_fins].up = d == &p->up;
    r->n_fins++;
    return 0;
}

/* An error or hang-up on a descriptor no direction watches now. */
static int
pm_unwatched_event(Pump *p, int fd, int client_side)
{
    int code = 0;
    socklen_t len = sizeof code;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &code, &len) < 0)
        code = errno;
    if (code) { /* a reset after its side half-closed: end now, not at the idle timeout */
        pm_failed(p, client_side, code);
        return 0;
    }
    /* both halves shut, yet bytes sent before its FIN may wait behind a blocked write:
     * not a failure, but a level-triggered hang-up is reported on every wait, so the
     * descriptor leaves the set until a direction needs it again */
    struct epoll_event ev;
    epoll_ctl(p->reactor->epfd, EPOLL_CTL_DEL, fd, &ev);
    if (client_side)
        p->client_mask = -1;
    else
        p->server_mask = -1;
    return 0;
}

/* What a move or a write-out reported. */
static int
pm_after(Pump *p, Direction *d, int status)
{
    switch (status) {
    case MOVED:
        if (d->state == WRITING) { /* a blocked chunk went out: read again */
            d->state = READING;
            return pm_update_interest(p);
        }
        return 0;
    case BLOCKED:
        if (d->state == READING) { /* stop reading until dst takes the chunk */
            d->state = WRITING;
            return pm_update_interest(p);
        }
        return 0;
    case GOT_EOF:
        return pm_pass_fin(p, d);
    case SOURCE_FAILED:
        pm_failed(p, TO_SERVER(p, d), d->err);
        return 0;
    default:
        pm_failed(p, !TO_SERVER(p, d), d->err);
        return 0;
    }
}

/* `events` on one of p's descriptors: move what can be moved. 0, or -1 with an
 * exception (a bug: the caller ends p). */
static int
pm_on_event(Pump *p, int fd, uint32_t events)
{
    int client_side = fd == p->client_fd;
    Direction *reader = client_side ? &p->up : &p->down;
    Direction *writer = client_side ? &p->down : &p->up;
    int watched = 0;
    if (reader->state == READING && (events & IN_OR_FAILED)) {
        watched = 1;
        int status = pm_move(p, reader);
        if (status < 0 || (status && pm_after(p, reader, status) < 0))
            return -1;
    }
    if (writer->state == WRITING && (events & OUT_OR_FAILED)) {
        watched = 1;
        if (p->outcome == OPEN) {
            int status = pm_write_out(p, writer);
            if (status < 0 || pm_after(p, writer, status) < 0)
                return -1;
        }
    }
    else if (writer->state == HELD && (events & OUT_OR_FAILED)) {
        watched = 1;
        if (pm_write_initial(p) < 0)
            return -1;
    }
    if (!watched && (events & FAILED) && p->outcome == OPEN &&
        pm_unwatched_event(p, fd, client_side) < 0)
        return -1;
    if (p->outcome != OPEN)
        pm_finish(p);
    return 0;
}

#include "_cpump_udp.h" /* the UDP relay: UdpRelay, UdpSession */

/* -- batches ---------------------------------------------------------------------------- */

/* The FINs read in the batch, passed on. */
static void
rx_send_fins(Reactor *r)
{
    for (int i = 0; i < r->n_fins; i++) {
        Pump *p = r->fins[i].pump;
        if (pm_send_fin(p, r->fins[i].up ? &p->up : &p->down) < 0)
            pm_crash(p);
        Py_DECREF(p);
    }
    r->n_fins = 0;
}

/* One batch's events, each to what its descriptor belongs to; an Exception met handling
 * one is that pump's end ("error", counted) or, for a callback, counted; then the FINs.
 * An event on `trio_fd` (-1: none) only sets *trio_ready. 0, or -1 with an exception
 * that is not an Exception (KeyboardInterrupt, trio's Cancelled from a callback). */
static int
rx_handle(Reactor *r, struct epoll_event *evs, int n, int trio_fd, int *trio_ready)
{
    int result = 0;
    r->in_batch = 1;
    for (int i = 0; i < n; i++) {
        int fd = (int)(uint32_t)evs[i].data.u64;
        uint32_t gen = (uint32_t)(evs[i].data.u64 >> 32);
        if (fd == trio_fd) {
            *trio_ready = 1;
            continue;
        }
        if (fd < 0 || fd >= r->n_slots)
            continue;
        Slot *s = &r->slots[fd];
        if (s->gen != gen || s->kind == SLOT_FREE)
            continue; /* ended earlier in this batch */
        if (s->kind == SLOT_PUMP) {
            Pump *p = (Pump *)Py_NewRef(s->obj);
            if (pm_on_event(p, fd, evs[i].events) < 0) {
                if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                    Py_DECREF(p);
                    result = -1;
                    break;
                }
                pm_crash(p);
            }
            Py_DECREF(p);
        }
        else if (s->kind == SLOT_UDP_LISTEN) {
            if (ur_from_clients((UdpRelay *)s->obj) < 0) {
                result = -1;
                break;
            }
        }
        else if (s->kind == SLOT_UDP_SESSION) {
            UdpSession *us = (UdpSession *)Py_NewRef(s->obj);
            us_on_event(us);
            Py_DECREF(us);
        }
        else {
            PyObject *cb = Py_NewRef(s->obj);
            python_ran++;
            PyObject *fdo = PyLong_FromLong(fd);
            PyObject *ev = fdo ? PyLong_FromUnsignedLong(evs[i].events) : NULL;
            PyObject *args[2] = {fdo, ev};
            PyObject *res = ev ? PyObject_Vectorcall(cb, args, 2, NULL) : NULL;
            Py_XDECREF(fdo);
            Py_XDECREF(ev);
            Py_DECREF(cb);
            if (res == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                    result = -1;
                    break;
                }
                rx_record(r, s_where_pump);
            }
            Py_XDECREF(res);
        }
    }
    r->in_batch = 0;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    rx_send_fins(r);
    PyErr_Restore(type, value, tb);
    return result;
}

static int
rx_check_open(Reactor *r)
{
    if (r->epfd < 0) {
        PyErr_SetString(PyExc_ValueError, "the reactor is closed");
        return -1;
    }
    if (r->in_batch) {
        PyErr_SetString(PyExc_RuntimeError, "a reactor batch is running");
        return -1;
    }
    return 0;
}

/* -- the Pump's Python face ----------------------------------------------------------------- */

static int
Pump_traverse(Pump *p, visitproc visit, void *arg)
{
    Py_VISIT(p->reactor);
    Py_VISIT(p->on_end);
    Py_VISIT(p->exc);
    return 0;
}

static int
Pump_clear(Pump *p)
{
    if (p->outcome == OPEN) { /* collected while open: its descriptors are not leaked */
        p->outcome = O_CANCELLED;
        Py_XDECREF(pm_detach(p)); /* no reference left to drop: we are being cleared */
    }
    Py_CLEAR(p->reactor);
    Py_CLEAR(p->on_end);
    Py_CLEAR(p->exc);
    return 0;
}

static void
Pump_dealloc(Pump *p)
{
    PyObject_GC_UnTrack(p);
    Pump_clear(p);
    Py_CLEAR(p->initial);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyObject *
Pump_close(Pump *p, PyObject *unused)
{
    Py_INCREF(p);
    pm_end(p, O_CANCELLED);
    Py_DECREF(p);
    Py_RETURN_NONE;
}

static PyObject *
Pump_get_bytes_in(Pump *p, void *c)
{
    return PyLong_FromLongLong(p->bytes_in);
}

static PyObject *
Pump_get_bytes_out(Pump *p, void *c)
{
    return PyLong_FromLongLong(p->bytes_out);
}

static PyObject *
Pump_get_last_activity(Pump *p, void *c)
{
    return PyFloat_FromDouble(p->last_activity);
}

static PyObject *
Pump_get_outcome(Pump *p, void *c)
{
    if (p->outcome == OPEN)
        Py_RETURN_NONE;
    return Py_NewRef(outcome_str[p->outcome]);
}

static PyObject *
Pump_get_error(Pump *p, void *c)
{
    if (p->exc == NULL && p->err)
        p->exc = os_error(p->err);
    if (p->exc == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    return Py_NewRef(p->exc);
}

static PyObject *
Pump_get_idle_timeout(Pump *p, void *c)
{
    return PyFloat_FromDouble(p->idle_timeout);
}

static int
Pump_set_idle_timeout(Pump *p, PyObject *value, void *c)
{
    double seconds;
    if (idle_timeout_arg(value, &seconds) < 0)
        return -1;
    p->idle_timeout = seconds;
    if (p->outcome != OPEN)
        return 0;
    /* at once: idle that long already ends it now, else its deadline moves */
    double now;
    if (rx_now(p->reactor, &now) < 0)
        return -1;
    double due = p->last_activity + seconds;
    if (now >= due) {
        Py_INCREF(p);
        pm_end(p, O_IDLE_TIMEOUT);
        Py_DECREF(p);
        return 0;
    }
    return pm_arm(p, due);
}

static PyMethodDef Pump_methods[] = {
    {"close", (PyCFunction)Pump_close, METH_NOARGS,
     "close(): end it now, on purpose (outcome \"cancelled\"); nothing once it has ended."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Pump_members[] = {
    {"client_fd", T_INT, offsetof(Pump, client_fd), READONLY, "the client's descriptor"},
    {"server_fd", T_INT, offsetof(Pump, server_fd), READONLY, "the real server's descriptor"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Pump_getset[] = {
    {"bytes_in", (getter)Pump_get_bytes_in, NULL, "client -> server bytes written", NULL},
    {"bytes_out", (getter)Pump_get_bytes_out, NULL, "server -> client bytes written", NULL},
    {"last_activity", (getter)Pump_get_last_activity, NULL,
     "the clock's time of the last byte written either way (or FIN passed on, or the start)",
     NULL},
    {"outcome", (getter)Pump_get_outcome, NULL, "None while open, else how it ended", NULL},
    {"error", (getter)Pump_get_error, NULL,
     "the exception behind a *_reset or error outcome, else None", NULL},
    {"idle_timeout", (getter)Pump_get_idle_timeout, (setter)Pump_set_idle_timeout,
     "seconds (or math.inf) without a byte either way that end it; a new value applies at once",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject Pump_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lbproxy.net._cpump.Pump",
    .tp_basicsize = sizeof(Pump),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One connection's pump, made by Reactor.open(): both directions of a client\n"
              "and a real-server descriptor, its counters and its idle timeout.",
    .tp_dealloc = (destructor)Pump_dealloc,
    .tp_traverse = (traverseproc)Pump_traverse,
    .tp_clear = (inquiry)Pump_clear,
    .tp_methods = Pump_methods,
    .tp_members = Pump_members,
    .tp_getset = Pump_getset,
};

/* -- the Reactor's Python face --------------------------------------------------------------- */

static PyObject *
Reactor_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *names[] = {"clock", "offset", "record", "wake", "splice_refused", NULL};
    PyObject *clock, *offset, *record, *wake, *refused;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO:Reactor", names, &clock, &offset, &record,
                                     &wake, &refused))
        return NULL;
    if (!PyCallable_Check(clock) || !PyCallable_Check(record) || !PyCallable_Check(wake) ||
        !PyCallable_Check(refused)) {
        PyErr_SetString(PyExc_TypeError, "Reactor(): clock, record, wake and splice_refused "
                                         "must be callable");
        return NULL;
    }
    double off = 0.0;
    if (offset != Py_None) {
        off = PyFloat_AsDouble(offset);
        if (off == -1.0 && PyErr_Occurred())
            return NULL;
    }
    Reactor *r = (Reactor *)type->tp_alloc(type, 0);
    if (r == NULL)
        return NULL;
    r->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (r->epfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(r);
        return NULL;
    }
    r->clock = Py_NewRef(clock);
    r->native = offset != Py_None;
    r->offset = off;
    r->record = Py_NewRef(record);
    r->wake = Py_NewRef(wake);
    r->splice_refused = Py_NewRef(refused);
    r->armed = Py_HUGE_VAL;
    return (PyObject *)r;
}

/* Every open pump out, its descriptors closed, with no Python call (collection, close). */
static void
rx_drop_pumps(Reactor *r)
{
    while (r->first != NULL) {
        Pump *p = r->first;
        p->outcome = O_CANCELLED;
        Py_XDECREF(pm_detach(p));
    }
}

static int
Reactor_traverse(Reactor *r, visitproc visit, void *arg)
{
    Py_VISIT(r->clock);
    Py_VISIT(r->record);
    Py_VISIT(r->wake);
    Py_VISIT(r->splice_refused);
    for (int i = 0; i < r->n_slots; i++)
        if (SLOT_STRONG(r->slots[i].kind))
            Py_VISIT(r->slots[i].obj);
    for (Pump *p = r->first; p != NULL; p = p->next)
        Py_VISIT(p);
    for (int i = 0; i < r->n_fins; i++)
        Py_VISIT(r->fins[i].pump);
    return 0;
}

static int
Reactor_clear(Reactor *r)
{
    rx_drop_pumps(r);
    for (int i = 0; i < r->n_slots; i++)
        if (r->slots[i].kind == SLOT_UDP_LISTEN) {
            PyObject *held = Py_NewRef(r->slots[i].obj);
            ur_close((UdpRelay *)held, 0);
            Py_DECREF(held);
        }
        else if (r->slots[i].kind == SLOT_CALLBACK)
            rx_slot_clear(r, i, r->slots[i].obj);
    Py_CLEAR(r->clock);
    Py_CLEAR(r->record);
    Py_CLEAR(r->wake);
    Py_CLEAR(r->splice_refused);
    return 0;
}

static void
Reactor_dealloc(Reactor *r)
{
    PyObject_GC_UnTrack(r);
    Reactor_clear(r);
    for (int i = 0; i < r->n_fins; i++)
        Py_DECREF(r->fins[i].pump);
    PyMem_Free(r->fins);
    PyMem_Free(r->heap);
    PyMem_Free(r->slots);
    if (r->epfd >= 0)
        close(r->epfd);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

/* A keyword argument's value from a METH_FASTCALL | METH_KEYWORDS call, or NULL. */
static PyObject *
keyword(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, const char *name)
{
    if (kwnames == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++)
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, i), name) == 0)
            return args[nargs + i];
    return NULL;
}

PyDoc_STRVAR(open_doc,
    "open(client_fd, server_fd, initial, idle_timeout, on_end, uncounted=0, splice=True,\n"
    "     max_duration=math.inf) -> Pump\n\n"
    "Pump bytes both ways between two connected non-blocking TCP descriptors, which the\n"
    "pump owns from this call on (closed when it ends, or if this raises). `initial`\n"
    "(bytes) goes to the server before any client byte; its first `uncounted` bytes (a\n"
    "PROXY header) do not count in bytes_in. `on_end(pump)` is called once, when it has\n"
    "ended and both descriptors are closed -- before open() returns, if it ends at once.\n"
    "splice=False copies every chunk. `max_duration` seconds after this call the pump ends\n"
    "(outcome \"max_duration\"), however busy it is.");

static PyObject *
Reactor_open(Reactor *r, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"client_fd", "server_fd", "initial", "idle_timeout",
                                        "on_end", "uncounted", "splice", "max_duration"};
    PyObject *a[8] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    if (nargs > 8) {
        PyErr_SetString(PyExc_TypeError, "open() takes at most 8 arguments");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        a[i] = args[i];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (int i = 0; i < 8 && nkw; i++) {
        PyObject *v = keyword(args, nargs, kwnames, names[i]);
        if (v != NULL) {
            if (a[i] != NULL) {
                PyErr_Format(PyExc_TypeError, "open() got multiple values for %s", names[i]);
                return NULL;
            }
            a[i] = v;
            nkw--;
        }
    }
    if (nkw) {
        PyErr_SetString(PyExc_TypeError, "open() got an unexpected keyword argument");
        return NULL;
    }
    int client_fd = a[0] ? as_int(a[0]) : -1;
    if (client_fd == -1 && PyErr_Occurred())
        return NULL;
    int server_fd = a[1] ? as_int(a[1]) : -1;
    if (server_fd == -1 && PyErr_Occurred())
        return NULL;
    if (client_fd < 0 || server_fd < 0 || client_fd == server_fd) {
        PyErr_SetString(PyExc_TypeError, "open() needs two distinct descriptors");
        return NULL;
    }
    /* from here on the pump owns both descriptors: they are closed if this fails */
    double idle = Py_HUGE_VAL, lifetime = Py_HUGE_VAL, now = 0.0;
    Py_ssize_t uncounted = 0;
    int splice_wanted = 1;
    Pump *p = NULL;
    if (a[2] == NULL || a[3] == NULL || a[4] == NULL) {
        PyErr_SetString(PyExc_TypeError, "open() needs initial, idle_timeout and on_end");
        goto fail_fds;
    }
    if (!PyBytes_Check(a[2])) {
        PyErr_SetString(PyExc_TypeError, "open(): initial must be bytes");
        goto fail_fds;
    }
    idle = PyFloat_AsDouble(a[3]);
    if (idle == -1.0 && PyErr_Occurred())
        goto fail_fds;
    if (isnan(idle)) {
        PyErr_SetString(PyExc_ValueError, "idle_timeout must be a number of seconds or math.inf");
        goto fail_fds;
    }
    if (a[4] != Py_None && !PyCallable_Check(a[4])) {
        PyErr_SetString(PyExc_TypeError, "open(): on_end must be callable or None");
        goto fail_fds;
    }
    if (a[5] != NULL) {
        uncounted = PyLong_AsSsize_t(a[5]);
        if (uncounted == -1 && PyErr_Occurred())
            goto fail_fds;
    }
    if (a[6] != NULL) {
        splice_wanted = PyObject_IsTrue(a[6]);
        if (splice_wanted < 0)
            goto fail_fds;
    }
    if (a[7] != NULL) {
        lifetime = PyFloat_AsDouble(a[7]);
        if (lifetime == -1.0 && PyErr_Occurred())
            goto fail_fds;
        if (isnan(lifetime)) {
            PyErr_SetString(PyExc_ValueError,
                            "max_duration must be a number of seconds or math.inf");
            goto fail_fds;
        }
    }
    if (r->epfd < 0) { /* (a pump may be opened inside a batch: an accept's) */
        PyErr_SetString(PyExc_ValueError, "the reactor is closed");
        goto fail_fds;
    }
    if (rx_slot_room(r, client_fd > server_fd ? client_fd : server_fd) < 0)
        goto fail_fds;
    if (r->slots[client_fd].kind != SLOT_FREE || r->slots[server_fd].kind != SLOT_FREE) {
        PyErr_SetString(PyExc_ValueError, "open(): a descriptor already in the reactor");
        goto fail_fds;
    }
    if (rx_now(r, &now) < 0)
        goto fail_fds;
    p = PyObject_GC_New(Pump, &Pump_Type);
    if (p == NULL)
        goto fail_fds;
    memset((char *)p + sizeof(PyObject), 0, sizeof(Pump) - sizeof(PyObject));
    p->reactor = (Reactor *)Py_NewRef(r);
    p->client_fd = client_fd;
    p->server_fd = server_fd;
    p->client_mask = p->server_mask = -1;
    p->open_directions = 2;
    p->timed.heap_index = -1;
    p->timed.kind = TIMED_PUMP;
    p->up.pipe[0] = p->up.pipe[1] = p->down.pipe[0] = p->down.pipe[1] = -1;
    p->up.copy_only = p->down.copy_only = !(splice_wanted && splice_ok);
    p->idle_timeout = idle;
    p->ends_at = now + lifetime;
    p->last_activity = now;
    p->initial = Py_NewRef(a[2]);
    p->uncounted = uncounted;
    p->on_end = a[4] == Py_None ? NULL : Py_NewRef(a[4]);
    PyObject_GC_Track(p);
    /* into the reactor: both slots, the open list (its reference), the epoll set */
    Slot *cs = &r->slots[client_fd], *ss = &r->slots[server_fd];
    cs->kind = ss->kind = SLOT_PUMP;
    cs->obj = ss->obj = (PyObject *)p;
    p->next = r->first;
    if (r->first != NULL)
        r->first->prev = p;
    r->first = (Pump *)Py_NewRef(p);
    if (rx_ctl(r, EPOLL_CTL_ADD, client_fd, EPOLLIN) < 0 ||
        (p->client_mask = EPOLLIN, rx_ctl(r, EPOLL_CTL_ADD, server_fd, EPOLLIN) < 0)) {
        PyErr_SetFromErrno(PyExc_OSError);
        p->outcome = O_ERROR;
        Py_XDECREF(pm_detach(p)); /* closes both descriptors */
        Py_CLEAR(p->on_end);
        Py_DECREF(p);
        return NULL;
    }
    p->server_mask = EPOLLIN;
    if (PyBytes_GET_SIZE(p->initial) > 0 && pm_write_initial(p) < 0) {
        pm_crash(p);
        return (PyObject *)p;
    }
    if (p->outcome != OPEN) { /* the server failed before the initial bytes were out */
        pm_finish(p);
        return (PyObject *)p;
    }
    if (pm_arm(p, now + idle) < 0)
        pm_crash(p);
    return (PyObject *)p;
fail_fds:
    close(client_fd);
    close(server_fd);
    return NULL;
}

static PyObject *
Reactor_listen(Reactor *r, PyObject *args)
{
    int fd;
    PyObject *callback;
    if (!PyArg_ParseTuple(args, "iO:listen", &fd, &callback))
        return NULL;
    if (!PyCallable_Check(callback)) {
        PyErr_SetString(PyExc_TypeError, "listen(): callback must be callable");
        return NULL;
    }
    if (r->epfd < 0) {
        PyErr_SetString(PyExc_ValueError, "the reactor is closed");
        return NULL;
    }
    if (rx_slot_room(r, fd) < 0)
        return NULL;
    if (r->slots[fd].kind != SLOT_FREE) {
        PyErr_SetString(PyExc_ValueError, "listen(): the descriptor is in the reactor already");
        return NULL;
    }
    if (rx_ctl(r, EPOLL_CTL_ADD, fd, EPOLLIN) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    r->slots[fd].kind = SLOT_CALLBACK;
    r->slots[fd].obj = Py_NewRef(callback);
    Py_RETURN_NONE;
}

static PyObject *
Reactor_unlisten(Reactor *r, PyObject *args)
{
    int fd;
    PyObject *callback;
    if (!PyArg_ParseTuple(args, "iO:unlisten", &fd, &callback))
        return NULL;
    if (fd < 0 || fd >= r->n_slots || r->slots[fd].kind != SLOT_CALLBACK)
        Py_RETURN_NONE;
    PyObject *held = r->slots[fd].obj;
    int same = held == callback;
    if (!same) {
        same = PyObject_RichCompareBool(held, callback, Py_EQ);
        if (same < 0)
            return NULL;
    }
    if (!same)
        Py_RETURN_NONE;
    if (r->epfd >= 0) {
        struct epoll_event ev;
        epoll_ctl(r->epfd, EPOLL_CTL_DEL, fd, &ev); /* closed already: gone from the set */
    }
    rx_slot_clear(r, fd, held);
    Py_RETURN_NONE;
}

/* epoll_wait on the reactor's set, the GIL released while it may block: the number of
 * events; 0 on a signal when blocking; -1 with an exception. */
static int
rx_epoll_wait(Reactor *r, struct epoll_event *evs, int timeout_ms)
{
    for (;;) {
        int n;
        if (timeout_ms != 0) {
            Py_BEGIN_ALLOW_THREADS
            n = epoll_wait(r->epfd, evs, MAX_BATCH, timeout_ms);
            Py_END_ALLOW_THREADS
        }
        else
            n = epoll_wait(r->epfd, evs, MAX_BATCH, 0);
        if (n >= 0)
            return n;
        if (errno != EINTR) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        python_ran++;
        if (PyErr_CheckSignals() < 0)
            return -1;
        if (timeout_ms != 0)
            return 0; /* a signal: back to the caller (trio sees its wake-up) */
    }
}

PyDoc_STRVAR(dispatch_new_doc,
    "dispatch(timeout_ms=0) -> number of events\n\n"
    "One batch: wait up to `timeout_ms` (0: not at all; the GIL is released) for the set's\n"
    "events and handle them; the FINs read in it are passed on at its end.");

static PyObject *
Reactor_dispatch(Reactor *r, PyObject *const *args, Py_ssize_t nargs)
{
    int timeout_ms = 0;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "dispatch() takes at most 1 argument");
        return NULL;
    }
    if (nargs == 1) {
        timeout_ms = as_int(args[0]);
        if (timeout_ms == -1 && PyErr_Occurred())
            return NULL;
    }
    if (rx_check_open(r) < 0)
        return NULL;
    struct epoll_event evs[MAX_BATCH];
    int n = rx_epoll_wait(r, evs, timeout_ms);
    if (n < 0)
        return NULL;
    int trio_ready = 0;
    Py_INCREF(r);
    int rc = rx_handle(r, evs, n, -1, &trio_ready);
    Py_DECREF(r);
    if (rc < 0)
        return NULL;
    return PyLong_FromLong(n);
}

PyDoc_STRVAR(wait_new_doc,
    "wait(trio_fd, timeout, offset, next_deadline, runq) -> bool\n\n"
    "The reactor waiting in trio's place (lbproxy/net/trio_wait.py's loop, in C, for trio's\n"
    "SystemClock: its time is `offset` + CLOCK_MONOTONIC): batches as dispatch() makes them,\n"
    "each waiting (GIL released) until `timeout` seconds from now or next_deadline(), called\n"
    "before each, whichever comes first. True as soon as a batch saw `trio_fd` ready; False\n"
    "once the time is over or `runq` is not empty (a batch made a task runnable).");

static PyObject *
Reactor_wait(Reactor *r, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "wait() takes exactly 5 arguments (%zd given)", nargs);
        return NULL;
    }
    int trio_fd = as_int(args[0]);
    if (trio_fd == -1 && PyErr_Occurred())
        return NULL;
    double timeout = PyFloat_AsDouble(args[1]);
    double offset = PyFloat_AsDouble(args[2]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *next_deadline = args[3], *runq = args[4];
    if (rx_check_open(r) < 0)
        return NULL;
    struct epoll_event evs[MAX_BATCH];
    double now;
    if (cp_native_seconds(offset, &now) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    double end = now + timeout, deadline = 0.0;
    unsigned long asked = python_ran - 1;
    PyObject *result = NULL;
    Py_INCREF(r);
    for (;;) {
        /* trio's next deadline, again after a batch that may have moved it: one that ran
         * Python code (only that can) */
        if (asked != python_ran) {
            PyObject *d = PyObject_CallNoArgs(next_deadline);
            if (d == NULL)
                break;
            deadline = PyFloat_AsDouble(d);
            Py_DECREF(d);
            if (deadline == -1.0 && PyErr_Occurred())
                break;
            asked = python_ran;
        }
        if (cp_native_seconds(offset, &now) < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            break;
        }
        double left = (deadline < end ? deadline : end) - now;
        if (!(left > 0)) {
            result = Py_NewRef(Py_False);
            break;
        }
        /* rounded up, as trio's own epoll wait rounds: never back before the deadline */
        double ms = ceil(left * 1000.0);
        int n = rx_epoll_wait(r, evs, ms > 86400000.0 ? 86400000 : (int)ms);
        if (n < 0)
            break;
        int trio_ready = 0;
        if (rx_handle(r, evs, n, trio_fd, &trio_ready) < 0)
            break;
        if (trio_ready) {
            result = Py_NewRef(Py_True);
            break;
        }
        Py_ssize_t runnable = PyObject_Length(runq);
        if (runnable < 0)
            break;
        if (runnable > 0) {
            result = Py_NewRef(Py_False);
            break;
        }
        if (r->epfd < 0) { /* closed by a callback */
            result = Py_NewRef(Py_False);
            break;
        }
    }
    Py_DECREF(r);
    return result;
}

PyDoc_STRVAR(expire_doc,
    "expire() -> float\n\n"
    "End the pumps idle for their idle_timeout (outcome \"idle_timeout\"; a deadline that\n"
    "rings for a pump that moved bytes since is moved to its new time) and those past\n"
    "their max_duration (outcome \"max_duration\"), and return when\n"
    "to call again: the next deadline, math.inf if there is none. The idle timer calls it\n"
    "then; until then a pump whose deadline is earlier calls wake(when).");

static PyObject *
Reactor_expire(Reactor *r, PyObject *unused)
{
    double now;
    if (rx_now(r, &now) < 0)
        return NULL;
    Py_INCREF(r);
    while (r->heap_len > 0 && r->heap[0]->due <= now) {
        Timed *t = r->heap[0];
        if (t->kind == TIMED_SESSION) {
            us_ring(r, SESSION_OF(t), now);
            continue;
        }
        Pump *p = PUMP_OF(t);
        double due = p->last_activity + p->idle_timeout;
        if (now >= p->ends_at) {
            Py_INCREF(p);
            pm_end(p, O_MAX_DURATION);
            Py_DECREF(p);
        }
        else if (now >= due) {
            Py_INCREF(p);
            pm_end(p, O_IDLE_TIMEOUT);
            Py_DECREF(p);
        }
        else { /* bytes moved since it was armed: look again at its new time */
            t->due = due < p->ends_at ? due : p->ends_at;
            heap_down(r, 0);
        }
    }
    r->armed = r->heap_len > 0 ? r->heap[0]->due : Py_HUGE_VAL;
    Py_DECREF(r);
    return PyFloat_FromDouble(r->armed);
}

static PyObject *
Reactor_fileno(Reactor *r, PyObject *unused)
{
    if (r->epfd < 0) {
        PyErr_SetString(PyExc_ValueError, "the reactor is closed");
        return NULL;
    }
    return PyLong_FromLong(r->epfd);
}

static PyObject *
Reactor_close(Reactor *r, PyObject *unused)
{
    if (r->in_batch) {
        PyErr_SetString(PyExc_RuntimeError, "a reactor batch is running");
        return NULL;
    }
    Py_INCREF(r);
    /* every open pump ends ("cancelled": its owner's on_end hears of it) */
    while (r->first != NULL) {
        Pump *p = (Pump *)Py_NewRef(r->first);
        if (p->outcome == OPEN)
            pm_end(p, O_CANCELLED);
        else
            Py_XDECREF(pm_detach(p));
        Py_DECREF(p);
    }
    for (int i = 0; i < r->n_slots; i++)
        if (r->slots[i].kind == SLOT_UDP_LISTEN) {
            PyObject *held = Py_NewRef(r->slots[i].obj);
            ur_close((UdpRelay *)held, 1);
            Py_DECREF(held);
        } /* every session ends: "stopped" */
        else if (r->slots[i].kind == SLOT_CALLBACK)
            rx_slot_clear(r, i, r->slots[i].obj);
    if (r->epfd >= 0) {
        close(r->epfd);
        r->epfd = -1;
    }
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *
Reactor_get_pumps(Reactor *r, void *c)
{
    long n = 0;
    for (Pump *p = r->first; p != NULL; p = p->next)
        n++;
    return PyLong_FromLong(n);
}

static PyObject *
Reactor_get_closed(Reactor *r, void *c)
{
    return PyBool_FromLong(r->epfd < 0);
}

static PyMethodDef Reactor_methods[] = {
    {"open", (PyCFunction)(void (*)(void))Reactor_open, METH_FASTCALL | METH_KEYWORDS, open_doc},
    {"udp", (PyCFunction)Reactor_udp, METH_VARARGS, udp_doc},
    {"listen", (PyCFunction)Reactor_listen, METH_VARARGS,
     "listen(fd, callback): callback(fd, events) in the batches while fd is readable"},
    {"unlisten", (PyCFunction)Reactor_unlisten, METH_VARARGS,
     "unlisten(fd, callback): out of the set again (before fd is closed); idempotent"},
    {"dispatch", (PyCFunction)(void (*)(void))Reactor_dispatch, METH_FASTCALL, dispatch_new_doc},
    {"wait", (PyCFunction)(void (*)(void))Reactor_wait, METH_FASTCALL, wait_new_doc},
    {"expire", (PyCFunction)Reactor_expire, METH_NOARGS, expire_doc},
    {"fileno", (PyCFunction)Reactor_fileno, METH_NOARGS, "fileno(): the epoll descriptor"},
    {"close", (PyCFunction)Reactor_close, METH_NOARGS,
     "close(): every open pump ends (\"cancelled\"), then the set is closed"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Reactor_getset[] = {
    {"pumps", (getter)Reactor_get_pumps, NULL, "how many pumps are open", NULL},
    {"closed", (getter)Reactor_get_closed, NULL, "close() was called", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject Reactor_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lbproxy.net._cpump.Reactor",
    .tp_basicsize = sizeof(Reactor),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Reactor(clock, offset, record, wake, splice_refused): one epoll set and the\n"
              "pumps in it, for one trio run. clock(): the run's time (offset: trio's\n"
              "SystemClock's, read here instead; None: call clock); record(where, exc): a\n"
              "failure counted; wake(when): the idle timer must ring by then;\n"
              "splice_refused(exc): the kernel cannot splice (once per process).",
    .tp_new = Reactor_new,
    .tp_dealloc = (destructor)Reactor_dealloc,
    .tp_traverse = (traverseproc)Reactor_traverse,
    .tp_clear = (inquiry)Reactor_clear,
    .tp_methods = Reactor_methods,
    .tp_getset = Reactor_getset,
};

/* -- the pipe pool's Python face ---------------------------------------------------------- */

static PyObject *
idle_pipes(PyObject *self, PyObject *unused)
{
    PyObject *list = PyList_New(n_pool);
    if (list == NULL)
        return NULL;
    for (int i = 0; i < n_pool; i++) {
        PyObject *t = Py_BuildValue("(ii)", pool[i][0], pool[i][1]);
        if (t == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, t);
    }
    return list;
}

static PyObject *
close_idle_pipes(PyObject *self, PyObject *unused)
{
    int n = n_pool;
    while (n_pool > 0) {
        n_pool--;
        close(pool[n_pool][0]);
        close(pool[n_pool][1]);
    }
    return PyLong_FromLong(n);
}

static PyObject *
splice_available(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(splice_ok);
}

static PyObject *
set_splice(PyObject *self, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    splice_ok = on;
    Py_RETURN_NONE;
}

/* Set up at import: the outcomes' strings (and b"" for a written-out initial). */
static int
pump_init(PyObject *m)
{
    empty_bytes = PyBytes_FromStringAndSize(NULL, 0);
    if (empty_bytes == NULL)
        return -1;
    for (int i = 1; i < N_OUTCOMES; i++) {
        outcome_str[i] = PyUnicode_InternFromString(outcome_text[i]);
        if (outcome_str[i] == NULL)
            return -1;
    }
    s_where_pump = PyUnicode_InternFromString("pump");
    s_where_connection_end = PyUnicode_InternFromString("connection_end");
    if (s_where_pump == NULL || s_where_connection_end == NULL)
        return -1;
    if (PyType_Ready(&Reactor_Type) < 0 || PyType_Ready(&Pump_Type) < 0)
        return -1;
    Py_INCREF(&Reactor_Type);
    if (PyModule_AddObject(m, "Reactor", (PyObject *)&Reactor_Type) < 0) {
        Py_DECREF(&Reactor_Type);
        return -1;
    }
    if (PyModule_AddIntConstant(m, "MAX_IDLE_PIPES", MAX_IDLE_PIPES) < 0 ||
        PyModule_AddIntConstant(m, "PIPE_SIZE", PIPE_SIZE) < 0)
        return -1;
    return 0;
}


/* == accept, connect ================================================================= */

PyDoc_STRVAR(accept_doc,
    "accept(fd) -> (client_fd, address)\n\n"
    "accept4(fd, SOCK_NONBLOCK | SOCK_CLOEXEC): the descriptor is non-blocking already,\n"
    "saving the fcntl that socket._accept() needs after it. The address is what\n"
    "socket.accept() gives: (host, port) for IPv4, (host, port, flowinfo, scope_id) for\n"
    "IPv6. Raises OSError (BlockingIOError when the backlog is empty) as socket does.");

/* accept4 once: the new descriptor in *client and a new reference to its address in
 * *addr, 0; or -1 with OSError set (BlockingIOError: the backlog is empty). */
static int
accept_one(int fd, int *client_out, PyObject **addr_out)
{
    struct sockaddr_storage ss;
    int client;
    for (;;) {
        socklen_t len = sizeof ss;
        /* a non-blocking listening socket: no need to let go of the GIL */
        client = accept4(fd, (struct sockaddr *)&ss, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (client >= 0)
            break;
        if (errno != EINTR) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (PyErr_CheckSignals() < 0)
            return -1;
    }
    char host[NI_MAXHOST];
    PyObject *addr = NULL;
    if (ss.ss_family == AF_INET) {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
        if (inet_ntop(AF_INET, &a->sin_addr, host, sizeof host) != NULL)
            addr = Py_BuildValue("(si)", host, ntohs(a->sin_port));
        else
            PyErr_SetFromErrno(PyExc_OSError);
    }
    else if (ss.ss_family == AF_INET6) {
        /* getnameinfo, as CPython: a scoped address keeps its "%zone" */
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
        int e = getnameinfo((struct sockaddr *)a, sizeof *a, host, sizeof host, NULL, 0,
                            NI_NUMERICHOST);
        if (e == 0)
            addr = Py_BuildValue("(siII)", host, ntohs(a->sin6_port),
                                 (unsigned int)ntohl(a->sin6_flowinfo),
                                 (unsigned int)a->sin6_scope_id);
        else
            PyErr_SetString(PyExc_OSError, gai_strerror(e));
    }
    else {
        addr = Py_None;
        Py_INCREF(addr);
    }
    if (addr == NULL) {
        close(client);
        return -1;
    }
    *client_out = client;
    *addr_out = addr;
    return 0;
}

static PyObject *
accept_(PyObject *self, PyObject *arg)
{
    int fd = as_int(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    int client;
    PyObject *addr;
    if (accept_one(fd, &client, &addr) < 0)
        return NULL;
    PyObject *r = Py_BuildValue("(iN)", client, addr);
    if (r == NULL)
        close(client);
    return r;
}

/* The process's count of open clients and its limit (global.max_clients), shared by
 * the Python side (connection.py raises and lowers `open`) and the accept batch, which
 * compares the two before it hands a client over (net/descriptors.py). */
typedef struct {
    PyObject_HEAD
    Py_ssize_t open;
    Py_ssize_t limit;
} ClientCount;

static PyObject *
ClientCount_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    if (PyTuple_GET_SIZE(args) || (kw != NULL && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "ClientCount() takes no arguments");
        return NULL;
    }
    ClientCount *c = (ClientCount *)type->tp_alloc(type, 0);
    if (c == NULL)
        return NULL;
    c->open = 0;
    c->limit = PY_SSIZE_T_MAX;
    return (PyObject *)c;
}

static PyMemberDef ClientCount_members[] = {
    {"open", T_PYSSIZET, offsetof(ClientCount, open), 0, "clients open now"},
    {"limit", T_PYSSIZET, offsetof(ClientCount, limit), 0, "at most this many"},
    {NULL},
};

static PyTypeObject ClientCount_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lbproxy.net._cpump.ClientCount",
    .tp_basicsize = sizeof(ClientCount),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ClientCount(): `open` clients, at most `limit` (net/descriptors.py); the\n"
              "accept batch reads both as C integers.",
    .tp_new = ClientCount_new,
    .tp_members = ClientCount_members,
};

PyDoc_STRVAR(accept_batch_doc,
    "accept_batch(fd, owner, spawn, most, failed[, clients]) -> number accepted\n\n"
    "The accept loop's inner part (net/accept.py): up to `most` times, accept4 (as\n"
    "accept()) and owner.accept_client(client_fd, address, spawn) -- the attribute read\n"
    "afresh for every client, as a reload may re-route the owner. An Exception raised by\n"
    "it goes to failed(exc) (the barrier) and the batch goes on. With `clients` (a\n"
    "ClientCount), a client accepted while `clients.open >= clients.limit` is closed at\n"
    "once and owner.refuse_client(address) is called instead. Returns how many were\n"
    "accepted when the backlog is empty, an accept fails after some were, or `most` is\n"
    "reached; raises the OSError (BlockingIOError: the backlog was empty) when the first\n"
    "accept fails.");

static PyObject *s_accept_client, *s_refuse_client;

static PyObject *
accept_batch(PyObject *self, PyObject *args)
{
    int fd, most;
    PyObject *owner, *spawn, *failed, *count = Py_None;
    if (!PyArg_ParseTuple(args, "iOOiO|O:accept_batch", &fd, &owner, &spawn, &most, &failed,
                          &count))
        return NULL;
    ClientCount *clients = NULL;
    if (count != Py_None) {
        if (!PyObject_TypeCheck(count, &ClientCount_Type)) {
            PyErr_SetString(PyExc_TypeError, "accept_batch: clients must be a ClientCount");
            return NULL;
        }
        clients = (ClientCount *)count;
    }
    int n = 0;
    while (n < most) {
        int client;
        PyObject *addr;
        if (accept_one(fd, &client, &addr) < 0) {
            if (n == 0)
                return NULL;
            PyErr_Clear(); /* the next call meets it again, or the backlog is empty */
            break;
        }
        n++;
        PyObject *r = NULL;
        if (clients != NULL && clients->open >= clients->limit) {
            /* max_clients: closed before a byte is read; the owner counts it */
            close(client);
            r = PyObject_CallMethodOneArg(owner, s_refuse_client, addr);
            Py_DECREF(addr);
        }
        else {
            PyObject *fdo = PyLong_FromLong(client);
            PyObject *handler = fdo ? PyObject_GetAttr(owner, s_accept_client) : NULL;
            if (handler != NULL) {
                PyObject *argv[3] = {fdo, addr, spawn};
                r = PyObject_Vectorcall(handler, argv, 3, NULL);
                Py_DECREF(handler);
            }
            else
                close(client); /* nobody owns it yet */
            Py_XDECREF(fdo);
            Py_DECREF(addr);
        }
        if (r != NULL) {
            Py_DECREF(r);
            continue;
        }
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return NULL; /* Cancelled, KeyboardInterrupt */
        /* the barrier: the owner closed what it owned */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL && value != NULL)
            PyException_SetTraceback(value, tb);
        PyObject *x = PyObject_CallOneArg(failed, value ? value : Py_None);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        if (x == NULL)
            return NULL;
        Py_DECREF(x);
    }
    return PyLong_FromLong(n);
}

PyDoc_STRVAR(sockaddr_doc,
    "sockaddr(family, address) -> bytes\n\n"
    "The struct sockaddr_in / sockaddr_in6 of a numeric address as getaddrinfo gives it:\n"
    "(host, port) for AF_INET, (host, port[, flowinfo, scope_id]) for AF_INET6 (a\n"
    "'%zone' suffix is dropped: scope_id says it). Made once per real-server address, for\n"
    "connect(). ValueError for anything else.");

static PyObject *
sockaddr_(PyObject *self, PyObject *args)
{
    int family;
    PyObject *address;
    if (!PyArg_ParseTuple(args, "iO!:sockaddr", &family, &PyTuple_Type, &address))
        return NULL;
    const char *host;
    int port;
    unsigned int flowinfo = 0, scope_id = 0;
    if (family == AF_INET) {
        if (!PyArg_ParseTuple(address, "si:sockaddr", &host, &port))
            return NULL;
    }
    else if (family == AF_INET6) {
        if (!PyArg_ParseTuple(address, "si|II:sockaddr", &host, &port, &flowinfo, &scope_id))
            return NULL;
    }
    else {
        PyErr_SetString(PyExc_ValueError, "not an AF_INET or AF_INET6 address");
        return NULL;
    }
    if (port < 0 || port > 65535) {
        PyErr_SetString(PyExc_ValueError, "port out of range");
        return NULL;
    }
    if (family == AF_INET) {
        struct sockaddr_in a;
        memset(&a, 0, sizeof a);
        a.sin_family = AF_INET;
        a.sin_port = htons((uint16_t)port);
        if (inet_pton(AF_INET, host, &a.sin_addr) != 1) {
            PyErr_SetString(PyExc_ValueError, "not a numeric IPv4 address");
            return NULL;
        }
        return PyBytes_FromStringAndSize((const char *)&a, sizeof a);
    }
    char text[INET6_ADDRSTRLEN];
    size_t len = strcspn(host, "%");
    if (len >= sizeof text) {
        PyErr_SetString(PyExc_ValueError, "not a numeric IPv6 address");
        return NULL;
    }
    memcpy(text, host, len);
    text[len] = 0;
    struct sockaddr_in6 a;
    memset(&a, 0, sizeof a);
    a.sin6_family = AF_INET6;
    a.sin6_port = htons((uint16_t)port);
    a.sin6_flowinfo = htonl(flowinfo);
    a.sin6_scope_id = scope_id;
    if (inet_pton(AF_INET6, text, &a.sin6_addr) != 1) {
        PyErr_SetString(PyExc_ValueError, "not a numeric IPv6 address");
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)&a, sizeof a);
}

PyDoc_STRVAR(connect_doc,
    "connect(sockaddr) -> (fd, err)\n\n"
    "The connect to a real server, in one call: socket(SOCK_STREAM | SOCK_NONBLOCK |\n"
    "SOCK_CLOEXEC) of the address's family, TCP_NODELAY, a non-blocking connect to\n"
    "`sockaddr` (bytes from sockaddr()) and, when it is in progress, one getpeername: a\n"
    "near server has often completed the handshake before connect() returns. Returns\n"
    "(fd, 0) connected, (fd, EINPROGRESS) still connecting, (-1, errno) when socket()\n"
    "failed, (-2, errno) when setsockopt or the connect failed (the socket is closed).\n"
    "A system call's failure is never raised.");

static PyObject *
connect_(PyObject *self, PyObject *arg)
{
    if (!PyBytes_Check(arg) || PyBytes_GET_SIZE(arg) < (Py_ssize_t)sizeof(sa_family_t) ||
        PyBytes_GET_SIZE(arg) > (Py_ssize_t)sizeof(struct sockaddr_storage)) {
        PyErr_SetString(PyExc_TypeError, "connect() takes the bytes sockaddr() made");
        return NULL;
    }
    struct sockaddr_storage ss;
    socklen_t len = (socklen_t)PyBytes_GET_SIZE(arg);
    memcpy(&ss, PyBytes_AS_STRING(arg), len);
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return Py_BuildValue("(ii)", -1, errno);
    int one = 1, err = 0;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) < 0)
        err = errno;
    else if (connect(fd, (struct sockaddr *)&ss, len) < 0) {
        err = errno;
        if (err == EINTR) /* a non-blocking connect goes on in the background */
            err = EINPROGRESS;
        if (err == EINPROGRESS) {
            /* One system call: a peer name means connected; ENOTCONN means still
             * connecting or failed, and SO_ERROR after the wait tells which. */
            struct sockaddr_storage peer;
            socklen_t peer_len = sizeof peer;
            if (getpeername(fd, (struct sockaddr *)&peer, &peer_len) == 0)
                err = 0;
        }
    }
    if (err && err != EINPROGRESS) {
        close(fd);
        return Py_BuildValue("(ii)", -2, err);
    }
    PyObject *r = Py_BuildValue("(ii)", fd, err);
    if (r == NULL)
        close(fd);
    return r;
}

static PyMethodDef methods[] = {
    {"accept", accept_, METH_O, accept_doc},
    {"accept_batch", accept_batch, METH_VARARGS, accept_batch_doc},
    {"connect", connect_, METH_O, connect_doc},
    {"sockaddr", sockaddr_, METH_VARARGS, sockaddr_doc},
    {"idle_pipes", idle_pipes, METH_NOARGS,
     "idle_pipes() -> [(read_fd, write_fd)]: the pooled pipes (a copy)"},
    {"close_idle_pipes", close_idle_pipes, METH_NOARGS,
     "close_idle_pipes() -> int: close every pooled pipe, say how many there were"},
    {"splice_available", splice_available, METH_NOARGS,
     "splice_available() -> bool: whether pumps opened now splice their bulk chunks"},
    {"set_splice", set_splice, METH_O,
     "set_splice(on): let pumps opened from now on splice, or not"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "lbproxy.net._cpump",
    "The connection path in C: see lbproxy/net/compiled.py.", -1, methods,
};

static int
add_type(PyObject *m, const char *name, PyTypeObject *type)
{
    if (PyType_Ready(type) < 0)
        return -1;
    Py_INCREF(type);
    if (PyModule_AddObject(m, name, (PyObject *)type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

PyMODINIT_FUNC
PyInit__cpump(void)
{
    s_accept_client = PyUnicode_InternFromString("accept_client");
    s_refuse_client = PyUnicode_InternFromString("refuse_client");
    if (s_accept_client == NULL || s_refuse_client == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (add_type(m, "Clock", &CClock_Type) < 0 || add_type(m, "ClientCount", &ClientCount_Type) < 0 ||
        PyModule_AddIntConstant(m, "COPY_CHUNK", COPY_CHUNK) < 0 ||
        PyModule_AddIntConstant(m, "C_API", C_API) < 0 || pump_init(m) < 0 ||
        udp_init(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
