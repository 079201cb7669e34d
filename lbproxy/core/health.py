"""Health hysteresis: rise/fall as one bounded counter (HAProxy `check-t.h`).

PURE. The counter runs from 0 to rise + fall - 1: values below `rise` mean down, values
from `rise` up mean up. While up, a failure takes one step down and a success restores
the top, so only `fall` failures *in a row* take a server down; while down, a success
takes one step up and a failure restarts from 0, so `rise` successes in a row bring it
back. Active checks and passive connect failures feed the same counter.

`record_health()` is the one path that feeds a result to it (through
pool.record_health) for the active checks (control/checks.py) and the data plane's
passive health (dataplane/connection.py, udp.py), and, when a server goes down and its
virtual server says `on_down: close`, closes its established connections. It lives here,
below both, so neither imports the other.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lbproxy.core.pool import Lease, Pool, RealServer

log = logging.getLogger("lbproxy.health")


class Health:
    __slots__ = ("counter", "fall", "rise")

    def __init__(self, rise: int, fall: int, up: bool = True) -> None:
        self.rise = rise
        self.fall = fall
        self.counter = rise + fall - 1 if up else 0

    @property
    def clean(self) -> bool:
        """Up with no failure counted: a success would change nothing."""
        return self.counter == self.rise + self.fall - 1

    @property
    def up(self) -> bool:
        return self.counter >= self.rise

    def record(self, ok: bool) -> bool | None:
        """Count one check result; returns the new state if it changed, else None."""
        top = self.rise + self.fall - 1
        if self.up:
            if ok:
                self.counter = top
                return None
            self.counter -= 1
            if self.counter < self.rise:
                self.counter = 0
                return False
            return None
        if not ok:
            self.counter = 0
            return None
        self.counter += 1
        if self.counter >= self.rise:
            self.counter = top
            return True
        return None

    def force(self, up: bool) -> None:
        self.counter = self.rise + self.fall - 1 if up else 0


# -- feeding results (active checks and passive health) ----------------------------


def record_health(
    pool: Pool, rs: RealServer, ok: bool, now: float, reason: str = ""
) -> bool | None:
    """Count one health result (active check or passive connect) for `rs`.

    Returns the new up/down state on a transition, else None. With
    `health_check.on_down: close`, a transition to down closes `rs`'s connections.
    """
    changed = pool.record_health(rs, ok, now, reason)
    if changed is False and pool.config.health_check.on_down == "close":
        closed = close_leases(rs.leases)
        if closed:
            log.info("%s/%s: closed %d connection(s) (on_down: close)", pool.name, rs.name, closed)
    return changed


def close_leases(leases: Iterable[Lease]) -> int:
    """Close the connections behind `leases` (their handle's `close()`); returns how many.

    Closing cancels the connection's task; its lease is dropped from the pool as that
    task unwinds, so the caller may pass `rs.leases` itself.
    """
    closed = 0
    for lease in list(leases):
        handle = lease.handle
        if handle is not None:
            handle.close()
            closed += 1
    return closed
