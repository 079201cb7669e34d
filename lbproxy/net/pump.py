"""The byte pump: copy a client and a real-server TCP socket into each other.

This module owns everything between "both sockets are connected" and "both directions
are finished" (SPEC section 4): the two directions, the half-close hand-over, the idle
timeout and the pipe pool behind splice(2). It does not own the sockets: the caller
closes both after :func:`pump` returns, whatever it returns -- or asks the pump to close
them the moment it ends (``Pump(close_sockets=True)``, what the connection handler
does, with plain descriptors rather than socket objects), which leaves two system calls
per connection to close(2): the epoll set's removal, and the last FIN of a connection
both of whose sides have closed. A FIN read while the other way is still open is passed
on as a half-close at the end of the reactor's batch, so a client and a server that
close at about the same time (HTTP with ``Connection: close``) need no shutdown at all.

How it works
------------
Bytes are moved by one reactor per trio run: one shared, level-triggered epoll set
that holds both sockets of every connection being pumped (``_Reactor``), served in
batches by trio's own loop, in its wait (net/trio_wait.py), or else by a system task.
Each batch handles every socket that became ready since the last one, so the cost of
a wait is paid once per batch, not once per chunk per connection -- the way HAProxy's
and nginx's event loops work. A connection is a state machine (:class:`Pump`)
whose task, after ``start()``, parks in ``finished()`` until the reactor, the idle
deadline or :meth:`Flow.close` sets its outcome: no nursery, no second task, no cancel
scope; the idle timeout is an entry in the process-wide heap of deadlines.py.

Measured with scripts/bench (docs/benchmarks.md), against one task per direction plus a
watchdog: CPU per keep-alive request 34 -> 13 us, per new connection 269 -> 145 us,
memory per idle connection 11 -> 3.5 kB. The price: moving bytes is callbacks inside one
task, so a bug there is caught per connection (logged, raised in that connection's
task) rather than taking the reactor down, and fairness is explicit: a batch handles at
most _Reactor.MAX_EVENTS events, each at most _BURST chunks, then trio runs others.

A direction is a small state machine: reading (its source is watched for input), or
writing (a chunk it could not write out yet; its destination is watched for output and
its source is not: back-pressure). A chunk is written out completely before the next
read, so a direction holds nothing between chunks. An idle connection -- most of them,
on a busy proxy -- holds no pipe and no buffer, and the number of pipes in use is the
number of bulk directions actually blocked on a slow reader, not twice the number of
connections
(HAProxy's pipe pool makes the same choice: a pipe is taken when splicing starts and
released as soon as it is empty). This matters for file descriptors (a pipe is two) and
for the kernel's per-user pipe budget (``/proc/sys/fs/pipe-user-pages-soft``: beyond it
new pipes shrink to a page or two).

How a chunk moves is HAProxy's splice-auto: copied (one read into memory, one write; no
pipe) while chunks are small, spliced (socket -> pipe -> socket inside the kernel, zero
copy, a pipe borrowed from the pool per chunk) once a read has filled COPY_CHUNK, the
sign of a bulk transfer. A request and its response (most connections) are two
system calls each, like two splices, but cheaper in the kernel, and never touch a pipe.
Where ``os.splice`` is missing, where the kernel refuses the first splice with EINVAL or
ENOSYS, or when the caller forces it (``use_splice=False``), every chunk is copied. Linux
only: the reactor needs ``select.epoll`` (trio supports more systems).

Outcomes
--------
:func:`pump` returns one of:

``"closed"``        both sides sent FIN and every byte was passed on.
``"idle_timeout"``  nothing moved in either direction for ``flow.idle_timeout`` seconds
                    (this also bounds a half-closed connection).
``"client_reset"``  the client socket failed with ECONNRESET, EPIPE, ENOTCONN or
                    ECONNABORTED (reset, or closed while we still had data for it).
``"server_reset"``  the same on the real-server socket.
``"error"``         any other socket error (ETIMEDOUT, EHOSTUNREACH, ENOMEM, ...);
                    ``flow.error`` holds it.
``"cancelled"``     :meth:`Flow.close` was called (the proxy closing it on purpose).

On a reset or error pump returns at once, so the caller's close() reaches the other
peer without delay. The other side gets an orderly close, not a reset: data already
handed to its kernel buffer (the last part of a response, say) still arrives, which an
RST would throw away. A reset is noticed even on a socket that has half-closed and is
no longer read: epoll reports errors on every socket in its set. If the caller's own
scope is cancelled, pump raises ``trio.Cancelled`` like any trio call; pipes and the
shared set are cleaned up either way.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import select
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final, Literal, Protocol

try:
    import fcntl
except ImportError:  # not POSIX: no pipes to size, and no splice either
    fcntl = None  # type: ignore[assignment]  # None off POSIX: tested before use

import outcome
import trio
from trio.lowlevel import wait_readable

from lbproxy.net import trio_wait
from lbproxy.net.barrier import record
from lbproxy.net.compiled import cpump
from lbproxy.net.deadlines import Deadline, deadlines

if TYPE_CHECKING:
    from trio.socket import SocketType

__all__ = [
    "CANCELLED",
    "CLIENT_RESET",
    "CLOSED",
    "ERROR",
    "IDLE_TIMEOUT",
    "SERVER_RESET",
    "Flow",
    "Outcome",
    "Pump",
    "close_idle_pipes",
    "new_pump",
    "pump",
    "reactor",
    "splice_available",
]

log = logging.getLogger("lbproxy.pump")

Outcome = Literal["closed", "idle_timeout", "client_reset", "server_reset", "error", "cancelled"]
CLOSED: Final = "closed"
CANCELLED: Final = "cancelled"
IDLE_TIMEOUT: Final = "idle_timeout"
CLIENT_RESET: Final = "client_reset"
SERVER_RESET: Final = "server_reset"
ERROR: Final = "error"

# "The peer went away": a reset, or a write after the peer closed. Anything else is a
# real error worth a different label.
_RESET_ERRNOS: Final = frozenset(
    {errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ECONNABORTED}
)

# ---------------------------------------------------------------------------- tuning

#: Bulk chunks are spliced when this is true (and the kernel agrees). Set it to False to
#: copy every chunk in every later pump; it is also cleared, once, when the kernel
#: refuses splice on a TCP socket.
splice_enabled: bool = hasattr(os, "splice")

_SPLICE_FLAGS: Final = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)

#: Pipe capacity asked for with F_SETPIPE_SZ (the kernel default is 64 KiB). Measured with
#: bench/pump_bench.py on loopback: 64 KiB pipes cost ~0.75 CPU-s/GB in this process,
#: 128 KiB ~0.48, 256 KiB no better than 128. Bigger is not free: every pipe, pooled or
#: busy, counts against the user's /proc/sys/fs/pipe-user-pages-soft (16384 pages by
#: default); past it the kernel hands out 2-page pipes and refuses F_SETPIPE_SZ (EPERM,
#: which we ignore: a small pipe still works, only slower). At 128 KiB, 512 pipes fit.
PIPE_SIZE: int = 1 << 17
#: Idle pipes kept for reuse; more are closed. An idle pipe costs two fds and its share of
#: the pipe budget above (128 x 32 pages = a quarter of the default), no memory.
MAX_IDLE_PIPES: int = 128
#: splice-auto, as HAProxy's (16 KiB, HAProxy's bufsize): chunks are copied with one read
#: and one write until a read fills this many bytes, the sign of a bulk transfer; that
#: direction splices from then on. A small chunk copied costs less than two splices
#: through a pipe (system CPU per new connection: docs/benchmarks.md, issue 26).
COPY_CHUNK: Final = 1 << 14

# Ask splice for more than any pipe holds: it stops at what the pipe can take.
_SPLICE_CHUNK: Final = 1 << 24

_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", None) if fcntl is not None else None


def splice_available() -> bool:
    """Whether a pump started now with ``use_splice=None`` would try splice."""
    return splice_enabled and hasattr(os, "splice")


# ----------------------------------------------------------------------- pipe pool

# Module-level, shared by every pump in the process. Only empty pipes are ever put back
# (a pipe with bytes left in it would hand one connection's data to another), so a
# pipe in this list is always safe to reuse. Plain list pop/append: trio runs all pumps
# on one thread, and the GIL makes each operation atomic even if it did not.
_idle_pipes: list[tuple[int, int]] = []


def _new_pipe() -> tuple[int, int]:
    # O_NONBLOCK on both ends, although SPLICE_F_NONBLOCK already makes the pipe side of
    # splice non-blocking: belt and braces for any other reader. O_CLOEXEC so a pipe
    # never leaks into a spawned process.
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    if _F_SETPIPE_SZ is not None and PIPE_SIZE:
        # EPERM over the user's pipe budget, EINVAL: keep the default size.
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_SIZE)
    return r, w


def _put_pipe(pipe: tuple[int, int]) -> None:
    """Return an EMPTY pipe to the pool (or close it when the pool is full)."""
    if len(_idle_pipes) < MAX_IDLE_PIPES:
        _idle_pipes.append(pipe)
    else:
        os.close(pipe[0])
        os.close(pipe[1])


def _discard_pipe(pipe: tuple[int, int]) -> None:
    """Close a pipe that may still hold bytes: it must never be reused."""
    os.close(pipe[0])
    os.close(pipe[1])


def close_idle_pipes() -> int:
    """Close every pooled pipe and return how many were closed.

    For shutdown and for tests that count file descriptors; pumps keep working and
    simply create new pipes.
    """
    n = len(_idle_pipes)
    while _idle_pipes:
        _discard_pipe(_idle_pipes.pop())
    return n


def _after_fork_in_child() -> None:
    # A forked worker shares the parent's pipes: two processes splicing through one
    # pipe would mix their connections' bytes. Drop the child's copies (without
    # touching the parent's, which stay open in the parent).
    close_idle_pipes()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------------------- flow


class Flow:
    """Per-connection byte counters and idle timeout, read by metrics and the throttle.

    Created by the connection handler before :func:`pump`; the counters stay readable
    after pump returns. Attributes:

    ``bytes_in``       client -> server bytes written to the server (including
                       ``initial_client_bytes``).
    ``bytes_out``      server -> client bytes written to the client.
    ``idle_timeout``   seconds (float or ``math.inf``). Assigning it while pumping takes
                       effect at once (the admission-control monitor shortens it under
                       load). A value already exceeded by the current idle time ends the
                       pump at once.
    ``last_activity``  ``trio.current_time()`` of the last byte written either way (or of
                       the start of pump, or of a FIN passed on).
    ``error``          the OSError behind a ``*_reset`` or ``error`` outcome, else None.
    ``closing``        set by :meth:`close`.
    """

    __slots__ = (
        "_idle_timeout",
        "_pump",
        "bytes_in",
        "bytes_out",
        "closing",
        "error",
        "last_activity",
    )

    def __init__(self, idle_timeout: float = math.inf) -> None:
        self.bytes_in = 0
        self.bytes_out = 0
        self.error: OSError | None = None
        self.last_activity = 0.0
        self.closing = False
        self._pump: Pump | None = None  # while pump() runs
        self._idle_timeout = math.inf
        self.idle_timeout = idle_timeout

    @property
    def idle_timeout(self) -> float:
        return self._idle_timeout

    @idle_timeout.setter
    def idle_timeout(self, seconds: float) -> None:
        seconds = float(seconds)
        if math.isnan(seconds):
            raise ValueError("idle_timeout must be a number of seconds or math.inf")
        self._idle_timeout = seconds
        self.poke()

    @property
    def pumping(self) -> bool:
        """True while a pump moves this flow's bytes (connected, not yet finished)."""
        return self._pump is not None

    def poke(self) -> None:
        """Re-read ``last_activity`` and ``idle_timeout`` now, in a running pump.

        Assigning ``idle_timeout`` already does this; call it only after changing
        ``last_activity`` by hand. Safe to call at any time, from any trio task.
        """
        if self._pump is not None:
            self._pump.rearm()

    def close(self) -> None:
        """End the pump now (or as soon as it starts): it returns ``"cancelled"``.

        For the proxy closing a connection on purpose (a disabled real server,
        ``on_down: close``). The caller then closes both sockets as usual. Safe to call
        at any time, from any trio task, more than once.
        """
        self.closing = True
        if self._pump is not None:
            self._pump.cancel()

    def __repr__(self) -> str:
        return (
            f"Flow(bytes_in={self.bytes_in}, bytes_out={self.bytes_out}, "
            f"idle_timeout={self._idle_timeout})"
        )


# ---------------------------------------------------------------------- directions

# Epoll event masks. A socket's mask in the reactor's epoll set is _UNWATCHED when it
# has been taken out of the set (see Pump._unwatched_event).
_IN: Final = select.EPOLLIN
_OUT: Final = select.EPOLLOUT
_FAILED: Final = select.EPOLLERR | select.EPOLLHUP
_IN_OR_FAILED: Final = _IN | _FAILED
_OUT_OR_FAILED: Final = _OUT | _FAILED
_UNWATCHED: Final = -1
# splice(2) errors on a first read that mean "this socket cannot be spliced".
_NO_SPLICE: Final = frozenset({errno.EINVAL, errno.ENOSYS})

# What a direction is doing, which decides what the pump watches for it.
_READING: Final = 0  # waiting for its source to be readable
_WRITING: Final = 1  # holding `pending` bytes, waiting for its destination to take them
_DONE: Final = 2  # its source sent FIN and the FIN was passed on
_HELD: Final = 3  # client -> server only: waits until the preamble is out

# What a direction's move() or write_out() reports. _MOVED is 0 so the loop's usual
# case is one falsy test.
_MOVED: Final = 0  # the chunk went out completely (or there was nothing to read)
_BLOCKED: Final = 1  # the destination is full: `pending` bytes wait for it
_EOF: Final = 2  # the source sent FIN
_SOURCE_FAILED: Final = 3  # reading failed: `error` says why
_DESTINATION_FAILED: Final = 4  # writing failed: `error` says why

# Idle deadlines of at least _DEFER_IDLE seconds are armed by a sweep of the connections
# started in the last _SWEEP seconds (_Reactor.defer), not when each connection starts.
_DEFER_IDLE: Final = 1.0
_SWEEP: Final = 0.1


class _Deferred:
    """Pump.alarm of a connection whose idle deadline the next sweep arms."""

    __slots__ = ()


_DEFERRED: Final = _Deferred()

# Direction.move(): chunks moved per turn at most, and what counts as a big chunk.
# Measured with scripts/bench --quick (iperf3 bulk / 1 MiB GETs over 4 keep-alive
# connections): 1 chunk per turn 12.7-13.7 / 26-37 Gbit/s at 0.48-0.59 CPU-s per GB;
# 2 chunks 14.6-15.5 / 24-27 at 0.31-0.42; 4 chunks 15.1-15.3 / 18 at 0.29-0.32. Two
# keep most of the bulk gain without the loss on large responses.
_BURST: Final = 2
_BIG_CHUNK: Final = 1 << 16


class _Direction:
    """One way of a connection: src -> dst, a chunk at a time, copied or spliced.

    splice-auto, as HAProxy's: a chunk is copied (one read into a bytes object, one
    write: two system calls, no pipe) until a read fills COPY_CHUNK -- the sign of a bulk
    transfer -- and from the next read on the direction splices, src -> pipe -> dst
    inside the kernel (zero copy, through a pipe borrowed from the pool per chunk and
    given back as soon as it is empty, so an idle connection holds no pipe). A request,
    a keep-alive response, an HTTP exchange that fits in 16 KiB never touches a pipe.
    ``can_splice`` False (``use_splice=False``, or the kernel refused splice on this
    socket) copies every chunk.

    ``move()`` reads one chunk and writes out as much of it as dst takes;
    ``write_out()`` goes on writing a chunk that dst refused before. Both return one of
    the statuses above and keep the flow's counter and ``last_activity`` up to date.
    The pump owns the state machine; a direction only moves bytes. It works on the two
    descriptors: no socket object is needed to read, write or splice, and none is built
    per connection (CPython makes a ``getsockname`` call and a few Python frames for
    each). lbproxy/net/_cpump.c does the same, chunk for chunk, in C.
    """

    __slots__ = (
        "bulk",
        "can_splice",
        "chunk",
        "clock",
        "dst_fd",
        "error",
        "fin_pending",
        "flow",
        "last_read",
        "pending",
        "pipe",
        "spliced",
        "src_fd",
        "state",
        "to_server",
    )

    def __init__(
        self,
        src_fd: int,
        dst_fd: int,
        flow: Flow,
        to_server: bool,
        clock: Callable[[], float],
        can_splice: bool,
    ) -> None:
        self.src_fd = src_fd
        self.dst_fd = dst_fd
        self.flow = flow
        self.clock = clock  # the run's clock.current_time: one frame, not trio's three
        self.to_server = to_server  # which counter; which side a failure is blamed on
        self.state = _READING
        self.pending = 0  # bytes read from src and not yet written to dst
        self.last_read = 0  # size of the last chunk read
        self.error: OSError | None = None
        # Its source sent FIN and the shutdown that passes it on waits for the end of
        # the reactor's batch (Pump._pass_fin says why).
        self.fin_pending = False
        self.can_splice = can_splice
        self.bulk = False  # a read filled COPY_CHUNK: the next ones splice
        self.pipe: tuple[int, int] | None = None  # a spliced chunk dst has not taken
        self.chunk: memoryview | None = None  # the rest of a copied chunk, likewise
        self.spliced = False  # until a splice succeeds, EINVAL means "cannot splice"

    def move(self) -> int:
        """Move one chunk; after a big one, move another, up to _BURST chunks in all.

        A big chunk (a copied read that filled COPY_CHUNK, a splice of _BIG_CHUNK) says
        more is probably waiting (a bulk transfer): reading it now saves a trip through
        trio's wait (~7 us) per chunk. A small one (a request, a keep-alive response)
        ends the turn without trying a read that would only find nothing. The bound
        keeps one busy connection from holding the loop.
        """
        left = _BURST
        while True:
            self.last_read = 0
            if not self.bulk:
                # Copied: one read, one write, no pipe.
                try:
                    data = os.read(self.src_fd, COPY_CHUNK)
                except BlockingIOError:  # readiness can be stale by the time we read
                    return _MOVED
                except OSError as exc:
                    self.error = exc
                    return _SOURCE_FAILED
                n = len(data)
                if not n:
                    return _EOF
                self.last_read = n
                if n == COPY_CHUNK and self.can_splice:
                    self.bulk = True  # bulk: splice from the next read on
                try:
                    m = os.write(self.dst_fd, data)
                except BlockingIOError:
                    self.chunk = memoryview(data)
                    self.pending = n
                    return _BLOCKED
                except OSError as exc:
                    self.error = exc
                    return _DESTINATION_FAILED
                flow = self.flow
                if self.to_server:
                    flow.bytes_in += m
                else:
                    flow.bytes_out += m
                flow.last_activity = self.clock()
                if m == n:
                    status = _MOVED
                else:  # a partial write: write_out() goes on (and waits if it has to)
                    self.chunk = memoryview(data)[m:]
                    self.pending = n - m
                    status = self.write_out()
                left -= 1
                if status or not left or n < COPY_CHUNK:
                    return status
                continue
            try:
                pipe = _idle_pipes.pop() if _idle_pipes else _new_pipe()
            except OSError as exc:  # EMFILE, ENFILE: no descriptor left for a pipe
                self.error = exc
                return _SOURCE_FAILED  # ends this connection with "error", nothing else
            try:
                n = os.splice(self.src_fd, pipe[1], _SPLICE_CHUNK, flags=_SPLICE_FLAGS)
            except BlockingIOError:  # readiness can be stale by the time we read
                _put_pipe(pipe)
                return _MOVED
            except OSError as exc:
                _put_pipe(pipe)  # nothing was moved into it
                if not self.spliced and exc.errno in _NO_SPLICE:
                    # This socket cannot be spliced: copy it (nothing was read), and
                    # let later pumps copy only.
                    self.can_splice = self.bulk = False
                    _splice_refused(exc)
                    continue
                self.error = exc
                return _SOURCE_FAILED
            self.spliced = True
            if not n:  # EOF: the pipe goes back as it came (_put_pipe, inline)
                if len(_idle_pipes) < MAX_IDLE_PIPES:
                    _idle_pipes.append(pipe)
                else:
                    _discard_pipe(pipe)
                return _EOF
            self.last_read = n
            # The usual case, inline: the whole chunk goes out at once (else write_out()
            # goes on with what is left, and waits for dst if it has to).
            try:
                m = os.splice(pipe[0], self.dst_fd, n, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                self.pipe = pipe
                self.pending = n
                return _BLOCKED
            except OSError as exc:
                self.pipe = pipe  # still holding the chunk: release() discards it
                self.pending = n
                self.error = exc
                return _DESTINATION_FAILED
            flow = self.flow
            if self.to_server:
                flow.bytes_in += m
            else:
                flow.bytes_out += m
            flow.last_activity = self.clock()
            if m == n:
                if len(_idle_pipes) < MAX_IDLE_PIPES:
                    _idle_pipes.append(pipe)
                else:
                    _discard_pipe(pipe)
                status = _MOVED
            else:  # a partial write: write_out() goes on (and waits if it has to)
                self.pipe = pipe
                self.pending = n - m
                status = self.write_out()
            left -= 1
            if status or not left or n < _BIG_CHUNK:
                return status

    def write_out(self) -> int:
        dst_fd = self.dst_fd
        flow = self.flow
        pipe = self.pipe
        if pipe is None:  # the rest of a copied chunk
            chunk = self.chunk
            assert chunk is not None
            while self.pending:
                try:
                    n = os.write(dst_fd, chunk)
                except BlockingIOError:
                    return _BLOCKED
                except OSError as exc:
                    self.error = exc
                    return _DESTINATION_FAILED
                chunk = self.chunk = chunk[n:]  # a view of the rest, never a copy
                self._wrote(n)
            self.chunk = None
            return _MOVED
        while self.pending:
            try:
                n = os.splice(pipe[0], dst_fd, self.pending, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                return _BLOCKED
            except OSError as exc:
                self.error = exc
                return _DESTINATION_FAILED
            # _wrote(n), inline (once per chunk, twice per keep-alive request); partial
            # writes are normal: loop until the pipe is empty.
            self.pending -= n
            if self.to_server:
                flow.bytes_in += n
            else:
                flow.bytes_out += n
            flow.last_activity = self.clock()
        # Empty again: back to the pool, so an idle connection holds no pipe.
        self.pipe = None
        if len(_idle_pipes) < MAX_IDLE_PIPES:
            _idle_pipes.append(pipe)
        else:
            _discard_pipe(pipe)
        return _MOVED

    def _wrote(self, n: int) -> None:
        """``n`` pending bytes reached dst: count them, and note it for the idle timeout."""
        self.pending -= n
        flow = self.flow
        if self.to_server:
            flow.bytes_in += n
        else:
            flow.bytes_out += n
        flow.last_activity = self.clock()

    def release(self) -> None:
        """The pump is over: give back (or discard) whatever is still held."""
        self.chunk = None
        pipe = self.pipe
        self.pipe = None
        if pipe is not None:
            # A pipe with bytes left in it would hand them to another connection.
            if self.pending:
                _discard_pipe(pipe)
            else:
                _put_pipe(pipe)


def _view(fd: int) -> socket.socket:
    """A socket object over a connected TCP descriptor it does not own (``detach()`` it
    afterwards): for the two calls that need one -- shutdown and SO_ERROR. Not on the
    byte path: CPython checks the descriptor with getsockname."""
    return socket.socket(-1, socket.SOCK_STREAM, 0, fd)


def _shutdown_write(fd: int) -> None:
    """shutdown(fd, SHUT_WR): pass a FIN on (a half-close)."""
    sock = _view(fd)
    try:
        sock.shutdown(socket.SHUT_WR)
    finally:
        sock.detach()


def _socket_error(fd: int) -> int:
    """The socket's pending error (SO_ERROR), 0 if none."""
    sock = _view(fd)
    try:
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    finally:
        sock.detach()


# --------------------------------------------------------------------------- pump


class Pump:
    """Both directions of one connection, as a state machine the reactor drives.

    :func:`pump` is the way to use it. The connection handler runs the same three lines
    itself (``start()``, ``await finished()``, ``close()`` in a finally), which keeps
    one coroutine frame less (~0.3 kB) alive per idle connection.

    The two sockets sit in the reactor's shared, level-triggered epoll set, and their
    interest follows the directions' states: the client socket is watched for input
    while client -> server is reading and for output while server -> client holds a
    chunk the client has not taken yet, and the same for the server socket. So a
    direction blocked on a slow reader stops reading (back-pressure, and no busy loop),
    and a finished direction's source (EOF is always "readable") is not watched. Errors
    and hang-ups are reported even on a socket nobody watches, which is how a reset on a
    half-closed socket is noticed at once.
    """

    __slots__ = (
        "alarm",
        "client_fd",
        "client_mask",
        "down",
        "error",
        "flow",
        "initial",
        "initial_uncounted",
        "on_end",
        "open_directions",
        "outcome",
        "reactor",
        "registered",
        "server_fd",
        "server_mask",
        "sockets",
        "task",
        "up",
    )

    def __init__(
        self,
        client: SocketType | socket.socket | int,
        server: SocketType | socket.socket | int,
        flow: Flow,
        *,
        preamble: bytes = b"",
        initial_client_bytes: bytes = b"",
        use_splice: bool | None = None,
        close_sockets: bool = False,
    ) -> None:
        if use_splice is None:
            use_splice = splice_enabled
        # close_sockets: the pump closes both sockets itself the moment it ends, inside
        # the reactor (the caller's own close() afterwards does nothing), as the
        # connection handler asks. Work per connection is then left to close(2):
        # closing a descriptor takes it out of the epoll set (no EPOLL_CTL_DEL, and no
        # batch woken by a finished socket's hang-up before the caller's close), and the
        # last FIN of a connection whose two directions are both finished is sent by
        # close, without a shutdown first (both receive queues are empty then: close
        # sends FIN, not RST). `client` and `server` are socket objects or plain
        # descriptors (what the connection handler passes: no socket object is built
        # per connection); the pump itself uses only the descriptors. It owns them from
        # the call on: should this constructor raise, they are closed.
        self.sockets = (client, server) if close_sockets else None
        self.up: _Direction | None = None
        self.down: _Direction | None = None
        self.registered = False
        # The idle deadline in the process-wide heap (or _DEFERRED: not armed yet).
        self.alarm: Deadline | _Deferred | None = None
        self.flow = flow
        splicing = bool(use_splice) and hasattr(os, "splice")
        self.outcome: Outcome | None = None
        self.error: BaseException | None = None  # a bug met while moving bytes
        self.open_directions = 2
        self.task: trio.lowlevel.Task | None = None  # parked in finished()
        # Instead of a task in finished(): called once, with the pump, when it ends --
        # synchronously, from the reactor, the deadline heap, or whoever called
        # Flow.close() or assigned Flow.idle_timeout (so such a caller must not be
        # iterating over something the callback changes). It must not raise.
        self.on_end: Callable[[Pump], None] | None = None
        # Bytes for the server before the loop starts; the first `initial_uncounted` of
        # them (a PROXY header) are not client data and do not count in bytes_in.
        self.initial = preamble + initial_client_bytes
        self.initial_uncounted = len(preamble)
        # (mypy narrows no `type(x) is int` else-branch, bool being an int too: socket)
        client_fd = self.client_fd = client if type(client) is int else client.fileno()  # type: ignore[union-attr]  # see above
        server_fd = self.server_fd = server if type(server) is int else server.fileno()  # type: ignore[union-attr]  # see above
        try:
            reactor = self.reactor = _reactor()
            self.up = _Direction(client_fd, server_fd, flow, True, reactor.clock, splicing)
            self.down = _Direction(server_fd, client_fd, flow, False, reactor.clock, splicing)
        except BaseException:
            self.close()
            raise
        self.client_mask = self.server_mask = _UNWATCHED

    def start(self) -> None:
        """Begin: watch both sockets, write the preamble if it goes out at once, and
        schedule the idle timeout. ``outcome`` may be set when it returns."""
        flow = self.flow
        if flow.closing:  # closed before it started
            self.outcome = CANCELLED
            return
        reactor = self.reactor
        reactor.add(self)
        self.registered = True
        flow._pump = self
        flow.last_activity = reactor.clock()
        # _update_interest() for the start, inline: both directions read.
        reactor.epoll.register(self.client_fd, _IN)
        self.client_mask = _IN
        reactor.epoll.register(self.server_fd, _IN)
        self.server_mask = _IN
        if self.initial:
            self._write_initial()
        if self.outcome is None:
            if flow._idle_timeout >= _DEFER_IDLE:
                self.reactor.defer(self)  # most connections end before it is armed
            else:
                self._arm()

    def finished(self) -> Awaitable[object]:
        """Wait for the outcome: ``await p.finished()`` right after ``start()``.

        A plain function returning trio's own wait, so the caller's frame is the only
        one of ours on an idle connection's stack. Cancelling the caller ends the pump
        (pipes and the reactor's set are cleaned up) and raises ``trio.Cancelled``.
        """
        if self.outcome is not None:
            return trio.lowlevel.checkpoint()
        self.task = trio.lowlevel.current_task()
        return trio.lowlevel.wait_task_rescheduled(self._abort)

    def _abort(self, _: object) -> trio.lowlevel.Abort:
        self.task = None
        self.close()
        return trio.lowlevel.Abort.SUCCEEDED

    def close(self) -> None:
        """End: stop watching, give back pipes and buffers; the sockets stay open
        unless the pump owns them (``close_sockets``). Safe to call more than once."""
        if self.flow._pump is self:
            self.flow._pump = None
        if self.alarm is not None:
            self._disarm()
        sockets = self.sockets
        if self.registered:
            self.registered = False
            self.reactor.remove(self, sockets is None)
        for d in (self.up, self.down):
            if d is not None:
                if d.fin_pending:  # ended within the batch that read this EOF
                    d.fin_pending = False
                    if sockets is None:  # else close() below sends it
                        with contextlib.suppress(OSError):
                            _shutdown_write(d.dst_fd)
                d.release()
        if sockets is not None:
            self.sockets = None
            client, server = sockets
            try:
                if type(client) is int:
                    os.close(client)
                else:
                    client.close()  # type: ignore[union-attr]  # not an int: a socket
            finally:
                if type(server) is int:
                    os.close(server)
                else:
                    server.close()  # type: ignore[union-attr]  # not an int: a socket

    def _finish(self) -> None:
        """The outcome is set: clean up and wake the task waiting in finished()."""
        self.close()
        task = self.task
        if task is not None:
            self.task = None
            if self.error is not None:
                trio.lowlevel.reschedule(task, outcome.Error(self.error))
            else:
                trio.lowlevel.reschedule(task)
        elif self.on_end is not None:
            on_end = self.on_end
            self.on_end = None
            try:
                on_end(self)
            except Exception as exc:  # the barrier: the end of one connection only
                record("connection_end", exc)

    # -- idle timeout and Flow.close() -------------------------------------------------
    #
    # No cancel scope: the idle deadline sits in the process-wide heap of deadlines.py,
    # whose task calls ring() when it passes. The byte path only stores last_activity,
    # so a busy connection's deadline is stale when it rings: a false alarm, answered by
    # scheduling the deadline again from the last activity, once per timeout period.

    def ring(self) -> None:
        """The idle deadline passed (called by the deadline heap's task)."""
        self.alarm = None  # it has rung: nothing left to cancel
        self.rearm()

    def rearm(self) -> None:
        """Idle long enough: end; else schedule the deadline from the last activity.

        Called when the deadline rings, and when the idle timeout (or last_activity)
        was changed from outside, so a change applies at once.
        """
        if self.outcome is not None:
            return
        if self.reactor.clock() >= self.flow.last_activity + self.flow._idle_timeout:
            self._end(IDLE_TIMEOUT)
        else:
            self._arm()

    def cancel(self) -> None:
        """Flow.close(): end now with "cancelled"."""
        if self.outcome is None:
            self._end(CANCELLED)

    def _end(self, result: Outcome) -> None:
        self.outcome = result
        self._finish()

    def _arm(self) -> None:
        if self.alarm is not None:
            self._disarm()
        when = self.flow.last_activity + self.flow._idle_timeout
        if when != math.inf:
            self.alarm = self.reactor.deadlines.at(when, self)

    def _disarm(self) -> None:
        alarm = self.alarm
        self.alarm = None
        if alarm is _DEFERRED:
            # Out of the sweep's set at once: an ended connection is not kept alive
            # until the next sweep (nor promoted to an older GC generation meanwhile).
            del self.reactor.young[self]
        elif alarm is not None:
            alarm.cancel()  # type: ignore[union-attr]  # not _DEFERRED (above): a Deadline

    # -- moving bytes ------------------------------------------------------------------

    def on_event(self, fd: int, events: int) -> None:
        """The reactor saw ``events`` on one of our sockets: move what can be moved."""
        # The client socket is read by `up` and written by `down`; the server socket the
        # other way round.
        if fd == self.client_fd:
            reader, writer = self.up, self.down
        else:
            reader, writer = self.down, self.up
        assert reader is not None and writer is not None
        watched = False
        if reader.state == _READING and events & _IN_OR_FAILED:
            watched = True
            status = reader.move()
            if status:
                self._after(reader, status)
        if writer.state == _WRITING and events & _OUT_OR_FAILED:
            watched = True
            if self.outcome is None:
                self._after(writer, writer.write_out())
        elif writer.state == _HELD and events & _OUT_OR_FAILED:
            watched = True
            self._write_initial()
        if not watched and events & _FAILED:
            self._unwatched_event(fd, fd == self.client_fd)
        if self.outcome is not None:
            self._finish()

    def crashed(self, exc: BaseException) -> None:
        """A bug met while handling an event: end this connection, raise it to its task."""
        if self.outcome is None:
            self.outcome = ERROR
            self.error = exc
            self._finish()

    def _after(self, d: _Direction, status: int) -> None:
        """Act on what a direction's move() or write_out() reported."""
        if status == _MOVED:
            if d.state == _WRITING:  # a blocked chunk went out: read again
                d.state = _READING
                self._update_interest()
        elif status == _BLOCKED:
            if d.state == _READING:  # stop reading until dst takes the chunk
                d.state = _WRITING
                self._update_interest()
        elif status == _EOF:
            self._pass_fin(d)
        elif status == _SOURCE_FAILED:
            exc = d.error
            assert exc is not None
            self._failed(d.to_server, exc)
        else:
            assert d.error is not None
            self._failed(not d.to_server, d.error)

    def _unwatched_event(self, fd: int, client_side: bool) -> None:
        """An error or hang-up on a socket no direction is watching right now."""
        code = _socket_error(fd)
        if code:  # a reset after its side half-closed: end now, not at the idle timeout
            self._failed(client_side, OSError(code, os.strerror(code)))
            return
        # A hang-up without an error: both halves are shut (we passed a FIN to it and it
        # sent its own), yet bytes it sent before its FIN may still wait to be read
        # while the other way is blocked. Not a failure; but a level-triggered hang-up
        # is reported on every poll, so stop watching the socket until a direction
        # needs it again (_update_interest adds it back).
        self.reactor.epoll.unregister(fd)
        if client_side:
            self.client_mask = _UNWATCHED
        else:
            self.server_mask = _UNWATCHED

    def _pass_fin(self, d: _Direction) -> None:
        """The source sent FIN: pass it on as a half-close; the other way stays open.

        The shutdown waits for the end of the reactor's batch (``send_fin``, a few
        microseconds later): when the other side's FIN is in the same batch -- a client
        and a server closing at about the same time, as HTTP clients and servers do --
        both directions are finished, the connection ends, and a pump that closes the
        sockets (``close_sockets``) lets close(2) send both FINs, with no shutdown at
        all. Otherwise the FIN goes out as a half-close, as before.
        """
        d.state = _DONE
        self.open_directions -= 1
        if self.open_directions == 0:
            if self.sockets is None:  # else close() sends it, when the pump ends now
                try:
                    _shutdown_write(d.dst_fd)
                except OSError as exc:  # ENOTCONN: dst was reset meanwhile
                    self._failed(not d.to_server, exc)
                    return
            self.outcome = CLOSED
            return
        # The source is no longer read either (EOF stays readable), from the end of the
        # batch too (send_fin): this batch's events are already in hand, so nothing
        # reads it meanwhile, and a connection both of whose FINs are in the batch
        # saves the epoll_ctl.
        self.flow.last_activity = self.reactor.clock()
        d.fin_pending = True
        self.reactor.fins.append((self, d))

    def send_fin(self, d: _Direction) -> None:
        """Pass on a FIN read earlier in this batch (the reactor calls it at its end)."""
        if not d.fin_pending:  # the pump ended meanwhile: close() dealt with it
            return
        d.fin_pending = False
        try:
            _shutdown_write(d.dst_fd)
        except OSError as exc:  # ENOTCONN: dst was reset meanwhile
            self._failed(not d.to_server, exc)
            self._finish()
            return
        self._update_interest()

    def _update_interest(self) -> None:
        up, down = self.up, self.down
        assert up is not None and down is not None
        client = (_IN if up.state == _READING else 0) | (_OUT if down.state == _WRITING else 0)
        server = (_IN if down.state == _READING else 0) | (
            _OUT if up.state == _WRITING or up.state == _HELD else 0
        )
        if client != self.client_mask:
            self.client_mask = self._watch(self.client_fd, client, self.client_mask)
        if server != self.server_mask:
            self.server_mask = self._watch(self.server_fd, server, self.server_mask)

    def _watch(self, fd: int, mask: int, current: int) -> int:
        if current != _UNWATCHED:
            self.reactor.epoll.modify(fd, mask)
        elif mask:
            self.reactor.epoll.register(fd, mask)
        else:
            return _UNWATCHED  # nothing wanted: no need to add it back yet
        return mask

    def _failed(self, client_side: bool, exc: OSError) -> None:
        if exc.errno in _RESET_ERRNOS:
            self.outcome = CLIENT_RESET if client_side else SERVER_RESET
        else:
            self.outcome = ERROR
        self.flow.error = exc

    def _write_initial(self) -> None:
        """Write ``initial`` to the server before any client byte goes that way. Not a
        hot path: once per connection at most, and it almost never has to wait."""
        up = self.up
        assert up is not None
        flow = self.flow
        while self.initial:
            try:
                n = os.write(self.server_fd, self.initial)
            except BlockingIOError:
                if up.state != _HELD:  # wait for the server socket, read no client byte
                    up.state = _HELD
                    self._update_interest()
                return
            except OSError as exc:
                self._failed(False, exc)
                return
            self.initial = self.initial[n:]
            counted = n - self.initial_uncounted
            self.initial_uncounted = max(0, -counted)
            if counted > 0:
                flow.bytes_in += counted
            flow.last_activity = self.reactor.clock()
        if up.state == _HELD:
            up.state = _READING
            self._update_interest()


class EventReader(Protocol):
    """A reader of the reactor's epoll set other than a pump: a listening socket whose
    accepts share the reactor's wait (net/accept.py's ReactorAcceptor). Called in the
    batch, like a pump; it must not block, and handles its own errors (`crashed` is the
    barrier's last resort, and must not raise)."""

    def on_event(self, fd: int, events: int) -> None: ...

    def crashed(self, exc: BaseException) -> None: ...


class _Reactor:
    """One shared epoll set for every pump of a trio run, and what serves it.

    A batch handles every socket that became ready since the last one (up to
    MAX_EVENTS, each at most _BURST chunks). Batches run in trio's loop itself
    (net/trio_wait.py): one before each of trio's I/O checks, and, when trio has nothing
    to run, in trio's place -- one epoll_wait on this set, which then also holds trio's
    own descriptor -- so an idle-to-busy wake-up costs no trio round. Where trio's
    internals are not the expected ones, or after a batch has failed, the reactor's
    task serves the set instead: each of its wake-ups pays trio's cost per wait (an
    ``epoll_ctl`` to re-arm, parking and rescheduling, ~7 us) once per batch, not once
    per chunk per connection, and other tasks run between its wake-ups.
    """

    MAX_EVENTS = 256
    # When its task serves the set: after a batch that had events, poll again at once,
    # up to REPOLL_ROUNDS batches per wake-up: under load the next events are there
    # already (the peers on the other core answered meanwhile), and an empty
    # epoll_wait(0) costs well under a microsecond where a trio round (re-arming the
    # epoll descriptor, parking, rescheduling, the scheduler's loop) costs several.
    # Keep-alive load, strace -c (issue 26): trio's epoll_ctl per request 0.051 ->
    # 0.019. Bounded, so other tasks still run at least every REPOLL_ROUNDS batches.
    REPOLL_ROUNDS = 4

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.epfd = self.epoll.fileno()  # for the C pumps (_cpump.Pump)
        # The run's clock, read directly: trio.current_time() is three Python frames, and
        # the byte path reads the time once per chunk (Flow.last_activity).
        self.clock: Callable[[], float] = trio.lowlevel.current_clock().current_time
        self.deadlines = deadlines()
        # Pumps started since the last sweep whose idle deadline is not armed yet (see
        # defer); the sweep's own deadline is armed while there are any.
        self.young: dict[Pump, None] = {}
        self.sweeping = False  # the sweep's deadline is armed
        # Who reads each descriptor of the set: a pump (both of its sockets), or a
        # listening socket's acceptor (listen()).
        self.pumps: dict[int, Pump | EventReader] = {}
        # FINs read in this batch, passed on at its end (Pump._pass_fin).
        self.fins: list[tuple[Pump, _Direction]] = []
        trio.lowlevel.spawn_system_task(self._run, name="lbproxy pump reactor")

    def add(self, p: Pump) -> None:
        self.pumps[p.client_fd] = p
        self.pumps[p.server_fd] = p

    def defer(self, p: Pump) -> None:
        """Arm `p`'s idle deadline at the next sweep (within _SWEEP seconds), not now.

        An entry in the deadline heap costs a handle, a heap push and, once the
        connection has ended, its share of the heap's compaction; most connections end
        long before their idle timeout (an HTTP exchange, in a millisecond or so), so
        the entry would only ever be cancelled. A sweep arms the deadlines of those
        still open, computed as always from their last activity, so a deadline never
        rings early, and not late either: only timeouts of at least _DEFER_IDLE (far
        more than _SWEEP) are deferred.
        """
        p.alarm = _DEFERRED
        young = self.young
        young[p] = None  # taken out again when p's alarm is disarmed (Pump._disarm)
        if not self.sweeping:
            self.sweeping = True
            self.deadlines.at(self.clock() + _SWEEP, self)

    def ring(self) -> None:
        """The sweep (the deadline heap calls it): arm the deferred idle deadlines."""
        young, self.young = self.young, {}
        self.sweeping = False
        for p in young:  # all still open and deferred: Pump._disarm takes them out
            p.alarm = None
            p._arm()

    def remove(self, p: Pump, unregister: bool = True) -> None:
        """Forget `p`; ``unregister=False``: its sockets are about to be closed, which
        takes them out of the epoll set."""
        pumps = self.pumps
        if not unregister:  # the usual case (close_sockets), without the loop
            if pumps.get(p.client_fd) is p:  # the caller may have closed and reused it
                del pumps[p.client_fd]
            if pumps.get(p.server_fd) is p:
                del pumps[p.server_fd]
            return
        for fd, mask in ((p.client_fd, p.client_mask), (p.server_fd, p.server_mask)):
            if self.pumps.get(fd) is p:  # the caller may have closed and reused the fd
                del self.pumps[fd]
                if mask != _UNWATCHED and unregister:
                    with contextlib.suppress(OSError):  # closed already: gone from the set
                        self.epoll.unregister(fd)

    def listen(self, fd: int, reader: EventReader) -> None:
        """Add a listening socket to the set: `reader.on_event(fd, events)` in the batches
        whenever it is readable (level-triggered: a backlog left over is reported again
        in the next batch). The owner must call unlisten() before it closes `fd`: a
        socket whose file is still open elsewhere (a worker's, shared with the
        supervisor; systemd's) would stay in the set after close(2)."""
        self.epoll.register(fd, _IN)
        self.pumps[fd] = reader

    def unlisten(self, fd: int, reader: EventReader) -> None:
        """Take `fd` out of the set again (before it is closed); idempotent."""
        if self.pumps.get(fd) is reader:
            del self.pumps[fd]
            with contextlib.suppress(OSError):  # closed already: gone from the set
                self.epoll.unregister(fd)

    async def _run(self) -> None:
        # One batch: the C one (lbproxy/net/_cpump.c; a partial, no Python frame) or the
        # same in Python; either leaves the FINs it read to _send_fins.
        batch: Callable[[int], int] = (
            functools.partial(cpump.dispatch, self.epfd, self.pumps, self.MAX_EVENTS, self._crashed)
            if cpump is not None
            else self._pure_batch
        )
        fins, send_fins = self.fins, self._send_fins
        compiled_wait = (
            functools.partial(cpump.wait, self.epfd, self.pumps, self.MAX_EVENTS, self._crashed)
            if cpump is not None
            else None
        )
        # Served by trio's loop in its own wait (net/trio_wait.py), or else by this task.
        waiter = trio_wait.install(batch, fins, send_fins, self.epoll, self.pumps, compiled_wait)
        try:
            if waiter is not None:
                try:
                    await waiter.parked()  # returns only if the hook gave the set back
                except Exception as exc:  # a batch raised past the per-connection barrier
                    record("pump", exc, "a reactor batch (its task serves the set from now on)")
            epfd, rounds = self.epfd, self.REPOLL_ROUNDS
            while True:
                await wait_readable(epfd)
                for _ in range(rounds):
                    n = batch(0)
                    if fins:
                        send_fins()
                    if not n:
                        break
        finally:  # the run is over (system tasks are cancelled last)
            if waiter is not None:
                waiter.close()  # before the set it reads is closed
            trio.lowlevel.notify_closing(self.epfd)
            self.epoll.close()

    def _pure_batch(self, timeout_ms: int) -> int:
        """One batch: wait up to `timeout_ms` (0: not at all) and handle what is ready
        (cpump.dispatch in Python); the FINs it read are left in self.fins."""
        ready = self.epoll.poll(timeout_ms / 1000.0, self.MAX_EVENTS)
        pumps = self.pumps
        for fd, events in ready:
            p = pumps.get(fd)
            if p is None:  # ended earlier in this batch
                continue
            try:
                p.on_event(fd, events)
            except Exception as exc:  # a bug: end that connection, not the reactor
                self._crashed(p, exc)
        return len(ready)

    def _send_fins(self) -> None:
        fins = self.fins.copy()
        self.fins.clear()
        for p, d in fins:
            try:
                p.send_fin(d)
            except Exception as exc:  # a bug: end that connection, not the reactor
                self._crashed(p, exc)

    def _crashed(self, p: Pump | EventReader, exc: Exception) -> None:
        """The barrier: a bug met handling `p`'s events ends `p` (counted, logged)."""
        record("pump", exc)
        try:
            p.crashed(exc)
        except Exception as again:  # its clean-up failed too: forget it, keep serving
            record("pump", again, "ending the connection")
            if isinstance(p, Pump):
                self.remove(p)


_reactors: trio.lowlevel.RunVar[_Reactor] = trio.lowlevel.RunVar("lbproxy_reactor")


def _splice_refused(exc: OSError) -> None:
    """A direction met a socket the kernel cannot splice (EINVAL or ENOSYS on its first
    splice; nothing was read): it copies from now on, and so does every later pump."""
    global splice_enabled
    if splice_enabled:
        log.warning("splice(2) refused (%s); copying with read/write", exc)
        splice_enabled = False


def new_pump(
    client: SocketType | socket.socket | int,
    server: SocketType | socket.socket | int,
    flow: Flow,
    *,
    preamble: bytes = b"",
    initial_client_bytes: bytes = b"",
    use_splice: bool | None = None,
    close_sockets: bool = False,
) -> Pump:
    """A pump for one connection: the C one (``_cpump.Pump``: the same state machine,
    attributes and methods as :class:`Pump`, the same splice-auto policy, one object, no
    Python frame until ``on_end``) when the compiled path runs, else a :class:`Pump`.
    Same arguments as :class:`Pump`."""
    if use_splice is None:
        use_splice = splice_enabled
    if cpump is not None:
        c: Pump = cpump.Pump(
            client,
            server,
            flow,
            preamble + initial_client_bytes,
            len(preamble),
            close_sockets,
            bool(use_splice) and hasattr(os, "splice"),
        )
        return c
    return Pump(
        client,
        server,
        flow,
        preamble=preamble,
        initial_client_bytes=initial_client_bytes,
        use_splice=use_splice,
        close_sockets=close_sockets,
    )


if cpump is not None:
    # The C pump moves its chunks itself and reads the pool (and its bound, and the
    # helpers) from this module's globals; the constants must agree.
    assert (cpump.READING, cpump.WRITING, cpump.HELD) == (_READING, _WRITING, _HELD)
    assert (cpump.BLOCKED, cpump.EOF, cpump.SOURCE_FAILED, cpump.DESTINATION_FAILED) == (
        _BLOCKED,
        _EOF,
        _SOURCE_FAILED,
        _DESTINATION_FAILED,
    )
    assert (cpump.BURST, cpump.BIG_CHUNK, cpump.SPLICE_CHUNK, cpump.COPY_CHUNK) == (
        _BURST,
        _BIG_CHUNK,
        _SPLICE_CHUNK,
        COPY_CHUNK,
    )
    assert _SPLICE_FLAGS == os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
    cpump.setup(globals(), _Direction, Pump)


def _reactor() -> _Reactor:
    """The run's reactor (made, with its task, on first use; _cpump.c calls it too)."""
    try:
        return _reactors.get()
    except LookupError:
        reactor = _Reactor()
        _reactors.set(reactor)
        return reactor


reactor = _reactor  # the public name (net/accept.py's acceptors)


async def pump(
    client: SocketType,
    server: SocketType,
    flow: Flow,
    *,
    preamble: bytes = b"",
    initial_client_bytes: bytes = b"",
    use_splice: bool | None = None,
) -> Outcome:
    """Copy bytes both ways between two connected TCP sockets until both are finished.

    ``preamble`` (a PROXY header for the real server) and then ``initial_client_bytes``
    (bytes that arrived behind the client's own PROXY header) are written to the server
    before anything else goes that way; only the latter count in ``flow.bytes_in``.

    ``use_splice``: None follows the module (:func:`splice_available`), False copies
    every chunk, True splices bulk chunks (copying all if splice is missing).

    Returns the outcome (see the module docstring). The caller closes both sockets
    afterwards. Raises ``trio.Cancelled`` if the caller's scope is cancelled.
    """
    p = new_pump(
        client,
        server,
        flow,
        preamble=preamble,
        initial_client_bytes=initial_client_bytes,
        use_splice=use_splice,
    )
    if type(p) is not Pump:  # the C pump: woken by its on_end
        return await _pump_c(p)
    try:
        p.start()
        await p.finished()
    finally:
        p.close()
    assert p.outcome is not None
    return p.outcome


async def _pump_c(p: Pump) -> Outcome:
    """pump() with a C pump: ``finished()`` is its ``on_end``, which wakes this task."""
    task = trio.lowlevel.current_task()

    def ended(_: Pump) -> None:
        error = p.error
        trio.lowlevel.reschedule(
            task, outcome.Value(None) if error is None else outcome.Error(error)
        )

    def abort(_: object) -> trio.lowlevel.Abort:
        p.on_end = None
        p.close()
        return trio.lowlevel.Abort.SUCCEEDED

    p.on_end = ended
    try:
        p.start()
        if p.outcome is None:
            await trio.lowlevel.wait_task_rescheduled(abort)
        else:
            await trio.lowlevel.checkpoint()
    finally:
        p.on_end = None
        p.close()
    assert p.outcome is not None
    return p.outcome
