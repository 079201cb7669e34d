"""A fixed-bucket histogram cheap enough to observe once per connection.

PURE. `observe` is one bisect and two additions; the metrics collector turns the counts
into Prometheus' cumulative buckets at scrape time, so nothing on the connection path
touches prometheus-client or takes a lock.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

# Connection lifetimes: from a health-check-like blip to a long-lived stream (a
# database pool's connections, a tunnel) of hours: 4 h, 12 h and a day, so that those
# are not all in +Inf. 13 bounds: bisect takes 4 comparisons, as it did with 10.
DURATION_BUCKETS = (
    0.005,
    0.025,
    0.1,
    0.5,
    1.0,
    5.0,
    30.0,
    120.0,
    600.0,
    3600.0,
    14400.0,
    43200.0,
    86400.0,
)
# SNMP round trips on a LAN: milliseconds, up to the poll timeout.
POLL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Waits in a virtual server's queue: from a slot freed at once to `queue.timeout`.
QUEUE_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last slot is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound falls into that bucket (le = "<=").
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """[(le, count of observations <= le), ..., ("+Inf", count)] for exposition."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out
