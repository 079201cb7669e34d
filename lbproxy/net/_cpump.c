/* lbproxy.net._cpump: the reactor's inner loop in C (issue 26), optional.
 *
 * What every connection and every chunk goes through, and nothing else: one batch of
 * the reactor (epoll_wait, the pump of each ready descriptor, its event), a splice
 * direction's move (socket -> pipe -> socket, the pipe borrowed from the pool), and
 * accept4 with SOCK_NONBLOCK for the accept loop. It works on the very Python objects
 * pump.py defines (Pump, _SpliceDirection, Flow, the module's pipe pool): the state is
 * theirs, so the pure-Python path and this one can never disagree about it. Whatever is
 * not the common case -- a FIN, an error, a blocked chunk written out, the preamble, a
 * hang-up nobody watches, the end -- is handed to the Pump's own Python methods, which
 * take the decisions exactly as on the pure path (LBPROXY_PURE=1; lbproxy/net/compiled.py
 * chooses).
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
#include <limits.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
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
    *s_new_pipe, *s_discard_pipe;

/* -- attributes ----------------------------------------------------------------------
 *
 * Pump and _SpliceDirection keep their state in __slots__: a slot is a pointer at a
 * fixed offset in the object, which PyObject_GetAttr finds through the type's
 * descriptor (~175 instructions, measured with callgrind; most of what a batch cost
 * here). For exactly those two types (not a subclass, which could override a name) the
 * offsets are read once, in setup(), and used directly; any other object goes through
 * PyObject_GetAttr / PyObject_SetAttr as before. */

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

static int
set_attr(PyObject *obj, PyObject *name, PyObject *value)
{
    PyObject **p = slot_of(obj, name);
    if (p == NULL)
        return PyObject_SetAttr(obj, name, value);
    PyObject *old = *p;
    Py_INCREF(value);
    *p = value;
    Py_XDECREF(old);
    return 0;
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

static int
set_long(PyObject *obj, PyObject *name, long value)
{
    PyObject *v = PyLong_FromLong(value);
    if (v == NULL)
        return -1;
    int r = set_attr(obj, name, v);
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

/* flow.bytes_in/out += n; flow.last_activity = d.clock() */
static int
count(PyObject *d, PyObject *flow, int to_server, ssize_t n)
{
    PyObject *name = to_server ? s_bytes_in : s_bytes_out;
    PyObject *old = get_attr(flow, name);
    if (old == NULL)
        return -1;
    PyObject *add = PyLong_FromSsize_t(n);
    if (add == NULL) {
        Py_DECREF(old);
        return -1;
    }
    PyObject *sum = PyNumber_Add(old, add);
    Py_DECREF(old);
    Py_DECREF(add);
    if (sum == NULL)
        return -1;
    int r = set_attr(flow, name, sum);
    Py_DECREF(sum);
    if (r < 0)
        return -1;
    PyObject *clock = get_attr(d, s_clock);
    if (clock == NULL)
        return -1;
    PyObject *now = PyObject_CallNoArgs(clock);
    Py_DECREF(clock);
    if (now == NULL)
        return -1;
    r = set_attr(flow, s_last_activity, now);
    Py_DECREF(now);
    return r;
}

/* d.error = OSError(code); then `status` */
static int
failed(PyObject *d, int code, int status)
{
    PyObject *exc = os_error(code);
    if (exc == NULL)
        return -1;
    int r = set_attr(d, s_error, exc);
    Py_DECREF(exc);
    return r < 0 ? -1 : status;
}

/* -- _SpliceDirection.move(), line for line ------------------------------------------- */

static int
splice_move(PyObject *d)
{
    int src = (int)get_long(d, s_src_fd);
    if (src == -1 && PyErr_Occurred())
        return -1;
    int dst = (int)get_long(d, s_dst_fd);
    if (dst == -1 && PyErr_Occurred())
        return -1;
    int to_server = (int)get_long(d, s_to_server);
    if (to_server == -1 && PyErr_Occurred())
        return -1;
    PyObject *flow = get_attr(d, s_flow);
    if (flow == NULL)
        return -1;
    int left = BURST, status = -1;
    PyObject *pipe = NULL;
    for (;;) {
        if (set_long(d, s_last_read, 0) < 0)
            goto error;
        pipe = take_pipe();
        if (pipe == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_OSError))
                goto error;
            /* EMFILE, ENFILE: no descriptor left for a pipe -- ends this connection */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            int r = value ? set_attr(d, s_error, value) : -1;
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            status = r < 0 ? -1 : SOURCE_FAILED;
            goto done;
        }
        int pr, pw;
        if (pipe_fds(pipe, &pr, &pw) < 0)
            goto error;
        ssize_t n = do_splice(src, pw, SPLICE_CHUNK);
        if (n == -2)
            goto error; /* nothing moved: the pipe is still empty */
        if (n < 0) {
            int code = errno;
            if (put_pipe(pipe) < 0)
                goto error;
            Py_CLEAR(pipe);
            if (code == EAGAIN || code == EWOULDBLOCK) {
                status = MOVED; /* readiness can be stale by the time we read */
                goto done;
            }
            status = failed(d, code, SOURCE_FAILED);
            goto done;
        }
        if (set_attr(d, s_spliced, Py_True) < 0)
            goto error;
        if (n == 0) { /* EOF: the pipe goes back as it came */
            if (put_pipe(pipe) < 0)
                goto error;
            Py_CLEAR(pipe);
            status = EOF_;
            goto done;
        }
        if (set_long(d, s_last_read, (long)n) < 0)
            goto error;
        ssize_t m = do_splice(pr, dst, (size_t)n);
        if (m < 0) {
            int code = errno;
            /* still holding the chunk: write_out() goes on, or release() discards it */
            if (set_attr(d, s_pipe, pipe) < 0 || set_long(d, s_pending, (long)n) < 0)
                goto error;
            Py_CLEAR(pipe);
            if (m == -2)
                goto error_kept;
            if (code == EAGAIN || code == EWOULDBLOCK) {
                status = BLOCKED;
                goto done;
            }
            status = failed(d, code, DESTINATION_FAILED);
            goto done;
        }
        if (count(d, flow, to_server, m) < 0) {
            /* the chunk is out; only the counting failed: give the pipe back first */
            if (m == n) {
                PyObject *type, *value, *tb;
                PyErr_Fetch(&type, &value, &tb);
                put_pipe(pipe);
                PyErr_Restore(type, value, tb);
            }
            else {
                PyObject *type, *value, *tb;
                PyErr_Fetch(&type, &value, &tb);
                set_attr(d, s_pipe, pipe);
                set_long(d, s_pending, (long)(n - m));
                PyErr_Restore(type, value, tb);
            }
            Py_CLEAR(pipe);
            goto error;
        }
        if (m == n) {
            if (put_pipe(pipe) < 0)
                goto error;
            Py_CLEAR(pipe);
            status = MOVED;
        }
        else { /* a partial write: write_out() goes on (and waits if it has to) */
            if (set_attr(d, s_pipe, pipe) < 0 || set_long(d, s_pending, (long)(n - m)) < 0)
                goto error;
            Py_CLEAR(pipe);
            PyObject *r = PyObject_CallMethodNoArgs(d, s_write_out);
            if (r == NULL)
                goto error;
            status = (int)PyLong_AsLong(r);
            Py_DECREF(r);
            if (status == -1 && PyErr_Occurred())
                goto error;
        }
        left -= 1;
        if (status || !left || n < BIG_CHUNK)
            goto done;
    }
error:
    if (pipe != NULL) {
        /* held, maybe with bytes in it: never reused (_discard_pipe, as release() does) */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *discard = module_global(s_discard_pipe);
        PyObject *r = discard ? PyObject_CallOneArg(discard, pipe) : NULL;
        Py_XDECREF(r);
        PyErr_Clear();
        PyErr_Restore(type, value, tb);
        Py_CLEAR(pipe);
    }
error_kept:
    status = -1;
done:
    Py_XDECREF(pipe);
    Py_DECREF(flow);
    return status;
}

/* reader.move(): here for a splice direction, its own method otherwise. */
static int
move(PyObject *d)
{
    if (Py_TYPE(d) == splice_type)
        return splice_move(d);
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

/* -- the module's functions ------------------------------------------------------------ */

PyDoc_STRVAR(dispatch_doc,
    "dispatch(epfd, pumps, maxevents, crashed) -> number of events\n\n"
    "One batch of the reactor: epoll_wait(epfd, maxevents, timeout 0), then for each\n"
    "ready descriptor the pump `pumps` maps it to (skipped if none: ended earlier in the\n"
    "batch) handles its event as Pump.on_event does. An Exception met handling one pump\n"
    "goes to crashed(pump, exc) and the batch goes on.");

static PyObject *
dispatch(PyObject *self, PyObject *args)
{
    int epfd, maxevents;
    PyObject *pumps, *crashed;
    if (!PyArg_ParseTuple(args, "iO!iO:dispatch", &epfd, &PyDict_Type, &pumps, &maxevents,
                          &crashed))
        return NULL;
    if (module_dict == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_cpump.setup() was not called");
        return NULL;
    }
    if (maxevents < 1 || maxevents > MAX_BATCH)
        maxevents = MAX_BATCH;
    struct epoll_event evs[MAX_BATCH];
    int n;
    for (;;) {
        n = epoll_wait(epfd, evs, maxevents, 0);
        if (n >= 0)
            break;
        if (errno != EINTR)
            return PyErr_SetFromErrno(PyExc_OSError);
        if (PyErr_CheckSignals() < 0)
            return NULL;
    }
    for (int i = 0; i < n; i++) {
        int fd = evs[i].data.fd;
        PyObject *key = PyLong_FromLong(fd);
        if (key == NULL)
            return NULL;
        PyObject *p = PyDict_GetItemWithError(pumps, key); /* borrowed */
        Py_DECREF(key);
        if (p == NULL) {
            if (PyErr_Occurred())
                return NULL;
            continue; /* ended earlier in this batch */
        }
        Py_INCREF(p);
        if (on_event(p, fd, evs[i].events) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) { /* Cancelled, KeyboardInterrupt */
                Py_DECREF(p);
                return NULL;
            }
            /* the barrier: a bug ends that connection, not the reactor */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            if (tb != NULL && value != NULL)
                PyException_SetTraceback(value, tb);
            PyObject *r = PyObject_CallFunctionObjArgs(crashed, p, value ? value : Py_None, NULL);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            if (r == NULL) {
                Py_DECREF(p);
                return NULL;
            }
            Py_DECREF(r);
        }
        Py_DECREF(p);
    }
    return PyLong_FromLong(n);
}

PyDoc_STRVAR(accept_doc,
    "accept(fd) -> (client_fd, address)\n\n"
    "accept4(fd, SOCK_NONBLOCK | SOCK_CLOEXEC): the descriptor is non-blocking already,\n"
    "saving the fcntl that socket._accept() needs after it. The address is what\n"
    "socket.accept() gives: (host, port) for IPv4, (host, port, flowinfo, scope_id) for\n"
    "IPv6. Raises OSError (BlockingIOError when the backlog is empty) as socket does.");

static PyObject *
accept_(PyObject *self, PyObject *arg)
{
    int fd = as_int(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    struct sockaddr_storage ss;
    int client;
    for (;;) {
        socklen_t len = sizeof ss;
        /* a non-blocking listening socket: no need to let go of the GIL */
        client = accept4(fd, (struct sockaddr *)&ss, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (client >= 0)
            break;
        if (errno != EINTR)
            return PyErr_SetFromErrno(PyExc_OSError);
        if (PyErr_CheckSignals() < 0)
            return NULL;
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
        return NULL;
    }
    PyObject *r = Py_BuildValue("(iN)", client, addr);
    if (r == NULL)
        close(client);
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
    PyObject *direction_names[] = {s_state,   s_src_fd,  s_dst_fd,    s_last_read,
                                   s_error,   s_pipe,    s_pending,   s_spliced,
                                   s_flow,    s_to_server, s_clock};
    for (size_t i = 0; i < sizeof pump_names / sizeof *pump_names; i++)
        learn_slot(pump_type, pump_names[i]);
    for (size_t i = 0; i < sizeof direction_names / sizeof *direction_names; i++)
        learn_slot(splice_type, direction_names[i]);
    return PyLong_FromLong(n_slots);
}

static PyMethodDef methods[] = {
    {"dispatch", dispatch, METH_VARARGS, dispatch_doc},
    {"accept", accept_, METH_O, accept_doc},
    {"setup", setup, METH_VARARGS, setup_doc},
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
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "READING", READING) < 0 ||
        PyModule_AddIntConstant(m, "WRITING", WRITING) < 0 ||
        PyModule_AddIntConstant(m, "HELD", HELD) < 0 ||
        PyModule_AddIntConstant(m, "BLOCKED", BLOCKED) < 0 ||
        PyModule_AddIntConstant(m, "EOF", EOF_) < 0 ||
        PyModule_AddIntConstant(m, "SOURCE_FAILED", SOURCE_FAILED) < 0 ||
        PyModule_AddIntConstant(m, "DESTINATION_FAILED", DESTINATION_FAILED) < 0 ||
        PyModule_AddIntConstant(m, "BURST", BURST) < 0 ||
        PyModule_AddIntConstant(m, "BIG_CHUNK", BIG_CHUNK) < 0 ||
        PyModule_AddIntConstant(m, "SPLICE_CHUNK", SPLICE_CHUNK) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
