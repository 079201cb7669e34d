"""Health hysteresis: rise/fall as one bounded counter (HAProxy `check-t.h`).

PURE. The counter runs from 0 to rise + fall - 1: values below `rise` mean down, values
from `rise` up mean up. While up, a failure takes one step down and a success restores
the top, so only `fall` failures *in a row* take a server down; while down, a success
takes one step up and a failure restarts from 0, so `rise` successes in a row bring it
back. Active checks and passive connect failures feed the same counter; with an active
check, a client's successful connect is not fed at all (pool.record_health).

`record_health()` is the one path that feeds a result to it (through
pool.record_health) for the active checks (control/checks.py) and the data plane's
passive health (dataplane/connection.py, udp.py), and closes connections on purpose at
a state change: with `on_down: close`, a server's own when it goes down; with
`on_up: close_backups`, the backup servers' when a primary comes back up (HAProxy's
`on-marked-down shutdown-sessions` and `on-marked-up shutdown-backup-sessions`). Each
close is counted in `pool.closed` by reason (CLOSE_REASONS). It lives here, below both
callers, so neither imports the other.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lbproxy.core.pool import Lease, Pool, RealServer

log = logging.getLogger("lbproxy.health")

# Why health closed connections (lbproxy_connections_closed_total{reason}).
MARKED_DOWN = "marked_down"
BACKUP_RETURNED = "backup_returned"
CLOSE_REASONS = (MARKED_DOWN, BACKUP_RETURNED)


class Health:
    """A server's up/down state as a counter of check results (HAProxy's `health`).

    `clean`: up with no failure counted, so a success would change nothing. A plain
    attribute, kept by every write of `counter`, because the connection path reads it
    for every connection (a property would be a Python frame each time); `rise` and
    `fall` change only together with a `counter` write (`force`, on a reload).
    """

    __slots__ = ("_counter", "clean", "fall", "rise")

    def __init__(self, rise: int, fall: int, up: bool = True) -> None:
        self.rise = rise
        self.fall = fall
        self.counter = rise + fall - 1 if up else 0

    @property
    def counter(self) -> int:
        return self._counter

    @counter.setter
    def counter(self, value: int) -> None:
        self._counter = value
        self.clean = value == self.rise + self.fall - 1

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
    pool: Pool, rs: RealServer, ok: bool, now: float, reason: str = "", *, passive: bool = False
) -> bool | None:
    """Count one health result for `rs`: an active check's, or (`passive`) a client
    connect's, whose success counts only without an active check (pool.record_health).

    Returns the new up/down state on a transition, else None (and on a transition,
    health_changed closes what `on_down` / `on_up` say).
    """
    changed = pool.record_health(rs, ok, now, reason, passive=passive)
    if changed is not None:
        health_changed(pool, rs, changed)
    return changed


def health_changed(pool: Pool, rs: RealServer, up: bool) -> None:
    """`rs`'s health has just turned `up` or down: close what `on_down` / `on_up` say.

    record_health calls it on every transition it counts; a path that sets health
    another way calls it too, so the closes and their counts stay in one place.
    O(connections closed + backup servers), and only at a transition.
    """
    check = pool.config.health_check
    if not up:
        if check.on_down == "close":
            _close(pool, rs.leases, MARKED_DOWN, f"{rs.name} is down (on_down: close)")
    elif check.on_up == "close_backups" and not rs.backup and rs.online:
        for backup in list(pool.backup_servers):
            _close(
                pool,
                backup.leases,
                BACKUP_RETURNED,
                f"{backup.name} is a backup and primary {rs.name} is up (on_up: close_backups)",
            )


def _close(pool: Pool, leases: Iterable[Lease], reason: str, why: str) -> None:
    closed = close_leases(leases)
    if closed:
        pool.closed[reason] += closed
        log.info("%s: closed %d connection(s): %s", pool.name, closed, why)


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
