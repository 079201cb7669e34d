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
    No decision at all: every client to the first real server, its pump with no on_end:
    one Python call (the accept batch's) per connection. The ceiling of the C path
    itself.

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
    if c_connect is None:
        raise SystemExit("LBPROXY_FLOOR needs the compiled path (lbproxy/net/_cpump.c)")

    def ready(self: Any) -> bool:
        """The floor serves this handler once its server's address is resolved (the
        normal way does it, for the first connections): then ``self._floor`` holds the
        sockaddr, the reactor, the idle timeout, the leases of the pumps open now (by
        client descriptor) and the pumps' on_end, which gives one back."""
        if getattr(self, "_floor", None) is not None:
            return True
        target = self._target(self.pool.servers[0])
        if target is None:
            return False
        if self._reactor is None:
            self._reactor = pump.reactor()
        leases: dict[int, Any] = {}

        def dropped(p: Any) -> None:  # a pump's on_end: its lease back
            self.pool.drop(leases.pop(p.client_fd), self._clock())

        self._floor = (target[3], self._reactor, self.pool.config.idle_timeout, leases, dropped)
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

    def decisions_accept(self: Any, client: int, peer: tuple, spawn: Any) -> None:
        if not ready(self):
            normal_accept(self, client, peer, spawn)
            return
        # The decision, as Handler.accept makes it (the bench's one server is up: no
        # None to handle), then the lease given back if the connect failed.
        pool = self.pool
        now = self._clock()
        rs = pool.pick(now, (), peer)
        lease = pool.take(rs, now, None, peer)
        fd = connect(self, client)
        if fd is None:
            pool.drop(lease, now)
            return
        _, reactor, idle_timeout, leases, dropped = self._floor
        leases[client] = lease
        reactor.open(client, fd, b"", idle_timeout, dropped)

    def c_only_accept(self: Any, client: int, peer: tuple, spawn: Any) -> None:
        if not ready(self):
            normal_accept(self, client, peer, spawn)
            return
        fd = connect(self, client)
        if fd is not None:
            floor = self._floor
            floor[1].open(client, fd, b"", floor[2], None)

    accepts = {"decisions": decisions_accept, "c-only": c_only_accept}
    if variant not in accepts:
        raise SystemExit(f"LBPROXY_FLOOR={variant!r}: decisions or c-only")
    handler_type.accept = accepts[variant]


if os.environ.get("LBPROXY_FLOOR"):
    _install(os.environ["LBPROXY_FLOOR"])
