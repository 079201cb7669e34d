"""The byte pump: copy a client and a real-server TCP socket into each other.

The pump owns everything between "both sockets are connected" and "both directions
are finished" (SPEC section 4): the two directions, the half-close hand-over, the idle
timeout and the pipe pool behind splice(2). Its API (both implementations, the C one in
lbproxy/net/_cpump.c and the pure one in lbproxy/net/pure_pump.py; net/reactor.py has
the protocols and serves the run's reactor):

``reactor().open(client_fd, server_fd, initial, idle_timeout, on_end, uncounted=0,
splice=True, max_duration=math.inf)``
    a pump on two connected non-blocking descriptors, which it owns from the call on
    and closes when it ends; ``initial`` goes to the server before any client byte (its
    first ``uncounted`` bytes, a PROXY header, are not client bytes); ``max_duration``
    seconds after the call it ends, however busy.
``pump.bytes_in``, ``bytes_out``, ``last_activity``, ``outcome``, ``error``
    read-only: client -> server and server -> client bytes written, the run's time of
    the last byte either way, how it ended (None while open), the exception behind an
    ``error`` or ``*_reset`` outcome.
``pump.idle_timeout``
    seconds (or ``math.inf``); a new value applies at once.
``pump.close()``
    end it on purpose (``"cancelled"``).
``on_end(pump)``
    called once when it has ended, both descriptors closed -- from the reactor's batch,
    its idle timer, or whoever called ``close()`` or set ``idle_timeout``.

How it works: the reactor holds one level-triggered epoll set with both descriptors of
every pump, served in batches by trio's own loop (net/trio_wait.py), so the cost of a
wait is paid once per batch, not once per chunk per connection -- as HAProxy's and
nginx's event loops do. A direction reads a chunk and writes it out; a chunk its
destination refuses is held and its source is no longer read (back-pressure): one chunk
at most per direction, so an idle connection holds no buffer and no pipe. How a chunk
moves is HAProxy's splice-auto: copied (one read, one write, no pipe) while chunks are
small, spliced (socket -> pipe -> socket in the kernel, a pipe borrowed from the pool
per chunk) once a read has filled COPY_CHUNK, the sign of a bulk transfer. A FIN read
while the other way is still open is passed on as a half-close at the end of the batch;
the last one is sent by closing the descriptors, so a client and a server that close at
about the same time need no shutdown at all.

Outcomes
--------
``"closed"``        both sides sent FIN and every byte was passed on.
``"idle_timeout"``  nothing moved in either direction for ``idle_timeout`` seconds
                    (this also bounds a half-closed connection).
``"client_reset"``  the client socket failed with ECONNRESET, EPIPE, ENOTCONN or
                    ECONNABORTED (reset, or closed while we still had data for it).
``"server_reset"``  the same on the real-server socket.
``"error"``         any other socket error (ETIMEDOUT, EHOSTUNREACH, ENOMEM, ...), or a
                    bug met moving this connection's bytes (counted in
                    ``lbproxy_internal_errors_total{where="pump"}``); ``error`` holds it.
``"cancelled"``     ``close()`` was called (the proxy closing it on purpose).
``"max_duration"``  its lifetime (``max_duration``) ran out, whatever moved. The
                    deadline shares the idle one's heap entry (the earlier of the
                    two), so it costs nothing per chunk and nothing when not set.

On a reset or error the pump ends at once and closes both descriptors, so the other
peer gets an orderly close without delay: data already handed to its kernel buffer still
arrives, which an RST would throw away. A reset is noticed even on a socket that has
half-closed and is no longer read: epoll reports errors on every socket in its set.

This module is the connection's side of it: `Flow` (what the control plane reads and
sets on a connection, before, during and after its pump), the outcomes and the tuning
the rest of lbproxy sees.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final, Literal

import trio

from lbproxy.net import pure_pump
from lbproxy.net.compiled import cpump
from lbproxy.net.reactor import (
    Pump,
    Reactor,
    close_idle_pipes,
    idle_pipes,
    implementation,
    reactor,
    splice_available,
)
from lbproxy.net.trio_wait import clock_offset

__all__ = [
    "CANCELLED",
    "CLIENT_RESET",
    "CLOSED",
    "COPY_CHUNK",
    "ERROR",
    "IDLE_TIMEOUT",
    "MAX_DURATION",
    "MAX_IDLE_PIPES",
    "SERVER_RESET",
    "Flow",
    "Outcome",
    "Pump",
    "Reactor",
    "close_idle_pipes",
    "idle_pipes",
    "implementation",
    "reactor",
    "run_clock",
    "splice_available",
]

Outcome = Literal[
    "closed", "idle_timeout", "client_reset", "server_reset", "error", "cancelled", "max_duration"
]
CLOSED: Final = "closed"
CANCELLED: Final = "cancelled"
IDLE_TIMEOUT: Final = "idle_timeout"
CLIENT_RESET: Final = "client_reset"
SERVER_RESET: Final = "server_reset"
ERROR: Final = "error"
MAX_DURATION: Final = "max_duration"

#: splice-auto's threshold: a read that fills this many bytes switches its direction from
#: copying to splicing (HAProxy's bufsize). The same in both implementations (the
#: differential test checks), as the pool's bound:
COPY_CHUNK: Final = pure_pump.COPY_CHUNK
#: Idle pipes kept for reuse (two descriptors each; net/descriptors.py counts them).
MAX_IDLE_PIPES: Final = pure_pump.MAX_IDLE_PIPES


class Flow:
    """A connection's side of its pump: what the control plane reads and sets on a
    connection -- byte counts, last activity, idle timeout, close -- before its pump
    exists (nothing moved yet), while it runs and after it ended.

    ``pump``           the connection's pump once it is open (set by whoever opens it),
                       else None.
    ``bytes_in``       client -> server bytes written to the server (the pump's).
    ``bytes_out``      server -> client bytes written to the client.
    ``last_activity``  the run's time of the last byte written either way.
    ``idle_timeout``   seconds (or ``math.inf``); assigning it applies at once to a
                       running pump (the admission-control monitor shortens it under
                       load): a value already exceeded by the idle time ends it now.
    ``closing``        set by :meth:`close`, before or during the pump.
    """

    __slots__ = ("_idle_timeout", "closing", "pump")

    def __init__(self, idle_timeout: float = math.inf) -> None:
        self.pump: Pump | None = None
        self.closing = False
        self._idle_timeout = math.inf
        self.idle_timeout = idle_timeout

    @property
    def bytes_in(self) -> int:
        pump = self.pump
        return 0 if pump is None else pump.bytes_in

    @property
    def bytes_out(self) -> int:
        pump = self.pump
        return 0 if pump is None else pump.bytes_out

    @property
    def last_activity(self) -> float:
        pump = self.pump
        return 0.0 if pump is None else pump.last_activity

    @property
    def idle_timeout(self) -> float:
        return self._idle_timeout

    @idle_timeout.setter
    def idle_timeout(self, seconds: float) -> None:
        seconds = float(seconds)
        if math.isnan(seconds):
            raise ValueError("idle_timeout must be a number of seconds or math.inf")
        self._idle_timeout = seconds
        if self.pump is not None:
            self.pump.idle_timeout = seconds

    @property
    def pumping(self) -> bool:
        """True while a pump moves this flow's bytes (open, not yet ended)."""
        pump = self.pump
        return pump is not None and pump.outcome is None

    def close(self) -> None:
        """End the pump now ("cancelled"), or tell whoever would open one not to. Safe
        to call at any time, more than once."""
        self.closing = True
        if self.pump is not None:
            self.pump.close()

    def __repr__(self) -> str:
        return (
            f"Flow(bytes_in={self.bytes_in}, bytes_out={self.bytes_out}, "
            f"idle_timeout={self._idle_timeout})"
        )


def run_clock() -> Callable[[], float]:
    """The current trio run's ``current_time``, as cheap to call as it gets: on the
    compiled path a C callable that reads trio's SystemClock itself (no Python frame),
    else the clock's own method."""
    clock = trio.lowlevel.current_clock()
    if cpump is None:
        return clock.current_time
    fast: Callable[[], float] = cpump.Clock(clock.current_time, clock_offset(clock))
    return fast
