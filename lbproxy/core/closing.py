"""Closing connections on purpose, other than on a change of health: why, and in what order.

PURE. Three reasons, each counted in `pool.closed` (lbproxy_connections_closed_total
{reason}) beside health's (core/health.py CLOSE_REASONS):

- `max_duration`: a connection outlived its virtual server's `max_connection_duration`
  (the pump's lifetime deadline ends it, net/pump.py; Envoy's
  `max_downstream_connection_duration`);
- `shutdown`: an operator closed a real server's connections (`shutdown-sessions`,
  HAProxy's `shutdown sessions server`);
- `drain`: a drain's `close_after` ran out and the connections still open were closed,
  oldest first, at most `close_rate` a second (control/drain_close.py paces them).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lbproxy.core.pool import Lease

MAX_DURATION = "max_duration"
SHUTDOWN = "shutdown"
DRAIN = "drain"
ON_PURPOSE_REASONS = (MAX_DURATION, SHUTDOWN, DRAIN)


def lifetime(duration: float, jitter_percent: float, draw: float | None = None) -> float:
    """One connection's limit: drawn uniformly within `duration` ± `jitter_percent` %.
    `draw` (0..1) stands for the random draw in tests."""
    if not jitter_percent:
        return duration
    u = random.random() if draw is None else draw
    return duration * (1.0 + jitter_percent / 100.0 * (2.0 * u - 1.0))


def oldest_first(leases: Iterable[Lease]) -> list[Lease]:
    """The leases by their connection's start, oldest first (a handle without a start
    time, none of lbproxy's, last)."""
    return sorted(leases, key=lambda lease: getattr(lease.handle, "started", float("inf")))
