"""rr and wrr: (weighted) round robin as earliest-deadline-first.

wrr (LVS document, seeds/001: "weights 1 and 5 give 5 connections to 1"): each available
server has a virtual deadline; the earliest deadline wins (ties: configuration order),
and a server that takes a connection moves its deadline on by 1/weight. A server starts,
or comes back, half a period after the current virtual time, which interleaves picks
smoothly: weights 1 and 5 give b b a b b b, b b b b a b, ... (Envoy's EDF scheduler; the
same shares as nginx's smooth weighted round robin, in O(log n) instead of O(n)).

rr is the same with every weight taken as 1: servers in configuration order, cycling.
A weight change keeps the progress already made: the time left to the deadline is
scaled by old/new weight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lbproxy.core.schedulers import HeapScheduler, Scheduler, register

if TYPE_CHECKING:
    from lbproxy.core.pool import Pool, RealServer


@register
class WeightedRoundRobin(HeapScheduler):
    score_legend = "(next turn on the virtual clock, position): the earliest wins"
    name = "wrr"
    keys = frozenset({"slow_start"})
    rank = 20

    def __init__(self, pool: Pool) -> None:
        super().__init__(pool)
        self.now_virtual = 0.0
        # deadline = base + (picks + 0.5) / weight, computed from scratch each time
        # rather than accumulated, so weights 1 and 5 tie exactly at 1.5 and float drift
        # never reorders a cycle.
        self.base: dict[RealServer, float] = {}
        self.picks: dict[RealServer, int] = {}

    # False: every weight is taken as 1 (rr). on_take reads this rather than call
    # weight(), a Python frame per connection.
    weighted = True

    def weight(self, rs: RealServer) -> float:
        return rs.effective_weight if self.weighted else 1.0

    def deadline(self, rs: RealServer) -> float:
        return self.base[rs] + (self.picks[rs] + 0.5) / self.weight(rs)

    def key(self, rs: RealServer) -> tuple[float, int]:
        return (self.deadline(rs), rs.index)

    def on_available(self, rs: RealServer, now: float) -> None:
        self.base[rs] = self.now_virtual
        self.picks[rs] = 0
        super().on_available(rs, now)

    def on_unavailable(self, rs: RealServer, now: float) -> None:
        self.base.pop(rs, None)
        self.picks.pop(rs, None)
        super().on_unavailable(rs, now)

    def on_weight(self, rs: RealServer, old: float, now: float) -> None:
        if rs not in self.base or old <= 0:
            return
        # Keep the progress made: the time left to the deadline scales by old/new.
        left = self.base[rs] + (self.picks[rs] + 0.5) / old - self.now_virtual
        new_weight = self.weight(rs)
        ratio = old / new_weight if new_weight != old else 1.0
        self.base[rs] = self.now_virtual + left * ratio - 0.5 / new_weight
        self.picks[rs] = 0
        super().on_weight(rs, old, now)

    def on_take(self, rs: RealServer, now: float) -> None:
        base = self.base.get(rs)
        if base is None:  # taken while not available (e.g. the last slot filled)
            return
        # deadline() before and after the pick, inline (once per connection: 6 Python
        # frames fewer than through deadline() and key();
        # tests/property/test_scheduler_properties.py checks that the heap's key is
        # key() after every operation).
        weight = rs.effective_weight if self.weighted else 1.0  # weight(), inline
        picks = self.picks[rs]
        deadline = base + (picks + 0.5) / weight
        if deadline > self.now_virtual:
            self.now_virtual = deadline
        self.picks[rs] = picks + 1
        heap = self.heap
        if rs in heap.entries:
            heap.set(rs, (base + (picks + 1.5) / weight, rs.index))

    def on_sticky_take(self, rs: RealServer, now: float) -> None:
        pass  # a persistence hit is not a turn: the rotation stays where it is

    # Round robin does not look at connection counts: the base's no-op, which the pool
    # knows not to call (watches_drops).
    on_drop = Scheduler.on_drop

    def on_reset(self, now: float) -> None:
        pass


@register
class RoundRobin(WeightedRoundRobin):
    name = "rr"
    keys = frozenset()  # every weight taken as 1: slow start has no effect
    rank = 10
    weighted = False

    def on_weight(self, rs: RealServer, old: float, now: float) -> None:
        pass  # rr ignores weights (0 makes a server unavailable, handled by the pool)
