"""The byte pump: copy a client and a real-server TCP socket into each other.

This module owns everything between "both sockets are connected" and "both directions
are finished" (SPEC section 4): the two copy loops, the half-close hand-over, the idle
timeout and the pipe pool behind splice(2). It does not own the sockets: the caller
closes both after :func:`pump` returns, whatever it returns.

How it works
------------
One task per direction, in a nursery whose body is the idle watchdog. A direction is a
plain loop: wait until the source is readable, move one chunk into an intermediate
(a pipe for splice, a buffer for the fallback), write that chunk out completely, repeat.
Because a chunk is always written out before the next read, a direction never needs a
buffer or pipe while it is waiting for its source, so it borrows one from a module pool
per chunk and gives it back at once. An idle connection -- most of them, on a busy
proxy -- holds no pipe and no buffer, and the number of pipes in use is the number of
directions actually blocked on a slow reader, not twice the number of connections
(HAProxy's pipe pool makes the same choice: a pipe is taken when splicing starts and
released as soon as it is empty). This matters for file descriptors (a pipe is two) and
for the kernel's per-user pipe budget (``/proc/sys/fs/pipe-user-pages-soft``: beyond it
new pipes shrink to a page or two).

Splice moves socket -> pipe -> socket inside the kernel (zero copy). The fallback, used
where ``os.splice`` is missing, where the kernel refuses the first splice with EINVAL or
ENOSYS, or when the caller forces it, does ``recv_into``/``send`` with the same waits.

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

On a reset or error the other direction is cancelled at once and pump returns, so the
caller's close() reaches the other peer without delay. The other side gets an orderly
close, not a reset: data already handed to its kernel buffer (the last part of a
response, say) still arrives, which an RST would throw away. If the caller's own scope
is cancelled, pump raises ``trio.Cancelled`` like any trio call; pipes are cleaned up
either way. Unexpected exceptions (bugs) propagate as an exception group.

A known limit: once one direction has finished, a reset on its (half-closed) source is
only noticed when the other direction next touches that socket, or by the idle timeout.
Watching a socket that has delivered EOF would wake epoll on every loop (EOF is always
"readable"), so we let the idle timeout bound that case, as the SPEC asks.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import socket
from typing import TYPE_CHECKING, Final, Literal

try:
    import fcntl
except ImportError:  # not POSIX: no pipes to size, and no splice either
    fcntl = None  # type: ignore[assignment]

import trio
from trio.lowlevel import wait_readable, wait_writable

if TYPE_CHECKING:
    from trio.socket import SocketType

__all__ = [
    "CLIENT_RESET",
    "CLOSED",
    "ERROR",
    "IDLE_TIMEOUT",
    "SERVER_RESET",
    "Flow",
    "Outcome",
    "close_idle_pipes",
    "pump",
    "splice_available",
]

log = logging.getLogger("lbproxy.pump")

Outcome = Literal["closed", "idle_timeout", "client_reset", "server_reset", "error"]
CLOSED: Final = "closed"
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

#: Splice is used when this is true (and the kernel agrees). Set it to False to force the
#: receive/send fallback for every later pump; it is also cleared, once, when the kernel
#: refuses splice on a TCP socket.
splice_enabled: bool = hasattr(os, "splice")

_SPLICE_FLAGS: Final = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)

#: Pipe capacity asked for with F_SETPIPE_SZ (the kernel default is 64 KiB). Measured with
#: scripts/pump_bench.py on loopback: 64 KiB pipes cost ~0.75 CPU-s/GB in this process,
#: 128 KiB ~0.48, 256 KiB no better than 128. Bigger is not free: every pipe, pooled or
#: busy, counts against the user's /proc/sys/fs/pipe-user-pages-soft (16384 pages by
#: default); past it the kernel hands out 2-page pipes and refuses F_SETPIPE_SZ (EPERM,
#: which we ignore: a small pipe still works, only slower). At 128 KiB, 512 pipes fit.
PIPE_SIZE: int = 1 << 17
#: Idle pipes kept for reuse; more are closed. An idle pipe costs two fds and its share of
#: the pipe budget above (128 x 32 pages = a quarter of the default), no memory.
MAX_IDLE_PIPES: int = 128
#: Fallback buffer size, and how many idle buffers to keep (256 KiB each).
BUFFER_SIZE: int = 1 << 18
MAX_IDLE_BUFFERS: int = 64

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
_idle_buffers: list[memoryview] = []


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
                       effect at once: the watchdog is woken to recompute its deadline
                       (the admission-control monitor shortens it under load). A value
                       already exceeded by the current idle time ends the pump at once.
    ``last_activity``  ``trio.current_time()`` of the last byte written either way (or of
                       the start of pump, or of a FIN passed on).
    ``error``          the OSError behind a ``*_reset`` or ``error`` outcome, else None.
    """

    __slots__ = ("_alarm", "_idle_timeout", "bytes_in", "bytes_out", "error", "last_activity")

    def __init__(self, idle_timeout: float = math.inf) -> None:
        self.bytes_in = 0
        self.bytes_out = 0
        self.error: OSError | None = None
        self.last_activity = 0.0
        self._alarm: trio.CancelScope | None = None
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

    def poke(self) -> None:
        """Make a sleeping watchdog re-read ``last_activity`` and ``idle_timeout`` now.

        Assigning ``idle_timeout`` already does this; call it only after changing
        ``last_activity`` by hand. Safe to call at any time, from any trio task.
        """
        if self._alarm is not None:
            self._alarm.cancel()

    def __repr__(self) -> str:
        return (
            f"Flow(bytes_in={self.bytes_in}, bytes_out={self.bytes_out}, "
            f"idle_timeout={self._idle_timeout})"
        )


# --------------------------------------------------------------------------- pump


class _Session:
    """One pump call's shared state: which directions are still open, how it ended."""

    __slots__ = ("cancel_scope", "done", "flow", "open_directions", "outcome")

    def __init__(self, flow: Flow) -> None:
        self.flow = flow
        self.open_directions = 2
        self.outcome: Outcome | None = None
        self.cancel_scope: trio.CancelScope | None = None
        self.done = trio.Event()  # set when both directions finished normally

    def direction_done(self) -> None:
        self.open_directions -= 1
        if self.open_directions == 0:
            # A normal end cancels nothing: the watchdog (waiting on `done`) returns and
            # the nursery closes. Cancelling a scope costs trio 0.35 a CancelReason with
            # two reprs and a Cancelled raised through the frames (~35 us per scope).
            if self.outcome is None:
                self.outcome = CLOSED
            self.done.set()

    def failed(self, client_side: bool, exc: OSError) -> None:
        if exc.errno in _RESET_ERRNOS:
            outcome: Outcome = CLIENT_RESET if client_side else SERVER_RESET
        else:
            outcome = ERROR
        if self.outcome is None:
            self.flow.error = exc
        self.end(outcome)

    def end(self, outcome: Outcome) -> None:
        # The first reason wins: once one side reset, the other direction's Cancelled
        # or follow-up EPIPE is a consequence, not news.
        if self.outcome is None:
            self.outcome = outcome
        assert self.cancel_scope is not None
        self.cancel_scope.cancel()


async def pump(
    client: SocketType,
    server: SocketType,
    flow: Flow,
    *,
    initial_client_bytes: bytes = b"",
    use_splice: bool | None = None,
) -> Outcome:
    """Copy bytes both ways between two connected TCP sockets until both are finished.

    ``initial_client_bytes`` are written to the server before anything else goes that
    way (bytes that arrived behind a PROXY header) and count in ``flow.bytes_in``. A
    PROXY header for the real server is not client data: the caller sends it itself
    (``await server.send(header)``) before calling pump.

    ``use_splice``: None follows the module (:func:`splice_available`), False forces the
    receive/send fallback, True asks for splice (still falling back if it is missing).

    Returns the outcome (see the module docstring). The caller closes both sockets
    afterwards. Raises ``trio.Cancelled`` if the caller's scope is cancelled.
    """
    if use_splice is None:
        use_splice = splice_enabled
    copy = _splice_copy if use_splice and hasattr(os, "splice") else _buffer_copy
    session = _Session(flow)
    flow.last_activity = trio.current_time()
    async with trio.open_nursery() as nursery:
        session.cancel_scope = nursery.cancel_scope
        nursery.start_soon(copy, session, client, server, True, initial_client_bytes)
        nursery.start_soon(copy, session, server, client, False, b"")
        # The watchdog runs in the nursery body: it returns only on an idle timeout; a
        # finished or failed pump cancels it with the rest of the nursery.
        await _watchdog(flow, session)
        if session.outcome is None:  # the idle timeout, not a normal end
            session.end(IDLE_TIMEOUT)
    assert session.outcome is not None
    return session.outcome


async def _watchdog(flow: Flow, session: _Session) -> None:
    """Return once nothing has moved for ``flow.idle_timeout`` seconds.

    The copy loops only store ``flow.last_activity = trio.current_time()`` per write; this
    task sleeps until ``last_activity + idle_timeout`` and, if something moved meanwhile,
    sleeps again until the new deadline, so it wakes about once per timeout period on a
    busy connection. The alternative, moving a cancel scope's deadline per chunk, costs
    ~1.8 us per update (trio re-queues the deadline in its heap) against ~0.15 us for
    current_time() (measured with trio 0.35 on a 2-core Linux box; a 128 KiB chunk
    costs tens of us in the kernel). A bare counter per chunk would be cheaper still but
    inexact: the watchdog could only tell "something moved since I last looked", so a
    timeout would fire anywhere between 1x and 2x idle_timeout. With the timestamp it
    fires at last_activity + idle_timeout. Flow.poke() cancels the current sleep so a
    changed timeout is applied at once.
    """
    while session.outcome is None:
        deadline = flow.last_activity + flow._idle_timeout
        if trio.current_time() >= deadline:
            return
        with trio.CancelScope(deadline=deadline) as alarm:
            flow._alarm = alarm
            try:
                await session.done.wait()
            finally:
                flow._alarm = None


async def _send_initial(session: _Session, dst: SocketType, data: bytes, to_server: bool) -> bool:
    """Write ``data`` to ``dst`` before the copy loop starts. Not a hot path: one call
    per connection at most. Works on trio and plain (non-blocking) sockets alike: a
    write(2) on the descriptor, waiting only on EAGAIN. False on failure."""
    flow = session.flow
    view = memoryview(data)
    fd = dst.fileno()
    try:
        while view:
            try:
                n = os.write(fd, view)
            except BlockingIOError:
                await wait_writable(fd)
                continue
            view = view[n:]
            if to_server:
                flow.bytes_in += n
            else:
                flow.bytes_out += n
            flow.last_activity = trio.current_time()
    except OSError as exc:
        session.failed(client_side=not to_server, exc=exc)
        return False
    return True


def _pass_fin(session: _Session, dst: SocketType, to_server: bool) -> None:
    """The source sent FIN: pass it on as a half-close; the other way stays open."""
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError as exc:  # ENOTCONN: dst was reset meanwhile
        session.failed(client_side=not to_server, exc=exc)
        return
    session.flow.last_activity = trio.current_time()
    session.direction_done()


async def _splice_copy(
    session: _Session, src: SocketType, dst: SocketType, to_server: bool, initial: bytes
) -> None:
    """One direction through a pooled pipe: src -> pipe -> dst, until EOF or error.

    ``to_server`` says which way this is (client -> server when true), for the counter
    and for blaming the right side when a socket fails.
    """
    global splice_enabled
    if initial and not await _send_initial(session, dst, initial, to_server):
        return
    flow = session.flow
    src_fd = src.fileno()
    dst_fd = dst.fileno()
    # Locals: each global/attribute lookup costs on a loop that runs per chunk.
    splice = os.splice
    flags = _SPLICE_FLAGS
    now = trio.current_time
    idle_pipes = _idle_pipes
    first = True
    pipe: tuple[int, int] | None = None
    pending = 0  # bytes in `pipe` not yet written to dst
    try:
        while True:
            # Wait first, then read: trio's wait_readable is also our checkpoint (so one
            # busy connection cannot starve the others) and a cancellation point. Reading
            # optimistically and adding a checkpoint() would save ~2.5 us per chunk
            # (6.2 vs 3.6 us measured), 2-3% of a 128 KiB chunk here: not worth a second
            # code path.
            await wait_readable(src_fd)
            pipe = idle_pipes.pop() if idle_pipes else _new_pipe()
            try:
                pending = splice(src_fd, pipe[1], _SPLICE_CHUNK, flags=flags)
            except BlockingIOError:
                # Spurious wakeup (readiness can be stale by the time we read): the pipe
                # is still empty, give it back and wait again.
                _put_pipe(pipe)
                pipe = None
                continue
            except OSError as exc:
                _put_pipe(pipe)  # nothing was moved into it
                pipe = None
                if first and exc.errno in (errno.EINVAL, errno.ENOSYS):
                    # The kernel cannot splice this socket. Nothing was consumed, so the
                    # fallback can take over this direction, and later pumps skip splice.
                    if splice_enabled:
                        log.warning("splice(2) refused (%s); using recv/send", exc)
                        splice_enabled = False
                    await _buffer_copy(session, src, dst, to_server, b"")
                    return
                session.failed(client_side=to_server, exc=exc)
                return
            first = False
            if pending == 0:  # EOF: the source sent FIN
                _put_pipe(pipe)
                pipe = None
                _pass_fin(session, dst, to_server)
                return
            while True:
                try:
                    n = splice(pipe[0], dst_fd, pending, flags=flags)
                except BlockingIOError:
                    # dst's send buffer is full (or a spurious wakeup): wait, retry.
                    await wait_writable(dst_fd)
                    continue
                except OSError as exc:
                    session.failed(client_side=not to_server, exc=exc)
                    return  # the finally discards the pipe, which still holds bytes
                # Partial writes are normal: loop until the pipe is empty.
                pending -= n
                if to_server:
                    flow.bytes_in += n
                else:
                    flow.bytes_out += n
                flow.last_activity = now()
                if not pending:
                    break
            # Empty again: back to the pool, so an idle connection holds no pipe.
            if len(idle_pipes) < MAX_IDLE_PIPES:
                idle_pipes.append(pipe)
            else:
                _discard_pipe(pipe)
            pipe = None
    finally:
        # Cancelled (or failed) while holding a pipe: reuse it only if it is empty.
        if pipe is not None:
            if pending:
                _discard_pipe(pipe)
            else:
                _put_pipe(pipe)


async def _buffer_copy(
    session: _Session, src: SocketType, dst: SocketType, to_server: bool, initial: bytes
) -> None:
    """One direction through a pooled buffer: recv_into, then send until all is out.

    The same loop as :func:`_splice_copy` with a user-space buffer. It calls the
    stdlib socket methods directly on non-blocking views of the two descriptors
    (trio's SocketType has no synchronous recv/send), so each chunk costs exactly one
    recv and one send system call, plus a wait only when the kernel says EAGAIN.
    """
    if initial and not await _send_initial(session, dst, initial, to_server):
        return
    flow = session.flow
    src_fd = src.fileno()
    dst_fd = dst.fileno()
    now = trio.current_time
    idle_buffers = _idle_buffers
    # Views over the caller's descriptors. detach() in the finally gives them back
    # without closing them; the caller owns and closes the real sockets.
    rsock = socket.socket(src.family, src.type, src.proto, src_fd)
    try:
        wsock = socket.socket(dst.family, dst.type, dst.proto, dst_fd)
    except BaseException:
        rsock.detach()
        raise
    buf: memoryview | None = None
    try:
        rsock.setblocking(False)  # already O_NONBLOCK; this makes Python treat it so
        wsock.setblocking(False)
        recv_into = rsock.recv_into
        send = wsock.send
        while True:
            await wait_readable(src_fd)  # also our checkpoint, as in _splice_copy
            buf = idle_buffers.pop() if idle_buffers else memoryview(bytearray(BUFFER_SIZE))
            try:
                n = recv_into(buf)
            except BlockingIOError:
                idle_buffers.append(buf)  # spurious wakeup
                buf = None
                continue
            except OSError as exc:
                session.failed(client_side=to_server, exc=exc)
                return
            if n == 0:
                _pass_fin(session, dst, to_server)
                return
            sent = 0
            while sent < n:
                try:
                    # Slicing a memoryview allocates a small view object, never a copy
                    # of the payload.
                    m = send(buf[sent:n])
                except BlockingIOError:
                    await wait_writable(dst_fd)
                    continue
                except OSError as exc:
                    session.failed(client_side=not to_server, exc=exc)
                    return
                sent += m
                if to_server:
                    flow.bytes_in += m
                else:
                    flow.bytes_out += m
                flow.last_activity = now()
            if len(idle_buffers) < MAX_IDLE_BUFFERS:
                idle_buffers.append(buf)
            buf = None
    finally:
        # A buffer's stale contents are harmless (always overwritten before use), so
        # unlike a pipe it can go back to the pool whatever state we left it in.
        if buf is not None and len(idle_buffers) < MAX_IDLE_BUFFERS:
            idle_buffers.append(buf)
        rsock.detach()
        wsock.detach()
