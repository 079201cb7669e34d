"""Geode's balance rule, with its hysteresis, and the conditioning round built on it.

PURE: no trio, no clock, no sockets.

The rule is Apache Geode's (`LocatorLoadSnapshot.isBalanced` and `thresholdCheck`, the
locator behind seeds/000): each server has a load L and a per-connection step p (what
one more connection adds; SPEC §11 lists them per scheduler, `Scheduler.balance_load`).

    balanced       max L - min L <= max p           (no single move can improve it)
    start moving   max L - min L >= threshold x max p
    keep moving    until balanced again

Between the two bounds the pool is tolerated as it is, so that clients do not
ping-pong between servers: once the threshold is crossed, `rebalancing` stays set until
the pool is balanced. One `Balance` per virtual server serves both uses, as one
`LocatorLoadSnapshot` does in Geode: the locator's `?current=` question
(`getReplacementServerForConnection`) and the conditioning monitor's rounds.

A round (`plan_round`) moves, one at a time, an idle-enough connection of the most
loaded server (its longest-idle first) to the least loaded one -- counting the move in
the model (L - p for the one, L + p for the other) -- until balanced or `max_moves`.
Loads are floats (least-load's 0.4 + 0.1 + 0.1): comparisons allow a relative 1e-9, so
0.6 - 0.5 counts as one step of 0.1.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

_EPSILON = 1e-9


def spread(loads: Iterable[tuple[float, float]]) -> tuple[float, float, float] | None:
    """(best L, worst L, largest p) over `(L, p)` pairs; None when there are none."""
    best = worst = step = None
    for load, per in loads:
        if best is None:
            best, worst, step = load, load, per
            continue
        best = min(best, load)
        worst = max(worst, load)  # type: ignore[type-var]  # set with best
        step = max(step, per)  # type: ignore[type-var]  # set with best
    if best is None:
        return None
    return best, worst, step  # type: ignore[return-value]  # all set with best


def is_balanced(best: float, worst: float, step: float) -> bool:
    """Geode's `isBalanced` without the threshold: no move can make it better."""
    return worst - best <= step * (1 + _EPSILON) + _EPSILON


class Balance:
    """The balance state of one virtual server: whether it is rebalancing."""

    __slots__ = ("rebalancing",)

    def __init__(self) -> None:
        self.rebalancing = False

    def check(self, best: float, worst: float, step: float, threshold: float) -> bool:
        """Geode's `isBalanced(withThresholdCheck=true)`: True means leave it alone.

        Sets `rebalancing` when the imbalance reaches `threshold` steps, and clears it
        only once the pool is balanced (`thresholdCheck`).
        """
        balanced = is_balanced(best, worst, step)
        if self.rebalancing:
            if balanced:
                self.rebalancing = False
            return balanced
        if not balanced:
            if worst - best >= step * threshold * (1 - _EPSILON):
                self.rebalancing = True
            else:
                balanced = True  # out of balance, but within the tolerated imbalance
        return balanced


S = TypeVar("S", bound=Hashable)  # a server (the control plane's: a RealServer)
C = TypeVar("C")  # one of its connections (the control plane's: a Lease)


@dataclass
class Member(Generic[S, C]):
    """One server as a conditioning round sees it.

    `candidates` are its connections that may be closed (idle long enough), longest
    idle first; None: ask `plan_round`'s `candidates_of` when first needed (only the
    most loaded servers' connections are ever looked at). Only servers that take part
    in balancing are members: the servers a new connection could go to now
    (`Pool.balance_members`; a draining, disabled, down, ejected or full server, or a
    backup the pool is not on, is never one).
    """

    server: S
    load: float
    step: float
    candidates: list[C] | None = field(default=None)


@dataclass(frozen=True)
class Move(Generic[S, C]):
    server: S  # closed on this server...
    connection: C  # ...this connection
    to: S  # the least-loaded server, where the model sends its client


@dataclass(frozen=True)
class Round(Generic[S, C]):
    moves: tuple[Move[S, C], ...]
    best: float  # the spread before the round
    worst: float
    step: float
    rebalancing: bool  # the state after the round


def plan_round(
    members: Sequence[Member[S, C]],
    balance: Balance,
    threshold: float,
    max_moves: int,
    candidates_of: Callable[[S], list[C]] | None = None,
) -> Round[S, C] | None:
    """The connections to close this interval; None when there is nothing to balance.

    Mutates the members' loads (the model of the moves) and `balance`.
    """
    numbers = spread((m.load, m.step) for m in members)
    if numbers is None or len(members) < 2:
        return None
    best, worst, step = numbers
    if balance.check(best, worst, step, threshold):
        return None
    moves: list[Move[S, C]] = []
    # O(n) per move, at most max_moves times per interval: never on the connection path.
    while len(moves) < max_moves:
        most = max(members, key=lambda m: m.load)  # ties: the first in configuration order
        least = min(members, key=lambda m: m.load)
        if is_balanced(least.load, most.load, max(m.step for m in members)):
            balance.rebalancing = False
            break
        if most.candidates is None:
            most.candidates = candidates_of(most.server) if candidates_of else []
        if not most.candidates:
            break  # nothing idle enough there; the next round looks again
        moves.append(Move(most.server, most.candidates.pop(0), least.server))
        most.load -= most.step
        least.load += least.step
    else:
        final = spread((m.load, m.step) for m in members)
        if final is not None and is_balanced(*final):
            balance.rebalancing = False
    return Round(tuple(moves), best, worst, step, balance.rebalancing)
