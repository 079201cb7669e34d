"""The pump in pure Python: the API of the C one (lbproxy/net/_cpump.c), for
``LBPROXY_PURE=1`` and machines without a compiler.

Same calls, same outcomes, same counts (tests/integration/test_pump_differential.py
plays the same scripted peers against both): a `Reactor` per trio run holds one
level-triggered epoll set, the descriptors' owners, the pumps' idle deadlines (a heap
with lazy deletion) and the FINs a batch read; `Reactor.open` makes a `Pump`, which owns
its two descriptors and counts its bytes. What the C file does chunk for chunk is not
mirrored here: this is the plain way to move bytes between two non-blocking sockets, a
small state machine per direction (reading, or writing out a chunk its destination
refused: back-pressure).

It is an epoll reactor and not one task per direction because of the cost: a trio wait
per chunk per connection (a task per direction and a watchdog) costs several times the
CPU per keep-alive request and nearly twice per new connection (docs/benchmarks.md,
"How it got there").
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import math
import os
import select
import socket
from collections.abc import Callable
from typing import Final

try:
    import fcntl
except ImportError:  # not POSIX: no pipes to size, and no splice either
    fcntl = None  # type: ignore[assignment]  # None off POSIX: tested before use

__all__ = [
    "COPY_CHUNK",
    "MAX_IDLE_PIPES",
    "Pump",
    "Reactor",
    "close_idle_pipes",
    "idle_pipes",
    "set_splice",
    "splice_available",
]

#: splice-auto, as HAProxy's: a direction copies its chunks (one read, one write, no
#: pipe) until a read fills COPY_CHUNK, the sign of a bulk transfer; it splices from then on.
COPY_CHUNK: Final = 1 << 14
#: A spliced read asks for more than any pipe holds: it stops at what the pipe takes.
SPLICE_CHUNK: Final = 1 << 24
#: Chunks moved per readiness report at most, while they are big (BIG_CHUNK spliced,
#: COPY_CHUNK copied): reading the next now saves a wait; the bound keeps one busy
#: connection from holding the batch.
BURST: Final = 2
BIG_CHUNK: Final = 1 << 16
#: Pipe capacity asked for (F_SETPIPE_SZ) and idle pipes kept for reuse (more are closed).
PIPE_SIZE: Final = 1 << 17
MAX_IDLE_PIPES: Final = 128
#: Events handled per batch at most.
MAX_EVENTS: Final = 256

# "The peer went away": a reset, or a write after the peer closed.
_RESET_ERRNOS: Final = frozenset(
    {errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ECONNABORTED}
)
# splice(2) errors on a first read that mean "this socket cannot be spliced".
_NO_SPLICE: Final = frozenset({errno.EINVAL, errno.ENOSYS})
_SPLICE_FLAGS: Final = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", None) if fcntl is not None else None

_IN: Final = select.EPOLLIN
_OUT: Final = select.EPOLLOUT
_FAILED: Final = select.EPOLLERR | select.EPOLLHUP
_IN_OR_FAILED: Final = _IN | _FAILED
_OUT_OR_FAILED: Final = _OUT | _FAILED
_UNWATCHED: Final = -1

# A direction's state.
_READING: Final = 0  # its source is watched for input
_WRITING: Final = 1  # a chunk waits for its destination (its source is not read)
_DONE: Final = 2  # its source sent FIN, passed on
_HELD: Final = 3  # client -> server only: the initial bytes are not out yet

# What moving a chunk reports (_MOVED falsy: the usual case is one test).
_MOVED: Final = 0
_BLOCKED: Final = 1
_EOF: Final = 2
_SOURCE_FAILED: Final = 3
_DESTINATION_FAILED: Final = 4

# ----------------------------------------------------------------------- pipe pool

# Process-wide. Only empty pipes are put back (a pipe with bytes in it would hand one
# connection's data to another).
_idle_pipes: list[tuple[int, int]] = []
_splice_ok = hasattr(os, "splice")


def _new_pipe() -> tuple[int, int]:
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    if _F_SETPIPE_SZ is not None:
        with contextlib.suppress(OSError):  # EPERM over the user's pipe budget: smaller
            fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_SIZE)
    return r, w


def _give_pipe(pipe: tuple[int, int]) -> None:
    """An EMPTY pipe back to the pool (closed when the pool is full)."""
    if len(_idle_pipes) < MAX_IDLE_PIPES:
        _idle_pipes.append(pipe)
    else:
        _discard_pipe(pipe)


def _discard_pipe(pipe: tuple[int, int]) -> None:
    os.close(pipe[0])
    os.close(pipe[1])


def idle_pipes() -> list[tuple[int, int]]:
    """The pooled pipes' (read, write) descriptors (a copy)."""
    return list(_idle_pipes)


def close_idle_pipes() -> int:
    """Close every pooled pipe; how many there were."""
    n = len(_idle_pipes)
    while _idle_pipes:
        _discard_pipe(_idle_pipes.pop())
    return n


def splice_available() -> bool:
    """Whether a pump opened now with ``splice=True`` splices its bulk chunks."""
    return _splice_ok


def set_splice(on: bool) -> None:
    """Let pumps opened from now on splice (if os.splice exists), or not."""
    global _splice_ok
    _splice_ok = bool(on) and hasattr(os, "splice")


# ---------------------------------------------------------------------- a direction


class _Direction:
    """One way of a connection, src -> dst: reads a chunk, writes it out, and holds what
    dst refused (`chunk`, or the `pipe` it was spliced into) until dst takes it."""

    __slots__ = (
        "bulk",
        "chunk",
        "clock",
        "copy_only",
        "dst_fd",
        "err",
        "fin_pending",
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
        to_server: bool,
        copy_only: bool,
        clock: Callable[[], float],
    ) -> None:
        self.clock = clock  # the run's
        self.src_fd = src_fd
        self.dst_fd = dst_fd
        self.to_server = to_server
        self.copy_only = copy_only
        self.state = _READING
        self.fin_pending = False
        self.bulk = False
        self.spliced = False
        self.err: OSError | None = None
        self.pending = 0
        self.chunk: memoryview | None = None
        self.pipe: tuple[int, int] | None = None

    def move(self, p: Pump) -> int:
        """Read a chunk and write it out (as much as dst takes); after a big one (a bulk
        transfer: reading the next now saves a wait) the next, up to BURST chunks."""
        left = BURST
        while True:
            bulk = self.bulk
            # The one place a chunk's size is decided: what a copy takes, or a pipe.
            limit = SPLICE_CHUNK if bulk else COPY_CHUNK
            if not bulk:
                try:
                    data = os.read(self.src_fd, limit)
                except BlockingIOError:  # readiness can be stale by the time we read
                    return _MOVED
                except OSError as exc:
                    self.err = exc
                    return _SOURCE_FAILED
                n = len(data)
                if not n:
                    return _EOF
                if n == limit and not self.copy_only:
                    self.bulk = True  # a bulk transfer: spliced from the next read on
                try:
                    m = os.write(self.dst_fd, data)
                except BlockingIOError:
                    self.chunk = memoryview(data)
                    self.pending = n
                    return _BLOCKED
                except OSError as exc:
                    self.err = exc
                    return _DESTINATION_FAILED
                if self.to_server:
                    p.bytes_in += m
                else:
                    p.bytes_out += m
                p.last_activity = self.clock()
                if m < n:
                    self.chunk = memoryview(data)[m:]
                    self.pending = n - m
                    status = self.write_out(p)
                    if status:
                        return status
                left -= 1
                if not left or n < limit:
                    return _MOVED
                continue
            try:
                pipe = _idle_pipes.pop() if _idle_pipes else _new_pipe()
            except OSError as exc:  # EMFILE, ENFILE: no descriptor for a pipe
                self.err = exc
                return _SOURCE_FAILED
            try:
                n = os.splice(self.src_fd, pipe[1], limit, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                _give_pipe(pipe)
                return _MOVED
            except OSError as exc:
                _give_pipe(pipe)  # nothing was moved into it
                if not self.spliced and exc.errno in _NO_SPLICE:
                    # this socket cannot be spliced: copy it (the same read), and every
                    # later pump too
                    self.copy_only = True
                    self.bulk = False
                    p.reactor.refuse_splice(exc)
                    continue
                self.err = exc
                return _SOURCE_FAILED
            self.spliced = True
            if not n:
                _give_pipe(pipe)
                return _EOF
            self.pipe = pipe
            self.pending = n
            status = self.write_out(p)
            if status:
                return status
            left -= 1
            if not left or n < BIG_CHUNK:
                return _MOVED

    def write_out(self, p: Pump) -> int:
        """Write what dst has not taken yet: _MOVED once it all went, _BLOCKED, or
        _DESTINATION_FAILED."""
        dst = self.dst_fd
        pipe = self.pipe
        while self.pending:
            try:
                if pipe is None:
                    assert self.chunk is not None
                    n = os.write(dst, self.chunk)
                else:
                    n = os.splice(pipe[0], dst, self.pending, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                return _BLOCKED
            except OSError as exc:
                self.err = exc
                return _DESTINATION_FAILED
            self.pending -= n
            if pipe is None:
                self.chunk = self.chunk[n:]  # type: ignore[index]  # not None: above
            if self.to_server:
                p.bytes_in += n
            else:
                p.bytes_out += n
            p.last_activity = self.clock()
        self.chunk = None
        if pipe is not None:
            self.pipe = None
            _give_pipe(pipe)  # empty again: an idle connection holds no pipe
        return _MOVED

    def release(self) -> None:
        self.chunk = None
        pipe, self.pipe = self.pipe, None
        if pipe is not None:
            if self.pending:  # bytes left in it would go to another connection
                _discard_pipe(pipe)
            else:
                _give_pipe(pipe)


def _shutdown_write(fd: int) -> None:
    sock = socket.socket(-1, socket.SOCK_STREAM, 0, fd)
    try:
        sock.shutdown(socket.SHUT_WR)
    finally:
        sock.detach()


def _socket_error(fd: int) -> int:
    sock = socket.socket(-1, socket.SOCK_STREAM, 0, fd)
    try:
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    finally:
        sock.detach()


# -------------------------------------------------------------------------- the pump


class Pump:
    """One connection's pump (made by `Reactor.open`): both directions, the two
    descriptors it owns, its counters and idle timeout. Read-only but for
    ``idle_timeout``; ``close()`` ends it ("cancelled")."""

    __slots__ = (
        "_idle_timeout",
        "bytes_in",
        "bytes_out",
        "client_fd",
        "client_mask",
        "down",
        "ends_at",
        "error",
        "initial",
        "last_activity",
        "on_end",
        "open_directions",
        "outcome",
        "reactor",
        "seq",
        "server_fd",
        "server_mask",
        "uncounted",
        "up",
    )

    def __init__(
        self, reactor: Reactor, client_fd: int, server_fd: int, idle_timeout: float, now: float
    ) -> None:
        self.reactor = reactor
        self.client_fd = client_fd
        self.server_fd = server_fd
        self.bytes_in = 0
        self.bytes_out = 0
        self.last_activity = now
        self._idle_timeout = idle_timeout
        self.ends_at = math.inf  # the run's time its lifetime ends (max_duration)
        self.outcome: str | None = None
        self.error: BaseException | None = None
        self.on_end: Callable[[Pump], object] | None = None
        self.open_directions = 2
        self.client_mask = self.server_mask = _UNWATCHED
        self.seq = 0  # its live entry in the reactor's deadline heap (0: none)
        self.initial = b""
        self.uncounted = 0
        copy_only = not _splice_ok
        clock = reactor.clock
        self.up = _Direction(client_fd, server_fd, True, copy_only, clock)
        self.down = _Direction(server_fd, client_fd, False, copy_only, clock)

    @property
    def idle_timeout(self) -> float:
        return self._idle_timeout

    @idle_timeout.setter
    def idle_timeout(self, seconds: float) -> None:
        seconds = float(seconds)
        if math.isnan(seconds):
            raise ValueError("idle_timeout must be a number of seconds or math.inf")
        self._idle_timeout = seconds
        if self.outcome is not None:
            return
        due = self.last_activity + seconds
        if self.reactor.clock() >= due:  # idle that long already: now
            self._end("idle_timeout")
        else:
            self.reactor.arm(self, due)

    def close(self) -> None:
        """End it now, on purpose ("cancelled"); nothing once it has ended."""
        if self.outcome is None:
            self._end("cancelled")

    def __repr__(self) -> str:
        return (
            f"<Pump {self.client_fd}<->{self.server_fd} in={self.bytes_in} "
            f"out={self.bytes_out} outcome={self.outcome}>"
        )

    # -- the end -------------------------------------------------------------------------

    def _end(self, outcome: str) -> None:
        self.outcome = outcome
        self._finish()

    def _finish(self) -> None:
        """The outcome is set: out of the reactor, both descriptors closed (which also
        sends a FIN read in this batch), the pipes back; then on_end, once."""
        reactor = self.reactor
        reactor.forget(self)
        self.up.release()
        self.down.release()
        self.up.fin_pending = self.down.fin_pending = False
        try:
            os.close(self.client_fd)
        finally:
            os.close(self.server_fd)
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            try:
                on_end(self)
            except Exception as exc:  # the barrier: the end of one connection only
                reactor.record("connection_end", exc)

    def _crash(self, exc: Exception) -> None:
        """A bug met handling this pump: counted, and it ends with "error"."""
        self.reactor.record("pump", exc)
        if self.outcome is None:
            self.error = exc
            self._end("error")

    def _failed(self, client_side: bool, exc: OSError) -> None:
        if exc.errno in _RESET_ERRNOS:
            self.outcome = "client_reset" if client_side else "server_reset"
        else:
            self.outcome = "error"
        self.error = exc

    # -- moving bytes --------------------------------------------------------------------

    def _on_event(self, fd: int, events: int) -> None:
        client_side = fd == self.client_fd
        if client_side:
            reader = self.up
            writer = self.down
        else:
            reader = self.down
            writer = self.up
        watched = False
        if reader.state == _READING and events & _IN_OR_FAILED:
            watched = True
            status = reader.move(self)
            if status:
                self._after(reader, status)
        if writer.state == _WRITING and events & _OUT_OR_FAILED:
            watched = True
            if self.outcome is None:
                self._after(writer, writer.write_out(self))
        elif writer.state == _HELD and events & _OUT_OR_FAILED:
            watched = True
            self._write_initial()
        if not watched and events & _FAILED and self.outcome is None:
            self._unwatched_event(fd, client_side)
        if self.outcome is not None:
            self._finish()

    def _after(self, d: _Direction, status: int) -> None:
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
        elif status == _SOURCE_FAILED:  # its source's side: the client's for `up`
            assert d.err is not None
            self._failed(d.to_server, d.err)
        else:  # its destination's side
            assert d.err is not None
            self._failed(not d.to_server, d.err)

    def _pass_fin(self, d: _Direction) -> None:
        """d's source sent FIN: the last one ends the connection (closing the
        descriptors passes it on); an earlier one is passed on at the batch's end."""
        d.state = _DONE
        self.open_directions -= 1
        if not self.open_directions:
            self.outcome = "closed"
            return
        self.last_activity = self.reactor.clock()
        d.fin_pending = True
        self.reactor.fin_read(self, d)

    def send_fin(self, d: _Direction) -> None:
        """A FIN read in the batch, passed on at its end (a half-close)."""
        if not d.fin_pending or self.outcome is not None:
            return
        d.fin_pending = False
        try:
            _shutdown_write(d.dst_fd)
        except OSError as exc:  # ENOTCONN: reset meanwhile
            self._failed(not d.to_server, exc)
            self._finish()
            return
        self._update_interest()

    def _unwatched_event(self, fd: int, client_side: bool) -> None:
        """An error or hang-up on a descriptor no direction watches now."""
        code = _socket_error(fd)
        if code:  # a reset after its side half-closed: now, not at the idle timeout
            self._failed(client_side, OSError(code, os.strerror(code)))
            return
        # Both halves shut, with bytes perhaps still behind a blocked write: a
        # level-triggered hang-up is reported on every wait, so out of the set until a
        # direction needs it again.
        self.reactor.epoll.unregister(fd)
        if client_side:
            self.client_mask = _UNWATCHED
        else:
            self.server_mask = _UNWATCHED

    def _update_interest(self) -> None:
        up, down = self.up, self.down
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
            return _UNWATCHED
        return mask

    def _write_initial(self) -> None:
        """The initial bytes to the server before any client byte goes that way; the
        first `uncounted` are not client bytes."""
        up = self.up
        while self.initial:
            try:
                n = os.write(self.server_fd, self.initial)
            except BlockingIOError:
                if up.state != _HELD:  # wait for the server, read no client byte
                    up.state = _HELD
                    self._update_interest()
                return
            except OSError as exc:
                self._failed(False, exc)
                return
            self.initial = self.initial[n:]
            counted = n - self.uncounted
            self.uncounted = max(0, -counted)
            if counted > 0:
                self.bytes_in += counted
            self.last_activity = self.reactor.clock()
        if up.state == _HELD:
            up.state = _READING
            self._update_interest()


# ----------------------------------------------------------------------- the reactor


class Reactor:
    """One epoll set and the pumps in it, for one trio run (see lbproxy/net/reactor.py).

    `clock()` gives the run's time (`offset` is for the C one, which reads trio's clock
    itself); `record(where, exc)` counts a failure; `wake(when)`: the idle timer must
    ring by then; `splice_refused(exc)`: the kernel cannot splice (once per process).
    """

    def __init__(
        self,
        clock: Callable[[], float],
        offset: float | None,
        record: Callable[[str, BaseException], object],
        wake: Callable[[float], object],
        splice_refused: Callable[[OSError], object],
    ) -> None:
        self.clock = clock
        self.record = record
        self._wake = wake
        self._splice_refused = splice_refused
        self.epoll = select.epoll()
        # Who reads each descriptor of the set: a pump (both of its own), or a callback.
        self._pumps: dict[int, Pump] = {}
        self._callbacks: dict[int, Callable[[int, int], object]] = {}
        self._fins: list[tuple[Pump, _Direction]] = []
        self._in_batch = False
        # Idle deadlines: (due, sequence, pump); an entry whose pump ended or was armed
        # again is dead, dropped when it comes up or when the dead are the majority.
        self._heap: list[tuple[float, int, Pump]] = []
        self._sequence = itertools.count()
        self._dead = 0
        self._armed = math.inf  # when the idle timer rings next, as far as we know

    # -- pumps ---------------------------------------------------------------------------

    def open(
        self,
        client_fd: int,
        server_fd: int,
        initial: bytes,
        idle_timeout: float,
        on_end: Callable[[Pump], object] | None,
        uncounted: int = 0,
        splice: bool = True,
        max_duration: float = math.inf,
    ) -> Pump:
        """A pump on two connected non-blocking TCP descriptors, which it owns from this
        call on (see _cpump.c's Reactor.open); `max_duration` seconds from now it ends
        ("max_duration"), however busy."""
        try:
            idle_timeout = float(idle_timeout)
            if math.isnan(idle_timeout):
                raise ValueError("idle_timeout must be a number of seconds or math.inf")
            max_duration = float(max_duration)
            if math.isnan(max_duration):
                raise ValueError("max_duration must be a number of seconds or math.inf")
            readers = self._pumps
            if client_fd == server_fd or self._taken(client_fd) or self._taken(server_fd):
                raise ValueError("open(): a descriptor already in the reactor")
            now = self.clock()
            p = Pump(self, client_fd, server_fd, idle_timeout, now)
            p.ends_at = now + max_duration
            if not splice:
                p.up.copy_only = p.down.copy_only = True
            p.on_end = on_end
            p.initial = initial
            p.uncounted = uncounted
            epoll = self.epoll
            epoll.register(client_fd, _IN)
            readers[client_fd] = p
            p.client_mask = _IN
            try:
                epoll.register(server_fd, _IN)
            except BaseException:
                del readers[client_fd]
                raise
            readers[server_fd] = p
            p.server_mask = _IN
        except BaseException:
            os.close(client_fd)
            os.close(server_fd)
            raise
        if initial:
            try:
                p._write_initial()
            except Exception as exc:
                p._crash(exc)
                return p
            if p.outcome is not None:  # the server failed before the bytes were out
                p._finish()
                return p
        due = min(now + idle_timeout, p.ends_at)
        if due != math.inf:
            self.arm(p, due)
        return p

    def arm(self, p: Pump, due: float) -> None:
        """p's idle deadline at `due` (inf: none), or the end of its lifetime if that
        comes first; an earlier one wakes the timer."""
        if p.seq:
            self._dead += 1  # its entry so far
            p.seq = 0
        due = min(due, p.ends_at)
        if due == math.inf:
            return
        heap = self._heap
        p.seq = seq = next(self._sequence)
        heapq.heappush(heap, (due, seq, p))
        if self._dead > 64 and self._dead * 2 > len(heap):
            self._heap = [e for e in heap if e[1] == e[2].seq]
            heapq.heapify(self._heap)
            self._dead = 0
        if due < self._armed:
            self._armed = due
            try:
                self._wake(due)
            except Exception as exc:  # the timer rings late; nothing else is lost
                self.record("pump", exc)

    def forget(self, p: Pump) -> None:
        """p ended: out of the set (closing its descriptors does that) and the heap."""
        readers = self._pumps
        if readers.get(p.client_fd) is p:
            del readers[p.client_fd]
        if readers.get(p.server_fd) is p:
            del readers[p.server_fd]
        if p.seq:
            p.seq = 0
            self._dead += 1

    def expire(self) -> float:
        """End the pumps idle for their idle_timeout and those past their max_duration;
        when to call again (inf: never)."""
        now = self.clock()
        while self._heap:
            heap = self._heap  # an on_end may have compacted it
            due, seq, p = heap[0]
            if seq != p.seq:  # dead: ended, or armed again
                heapq.heappop(heap)
                self._dead -= 1
                continue
            if due > now:
                break
            real = p.last_activity + p._idle_timeout
            if now >= p.ends_at:
                p.seq = 0
                heapq.heappop(heap)
                p._end("max_duration")
            elif now >= real:
                p.seq = 0
                heapq.heappop(heap)
                p._end("idle_timeout")
            else:  # bytes moved since: look again at its new time
                p.seq = seq = next(self._sequence)
                heapq.heapreplace(heap, (min(real, p.ends_at), seq, p))
        self._armed = self._heap[0][0] if self._heap else math.inf
        return self._armed

    def fin_read(self, p: Pump, d: _Direction) -> None:
        if self._in_batch:
            self._fins.append((p, d))
        else:
            p.send_fin(d)

    def _taken(self, fd: int) -> bool:
        return fd in self._pumps or fd in self._callbacks

    def refuse_splice(self, exc: OSError) -> None:
        global _splice_ok
        if _splice_ok:
            _splice_ok = False
            self._splice_refused(exc)

    # -- other readers -------------------------------------------------------------------

    def listen(self, fd: int, callback: Callable[[int, int], object]) -> None:
        """callback(fd, events) in the batches while fd is readable."""
        if self._taken(fd):
            raise ValueError("listen(): the descriptor is in the reactor already")
        self.epoll.register(fd, _IN)
        self._callbacks[fd] = callback

    def unlisten(self, fd: int, callback: Callable[[int, int], object]) -> None:
        """Out of the set again, before fd is closed; idempotent."""
        held = self._callbacks.get(fd)
        if held is None or (held is not callback and held != callback):
            return
        del self._callbacks[fd]
        with contextlib.suppress(OSError, ValueError):  # closed already: gone from the set
            self.epoll.unregister(fd)

    # -- batches -------------------------------------------------------------------------

    def dispatch(self, timeout_ms: int = 0) -> int:
        """One batch: wait up to `timeout_ms` (0: not at all), handle what is ready,
        then pass on the FINs read in it."""
        if self._in_batch:
            raise RuntimeError("a reactor batch is running")
        ready = self.epoll.poll(timeout_ms / 1000.0 if timeout_ms else 0, MAX_EVENTS)
        pumps = self._pumps
        self._in_batch = True
        try:
            for fd, events in ready:
                p = pumps.get(fd)
                if p is not None:
                    try:
                        p._on_event(fd, events)
                    except Exception as exc:  # a bug: that connection ends, not the reactor
                        p._crash(exc)
                    continue
                callback = self._callbacks.get(fd)
                if callback is None:  # ended earlier in this batch
                    continue
                try:
                    callback(fd, events)
                except Exception as exc:
                    self.record("pump", exc)
        finally:
            self._in_batch = False
            if self._fins:
                fins, self._fins = self._fins, []
                for p, d in fins:
                    try:
                        p.send_fin(d)
                    except Exception as exc:
                        p._crash(exc)
        return len(ready)

    def fileno(self) -> int:
        return self.epoll.fileno()

    @property
    def pumps(self) -> int:
        """How many pumps are open."""
        return len({id(p) for p in self._pumps.values()})

    @property
    def closed(self) -> bool:
        return self.epoll.closed

    def close(self) -> None:
        """Every open pump ends ("cancelled"), then the set is closed."""
        for p in list(self._pumps.values()):
            p.close()
        self._callbacks.clear()
        self.epoll.close()
