"""The locator of one virtual server (SPEC §10, §11): answers, load reports, balance.

PURE: no trio, no sockets, no clock — every method that needs the time takes `now`.

A locator answer is Apache Geode's `LocatorLoadSnapshot.getServerForConnection`: the
scheduler's pick, counted as a connection sent that closes at once (least-load adds its
estimate, sap its load factor, rr/wrr advance). `?current=` is Geode's
`getReplacementServerForConnection`: move the client only when its server is gone, or is
the most loaded while the pool is out of balance by §11's rule (lbproxy/core/balance.py,
`isBalanced` with hysteresis). Load reports are Geode's `ServerLoadProbe` pushes
(`PUT .../load`); they are kept here, not in the scheduler, so a reload that swaps the
scheduler (or makes a virtual server `least-load` with `load_source: report`) keeps them.

This module owns that state (`answers`, `reports`, `report_counts`, `balance`); the pool
(pool.py) owns the servers and exposes what a locator needs: `pick`, `count_answer` (the
scheduler's view of a connection that opens and closes at once), `load_of`,
`balance_members` and its persistence table.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lbproxy.config.model import DEFAULT_IMBALANCE_THRESHOLD
from lbproxy.core.balance import Balance, spread
from lbproxy.core.persistence import client_key

if TYPE_CHECKING:
    from lbproxy.core.pool import Pool, RealServer


@dataclass(frozen=True, slots=True)
class Located:
    """A locator answer (SPEC §10): the server, its load after the answer (None for a
    scheduler without one) and, for `?current=`, whether the client should move."""

    server: RealServer
    load: float | None
    replace: bool | None = None


class Locator:
    """The locator state of one pool; made by the pool, which outlives reloads."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        # rs -> (load, per_connection) of its last pushed report
        self.reports: dict[RealServer, tuple[float, float]] = {}
        self.report_counts: Counter[str] = Counter()  # reports per real server name
        self.answers: Counter[tuple[str, str]] = Counter()  # (real server, via)
        self.balance = Balance()  # §11's hysteresis, shared with conditioning

    def report_load(
        self, rs: RealServer, load: object, per_connection: object = None
    ) -> str | None:
        """A server's pushed load report; returns an error message (nothing changed) or None.

        `per_connection` defaults to 1 / max_connections, else 0 (Geode's default probe:
        "the load estimate for each additional pool connection is 1/max-connections").
        It replaces the scheduler's load when the scheduler reads reports (least-load with
        `load_source: report`) and clears the estimates added since the last report; on
        any other virtual server it is kept for when a reload makes it one.
        """
        error = _non_negative("load", load)
        if error:
            return error
        if per_connection is None:
            per_connection = 1.0 / rs.max_connections if rs.max_connections else 0.0
        error = _non_negative("per_connection", per_connection)
        if error:
            return error
        value, step = float(load), float(per_connection)  # type: ignore[arg-type]  # _non_negative() checked both
        self.reports[rs] = (value, step)
        self.report_counts[rs.name] += 1
        pool = self.pool
        if pool.scheduler.reads_reports(pool.config):
            pool.scheduler.report(rs, value, step)  # type: ignore[attr-defined]  # reads_reports: a least-load scheduler
        return None

    def forget(self, rs: RealServer) -> None:
        """`rs` left the pool (a reload or discovery removed it)."""
        self.reports.pop(rs, None)

    def answer(
        self, rs: RealServer, now: float, via: str = "http", client: tuple[Any, ...] | None = None
    ) -> None:
        """Count a locator answer for `rs` as a pick: a connection sent that closes at
        once.

        With persistence and the asking `client`'s address, its entry is made or moved
        to `rs` and, the "connection" being over at once, lives `timeout` from now: a
        client that asks again within `timeout` of its last answer gets `rs` again."""
        persistence = self.pool.persistence
        key = None
        if persistence is not None and client is not None:
            key = client[0]
            if ":" in key:
                key = client_key(client)
        hit = key is not None and persistence.holds(key, rs, now)  # type: ignore[union-attr]  # a key implies persistence
        self.pool.count_answer(rs, now, hit)
        self.answers[rs.name, via] += 1
        if key is not None:
            persistence.release(persistence.acquire(key, rs, now), now)  # type: ignore[union-attr]  # a key implies persistence

    def locate(
        self,
        now: float,
        current: str | None = None,
        via: str = "http",
        client: tuple[Any, ...] | None = None,
    ) -> Located | None:
        """The locator's answer, counted; None when no server is available.

        `client` is the asking address (the HTTP peer, the DNS query's source), given
        to the pick as a proxied connection's is: `maglev` hashes it, `persistence`
        looks it up and remembers the answer (see `answer`).

        With `current` (Geode's `getReplacementServerForConnection`): replace when that
        server is unknown or unavailable, or when it is the most loaded and the pool is
        out of balance by §11's rule (threshold and hysteresis); then the answer is the
        scheduler's pick and `current` loses one connection's estimate. Otherwise the
        answer is `current` itself and nothing is counted.
        """
        pool = self.pool
        if current is None:
            rs = pool.pick(now, (), client)
            if rs is None:
                return None
            self.answer(rs, now, via, client)
            return Located(rs, pool.load_of(rs))
        old = pool.by_name.get(current)
        if old is not None and old.available and not self.should_move(old):
            return Located(old, pool.load_of(old), False)
        rs = pool.pick(now, () if old is None else (old,), client)
        if rs is None:
            if old is not None and old.available:
                return Located(old, pool.load_of(old), False)
            return None
        if old is not None:
            pool.scheduler.on_moved_away(old, now)
        self.answer(rs, now, via, client)
        return Located(rs, pool.load_of(rs), True)

    @property
    def imbalance_threshold(self) -> float:
        conditioning = self.pool.config.conditioning
        return conditioning.threshold if conditioning else DEFAULT_IMBALANCE_THRESHOLD

    def should_move(self, rs: RealServer) -> bool:
        """True when a client of `rs` should be sent elsewhere (`?current=`)."""
        # O(n), for `?current=` only (a plain locate is one pick): Geode scans too.
        members = self.pool.balance_members()
        numbers = spread((load, step) for _, load, step in members)
        if numbers is None:
            return False
        if self.balance.check(*numbers, self.imbalance_threshold):
            return False
        mine = next((load for server, load, _ in members if server is rs), None)
        # Geode's isCurrentServerMostLoaded: no other server is loaded more.
        return mine is not None and not any(load > mine for _, load, _ in members)


def _non_negative(name: str, value: object) -> str | None:
    """The one check of a reported number: finite, >= 0, not a boolean."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{name} must be a number >= 0, got {value!r}"
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        number = float("inf")
    if not number >= 0 or number == float("inf"):
        return f"{name} must be a finite number >= 0, got {value!r}"
    return None
