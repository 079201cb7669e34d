"""Outlier ejection: real servers whose connects keep failing get no traffic for a while.

PURE: no trio, no sockets, no clock (time is passed in as `now`).

Envoy's `outlier_detection` (source/common/upstream/outlier_detection_impl.cc) is the
model, cut down to what a TCP balancer sees: whether each client connect reached a
server that answers.

- `consecutive_failures` connects in a row that fail (refused, timed out, or accepted
  and then reset before the server's first byte) eject the server: it is not picked
  for `base_ejection_time` times the number of times it was ejected in a row, at most
  `max_ejection_time`, whatever its health check says. Its failure count starts again
  at each ejection.
- A connection that reached its server and did not end in such a reset clears both the
  failure count and the ejections in a row, at the server's first byte or at its end,
  whichever comes first (a completed handshake alone does not: a server that accepts
  and resets completes every one). A server that closes cleanly (FIN) without a byte is
  no failure: a client that only sends (logs, a command) meets that from healthy
  servers. Only a reset is, as Envoy's and HAProxy's layer-4 observers count it.
- The ejection ends on time, not on a check: the server gets traffic again at once.
- Never more than `max_ejection_percent` of the non-backup servers (rounded down) are
  ejected at once, and at least one stays: a failure that would eject one more only
  counts. Backup servers are never ejected: they are what is left when the primaries fail.

Ejection is kept apart from health (health.py): health decides whether a server is up;
ejection only holds an up server back. The pool (pool.py) asks `is_ejected` when it
recomputes a server's availability and releases servers from its own timer (`due`).

Cost per connection: at its end, one test of the server's byte count and one of
`rs.outlier is None` (no Python call); a failing server's record is touched only on its
failures and, once per connection, on the first byte of a connection it answered.
"""

from __future__ import annotations

import math
from typing import Any

from lbproxy.config.model import OutlierDetectionConfig

__all__ = ["Ejection", "OutlierDetector"]


class Ejection:
    """One real server's outlier record, kept (as `rs.outlier`) only while it has
    failed since it last answered a client."""

    __slots__ = ("ejections", "failures", "until")

    def __init__(self) -> None:
        self.failures = 0  # connects failed in a row since the last ejection or answer
        self.ejections = 0  # ejections in a row (no answer between them)
        self.until: float | None = None  # when the current ejection ends; None: not ejected

    @property
    def ejected(self) -> bool:
        return self.until is not None


class OutlierDetector:
    """The ejection state of one virtual server's real servers."""

    def __init__(self, config: OutlierDetectionConfig) -> None:
        self.config = config
        # The servers ejected now (any object with an `outlier` attribute: a RealServer).
        self.ejected: dict[Any, Ejection] = {}
        self.next_release = math.inf  # the earliest `until` among them

    def allowed(self, primaries: int) -> int:
        """How many of `primaries` non-backup servers may be ejected at once."""
        return max(0, min(primaries * self.config.max_ejection_percent // 100, primaries - 1))

    def ejection_time(self, ejections: int) -> float:
        """How long the `ejections`-th ejection in a row lasts."""
        config = self.config
        return min(config.base_ejection_time * ejections, config.max_ejection_time)

    def failed(self, rs: Any, now: float, primaries: int) -> bool:
        """A connect to `rs` (a non-backup server) failed; True when that ejects it.

        `primaries`: the virtual server's non-backup real servers, for the cap. Failures
        of a server ejected already (connects started before its ejection) are ignored.
        """
        record = rs.outlier
        if record is None:
            record = rs.outlier = Ejection()
        if record.until is not None:
            return False
        record.failures += 1
        if record.failures < self.config.consecutive_failures:
            return False
        if len(self.ejected) >= self.allowed(primaries):
            return False  # the cap holds: it keeps counting, and is ejected when room is
        record.failures = 0
        record.ejections += 1
        record.until = now + self.ejection_time(record.ejections)
        self.ejected[rs] = record
        self.next_release = min(self.next_release, record.until)
        return True

    @staticmethod
    def succeeded(rs: Any) -> None:
        """`rs` answered a client: its failures and ejections in a row are over
        (an ejection under way still runs to its end)."""
        record = rs.outlier
        if record is None:
            return
        record.failures = 0
        record.ejections = 0
        if record.until is None:
            rs.outlier = None

    def due(self, now: float) -> list[Any]:
        """Release the servers whose ejection has ended by `now`; returns them.

        O(ejected servers), run only when `now` has reached `next_release`.
        """
        released = []
        upcoming = math.inf
        for rs, record in list(self.ejected.items()):
            until = record.until
            assert until is not None
            if until <= now:
                del self.ejected[rs]
                record.until = None
                record.failures = 0
                if record.ejections == 0:  # it answered a client during the ejection
                    rs.outlier = None
                released.append(rs)
            else:
                upcoming = min(upcoming, until)
        self.next_release = upcoming
        return released

    def forget(self, rs: Any) -> None:
        """`rs` was removed, turned backup, or ejection was switched off: no record."""
        record = self.ejected.pop(rs, None)
        rs.outlier = None
        if record is not None:
            ends = (r.until for r in self.ejected.values() if r.until is not None)
            self.next_release = min(ends, default=math.inf)
