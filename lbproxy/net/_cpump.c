/* lbproxy.net._cpump: the reactor's inner loop in C (issue 26), optional.
 *
 * What every connection and every chunk goes through, and nothing else: one batch of
 * the reactor (epoll_wait, the pump of each ready descriptor, its event), the pump of a
 * connection (the Pump type below: pump.py's Pump, state machine for state machine,
 * with the same splice-auto policy -- small chunks copied with recv/send, bulk ones
 * spliced socket -> pipe -> socket through a pipe from pump.py's pool), and accept4 with
 * SOCK_NONBLOCK for the accept loop. The decisions stay Python (the reactor's dict and
 * deadline heap, the pool, the Flow, on_end): the pure-Python path (LBPROXY_PURE=1;
 * lbproxy/net/compiled.py chooses) and this one behave alike.
 *
 * No error here may take the process down: every Python exception met while handling
 * one pump's event goes to the reactor's `_crashed(pump, exc)` (the exception barrier,
 * lbproxy_internal_errors_total{where="pump"}), as the pure loop does; only a
 * BaseException that is not an Exception (KeyboardInterrupt, trio's Cancelled) leaves.
 */
#define _GNU_SOURCE /* splice, accept4 */
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
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* pump.py's constants (pump.py checks them against its own before setup()). */
#define READING 0
#define WRITING 1
#define DONE 2
#define HELD 3
#define MOVED 0
#define BLOCKED 1
#define EOF_ 2
#define SOURCE_FAILED 3
#define DESTINATION_FAILED 4
#define BURST 2
#define BIG_CHUNK (1 << 16)
#define SPLICE_CHUNK (1 << 24)
/* splice-auto, as HAProxy's: a direction copies its chunks (one recv, one send: no pipe)
 * until a read fills this buffer (HAProxy's bufsize), the sign of a bulk transfer; from
 * then on it splices (socket -> pipe -> socket, zero copy). */
#define COPY_CHUNK (1 << 14)
#define MAX_BATCH 1024

#define IN_OR_FAILED (EPOLLIN | EPOLLERR | EPOLLHUP)
#define OUT_OR_FAILED (EPOLLOUT | EPOLLERR | EPOLLHUP)
#define FAILED (EPOLLERR | EPOLLHUP)

/* Set by setup(): the pump module's globals (the pipe pool, its bound, the helpers,
 * looked up at each use so a change to them applies as on the pure path) and the type
 * whose moves run here. */
static PyObject *module_dict = NULL;
static PyTypeObject *splice_type = NULL;

static PyObject *s_client_fd, *s_up, *s_down, *s_outcome, *s_state, *s_src_fd, *s_dst_fd,
    *s_last_read, *s_error, *s_pipe, *s_pending, *s_spliced, *s_flow, *s_to_server,
    *s_clock, *s_bytes_in, *s_bytes_out, *s_last_activity, *s_after, *s_write_initial,
    *s_unwatched_event, *s_finish, *s_move, *s_write_out, *s_idle_pipes, *s_max_idle_pipes,
    *s_new_pipe, *s_discard_pipe, *s_on_event;

/* -- attributes ----------------------------------------------------------------------
 *
 * Pump and _Direction keep their state in __slots__: a slot is a pointer at a
 * fixed offset in the object, which PyObject_GetAttr finds through the type's
 * descriptor (~175 instructions, measured with callgrind; most of what a batch cost
 * here). For exactly those two types (not a subclass, which could override a name) the
 * offsets are read once, in setup(), and used directly; any other object goes through
 * PyObject_GetAttr as before (the flow's slots have their own cache: flow_get, flow_set). */

#define MAX_SLOTS 32
static struct slot {
    PyTypeObject *type;
    PyObject *name; /* interned: compared by pointer */
    Py_ssize_t offset;
} slots[MAX_SLOTS];
static int n_slots = 0;
static PyTypeObject *pump_type = NULL;

static PyObject **
slot_of(PyObject *obj, PyObject *name)
{
    PyTypeObject *t = Py_TYPE(obj);
    if (t != pump_type && t != splice_type)
        return NULL;
    for (int i = 0; i < n_slots; i++)
        if (slots[i].name == name && slots[i].type == t)
            return (PyObject **)((char *)obj + slots[i].offset);
    return NULL;
}

/* A new reference, or NULL with AttributeError (an unset slot) or another error. */
static PyObject *
get_attr(PyObject *obj, PyObject *name)
{
    PyObject **p = slot_of(obj, name);
    if (p == NULL)
        return PyObject_GetAttr(obj, name);
    if (*p == NULL) {
        PyErr_SetObject(PyExc_AttributeError, name);
        return NULL;
    }
    Py_INCREF(*p);
    return *p;
}

/* Record `name`'s slot offset on `type`; 0 if it is not a plain object slot (then the
 * generic path serves it). */
static int
learn_slot(PyTypeObject *type, PyObject *name)
{
    PyObject *descr = PyObject_GetAttr((PyObject *)type, name);
    if (descr == NULL) {
        PyErr_Clear();
        return 0;
    }
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type) && n_slots < MAX_SLOTS) {
        PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READONLY) &&
            PyType_IsSubtype(type, PyDescr_TYPE(descr))) {
            slots[n_slots].type = type;
            slots[n_slots].name = name;
            slots[n_slots].offset = m->offset;
            n_slots++;
        }
    }
    Py_DECREF(descr);
    return 0;
}

/* -- small helpers ------------------------------------------------------------------ */

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

/* An int attribute; -1 with an exception set on failure (no attribute here is -1). */
static long
get_long(PyObject *obj, PyObject *name)
{
    PyObject *v = get_attr(obj, name);
    if (v == NULL)
        return -1;
    long r = PyLong_AsLong(v);
    Py_DECREF(v);
    return r;
}

/* An OSError for errno `code` (the subclass os.splice would raise: OSError's own
 * constructor picks it). */
static PyObject *
os_error(int code)
{
    return PyObject_CallFunction(PyExc_OSError, "is", code, strerror(code));
}

static PyObject *
module_global(PyObject *name)
{
    PyObject *v = PyDict_GetItemWithError(module_dict, name); /* borrowed */
    if (v == NULL && !PyErr_Occurred())
        PyErr_SetObject(PyExc_NameError, name);
    return v;
}

/* _put_pipe(pipe): an EMPTY pipe back to the pool, or closed when the pool is full. */
static int
put_pipe(PyObject *pipe)
{
    PyObject *pool = module_global(s_idle_pipes);
    if (pool == NULL)
        return -1;
    PyObject *limit = module_global(s_max_idle_pipes);
    if (limit == NULL)
        return -1;
    Py_ssize_t max = PyLong_AsSsize_t(limit);
    if (max == -1 && PyErr_Occurred())
        return -1;
    if (PyList_Check(pool) && PyList_GET_SIZE(pool) < max)
        return PyList_Append(pool, pipe);
    PyObject *discard = module_global(s_discard_pipe);
    if (discard == NULL)
        return -1;
    PyObject *r = PyObject_CallOneArg(discard, pipe);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* A pipe from the pool, else a new one (_new_pipe). NULL with an exception set. */
static PyObject *
take_pipe(void)
{
    PyObject *pool = module_global(s_idle_pipes);
    if (pool == NULL)
        return NULL;
    if (PyList_Check(pool) && PyList_GET_SIZE(pool) > 0) {
        Py_ssize_t last = PyList_GET_SIZE(pool) - 1;
        PyObject *pipe = PyList_GET_ITEM(pool, last);
        Py_INCREF(pipe);
        if (PyList_SetSlice(pool, last, last + 1, NULL) < 0) {
            Py_DECREF(pipe);
            return NULL;
        }
        return pipe;
    }
    PyObject *make = module_global(s_new_pipe);
    if (make == NULL)
        return NULL;
    return PyObject_CallNoArgs(make);
}

static int
pipe_fds(PyObject *pipe, int *r, int *w)
{
    if (!PyTuple_Check(pipe) || PyTuple_GET_SIZE(pipe) != 2) {
        PyErr_SetString(PyExc_TypeError, "a pipe is a tuple of two descriptors");
        return -1;
    }
    *r = as_int(PyTuple_GET_ITEM(pipe, 0));
    *w = as_int(PyTuple_GET_ITEM(pipe, 1));
    if ((*r == -1 || *w == -1) && PyErr_Occurred())
        return -1;
    return 0;
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
        if (PyErr_CheckSignals() < 0)
            return -2;
    }
}

/* reader.move(), the direction's own Python method: a Python Pump's chunks are moved
 * by its Python code (the C Pump moves its own, below). */
static int
move(PyObject *d)
{
    PyObject *r = PyObject_CallMethodNoArgs(d, s_move);
    if (r == NULL)
        return -1;
    long status = PyLong_AsLong(r);
    Py_DECREF(r);
    return (int)status;
}

static int
call_method(PyObject *obj, PyObject *name, PyObject *a, PyObject *b)
{
    PyObject *r;
    if (a == NULL)
        r = PyObject_CallMethodNoArgs(obj, name);
    else if (b == NULL)
        r = PyObject_CallMethodOneArg(obj, name, a);
    else
        r = PyObject_CallMethodObjArgs(obj, name, a, b, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* -- Pump.on_event(fd, events), line for line ------------------------------------------ */

static int
on_event(PyObject *p, int fd, uint32_t events)
{
    int result = -1;
    PyObject *reader = NULL, *writer = NULL, *st = NULL, *outcome = NULL;
    long client_fd = get_long(p, s_client_fd);
    if (client_fd == -1 && PyErr_Occurred())
        return -1;
    int client_side = fd == client_fd;
    reader = get_attr(p, client_side ? s_up : s_down);
    if (reader == NULL)
        goto out;
    writer = get_attr(p, client_side ? s_down : s_up);
    if (writer == NULL)
        goto out;
    int watched = 0;
    long state = get_long(reader, s_state);
    if (state == -1 && PyErr_Occurred())
        goto out;
    if (state == READING && (events & IN_OR_FAILED)) {
        watched = 1;
        int status = move(reader);
        if (status < 0) {
            if (PyErr_Occurred())
                goto out;
        }
        else if (status) {
            st = PyLong_FromLong(status);
            if (st == NULL || call_method(p, s_after, reader, st) < 0)
                goto out;
            Py_CLEAR(st);
        }
    }
    state = get_long(writer, s_state);
    if (state == -1 && PyErr_Occurred())
        goto out;
    if (state == WRITING && (events & OUT_OR_FAILED)) {
        watched = 1;
        outcome = get_attr(p, s_outcome);
        if (outcome == NULL)
            goto out;
        if (outcome == Py_None) {
            PyObject *r = PyObject_CallMethodNoArgs(writer, s_write_out);
            if (r == NULL)
                goto out;
            int ok = call_method(p, s_after, writer, r);
            Py_DECREF(r);
            if (ok < 0)
                goto out;
        }
        Py_CLEAR(outcome);
    }
    else if (state == HELD && (events & OUT_OR_FAILED)) {
        watched = 1;
        if (call_method(p, s_write_initial, NULL, NULL) < 0)
            goto out;
    }
    if (!watched && (events & FAILED)) {
        PyObject *fdo = PyLong_FromLong(fd);
        if (fdo == NULL)
            goto out;
        int ok = call_method(p, s_unwatched_event, fdo, client_side ? Py_True : Py_False);
        Py_DECREF(fdo);
        if (ok < 0)
            goto out;
    }
    outcome = get_attr(p, s_outcome);
    if (outcome == NULL)
        goto out;
    if (outcome != Py_None && call_method(p, s_finish, NULL, NULL) < 0)
        goto out;
    result = 0;
out:
    Py_XDECREF(reader);
    Py_XDECREF(writer);
    Py_XDECREF(st);
    Py_XDECREF(outcome);
    return result;
}

/* -- the Pump type: one connection's pump in C (issue 26, step 2) ---------------------
 *
 * pump.py's Pump and its two _Direction, as one C object: the same states, the same
 * transitions, method for method (the Python names are in the comments), so the pure
 * path (LBPROXY_PURE=1) and this one behave alike.
 * What it saves per connection: the three Python objects and their __init__ frames, the
 * start, the FINs (passed on at the batch's end inside dispatch()), the close and the
 * end -- Python is called back once, with on_end(pump). The reactor (epoll set, the
 * descriptor -> pump dict, the deadline heap and its sweep, the pipe pool) stays
 * pump.py's: this object registers in it as a Python Pump does. */

typedef struct {
    int state;       /* READING, WRITING, DONE, HELD */
    int fin_pending; /* its FIN waits for the end of the batch */
    int spliced;     /* a splice succeeded: EINVAL is no longer "cannot splice" */
    int bulk;        /* a read filled COPY_CHUNK: the next reads splice */
    int copy_only;   /* never splice (use_splice=False, or the kernel refused it) */
    int err;         /* the errno behind SOURCE_FAILED / DESTINATION_FAILED */
    ssize_t pending; /* bytes in `pipe` (or `buf`) not yet written to dst */
    ssize_t last_read;
    PyObject *pipe;  /* the borrowed (r, w) tuple while a spliced chunk waits, else NULL */
    char *buf;       /* the rest of a copied chunk dst did not take at once, else NULL */
    ssize_t buf_off; /* where in `buf` the `pending` bytes start */
} cdir;

typedef struct {
    PyObject_HEAD
    int client_fd, server_fd;
    int client_mask, server_mask; /* -1: not in the epoll set */
    int epfd;
    int open_directions;
    int registered;
    int in_batch_fins; /* queued in the current batch's FIN list */
    cdir up, down;
    Py_ssize_t initial_uncounted;
    PyObject *flow, *reactor, *outcome, *error, *on_end, *alarm, *initial, *sockets;
} CPump;

static PyTypeObject CPump_Type;

static PyObject *s_closed, *s_cancelled, *s_idle_timeout_o, *s_client_reset, *s_server_reset,
    *s_error_o, *s_closing, *s_pump_slot, *s_idle_timeout_attr, *s_pumps, *s_young,
    *s_sweeping, *s_defer, *s_deadlines, *s_at, *s_cancel, *s_deferred, *s_reactor_fn,
    *s_epfd, *s_record, *s_connection_end, *s_fileno, *s_close, *s_splice_refused;

/* -- the flow's attributes ----------------------------------------------------------
 *
 * Every chunk adds to the flow's bytes_in or bytes_out and stores its last_activity
 * (_Direction._wrote). The flow is a Flow (pump.py) or, in production, its subclass
 * ClientConnection: attributes in __slots__, so each is a pointer at a fixed offset
 * that PyObject_GetAttr / PyObject_SetAttr find through the type's member descriptor.
 * Measured with callgrind (scripts/bench_reactor.py --callgrind --new-pump --pumps 32
 * --rounds 100): that generic get + add + set + set was 895 instructions per event of
 * the 1,222 the C batch spent on one. So the offsets are learnt per flow type, here,
 * and read and written directly -- only where that is exactly what the generic path
 * does: the type's tp_getattro and tp_setattro are the generic ones (not a class with
 * __getattribute__, __getattr__ or __setattr__), the name resolves (_PyType_Lookup,
 * the MRO walk PyObject_GenericGetAttr makes) to a writable, unrestricted
 * T_OBJECT_EX member descriptor (a __slots__ entry: not a property, not shadowed by
 * a subclass), and the type has not changed since: CPython's own attribute cache
 * test, the type's version tag, which any assignment to the class or a base
 * invalidates (PyType_Modified). An unset slot is read through the generic path, for
 * its AttributeError. Anything else -- another object, a class with a property named
 * bytes_in -- goes through PyObject_GetAttr / PyObject_SetAttr as before. */

enum { F_BYTES_IN, F_BYTES_OUT, F_LAST_ACTIVITY, F_ERROR, F_PUMP, F_IDLE_TIMEOUT, F_CLOSING, F_N };

static PyObject **const flow_names[F_N] = {&s_bytes_in, &s_bytes_out, &s_last_activity,
                                           &s_error, &s_pump_slot, &s_idle_timeout_attr,
                                           &s_closing};

/* Two types: production has one (ClientConnection); tests meet Flow and subclasses. */
#define FLOW_TYPES 2
static struct flow_layout {
    PyTypeObject *type;    /* a strong reference: its address is not reused meanwhile */
    unsigned int version;  /* its tp_version_tag when learnt */
    int tagged;            /* the tag was valid then; untagged: every offset is 0 */
    Py_ssize_t offset[F_N]; /* 0: the generic path (no slot is at offset 0) */
} flow_layouts[FLOW_TYPES];

static int
flow_layout_valid(struct flow_layout *l, PyTypeObject *t)
{
    if (l->type != t)
        return 0;
    if (!l->tagged) /* all generic: right whatever became of the type */
        return 1;
    return (t->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) && t->tp_version_tag == l->version;
}

static Py_ssize_t
flow_member_offset(PyTypeObject *t, PyObject *name)
{
    PyObject *descr = _PyType_Lookup(t, name); /* borrowed; never sets an exception */
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type))
        return 0;
    PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
    if (m->type != T_OBJECT_EX || m->flags != 0 || m->offset <= 0 ||
        !PyType_IsSubtype(t, PyDescr_TYPE(descr)))
        return 0;
    return m->offset;
}

/* flow_offset() for any type but the one learnt last (or an untagged one). */
static Py_ssize_t
flow_offset_slow(PyObject *flow, int f)
{
    PyTypeObject *t = Py_TYPE(flow);
    for (int i = 0; i < FLOW_TYPES; i++)
        if (flow_layout_valid(&flow_layouts[i], t))
            return flow_layouts[i].offset[f];
    struct flow_layout learnt;
    memset(&learnt, 0, sizeof learnt);
    if (t->tp_getattro == PyObject_GenericGetAttr && t->tp_setattro == PyObject_GenericSetAttr) {
        /* The tag _PyType_Lookup gives the type (unless none is left for it), before
         * and after: the layout holds only if nothing changed the type meanwhile. */
        (void)_PyType_Lookup(t, *flow_names[0]);
        unsigned int before = t->tp_version_tag;
        int tagged = (t->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) != 0;
        for (int i = 0; i < F_N; i++)
            learnt.offset[i] = flow_member_offset(t, *flow_names[i]);
        if (tagged && (t->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) &&
            t->tp_version_tag == before) {
            learnt.tagged = 1;
            learnt.version = before;
        }
        else
            memset(learnt.offset, 0, sizeof learnt.offset);
    }
    /* Into the first entry, the last one dropped: no Python code runs until the
     * drop, which may (the type's deallocation) and so is last. */
    Py_INCREF(t);
    learnt.type = t;
    PyTypeObject *dropped = flow_layouts[FLOW_TYPES - 1].type;
    for (int i = FLOW_TYPES - 1; i > 0; i--)
        flow_layouts[i] = flow_layouts[i - 1];
    flow_layouts[0] = learnt;
    Py_XDECREF(dropped);
    for (int i = 0; i < FLOW_TYPES; i++)
        if (flow_layout_valid(&flow_layouts[i], t))
            return flow_layouts[i].offset[f];
    return 0;
}

/* The offset of attribute `f` in `flow`, or 0: use PyObject_GetAttr / SetAttr. The
 * type learnt last is tested inline (a call and the loop were 34 instructions). */
static inline Py_ssize_t
flow_offset(PyObject *flow, int f)
{
    PyTypeObject *t = Py_TYPE(flow);
    struct flow_layout *l = &flow_layouts[0];
    if (l->type == t && l->tagged && (t->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) &&
        t->tp_version_tag == l->version)
        return l->offset[f];
    return flow_offset_slow(flow, f);
}

/* A new reference to flow.<f>, or NULL with the exception PyObject_GetAttr raises. */
static PyObject *
flow_get(PyObject *flow, int f)
{
    Py_ssize_t off = flow_offset(flow, f);
    if (off) {
        PyObject *v = *(PyObject **)((char *)flow + off);
        if (v != NULL) {
            Py_INCREF(v);
            return v;
        }
    }
    return PyObject_GetAttr(flow, *flow_names[f]);
}

/* flow.<f> = v */
static int
flow_set(PyObject *flow, int f, PyObject *v)
{
    Py_ssize_t off = flow_offset(flow, f);
    if (!off)
        return PyObject_SetAttr(flow, *flow_names[f], v);
    PyObject **slot = (PyObject **)((char *)flow + off);
    PyObject *old = *slot;
    Py_INCREF(v);
    *slot = v;
    Py_XDECREF(old);
    return 0;
}

/* flow.<f> += n (n >= 0): a counter, a Python int. */
static int
flow_add(PyObject *flow, int f, Py_ssize_t n)
{
    Py_ssize_t off = flow_offset(flow, f);
    if (off) {
        PyObject **slot = (PyObject **)((char *)flow + off);
        PyObject *old = *slot;
        if (old != NULL && PyLong_CheckExact(old)) {
            /* what int.__add__ makes, without the generic number protocol: an exact
             * int that fits a long long (a counter always does) */
            int overflow;
            long long v = PyLong_AsLongLongAndOverflow(old, &overflow);
            if (!overflow && v <= LLONG_MAX - n) {
                PyObject *sum = PyLong_FromLongLong(v + n);
                if (sum == NULL)
                    return -1;
                *slot = sum; /* no Python code ran since `old` was read */
                Py_DECREF(old);
                return 0;
            }
        }
    }
    PyObject *old = flow_get(flow, f);
    if (old == NULL)
        return -1;
    PyObject *add = PyLong_FromSsize_t(n);
    PyObject *sum = add ? PyNumber_Add(old, add) : NULL;
    Py_DECREF(old);
    Py_XDECREF(add);
    if (sum == NULL)
        return -1;
    int r = flow_set(flow, f, sum);
    Py_DECREF(sum);
    return r;
}

/* -- descriptor keys ----------------------------------------------------------------
 *
 * The reactor's dict `pumps` maps a descriptor, a Python int, to its pump; each event
 * looks its descriptor up there. An int made for it afresh is a new object above 256
 * (the small ints end there) that the dict compares by value with its own key, and
 * frees after: measured with callgrind (bench_reactor.py --callgrind --new-pump --pumps
 * 128 --rounds 25: descriptors up to ~520), 183 instructions per lookup plus 49 to
 * make the int and its deallocation. So one int per descriptor number is made once and
 * kept; the C pumps register under it, and the lookup finds that very key (identity,
 * the dict's first test). The cost: a pointer per descriptor number up to the highest
 * seen (at most MAX_FD_KEYS), and the int itself, which the dict shares while the
 * descriptor is registered. */

#define MAX_FD_KEYS (1 << 20)
static PyObject **fd_keys = NULL; /* fd_keys[fd]: the int fd, or NULL not made yet */
static int n_fd_keys = 0;

/* fd_key() the first time for `fd`: made, and kept when it can be. */
static PyObject *
fd_key_new(int fd)
{
    PyObject *key = PyLong_FromLong(fd);
    if (key == NULL || fd < 0 || fd >= MAX_FD_KEYS)
        return key;
    if (fd >= n_fd_keys) {
        int n = n_fd_keys ? n_fd_keys : 1024;
        while (n <= fd)
            n *= 2;
        PyObject **grown = PyMem_Realloc(fd_keys, (size_t)n * sizeof *grown);
        if (grown == NULL) /* not kept: still the right key */
            return key;
        memset(grown + n_fd_keys, 0, (size_t)(n - n_fd_keys) * sizeof *grown);
        fd_keys = grown;
        n_fd_keys = n;
    }
    Py_INCREF(key);
    fd_keys[fd] = key;
    return key;
}

/* A new reference to the int `fd`; NULL with an exception. */
static inline PyObject *
fd_key(int fd)
{
    if (fd >= 0 && fd < n_fd_keys && fd_keys[fd] != NULL) {
        Py_INCREF(fd_keys[fd]);
        return fd_keys[fd];
    }
    return fd_key_new(fd);
}

/* The FINs read in the current dispatch() batch, passed on at its end (Pump._pass_fin). */
static struct {
    CPump *p;
    int up;
} batch_fins[MAX_BATCH];
static int n_batch_fins = 0;
static int in_batch = 0;

#define DIR_SRC(p, d) ((d) == &(p)->up ? (p)->client_fd : (p)->server_fd)
#define DIR_DST(p, d) ((d) == &(p)->up ? (p)->server_fd : (p)->client_fd)
#define DIR_TO_SERVER(p, d) ((d) == &(p)->up)

/* The run's clock. trio's SystemClock.current_time is `self.offset + perf_counter()`
 * (a Python frame, ~930 instructions); perf_counter is clock_gettime(CLOCK_MONOTONIC)
 * on Linux, so for a reactor whose clock is exactly that bound method the same sum is
 * made here, as Python makes it (integer nanoseconds, then seconds as a double), and
 * the result is the same clock. Any other clock (trio.testing.MockClock in the tests,
 * a subclass) is called as before. The reactor last seen is held, so its address is
 * not reused while it is cached; SystemClock is frozen, so its offset cannot change. */
static PyObject *clock_reactor = NULL;
static PyObject *system_clock_type = NULL;
static PyObject *system_clock_fn = NULL;
static int clock_native = 0;
static double clock_offset = 0.0;

/* 1 if `clock` is trio's SystemClock.current_time bound to a SystemClock (its offset
 * into *offset), 0 if it is any other callable, -1 on an error. */
static int
cp_native_clock(PyObject *clock, double *offset)
{
    if (system_clock_type == NULL) {
        PyObject *mod = PyImport_ImportModule("trio._core._run");
        if (mod == NULL)
            return -1;
        system_clock_type = PyObject_GetAttrString(mod, "SystemClock");
        Py_DECREF(mod);
        if (system_clock_type == NULL)
            return -1;
        system_clock_fn = PyObject_GetAttrString(system_clock_type, "current_time");
        if (system_clock_fn == NULL) {
            Py_CLEAR(system_clock_type);
            return -1;
        }
    }
    int native = 0;
    if (PyMethod_Check(clock) && PyMethod_GET_FUNCTION(clock) == system_clock_fn &&
        (PyObject *)Py_TYPE(PyMethod_GET_SELF(clock)) == system_clock_type) {
        PyObject *o = PyObject_GetAttrString(PyMethod_GET_SELF(clock), "offset");
        if (o == NULL)
            return -1;
        if (PyFloat_CheckExact(o)) {
            *offset = PyFloat_AS_DOUBLE(o);
            native = 1;
        }
        Py_DECREF(o);
    }
    return native;
}

/* SystemClock.current_time(), as Python computes it: perf_counter's integer
 * nanoseconds as seconds (a double), plus the offset, into *now: 0; or -1, no
 * exception set: the clock could not be read (then the caller calls the Python clock). */
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

static int
cp_learn_clock(PyObject *reactor)
{
    PyObject *clock = PyObject_GetAttr(reactor, s_clock);
    if (clock == NULL)
        return -1;
    double offset = 0.0;
    int native = cp_native_clock(clock, &offset);
    Py_DECREF(clock);
    if (native < 0)
        return -1;
    Py_INCREF(reactor);
    Py_XSETREF(clock_reactor, reactor);
    clock_native = native;
    clock_offset = offset;
    return 0;
}

/* The reactor's clock read here when it is trio's SystemClock (see above): 1 with the
 * time in *now; 0 when it must be called; -1 with an exception. */
static int
cp_clock_native(CPump *p, double *now)
{
    if (p->reactor != clock_reactor && cp_learn_clock(p->reactor) < 0)
        return -1;
    if (clock_native) {
        if (cp_native_seconds(clock_offset, now) == 0)
            return 1;
    }
    return 0;
}

/* A new reference to the reactor's clock(), a float. */
static PyObject *
cp_clock(CPump *p)
{
    double d;
    int native = cp_clock_native(p, &d);
    if (native < 0)
        return NULL;
    if (native)
        return PyFloat_FromDouble(d);
    PyObject *clock = PyObject_GetAttr(p->reactor, s_clock);
    if (clock == NULL)
        return NULL;
    PyObject *now = PyObject_CallNoArgs(clock);
    Py_DECREF(clock);
    return now;
}

/* flow.last_activity = clock(), once per chunk. When the float there is the one this
 * code stored (an exact float, in the flow's slot, that nothing else references: any
 * Python code that read it holds a reference of its own) it takes the new time in
 * place: no one can tell, and making a float and freeing the old one was 65
 * instructions per chunk (callgrind, bench_reactor.py --callgrind --new-pump). Else, or
 * on a clock that must be called, a new float is stored as before. */
static int
cp_clock_into_flow(CPump *p)
{
#ifndef Py_GIL_DISABLED /* reference counts are exact only with the GIL */
    /* the clock learnt already: reading it runs no Python code, `old` stays alone */
    if (p->reactor == clock_reactor && clock_native) {
        Py_ssize_t off = flow_offset(p->flow, F_LAST_ACTIVITY);
        PyObject *old = off ? *(PyObject **)((char *)p->flow + off) : NULL;
        double d;
        if (old != NULL && PyFloat_CheckExact(old) && Py_REFCNT(old) == 1 &&
            cp_clock_native(p, &d) == 1) {
            ((PyFloatObject *)old)->ob_fval = d;
            return 0;
        }
    }
#endif
    PyObject *now = cp_clock(p);
    if (now == NULL)
        return -1;
    int r = flow_set(p->flow, F_LAST_ACTIVITY, now);
    Py_DECREF(now);
    return r;
}

/* Clock(current_time): a callable with no Python frame that returns what
 * current_time() returns -- computed here for trio's SystemClock (as cp_clock does for
 * the reactor), else by calling it (trio.testing.MockClock). For the connection
 * handler, which reads its run's clock twice per connection (issue 26). */
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

static double
cp_now(CPump *p)
{
    PyObject *now = cp_clock(p);
    if (now == NULL)
        return -1.0;
    double r = PyFloat_AsDouble(now);
    Py_DECREF(now);
    return r;
}

/* _Direction._wrote(n): the counter, and last_activity */
static int
cp_count(CPump *p, cdir *d, ssize_t n)
{
    if (flow_add(p->flow, DIR_TO_SERVER(p, d) ? F_BYTES_IN : F_BYTES_OUT, n) < 0)
        return -1;
    return cp_clock_into_flow(p);
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
        if (PyErr_CheckSignals() < 0)
            return -2;
    }
}

/* Where a copied chunk is read: one buffer for every pump (the chunk is written out
 * before anything else runs, and what dst does not take is copied into the direction). */
static char copy_buf[COPY_CHUNK];

/* Keep the `len` bytes at `data` that dst did not take, for write_out(). */
static int
cp_hold(cdir *d, const char *data, ssize_t len)
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

/* _Direction.write_out(): the rest of the chunk, from the pipe or the buffer */
static int
cp_write_out(CPump *p, cdir *d)
{
    int dst = DIR_DST(p, d);
    int copied = d->pipe == NULL; /* a copied chunk's rest is in d->buf */
    int pr = -1, pw;
    if (!copied && pipe_fds(d->pipe, &pr, &pw) < 0)
        return -1;
    while (d->pending) {
        ssize_t n = copied ? do_send(dst, d->buf + d->buf_off, (size_t)d->pending)
                           : do_splice(pr, dst, (size_t)d->pending);
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
        if (cp_count(p, d, n) < 0)
            return -1;
    }
    if (copied) {
        PyMem_Free(d->buf);
        d->buf = NULL;
        d->buf_off = 0;
        return MOVED;
    }
    PyObject *pipe = d->pipe;
    d->pipe = NULL;
    int r = put_pipe(pipe);
    Py_DECREF(pipe);
    return r < 0 ? -1 : MOVED;
}

/* The kernel refused to splice this socket (EINVAL, ENOSYS before any splice worked):
 * nothing was read, so the direction copies from now on, and pump.py's
 * _splice_refused() makes later pumps copy only. */
static int
cp_splice_refused(cdir *d, int code)
{
    d->copy_only = 1;
    d->bulk = 0;
    PyObject *f = module_global(s_splice_refused);
    if (f == NULL)
        return -1;
    PyObject *exc = os_error(code);
    if (exc == NULL)
        return -1;
    PyObject *r = PyObject_CallOneArg(f, exc);
    Py_DECREF(exc);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* One chunk copied: recv into copy_buf, send it on. Sets *big when the read filled the
 * buffer (then the direction splices from the next read on, unless copy_only). */
static int
cp_copy_one(CPump *p, cdir *d, int *big)
{
    int src = DIR_SRC(p, d), dst = DIR_DST(p, d);
    ssize_t n = do_recv(src, copy_buf, COPY_CHUNK);
    if (n == -2)
        return -1;
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return MOVED; /* readiness can be stale by the time we read */
        d->err = errno;
        return SOURCE_FAILED;
    }
    if (n == 0)
        return EOF_;
    d->last_read = n;
    if (n == COPY_CHUNK) {
        *big = 1;
        if (!d->copy_only)
            d->bulk = 1;
    }
    ssize_t m = do_send(dst, copy_buf, (size_t)n);
    if (m == -2)
        return -1;
    if (m < 0) {
        int code = errno;
        if (code == EAGAIN || code == EWOULDBLOCK)
            return cp_hold(d, copy_buf, n) < 0 ? -1 : BLOCKED;
        d->err = code;
        return DESTINATION_FAILED;
    }
    if (m < n && cp_hold(d, copy_buf + m, n - m) < 0)
        return -1;
    if (cp_count(p, d, m) < 0)
        return -1;
    return m < n ? cp_write_out(p, d) : MOVED;
}

/* _Direction.move(): up to BURST chunks while they are big, each copied or spliced */
static int
cp_move(CPump *p, cdir *d)
{
    int src = DIR_SRC(p, d), dst = DIR_DST(p, d);
    int left = BURST;
    for (;;) {
        d->last_read = 0;
        if (!d->bulk) {
            int big = 0;
            int status = cp_copy_one(p, d, &big);
            if (status < 0)
                return -1;
            left -= 1;
            if (status || !left || !big)
                return status;
            continue;
        }
        PyObject *pipe = take_pipe();
        if (pipe == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_OSError))
                return -1;
            /* EMFILE, ENFILE: no descriptor left for a pipe -- ends this connection */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            int code = EMFILE;
            if (value != NULL) {
                PyObject *e = PyObject_GetAttrString(value, "errno");
                if (e != NULL && PyLong_Check(e))
                    code = (int)PyLong_AsLong(e);
                Py_XDECREF(e);
                PyErr_Clear();
            }
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            d->err = code;
            return SOURCE_FAILED;
        }
        int pr, pw;
        if (pipe_fds(pipe, &pr, &pw) < 0) {
            Py_DECREF(pipe);
            return -1;
        }
        ssize_t n = do_splice(src, pw, SPLICE_CHUNK);
        if (n == -2) {
            int r = put_pipe(pipe);
            Py_DECREF(pipe);
            (void)r;
            return -1;
        }
        if (n < 0) {
            int code = errno;
            int r = put_pipe(pipe);
            Py_DECREF(pipe);
            if (r < 0)
                return -1;
            if (code == EAGAIN || code == EWOULDBLOCK)
                return MOVED;
            if (!d->spliced && (code == EINVAL || code == ENOSYS)) {
                if (cp_splice_refused(d, code) < 0)
                    return -1;
                continue; /* the same read, copied */
            }
            d->err = code;
            return SOURCE_FAILED;
        }
        d->spliced = 1;
        if (n == 0) {
            int r = put_pipe(pipe);
            Py_DECREF(pipe);
            return r < 0 ? -1 : EOF_;
        }
        d->last_read = n;
        ssize_t m = do_splice(pr, dst, (size_t)n);
        if (m < 0) {
            d->pipe = pipe; /* still holding the chunk: release() discards it */
            d->pending = n;
            if (m == -2)
                return -1;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return BLOCKED;
            d->err = errno;
            return DESTINATION_FAILED;
        }
        int status;
        if (m == n) {
            int r = put_pipe(pipe);
            Py_DECREF(pipe);
            if (r < 0)
                return -1;
            if (cp_count(p, d, m) < 0)
                return -1;
            status = MOVED;
        }
        else {
            d->pipe = pipe;
            d->pending = n - m;
            if (cp_count(p, d, m) < 0)
                return -1;
            status = cp_write_out(p, d);
            if (status < 0)
                return -1;
        }
        left -= 1;
        if (status || !left || n < BIG_CHUNK)
            return status;
    }
}

/* _Direction.release() */
static void
cp_release(cdir *d)
{
    if (d->buf != NULL) {
        PyMem_Free(d->buf);
        d->buf = NULL;
        d->buf_off = 0;
    }
    PyObject *pipe = d->pipe;
    d->pipe = NULL;
    if (pipe == NULL)
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (d->pending) {
        int r, w;
        if (pipe_fds(pipe, &r, &w) == 0) {
            close(r);
            close(w);
        }
    }
    else if (put_pipe(pipe) < 0) {
        PyErr_Clear();
    }
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
    Py_DECREF(pipe);
}

static int
cp_set_outcome(CPump *p, PyObject *o)
{
    Py_INCREF(o);
    Py_SETREF(p->outcome, o);
    return 0;
}

/* Pump._failed(client_side, exc) */
static int
cp_failed(CPump *p, int client_side, int code)
{
    int reset = code == ECONNRESET || code == EPIPE || code == ENOTCONN || code == ECONNABORTED;
    cp_set_outcome(p, reset ? (client_side ? s_client_reset : s_server_reset) : s_error_o);
    PyObject *exc = os_error(code);
    if (exc == NULL)
        return -1;
    int r = flow_set(p->flow, F_ERROR, exc);
    Py_DECREF(exc);
    return r;
}

static int
cp_epoll(CPump *p, int op, int fd, int mask)
{
    struct epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.events = (uint32_t)mask;
    ev.data.fd = fd;
    if (epoll_ctl(p->epfd, op, fd, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

/* Pump._watch(fd, mask, current) -> the new mask, or -2 with an exception */
static int
cp_watch(CPump *p, int fd, int mask, int current)
{
    if (current != -1) {
        if (cp_epoll(p, EPOLL_CTL_MOD, fd, mask) < 0)
            return -2;
    }
    else if (mask) {
        if (cp_epoll(p, EPOLL_CTL_ADD, fd, mask) < 0)
            return -2;
    }
    else
        return -1;
    return mask;
}

/* Pump._update_interest() */
static int
cp_update_interest(CPump *p)
{
    int client = (p->up.state == READING ? EPOLLIN : 0) | (p->down.state == WRITING ? EPOLLOUT : 0);
    int server = (p->down.state == READING ? EPOLLIN : 0) |
                 (p->up.state == WRITING || p->up.state == HELD ? EPOLLOUT : 0);
    if (client != p->client_mask) {
        int m = cp_watch(p, p->client_fd, client, p->client_mask);
        if (m == -2)
            return -1;
        p->client_mask = m;
    }
    if (server != p->server_mask) {
        int m = cp_watch(p, p->server_fd, server, p->server_mask);
        if (m == -2)
            return -1;
        p->server_mask = m;
    }
    return 0;
}

/* Pump._write_initial() */
static int
cp_write_initial(CPump *p)
{
    while (p->initial != NULL && PyBytes_GET_SIZE(p->initial) > 0) {
        Py_ssize_t len = PyBytes_GET_SIZE(p->initial);
        ssize_t n;
        for (;;) {
            n = write(p->server_fd, PyBytes_AS_STRING(p->initial), (size_t)len);
            if (n >= 0 || errno != EINTR)
                break;
            if (PyErr_CheckSignals() < 0)
                return -1;
        }
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (p->up.state != HELD) {
                    p->up.state = HELD;
                    return cp_update_interest(p);
                }
                return 0;
            }
            return cp_failed(p, 0, errno);
        }
        PyObject *rest = PyBytes_FromStringAndSize(PyBytes_AS_STRING(p->initial) + n, len - n);
        if (rest == NULL)
            return -1;
        Py_SETREF(p->initial, rest);
        Py_ssize_t counted = n - p->initial_uncounted;
        p->initial_uncounted = counted < 0 ? -counted : 0;
        if (counted > 0 && flow_add(p->flow, F_BYTES_IN, counted) < 0)
            return -1;
        if (cp_clock_into_flow(p) < 0)
            return -1;
    }
    if (p->up.state == HELD) {
        p->up.state = READING;
        return cp_update_interest(p);
    }
    return 0;
}

/* Pump._disarm() */
static int
cp_disarm(CPump *p)
{
    PyObject *alarm = p->alarm;
    p->alarm = Py_None;
    Py_INCREF(Py_None);
    int r = 0;
    PyObject *deferred = module_global(s_deferred);
    if (deferred == NULL) {
        Py_DECREF(alarm);
        return -1;
    }
    if (alarm == deferred) {
        PyObject *young = PyObject_GetAttr(p->reactor, s_young);
        if (young == NULL)
            r = -1;
        else {
            r = PyObject_DelItem(young, (PyObject *)p);
            Py_DECREF(young);
        }
    }
    else if (alarm != Py_None) {
        PyObject *x = PyObject_CallMethodNoArgs(alarm, s_cancel);
        if (x == NULL)
            r = -1;
        Py_XDECREF(x);
    }
    Py_DECREF(alarm);
    return r;
}

/* Pump.close(): stop watching, give pipes back; close the descriptors if owned. */
static int
cp_close(CPump *p)
{
    int result = 0;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (p->flow != NULL) {
        PyObject *cur = flow_get(p->flow, F_PUMP);
        if (cur == NULL)
            PyErr_Clear();
        else {
            if (cur == (PyObject *)p && flow_set(p->flow, F_PUMP, Py_None) < 0)
                result = -1;
            Py_DECREF(cur);
        }
    }
    if (result == 0 && p->alarm != Py_None && cp_disarm(p) < 0)
        result = -1;
    int owned = p->sockets != Py_None;
    if (p->registered) {
        p->registered = 0;
        PyObject *pumps = PyObject_GetAttr(p->reactor, s_pumps);
        if (pumps == NULL)
            result = -1;
        else {
            int fds[2] = {p->client_fd, p->server_fd};
            int masks[2] = {p->client_mask, p->server_mask};
            for (int i = 0; i < 2; i++) {
                PyObject *key = fd_key(fds[i]);
                if (key == NULL) {
                    result = -1;
                    continue;
                }
                PyObject *cur = PyDict_GetItemWithError(pumps, key);
                if (cur == (PyObject *)p) { /* the caller may have closed and reused it */
                    if (PyDict_DelItem(pumps, key) < 0)
                        result = -1;
                    if (!owned && masks[i] != -1) {
                        struct epoll_event ev;
                        epoll_ctl(p->epfd, EPOLL_CTL_DEL, fds[i], &ev); /* closed: gone */
                    }
                }
                Py_DECREF(key);
            }
            Py_DECREF(pumps);
        }
    }
    cdir *ds[2] = {&p->up, &p->down};
    for (int i = 0; i < 2; i++) {
        cdir *d = ds[i];
        if (d->fin_pending) { /* ended within the batch that read this EOF */
            d->fin_pending = 0;
            if (!owned) /* else close() below sends it */
                shutdown(DIR_DST(p, d), SHUT_WR);
        }
        cp_release(d);
    }
    if (owned) {
        PyObject *sockets = p->sockets;
        p->sockets = Py_None;
        Py_INCREF(Py_None);
        for (int i = 0; i < 2; i++) {
            PyObject *s = PyTuple_GET_ITEM(sockets, i);
            if (PyLong_CheckExact(s)) {
                close(i == 0 ? p->client_fd : p->server_fd);
            }
            else {
                PyObject *r = PyObject_CallMethodNoArgs(s, s_close);
                if (r == NULL)
                    result = -1;
                Py_XDECREF(r);
            }
        }
        Py_DECREF(sockets);
    }
    if (result < 0) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    }
    else
        PyErr_Restore(type, value, tb);
    return result;
}

static void
cp_record(PyObject *where, PyObject *exc)
{
    PyObject *record = module_global(s_record);
    if (record == NULL) {
        PyErr_Clear();
        return;
    }
    PyObject *r = PyObject_CallFunctionObjArgs(record, where, exc, NULL);
    Py_XDECREF(r);
    PyErr_Clear();
}

/* Pump._finish(): clean up, then on_end(pump), once; its exceptions are recorded. */
static int
cp_finish(CPump *p)
{
    if (cp_close(p) < 0)
        return -1;
    if (p->on_end != Py_None) {
        PyObject *on_end = p->on_end;
        p->on_end = Py_None;
        Py_INCREF(Py_None);
        PyObject *r = PyObject_CallOneArg(on_end, (PyObject *)p);
        Py_DECREF(on_end);
        if (r == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                return -1;
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            if (tb != NULL && value != NULL)
                PyException_SetTraceback(value, tb);
            cp_record(s_connection_end, value ? value : Py_None);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        }
        Py_XDECREF(r);
    }
    return 0;
}

/* Pump._arm() */
static int
cp_arm(CPump *p)
{
    if (p->alarm != Py_None && cp_disarm(p) < 0)
        return -1;
    PyObject *last = flow_get(p->flow, F_LAST_ACTIVITY);
    if (last == NULL)
        return -1;
    PyObject *timeout = flow_get(p->flow, F_IDLE_TIMEOUT);
    if (timeout == NULL) {
        Py_DECREF(last);
        return -1;
    }
    double when = PyFloat_AsDouble(last) + PyFloat_AsDouble(timeout);
    Py_DECREF(last);
    Py_DECREF(timeout);
    if (PyErr_Occurred())
        return -1;
    if (when == Py_HUGE_VAL)
        return 0;
    PyObject *heap = PyObject_GetAttr(p->reactor, s_deadlines);
    if (heap == NULL)
        return -1;
    PyObject *w = PyFloat_FromDouble(when);
    PyObject *alarm = w ? PyObject_CallMethodObjArgs(heap, s_at, w, (PyObject *)p, NULL) : NULL;
    Py_XDECREF(w);
    Py_DECREF(heap);
    if (alarm == NULL)
        return -1;
    Py_SETREF(p->alarm, alarm);
    return 0;
}

/* Pump._end(result) */
static int
cp_end(CPump *p, PyObject *result)
{
    cp_set_outcome(p, result);
    return cp_finish(p);
}

/* Pump.rearm() */
static int
cp_rearm(CPump *p)
{
    if (p->outcome != Py_None)
        return 0;
    double now = cp_now(p);
    if (now == -1.0 && PyErr_Occurred())
        return -1;
    PyObject *last = flow_get(p->flow, F_LAST_ACTIVITY);
    if (last == NULL)
        return -1;
    PyObject *timeout = flow_get(p->flow, F_IDLE_TIMEOUT);
    if (timeout == NULL) {
        Py_DECREF(last);
        return -1;
    }
    double due = PyFloat_AsDouble(last) + PyFloat_AsDouble(timeout);
    Py_DECREF(last);
    Py_DECREF(timeout);
    if (PyErr_Occurred())
        return -1;
    if (now >= due)
        return cp_end(p, s_idle_timeout_o);
    return cp_arm(p);
}

/* Pump.send_fin(d), at the end of the batch */
static int
cp_send_fin(CPump *p, cdir *d)
{
    if (!d->fin_pending)
        return 0;
    d->fin_pending = 0;
    if (shutdown(DIR_DST(p, d), SHUT_WR) < 0) {
        if (cp_failed(p, !DIR_TO_SERVER(p, d), errno) < 0)
            return -1;
        return cp_finish(p);
    }
    return cp_update_interest(p);
}

/* Pump._pass_fin(d) */
static int
cp_pass_fin(CPump *p, cdir *d)
{
    d->state = DONE;
    p->open_directions -= 1;
    if (p->open_directions == 0) {
        if (p->sockets == Py_None) { /* else close() sends it, when the pump ends now */
            if (shutdown(DIR_DST(p, d), SHUT_WR) < 0)
                return cp_failed(p, !DIR_TO_SERVER(p, d), errno);
        }
        return cp_set_outcome(p, s_closed);
    }
    if (cp_clock_into_flow(p) < 0)
        return -1;
    d->fin_pending = 1;
    if (in_batch && n_batch_fins < MAX_BATCH) {
        Py_INCREF(p);
        batch_fins[n_batch_fins].p = p;
        batch_fins[n_batch_fins].up = d == &p->up;
        n_batch_fins++;
        return 0;
    }
    return cp_send_fin(p, d); /* outside a batch: at once */
}

/* Pump._unwatched_event(fd, client_side) */
static int
cp_unwatched_event(CPump *p, int fd, int client_side)
{
    int code = 0;
    socklen_t len = sizeof code;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &code, &len) < 0)
        code = errno;
    if (code)
        return cp_failed(p, client_side, code);
    struct epoll_event ev;
    epoll_ctl(p->epfd, EPOLL_CTL_DEL, fd, &ev);
    if (client_side)
        p->client_mask = -1;
    else
        p->server_mask = -1;
    return 0;
}

/* Pump._after(d, status) */
static int
cp_after(CPump *p, cdir *d, int status)
{
    switch (status) {
    case MOVED:
        if (d->state == WRITING) {
            d->state = READING;
            return cp_update_interest(p);
        }
        return 0;
    case BLOCKED:
        if (d->state == READING) {
            d->state = WRITING;
            return cp_update_interest(p);
        }
        return 0;
    case EOF_:
        return cp_pass_fin(p, d);
    case SOURCE_FAILED:
        return cp_failed(p, DIR_TO_SERVER(p, d), d->err);
    default:
        return cp_failed(p, !DIR_TO_SERVER(p, d), d->err);
    }
}

/* Pump.on_event(fd, events) */
static int
cp_on_event(CPump *p, int fd, uint32_t events)
{
    int client_side = fd == p->client_fd;
    cdir *reader = client_side ? &p->up : &p->down;
    cdir *writer = client_side ? &p->down : &p->up;
    int watched = 0;
    if (reader->state == READING && (events & IN_OR_FAILED)) {
        watched = 1;
        int status = cp_move(p, reader);
        if (status < 0)
            return -1;
        if (status && cp_after(p, reader, status) < 0)
            return -1;
    }
    if (writer->state == WRITING && (events & OUT_OR_FAILED)) {
        watched = 1;
        if (p->outcome == Py_None) {
            int status = cp_write_out(p, writer);
            if (status < 0 || cp_after(p, writer, status) < 0)
                return -1;
        }
    }
    else if (writer->state == HELD && (events & OUT_OR_FAILED)) {
        watched = 1;
        if (cp_write_initial(p) < 0)
            return -1;
    }
    if (!watched && (events & FAILED) && cp_unwatched_event(p, fd, client_side) < 0)
        return -1;
    if (p->outcome != Py_None)
        return cp_finish(p);
    return 0;
}

/* -- the type's Python face ------------------------------------------------------------ */

static int
cp_fd_of(PyObject *s)
{
    if (PyLong_CheckExact(s))
        return as_int(s);
    return PyObject_AsFileDescriptor(s);
}

static PyObject *
CPump_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *names[] = {"client", "server", "flow", "initial", "uncounted", "close_sockets",
                            "use_splice", "reactor", NULL};
    PyObject *client, *server, *flow, *initial = NULL, *given_reactor = Py_None;
    Py_ssize_t uncounted = 0;
    int close_sockets = 0, use_splice = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|SnppO:Pump", names, &client, &server, &flow,
                                     &initial, &uncounted, &close_sockets, &use_splice,
                                     &given_reactor))
        return NULL;
    if (module_dict == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_cpump.setup() was not called");
        return NULL;
    }
    CPump *p = (CPump *)type->tp_alloc(type, 0);
    if (p == NULL)
        goto fail_owned;
    p->client_fd = p->server_fd = -1;
    p->client_mask = p->server_mask = -1;
    p->epfd = -1;
    p->open_directions = 2;
    p->up.state = p->down.state = READING;
    p->up.copy_only = p->down.copy_only = !use_splice;
    Py_INCREF(flow);
    p->flow = flow;
    p->outcome = Py_None;
    p->error = Py_None;
    p->on_end = Py_None;
    p->alarm = Py_None;
    p->reactor = Py_None;
    Py_INCREF(Py_None);
    Py_INCREF(Py_None);
    Py_INCREF(Py_None);
    Py_INCREF(Py_None);
    Py_INCREF(Py_None);
    if (close_sockets) {
        p->sockets = PyTuple_Pack(2, client, server);
        if (p->sockets == NULL) {
            Py_DECREF(p);
            goto fail_owned;
        }
    }
    else {
        p->sockets = Py_None;
        Py_INCREF(Py_None);
    }
    if (initial == NULL)
        initial = PyBytes_FromStringAndSize(NULL, 0);
    else
        Py_INCREF(initial);
    p->initial = initial;
    p->initial_uncounted = uncounted;
    if (p->initial == NULL)
        goto fail;
    p->client_fd = cp_fd_of(client);
    if (p->client_fd < 0)
        goto fail;
    p->server_fd = cp_fd_of(server);
    if (p->server_fd < 0)
        goto fail;
    PyObject *reactor;
    if (given_reactor != Py_None) {
        /* The run's reactor, from a caller that keeps it (the connection handler):
         * pump._reactor() is three Python frames, a RunVar's get, per connection. */
        reactor = given_reactor;
        Py_INCREF(reactor);
    }
    else {
        PyObject *reactor_fn = module_global(s_reactor_fn);
        if (reactor_fn == NULL)
            goto fail;
        reactor = PyObject_CallNoArgs(reactor_fn);
        if (reactor == NULL)
            goto fail;
    }
    Py_SETREF(p->reactor, reactor);
    long epfd = get_long(reactor, s_epfd);
    if (epfd == -1 && PyErr_Occurred())
        goto fail;
    p->epfd = (int)epfd;
    return (PyObject *)p;
fail:
    if (p->sockets != Py_None) { /* it owns them from the call on */
        PyObject *type_, *value, *tb;
        PyErr_Fetch(&type_, &value, &tb);
        p->registered = 0;
        cp_close(p);
        PyErr_Restore(type_, value, tb);
    }
    Py_DECREF(p);
    return NULL;
fail_owned:
    if (close_sockets) {
        PyObject *type_, *value, *tb;
        PyErr_Fetch(&type_, &value, &tb);
        PyObject *both[2] = {client, server};
        for (int i = 0; i < 2; i++) {
            if (PyLong_CheckExact(both[i])) {
                int fd = (int)PyLong_AsLong(both[i]);
                if (fd >= 0)
                    close(fd);
            }
            else {
                PyObject *r = PyObject_CallMethodNoArgs(both[i], s_close);
                Py_XDECREF(r);
            }
        }
        PyErr_Clear();
        PyErr_Restore(type_, value, tb);
    }
    return NULL;
}

static int
CPump_traverse(CPump *p, visitproc visit, void *arg)
{
    Py_VISIT(p->flow);
    Py_VISIT(p->reactor);
    Py_VISIT(p->outcome);
    Py_VISIT(p->error);
    Py_VISIT(p->on_end);
    Py_VISIT(p->alarm);
    Py_VISIT(p->initial);
    Py_VISIT(p->sockets);
    Py_VISIT(p->up.pipe);
    Py_VISIT(p->down.pipe);
    return 0;
}

static int
CPump_clear(CPump *p)
{
    Py_CLEAR(p->flow);
    Py_CLEAR(p->reactor);
    Py_CLEAR(p->outcome);
    Py_CLEAR(p->error);
    Py_CLEAR(p->on_end);
    Py_CLEAR(p->alarm);
    Py_CLEAR(p->initial);
    Py_CLEAR(p->sockets);
    return 0;
}

static void
CPump_dealloc(CPump *p)
{
    PyObject_GC_UnTrack(p);
    /* a pipe still held here is never reused: it may hold a chunk */
    cdir *ds[2] = {&p->up, &p->down};
    for (int i = 0; i < 2; i++) {
        if (ds[i]->pipe != NULL) {
            int r, w;
            if (pipe_fds(ds[i]->pipe, &r, &w) == 0) {
                close(r);
                close(w);
            }
            else
                PyErr_Clear();
            Py_CLEAR(ds[i]->pipe);
        }
        PyMem_Free(ds[i]->buf);
        ds[i]->buf = NULL;
    }
    CPump_clear(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* A method's body ran into an exception: NULL; else None. */
#define RETURN_NONE_OR_NULL(r)                                                               \
    do {                                                                                     \
        if ((r) < 0)                                                                         \
            return NULL;                                                                     \
        Py_RETURN_NONE;                                                                      \
    } while (0)

static PyObject *
CPump_start(CPump *p, PyObject *unused)
{
    PyObject *closing = flow_get(p->flow, F_CLOSING);
    if (closing == NULL)
        return NULL;
    int is_closing = PyObject_IsTrue(closing);
    Py_DECREF(closing);
    if (is_closing < 0)
        return NULL;
    if (is_closing) {
        cp_set_outcome(p, s_cancelled);
        Py_RETURN_NONE;
    }
    PyObject *pumps = PyObject_GetAttr(p->reactor, s_pumps);
    if (pumps == NULL)
        return NULL;
    PyObject *k1 = fd_key(p->client_fd), *k2 = fd_key(p->server_fd);
    int r = (k1 && k2) ? PyDict_SetItem(pumps, k1, (PyObject *)p) : -1;
    if (r == 0)
        r = PyDict_SetItem(pumps, k2, (PyObject *)p);
    Py_XDECREF(k1);
    Py_XDECREF(k2);
    Py_DECREF(pumps);
    if (r < 0)
        return NULL;
    p->registered = 1;
    if (flow_set(p->flow, F_PUMP, (PyObject *)p) < 0)
        return NULL;
    if (cp_clock_into_flow(p) < 0)
        return NULL;
    if (cp_epoll(p, EPOLL_CTL_ADD, p->client_fd, EPOLLIN) < 0)
        return NULL;
    p->client_mask = EPOLLIN;
    if (cp_epoll(p, EPOLL_CTL_ADD, p->server_fd, EPOLLIN) < 0)
        return NULL;
    p->server_mask = EPOLLIN;
    if (PyBytes_GET_SIZE(p->initial) > 0 && cp_write_initial(p) < 0)
        return NULL;
    if (p->outcome != Py_None)
        Py_RETURN_NONE;
    PyObject *timeout = flow_get(p->flow, F_IDLE_TIMEOUT);
    if (timeout == NULL)
        return NULL;
    double t = PyFloat_AsDouble(timeout);
    Py_DECREF(timeout);
    if (t == -1.0 && PyErr_Occurred())
        return NULL;
    if (t < 1.0) /* _DEFER_IDLE */
        RETURN_NONE_OR_NULL(cp_arm(p));
    /* _Reactor.defer(p), inline while the sweep is armed */
    PyObject *sweeping = PyObject_GetAttr(p->reactor, s_sweeping);
    if (sweeping == NULL)
        return NULL;
    int armed = sweeping == Py_True;
    Py_DECREF(sweeping);
    if (!armed) {
        PyObject *x = PyObject_CallMethodOneArg(p->reactor, s_defer, (PyObject *)p);
        if (x == NULL)
            return NULL;
        Py_DECREF(x);
        Py_RETURN_NONE;
    }
    PyObject *deferred = module_global(s_deferred);
    if (deferred == NULL)
        return NULL;
    Py_INCREF(deferred);
    Py_SETREF(p->alarm, deferred);
    PyObject *young = PyObject_GetAttr(p->reactor, s_young);
    if (young == NULL)
        return NULL;
    r = PyObject_SetItem(young, (PyObject *)p, Py_None);
    Py_DECREF(young);
    RETURN_NONE_OR_NULL(r);
}

static PyObject *
CPump_close(CPump *p, PyObject *unused)
{
    RETURN_NONE_OR_NULL(cp_close(p));
}

static PyObject *
CPump_ring(CPump *p, PyObject *unused)
{
    Py_INCREF(Py_None);
    Py_SETREF(p->alarm, Py_None); /* it has rung: nothing left to cancel */
    RETURN_NONE_OR_NULL(cp_rearm(p));
}

static PyObject *
CPump_rearm(CPump *p, PyObject *unused)
{
    RETURN_NONE_OR_NULL(cp_rearm(p));
}

static PyObject *
CPump_arm(CPump *p, PyObject *unused)
{
    RETURN_NONE_OR_NULL(cp_arm(p));
}

static PyObject *
CPump_cancel(CPump *p, PyObject *unused)
{
    if (p->outcome == Py_None)
        RETURN_NONE_OR_NULL(cp_end(p, s_cancelled));
    Py_RETURN_NONE;
}

static PyObject *
CPump_crashed(CPump *p, PyObject *exc)
{
    if (p->outcome == Py_None) {
        cp_set_outcome(p, s_error_o);
        Py_INCREF(exc);
        Py_SETREF(p->error, exc);
        RETURN_NONE_OR_NULL(cp_finish(p));
    }
    Py_RETURN_NONE;
}

static PyObject *
CPump_on_event(CPump *p, PyObject *args)
{
    int fd;
    unsigned int events;
    if (!PyArg_ParseTuple(args, "iI:on_event", &fd, &events))
        return NULL;
    RETURN_NONE_OR_NULL(cp_on_event(p, fd, events));
}

static PyObject *
CPump_get_pending(CPump *p, void *closure)
{
    return Py_BuildValue("(nn)", p->up.pending, p->down.pending);
}

static PyObject *
CPump_get_pipes_held(CPump *p, void *closure)
{
    return PyLong_FromLong((p->up.pipe != NULL) + (p->down.pipe != NULL));
}

static PyObject *
CPump_get_states(CPump *p, void *closure)
{
    return Py_BuildValue("(ii)", p->up.state, p->down.state);
}

static PyMethodDef CPump_methods[] = {
    {"start", (PyCFunction)CPump_start, METH_NOARGS, "Pump.start()"},
    {"close", (PyCFunction)CPump_close, METH_NOARGS, "Pump.close()"},
    {"ring", (PyCFunction)CPump_ring, METH_NOARGS, "Pump.ring(): the idle deadline passed"},
    {"rearm", (PyCFunction)CPump_rearm, METH_NOARGS, "Pump.rearm()"},
    {"_arm", (PyCFunction)CPump_arm, METH_NOARGS, "Pump._arm() (the reactor's sweep)"},
    {"cancel", (PyCFunction)CPump_cancel, METH_NOARGS, "Pump.cancel(): Flow.close()"},
    {"crashed", (PyCFunction)CPump_crashed, METH_O, "Pump.crashed(exc): the barrier"},
    {"on_event", (PyCFunction)CPump_on_event, METH_VARARGS, "Pump.on_event(fd, events)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef CPump_members[] = {
    {"client_fd", T_INT, offsetof(CPump, client_fd), READONLY, NULL},
    {"server_fd", T_INT, offsetof(CPump, server_fd), READONLY, NULL},
    {"client_mask", T_INT, offsetof(CPump, client_mask), READONLY, NULL},
    {"server_mask", T_INT, offsetof(CPump, server_mask), READONLY, NULL},
    {"open_directions", T_INT, offsetof(CPump, open_directions), READONLY, NULL},
    {"flow", T_OBJECT, offsetof(CPump, flow), READONLY, NULL},
    {"reactor", T_OBJECT, offsetof(CPump, reactor), READONLY, NULL},
    {"outcome", T_OBJECT, offsetof(CPump, outcome), 0, NULL},
    {"error", T_OBJECT, offsetof(CPump, error), 0, NULL},
    {"on_end", T_OBJECT, offsetof(CPump, on_end), 0, NULL},
    {"alarm", T_OBJECT, offsetof(CPump, alarm), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef CPump_getset[] = {
    {"pending", (getter)CPump_get_pending, NULL, "bytes held (up, down)", NULL},
    {"pipes_held", (getter)CPump_get_pipes_held, NULL, "pipes borrowed now", NULL},
    {"states", (getter)CPump_get_states, NULL, "the directions' states (up, down)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CPump_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lbproxy.net._cpump.Pump",
    .tp_basicsize = sizeof(CPump),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Pump(client, server, flow, initial=b'', uncounted=0, close_sockets=False,\n"
              "use_splice=True, reactor=None): pump.py's Pump in C (see pump.new_pump);\n"
              "reactor: the run's (pump._reactor(), called when None).",
    .tp_new = CPump_new,
    .tp_dealloc = (destructor)CPump_dealloc,
    .tp_traverse = (traverseproc)CPump_traverse,
    .tp_clear = (inquiry)CPump_clear,
    .tp_methods = CPump_methods,
    .tp_members = CPump_members,
    .tp_getset = CPump_getset,
};

/* The FINs of this batch, passed on at its end (the reactor's _send_fins). */
static int
cp_batch_fins(PyObject *crashed)
{
    int result = 0;
    for (int i = 0; i < n_batch_fins; i++) {
        CPump *p = batch_fins[i].p;
        batch_fins[i].p = NULL;
        if (result == 0 && cp_send_fin(p, batch_fins[i].up ? &p->up : &p->down) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                result = -1;
            else {
                PyObject *type, *value, *tb;
                PyErr_Fetch(&type, &value, &tb);
                PyErr_NormalizeException(&type, &value, &tb);
                if (tb != NULL && value != NULL)
                    PyException_SetTraceback(value, tb);
                PyObject *r = PyObject_CallFunctionObjArgs(crashed, (PyObject *)p,
                                                           value ? value : Py_None, NULL);
                Py_XDECREF(type);
                Py_XDECREF(value);
                Py_XDECREF(tb);
                if (r == NULL)
                    result = -1;
                Py_XDECREF(r);
            }
        }
        Py_DECREF(p);
    }
    n_batch_fins = 0;
    return result;
}

/* -- the module's functions ------------------------------------------------------------ */

PyDoc_STRVAR(dispatch_doc,
    "dispatch(epfd, pumps, maxevents, crashed[, timeout_ms]) -> number of events\n\n"
    "One batch of the reactor: epoll_wait(epfd, maxevents, timeout_ms: 0 unless given;\n"
    "the GIL is released while it blocks; a signal ends the wait with 0 events), then for each\n"
    "ready descriptor the pump `pumps` maps it to (skipped if none: ended earlier in the\n"
    "batch) handles its event as Pump.on_event does. An Exception met handling one pump\n"
    "goes to crashed(pump, exc) and the batch goes on.");

/* p.on_event(fd, events) for a reader of the set that is not a pump: the accept loop
 * that shares the reactor's wait (net/accept.py's ReactorAcceptor). 0, or -1 with the
 * exception set. */
static int
call_on_event(PyObject *p, int fd, uint32_t events)
{
    PyObject *fdo = PyLong_FromLong(fd);
    PyObject *ev = fdo ? PyLong_FromUnsignedLong(events) : NULL;
    PyObject *r = ev ? PyObject_CallMethodObjArgs(p, s_on_event, fdo, ev, NULL) : NULL;
    Py_XDECREF(fdo);
    Py_XDECREF(ev);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* Handle one batch's events, as Pump.on_event does per ready descriptor (the pump
 * `pumps` maps it to; skipped if none: ended earlier in the batch), an Exception met
 * handling one going to crashed(pump, exc); then the FINs read in it are passed on.
 * An event on `trio_fd` (-1: none) only sets *trio_ready. 0, or -1 with an exception
 * set (not an Exception: Cancelled, KeyboardInterrupt; or crashed() failed). */
static int
handle_events(struct epoll_event *evs, int n, PyObject *pumps, PyObject *crashed, int trio_fd,
              int *trio_ready)
{
    in_batch = 1;
    n_batch_fins = 0;
    for (int i = 0; i < n; i++) {
        int fd = evs[i].data.fd;
        if (fd == trio_fd) { /* trio's own descriptor (wait()): trio's wait takes its events */
            *trio_ready = 1;
            continue;
        }
        PyObject *key = fd_key(fd);
        if (key == NULL)
            goto fail;
        /* borrowed. hash(fd) is fd (an int from 0 to 2**61 - 2 is its own hash): the hash
         * PyDict_GetItemWithError would compute, 75 instructions for an int (callgrind) */
        PyObject *p = fd >= 0 ? _PyDict_GetItem_KnownHash(pumps, key, (Py_hash_t)fd)
                              : PyDict_GetItemWithError(pumps, key);
        Py_DECREF(key);
        if (p == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue; /* ended earlier in this batch */
        }
        Py_INCREF(p);
        int r;
        if (Py_IS_TYPE(p, &CPump_Type))
            r = cp_on_event((CPump *)p, fd, evs[i].events);
        else if (pump_type != NULL && PyObject_TypeCheck(p, pump_type))
            r = on_event(p, fd, evs[i].events);
        else /* another reader of the set (a listening socket's acceptor): its method */
            r = call_on_event(p, fd, evs[i].events);
        if (r < 0) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) { /* Cancelled, KeyboardInterrupt */
                Py_DECREF(p);
                goto fail;
            }
            /* the barrier: a bug ends that connection, not the reactor */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            if (tb != NULL && value != NULL)
                PyException_SetTraceback(value, tb);
            PyObject *rc = PyObject_CallFunctionObjArgs(crashed, p, value ? value : Py_None, NULL);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            if (rc == NULL) {
                Py_DECREF(p);
                goto fail;
            }
            Py_DECREF(rc);
        }
        Py_DECREF(p);
    }
    in_batch = 0;
    return cp_batch_fins(crashed) < 0 ? -1 : 0;
fail:
    in_batch = 0;
    {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (cp_batch_fins(crashed) < 0)
            PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
    return -1;
}

/* The arguments dispatch() and wait() begin with: (epfd, pumps, maxevents, crashed),
 * checked; maxevents clamped to 1..MAX_BATCH. 0, or -1 with an exception set. */
static int
batch_args(const char *name, PyObject *const *args, int *epfd, PyObject **pumps,
           int *maxevents, PyObject **crashed)
{
    *epfd = as_int(args[0]);
    if (*epfd == -1 && PyErr_Occurred())
        return -1;
    *pumps = args[1];
    if (!PyDict_Check(*pumps)) {
        PyErr_Format(PyExc_TypeError, "%s() argument 2 must be dict, not %.50s", name,
                     Py_TYPE(*pumps)->tp_name);
        return -1;
    }
    *maxevents = as_int(args[2]);
    if (*maxevents == -1 && PyErr_Occurred())
        return -1;
    *crashed = args[3];
    if (module_dict == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_cpump.setup() was not called");
        return -1;
    }
    if (*maxevents < 1 || *maxevents > MAX_BATCH)
        *maxevents = MAX_BATCH;
    return 0;
}

static PyObject *
dispatch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    /* METH_FASTCALL, the four arguments checked here: PyArg_ParseTuple's "iO!iO" was
     * 594 instructions per call, once per batch (callgrind, bench_reactor.py). */
    if (nargs != 4 && nargs != 5) {
        PyErr_Format(PyExc_TypeError, "dispatch() takes 4 or 5 arguments (%zd given)", nargs);
        return NULL;
    }
    int timeout_ms = 0;
    if (nargs == 5) {
        timeout_ms = as_int(args[4]);
        if (timeout_ms == -1 && PyErr_Occurred())
            return NULL;
    }
    int epfd, maxevents;
    PyObject *pumps, *crashed;
    if (batch_args("dispatch", args, &epfd, &pumps, &maxevents, &crashed) < 0)
        return NULL;
    struct epoll_event evs[MAX_BATCH];
    int n;
    for (;;) {
        if (timeout_ms > 0) { /* waiting in trio's place (net/trio_wait.py): as trio does */
            Py_BEGIN_ALLOW_THREADS
            n = epoll_wait(epfd, evs, maxevents, timeout_ms);
            Py_END_ALLOW_THREADS
        } else
            n = epoll_wait(epfd, evs, maxevents, 0);
        if (n >= 0)
            break;
        if (errno != EINTR)
            return PyErr_SetFromErrno(PyExc_OSError);
        if (PyErr_CheckSignals() < 0)
            return NULL;
        if (timeout_ms > 0) { /* a signal: back to the caller (trio sees its wake-up) */
            n = 0;
            break;
        }
    }
    int trio_ready = 0;
    if (handle_events(evs, n, pumps, crashed, -1, &trio_ready) < 0)
        return NULL;
    return PyLong_FromLong(n);
}

PyDoc_STRVAR(wait_doc,
    "wait(epfd, pumps, maxevents, crashed, trio_fd, timeout, offset, next_deadline, runq,\n"
    "     fins, send_fins) -> bool\n\n"
    "The reactor waiting in trio's place (lbproxy/net/trio_wait.py's loop, in C, for trio's\n"
    "SystemClock: its time is `offset` + CLOCK_MONOTONIC): batches as dispatch() makes them,\n"
    "each waiting (GIL released) until `timeout` seconds from now or next_deadline(), called\n"
    "before each, whichever comes first; send_fins() after a batch that left FINs in `fins`.\n"
    "True as soon as a batch saw `trio_fd` ready; False once the time is over or `runq` is\n"
    "not empty (a batch made a task runnable).");

static PyObject *
cp_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 11) {
        PyErr_Format(PyExc_TypeError, "wait() takes exactly 11 arguments (%zd given)", nargs);
        return NULL;
    }
    int epfd, maxevents;
    PyObject *pumps, *crashed;
    if (batch_args("wait", args, &epfd, &pumps, &maxevents, &crashed) < 0)
        return NULL;
    int trio_fd = as_int(args[4]);
    if (trio_fd == -1 && PyErr_Occurred())
        return NULL;
    double timeout = PyFloat_AsDouble(args[5]);
    double offset = PyFloat_AsDouble(args[6]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *next_deadline = args[7], *runq = args[8], *fins = args[9], *send_fins = args[10];
    if (!PyList_Check(fins)) {
        PyErr_SetString(PyExc_TypeError, "wait() argument 10 must be a list");
        return NULL;
    }
    struct epoll_event evs[MAX_BATCH];
    double now;
    if (cp_native_seconds(offset, &now) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    double end = now + timeout;
    for (;;) {
        /* trio's next deadline, again before every wait: a batch may have moved one */
        PyObject *d = PyObject_CallNoArgs(next_deadline);
        if (d == NULL)
            return NULL;
        double deadline = PyFloat_AsDouble(d);
        Py_DECREF(d);
        if (deadline == -1.0 && PyErr_Occurred())
            return NULL;
        if (cp_native_seconds(offset, &now) < 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        double left = (deadline < end ? deadline : end) - now;
        if (!(left > 0))
            Py_RETURN_FALSE;
        /* rounded up, as trio's own epoll wait rounds: never back before the deadline */
        double ms = ceil(left * 1000.0);
        int timeout_ms = ms > 86400000.0 ? 86400000 : (int)ms;
        int n;
        Py_BEGIN_ALLOW_THREADS
        n = epoll_wait(epfd, evs, maxevents, timeout_ms);
        Py_END_ALLOW_THREADS
        if (n < 0) {
            if (errno != EINTR)
                return PyErr_SetFromErrno(PyExc_OSError);
            if (PyErr_CheckSignals() < 0)
                return NULL;
            continue; /* the signal's wake-up byte makes trio's descriptor ready */
        }
        int trio_ready = 0;
        if (handle_events(evs, n, pumps, crashed, trio_fd, &trio_ready) < 0)
            return NULL;
        if (PyList_GET_SIZE(fins) > 0) {
            PyObject *r = PyObject_CallNoArgs(send_fins);
            if (r == NULL)
                return NULL;
            Py_DECREF(r);
        }
        if (trio_ready)
            Py_RETURN_TRUE;
        Py_ssize_t runnable = PyObject_Length(runq);
        if (runnable < 0)
            return NULL;
        if (runnable > 0)
            Py_RETURN_FALSE;
    }
}

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

PyDoc_STRVAR(setup_doc,
    "setup(pump_module_globals, splice_direction_type, pump_type) -> slots learnt\n\n"
    "Called once by pump.py: its globals (the pipe pool and its helpers), the type\n"
    "whose moves run in C, and the pump's type (whose slots, with the direction's, are\n"
    "read at their offsets).");

static PyObject *
setup(PyObject *self, PyObject *args)
{
    PyObject *d, *t, *pt;
    if (!PyArg_ParseTuple(args, "O!O!O!:setup", &PyDict_Type, &d, &PyType_Type, &t,
                          &PyType_Type, &pt))
        return NULL;
    Py_INCREF(d);
    Py_INCREF(t);
    Py_INCREF(pt);
    Py_XSETREF(module_dict, d);
    Py_XSETREF(splice_type, (PyTypeObject *)t);
    Py_XSETREF(pump_type, (PyTypeObject *)pt);
    n_slots = 0;
    PyObject *pump_names[] = {s_client_fd, s_up, s_down, s_outcome};
    PyObject *direction_names[] = {s_state};
    for (size_t i = 0; i < sizeof pump_names / sizeof *pump_names; i++)
        learn_slot(pump_type, pump_names[i]);
    for (size_t i = 0; i < sizeof direction_names / sizeof *direction_names; i++)
        learn_slot(splice_type, direction_names[i]);
    return PyLong_FromLong(n_slots);
}

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
       N_OUTCOMES };
static const char *const outcome_text[N_OUTCOMES] = {
    NULL, "closed", "idle_timeout", "client_reset", "server_reset", "error", "cancelled",
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

#ifndef READING /* STEP1-SHIM */
/* What a direction is doing, which decides what its descriptors are watched for. */
enum { READING, WRITING, DONE, HELD };
/* What moving a chunk reports. */
enum { MOVED, BLOCKED, GOT_EOF, SOURCE_FAILED, DESTINATION_FAILED };
#else /* STEP1-SHIM */
#define GOT_EOF EOF_ /* STEP1-SHIM */
#endif /* STEP1-SHIM */

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
    int heap_index; /* -1: no deadline armed */
    double due;     /* its key in the heap: when to look at it again */
    PyObject *on_end;
};

/* What a descriptor of the set belongs to. `gen` changes whenever the slot does: an
 * event carries the generation it was registered with, so an event read for a
 * descriptor that has since been closed (and its number reused) is dropped. */
enum { SLOT_FREE, SLOT_PUMP, SLOT_CALLBACK };
typedef struct {
    uint32_t gen;
    int kind;
    PyObject *obj; /* SLOT_PUMP: the pump (borrowed: the open list holds it); SLOT_CALLBACK:
                    * the callable, strong */
} Slot;

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
    Pump **heap;
    int heap_len, heap_cap;
    double armed; /* when the idle timer rings next, as far as this reactor knows */
    Pump *first;  /* open pumps, each holding a reference */
    Fin *fins;
    int n_fins, cap_fins;
    int in_batch;
};

static PyTypeObject Reactor_Type;
static PyTypeObject Pump_Type;

/* -- small helpers ---------------------------------------------------------------------- */

#define DIR_SRC(p, d) ((d) == &(p)->up ? (p)->client_fd : (p)->server_fd)
#define DIR_DST(p, d) ((d) == &(p)->up ? (p)->server_fd : (p)->client_fd)
#define TO_SERVER(p, d) ((d) == &(p)->up)
#define EVENT_DATA(gen, fd) (((uint64_t)(gen) << 32) | (uint32_t)(fd))

/* The reactor's clock: 0 with the time in *now, or -1 with an exception. */
static int
rx_now(Reactor *r, double *now)
{
    if (r->native && cp_native_seconds(r->offset, now) == 0)
        return 0;
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
    PyObject *held = s->kind == SLOT_CALLBACK ? s->obj : NULL;
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
heap_set(Reactor *r, int i, Pump *p)
{
    r->heap[i] = p;
    p->heap_index = i;
}

static void
heap_up(Reactor *r, int i)
{
    Pump *p = r->heap[i];
    while (i > 0) {
        int parent = (i - 1) / 2;
        if (r->heap[parent]->due <= p->due)
            break;
        heap_set(r, i, r->heap[parent]);
        i = parent;
    }
    heap_set(r, i, p);
}

static void
heap_down(Reactor *r, int i)
{
    Pump *p = r->heap[i];
    for (;;) {
        int child = 2 * i + 1;
        if (child >= r->heap_len)
            break;
        if (child + 1 < r->heap_len && r->heap[child + 1]->due < r->heap[child]->due)
            child++;
        if (r->heap[child]->due >= p->due)
            break;
        heap_set(r, i, r->heap[child]);
        i = child;
    }
    heap_set(r, i, p);
}

static void
heap_remove(Reactor *r, Pump *p)
{
    int i = p->heap_index;
    if (i < 0)
        return;
    p->heap_index = -1;
    Pump *last = r->heap[--r->heap_len];
    if (last == p)
        return;
    heap_set(r, i, last);
    heap_up(r, i);
    heap_down(r, last->heap_index);
}

/* Arm (or move) p's deadline at `due` (inf: none); the idle timer is woken if it sleeps
 * past it. 0, or -1 with an exception (no room for the heap). */
static int
pm_arm(Pump *p, double due)
{
    Reactor *r = p->reactor;
    if (!(due < Py_HUGE_VAL)) {
        heap_remove(r, p);
        return 0;
    }
    p->due = due;
    if (p->heap_index >= 0) {
        heap_up(r, p->heap_index);
        heap_down(r, p->heap_index);
    }
    else {
        if (r->heap_len == r->heap_cap) {
            int n = r->heap_cap ? 2 * r->heap_cap : 64;
            Pump **grown = PyMem_Realloc(r->heap, (size_t)n * sizeof *grown);
            if (grown == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            r->heap = grown;
            r->heap_cap = n;
        }
        heap_set(r, r->heap_len++, p);
        heap_up(r, p->heap_index);
    }
    if (due < r->armed) {
        r->armed = due;
        PyObject *when = PyFloat_FromDouble(due);
        PyObject *res = when ? PyObject_CallOneArg(r->wake, when) : NULL;
        Py_XDECREF(when);
        if (res == NULL)
            rx_record(r, s_where_pump); /* the timer rings late; nothing else is lost */
        Py_XDECREF(res);
    }
    return 0;
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
    heap_remove(r, p);
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
        else {
            PyObject *cb = Py_NewRef(s->obj);
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
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "idle_timeout cannot be deleted");
        return -1;
    }
    double seconds = PyFloat_AsDouble(value);
    if (seconds == -1.0 && PyErr_Occurred())
        return -1;
    if (isnan(seconds)) {
        PyErr_SetString(PyExc_ValueError, "idle_timeout must be a number of seconds or math.inf");
        return -1;
    }
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
        if (r->slots[i].kind == SLOT_CALLBACK)
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
        if (r->slots[i].kind == SLOT_CALLBACK)
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
    "open(client_fd, server_fd, initial, idle_timeout, on_end, uncounted=0, splice=True)\n"
    "-> Pump\n\n"
    "Pump bytes both ways between two connected non-blocking TCP descriptors, which the\n"
    "pump owns from this call on (closed when it ends, or if this raises). `initial`\n"
    "(bytes) goes to the server before any client byte; its first `uncounted` bytes (a\n"
    "PROXY header) do not count in bytes_in. `on_end(pump)` is called once, when it has\n"
    "ended and both descriptors are closed -- before open() returns, if it ends at once.\n"
    "splice=False copies every chunk.");

static PyObject *
Reactor_open(Reactor *r, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"client_fd", "server_fd", "initial", "idle_timeout",
                                        "on_end", "uncounted", "splice"};
    PyObject *a[7] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    if (nargs > 7) {
        PyErr_SetString(PyExc_TypeError, "open() takes at most 7 arguments");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        a[i] = args[i];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (int i = 0; i < 7 && nkw; i++) {
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
    double idle = Py_HUGE_VAL, now = 0.0;
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
    p->heap_index = -1;
    p->up.pipe[0] = p->up.pipe[1] = p->down.pipe[0] = p->down.pipe[1] = -1;
    p->up.copy_only = p->down.copy_only = !(splice_wanted && splice_ok);
    p->idle_timeout = idle;
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
    double end = now + timeout;
    PyObject *result = NULL;
    Py_INCREF(r);
    for (;;) {
        /* trio's next deadline, again before every wait: a batch may have moved one */
        PyObject *d = PyObject_CallNoArgs(next_deadline);
        if (d == NULL)
            break;
        double deadline = PyFloat_AsDouble(d);
        Py_DECREF(d);
        if (deadline == -1.0 && PyErr_Occurred())
            break;
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
    "rings for a pump that moved bytes since is moved to its new time), and return when\n"
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
        Pump *p = r->heap[0];
        double due = p->last_activity + p->idle_timeout;
        if (now >= due) {
            Py_INCREF(p);
            pm_end(p, O_IDLE_TIMEOUT);
            Py_DECREF(p);
        }
        else { /* bytes moved since it was armed: look again at its new time */
            p->due = due;
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
        if (r->slots[i].kind == SLOT_CALLBACK)
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

static PyMethodDef methods[] = {
    {"dispatch", (PyCFunction)(void (*)(void))dispatch, METH_FASTCALL, dispatch_doc},
    {"wait", (PyCFunction)(void (*)(void))cp_wait, METH_FASTCALL, wait_doc},
    {"accept", accept_, METH_O, accept_doc},
    {"accept_batch", accept_batch, METH_VARARGS, accept_batch_doc},
    {"connect", connect_, METH_O, connect_doc},
    {"sockaddr", sockaddr_, METH_VARARGS, sockaddr_doc},
    {"setup", setup, METH_VARARGS, setup_doc},
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
    "The reactor's inner loop in C (issue 26): see lbproxy/net/compiled.py.", -1, methods,
};

#define INTERN(var, text)                                                                    \
    do {                                                                                     \
        var = PyUnicode_InternFromString(text);                                              \
        if (var == NULL)                                                                     \
            return NULL;                                                                     \
    } while (0)

PyMODINIT_FUNC
PyInit__cpump(void)
{
    INTERN(s_client_fd, "client_fd");
    INTERN(s_on_event, "on_event");
    INTERN(s_up, "up");
    INTERN(s_down, "down");
    INTERN(s_outcome, "outcome");
    INTERN(s_state, "state");
    INTERN(s_src_fd, "src_fd");
    INTERN(s_dst_fd, "dst_fd");
    INTERN(s_last_read, "last_read");
    INTERN(s_error, "error");
    INTERN(s_pipe, "pipe");
    INTERN(s_pending, "pending");
    INTERN(s_spliced, "spliced");
    INTERN(s_flow, "flow");
    INTERN(s_to_server, "to_server");
    INTERN(s_clock, "clock");
    INTERN(s_bytes_in, "bytes_in");
    INTERN(s_bytes_out, "bytes_out");
    INTERN(s_last_activity, "last_activity");
    INTERN(s_after, "_after");
    INTERN(s_write_initial, "_write_initial");
    INTERN(s_unwatched_event, "_unwatched_event");
    INTERN(s_finish, "_finish");
    INTERN(s_move, "move");
    INTERN(s_write_out, "write_out");
    INTERN(s_idle_pipes, "_idle_pipes");
    INTERN(s_max_idle_pipes, "MAX_IDLE_PIPES");
    INTERN(s_new_pipe, "_new_pipe");
    INTERN(s_discard_pipe, "_discard_pipe");
    INTERN(s_closed, "closed");
    INTERN(s_cancelled, "cancelled");
    INTERN(s_idle_timeout_o, "idle_timeout");
    INTERN(s_client_reset, "client_reset");
    INTERN(s_server_reset, "server_reset");
    INTERN(s_error_o, "error");
    INTERN(s_closing, "closing");
    INTERN(s_pump_slot, "_pump");
    INTERN(s_idle_timeout_attr, "_idle_timeout");
    INTERN(s_pumps, "pumps");
    INTERN(s_young, "young");
    INTERN(s_sweeping, "sweeping");
    INTERN(s_defer, "defer");
    INTERN(s_deadlines, "deadlines");
    INTERN(s_at, "at");
    INTERN(s_cancel, "cancel");
    INTERN(s_deferred, "_DEFERRED");
    INTERN(s_reactor_fn, "_reactor");
    INTERN(s_epfd, "epfd");
    INTERN(s_record, "record");
    INTERN(s_connection_end, "connection_end");
    INTERN(s_fileno, "fileno");
    INTERN(s_close, "close");
    INTERN(s_splice_refused, "_splice_refused");
    INTERN(s_accept_client, "accept_client");
    INTERN(s_refuse_client, "refuse_client");
    if (PyType_Ready(&CPump_Type) < 0 || PyType_Ready(&CClock_Type) < 0 ||
        PyType_Ready(&ClientCount_Type) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&CPump_Type);
    if (PyModule_AddObject(m, "Pump", (PyObject *)&CPump_Type) < 0) {
        Py_DECREF(&CPump_Type);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&CClock_Type);
    if (PyModule_AddObject(m, "Clock", (PyObject *)&CClock_Type) < 0) {
        Py_DECREF(&CClock_Type);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ClientCount_Type);
    if (PyModule_AddObject(m, "ClientCount", (PyObject *)&ClientCount_Type) < 0) {
        Py_DECREF(&ClientCount_Type);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "READING", READING) < 0 ||
        PyModule_AddIntConstant(m, "WRITING", WRITING) < 0 ||
        PyModule_AddIntConstant(m, "HELD", HELD) < 0 ||
        PyModule_AddIntConstant(m, "BLOCKED", BLOCKED) < 0 ||
        PyModule_AddIntConstant(m, "EOF", EOF_) < 0 ||
        PyModule_AddIntConstant(m, "SOURCE_FAILED", SOURCE_FAILED) < 0 ||
        PyModule_AddIntConstant(m, "DESTINATION_FAILED", DESTINATION_FAILED) < 0 ||
        PyModule_AddIntConstant(m, "BURST", BURST) < 0 ||
        PyModule_AddIntConstant(m, "BIG_CHUNK", BIG_CHUNK) < 0 ||
        PyModule_AddIntConstant(m, "SPLICE_CHUNK", SPLICE_CHUNK) < 0 ||
        PyModule_AddIntConstant(m, "COPY_CHUNK", COPY_CHUNK) < 0 || pump_init(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
