"""The floor under lbproxy's CPU per new connection (issue 26): a measurement, not a
feature. Nothing here is part of lbproxy; it only runs when a benchmark asks for it:

    LBPROXY_FLOOR=decisions PYTHONPATH=bench/floor scripts/bench --syscalls
    LBPROXY_FLOOR=c-only    PYTHONPATH=bench/floor scripts/bench --syscalls

Python imports this file at start-up (``sitecustomize``, from PYTHONPATH) in every
process of the run; with LBPROXY_FLOOR set it replaces ``Handler.accept`` (the data
plane's per-connection entry) in the lbproxy it starts, once the first connection has
resolved the real server's address the normal way:

``decisions``
    What a connection costs when the Python left on its path is only what issue 26
    keeps in Python, the decision: one call in per connection for the pick and the take
    (``Pool.pick``, ``Pool.take``), one at the end for the drop (``Pool.drop``); the
    accept batch, the connect and the pump in C, as on main. No states, no counts, no
    access log, no histogram, no health, queue or throttle: more than any lifecycle
    moved into C could save, so its figure bounds that lever from above.
``c-only``
    No decision at all: every client to the first real server, with one flow object
    shared by all: one Python call (the accept batch's) per connection. The ceiling of
    the C path itself.

A connect that does not complete at once (never seen on loopback) closes the client:
wrk counts it as an error, so a run that had any shows it.
"""

from __future__ import annotations

import os
from typing import Any


def _install(variant: str) -> None:
    from lbproxy.dataplane import connection
    from lbproxy.net import pump

    handler_type = connection.Handler
    normal_accept = handler_type.accept
    c_connect = connection._c_connect
    c_pump = connection._c_pump
    if c_connect is None or c_pump is None:
        raise SystemExit("LBPROXY_FLOOR needs the compiled path (lbproxy/net/_cpump.c)")

    class FloorFlow(pump.Flow):
        __slots__ = ("handler", "lease")

    def new_flow(idle_timeout: float) -> FloorFlow:
        flow = FloorFlow.__new__(FloorFlow)
        flow.bytes_in = 0
        flow.bytes_out = 0
        flow.error = None
        flow.last_activity = 0.0
        flow.closing = False
        flow._pump = None
        flow._idle_timeout = idle_timeout
        flow.handler = None
        flow.lease = None
        return flow

    def ready(self: Any) -> bool:
        """The floor serves this handler once its server's address is resolved (the
        normal way does it, for the first connections): then ``self._floor`` holds the
        sockaddr, the reactor, the idle timeout and the flow c-only shares."""
        if getattr(self, "_floor", None) is not None:
            return True
        target = self._target(self.pool.servers[0])
        if target is None:
            return False
        if self._reactor is None:
            self._reactor = pump._reactor()
        idle_timeout = self.pool.config.idle_timeout
        self._floor = (target[2], self._reactor, idle_timeout, new_flow(idle_timeout))
        return True

    def connect(self: Any, client: int) -> int | None:
        """The server's descriptor, connected; None, with the client closed, if the
        connect did not complete at once."""
        fd, err = c_connect(self._floor[0])
        if fd >= 0 and not err:
            return fd  # type: ignore[no-any-return]  # C returns an int
        if fd >= 0:
            os.close(fd)
        os.close(client)
        return None

    def dropped(p: Any) -> None:
        flow = p.flow  # a C pump's flow: a FloorFlow
        handler = flow.handler
        handler.pool.drop(flow.lease, handler._clock())

    def decisions_accept(self: Any, client: int, peer: tuple, spawn: Any) -> None:
        if not ready(self):
            normal_accept(self, client, peer, spawn)
            return
        # The decision, as Handler.accept makes it (the bench's one server is up: no
        # None to handle), then the lease given back if the connect failed.
        pool = self.pool
        now = self._clock()
        rs = pool.pick(now, (), peer)
        flow = new_flow(self._floor[2])
        flow.handler = self
        flow.lease = pool.take(rs, now, flow, peer)
        fd = connect(self, client)
        if fd is None:
            pool.drop(flow.lease, now)
            return
        p = c_pump(client, fd, flow, b"", 0, True, pump.splice_enabled, self._floor[1])
        p.on_end = dropped
        p.start()

    def c_only_accept(self: Any, client: int, peer: tuple, spawn: Any) -> None:
        if not ready(self):
            normal_accept(self, client, peer, spawn)
            return
        fd = connect(self, client)
        if fd is not None:
            floor = self._floor
            c_pump(client, fd, floor[3], b"", 0, True, pump.splice_enabled, floor[1]).start()

    accepts = {"decisions": decisions_accept, "c-only": c_only_accept}
    if variant not in accepts:
        raise SystemExit(f"LBPROXY_FLOOR={variant!r}: decisions or c-only")
    handler_type.accept = accepts[variant]


if os.environ.get("LBPROXY_FLOOR"):
    _install(os.environ["LBPROXY_FLOOR"])
