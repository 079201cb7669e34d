"""The counters of one UDP virtual server's datagram path (SPEC §19).

PURE. The relay (lbproxy/dataplane/udp.py) adds to them per datagram; the metrics, the
JSON document, `lbproxy status` and the dashboard read them. They live on the pool, so
they outlast a reload and a change of the listen address, as the pool's own counters do.
Sessions themselves are the pool's leases: `active` and `connections_total` of a real
server of a UDP virtual server count its sessions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Why a datagram was dropped. The first five are SPEC §19's: a client datagram that could
# not open a session. Then: a reply beyond `udp.responses` per request (no amplification;
# with `responses: 0` every reply), and a send that failed either way (a full socket
# buffer, a session socket that could not be made).
DROP_REASONS = (
    "max_sessions",
    "per_source",
    "no_server",
    "acl",
    "throttle",
    "unrequested",
    "send_error",
    "reply_error",
)
DIRECTIONS = ("in", "out")  # in: client to real server; out: real server to client


@dataclass
class UdpCounters:
    datagrams: Counter[Any] = field(default_factory=Counter)  # (real server, direction)
    bytes: Counter[Any] = field(default_factory=Counter)  # (real server, direction)
    sessions_total: Counter[Any] = field(default_factory=Counter)  # by real server
    dropped: Counter[Any] = field(default_factory=Counter)  # by reason (DROP_REASONS)
    # Who counts elsewhere and adds it here when asked (the compiled relay: its counts
    # accumulate in C, with no Python call per datagram): `settle()` before a reading.
    unsettled: set[Callable[[], None]] = field(default_factory=set, compare=False)

    def settle(self) -> None:
        """Bring the counters up to date with what was counted elsewhere."""
        for settle in list(self.unsettled):
            settle()

    def document(self) -> dict[str, Any]:
        """The `udp` part of a UDP virtual server's JSON document, totals only."""
        self.settle()
        return {
            "datagrams_in": sum(n for (_, d), n in self.datagrams.items() if d == "in"),
            "datagrams_out": sum(n for (_, d), n in self.datagrams.items() if d == "out"),
            "sessions_total": sum(self.sessions_total.values()),
            "dropped": {reason: self.dropped[reason] for reason in DROP_REASONS},
        }
