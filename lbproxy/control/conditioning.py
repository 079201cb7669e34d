"""Connection conditioning: one trio task per virtual server with a `conditioning:` block.

Geode's client pools "condition (rebalance) existing pool connections" with the locator's
best server every load-conditioning-interval (seeds/000); lbproxy does it for the
long-lived connections it proxies (SPEC §11). The decision is the pure
lbproxy/core/balance.py (`plan_round`: Geode's balance rule, threshold and hysteresis); this
module samples the pool every `conditioning.interval`, closes what the round chose and
logs it.

- Candidates are connections whose pump runs and that moved no byte for `idle_for`
  (`flow.last_activity`), longest idle first; only the servers the round takes
  connections from are looked at.
- Members of the round are the servers a new connection could go to now
  (`Pool.balance_members`: available and up, of the tier the pool serves from). A
  draining, disabled, down, ejected or full server, or a backup the pool is not on, is
  none: its connections are never closed, and none is closed toward it.
- A close is the pump's own close path (`Flow.close`): the handler then closes both
  sockets with nothing unread or unsent, which is a FIN each way, never an RST. The
  client reconnects and is scheduled as usual -- toward the least loaded server.
- Counted in `pool.conditioned` (lbproxy_conditioned_connections_total) and logged at
  INFO once per round that closes something.

`Conditioners` keeps one monitor per virtual server in step with the configuration, with
the one reconciler (reconcile.py), as every control-plane subsystem.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

import trio

from lbproxy.control.reconcile import Configured, Reconciler
from lbproxy.core.balance import Member, Round, plan_round
from lbproxy.core.pool import Lease, RealServer

log = logging.getLogger("lbproxy.conditioning")


def idle_leases(rs: RealServer, now: float, idle_for: float) -> list[Lease]:
    """`rs`'s connections idle for at least `idle_for`, longest idle first."""
    idle = []
    for lease in rs.leases:
        flow = getattr(lease.handle, "flow", None)
        if flow is None or not flow.pumping or flow.closing:
            continue  # still connecting, or already closing
        if now - flow.last_activity >= idle_for:
            idle.append((flow.last_activity, lease))
    idle.sort(key=lambda pair: pair[0])
    return [lease for _, lease in idle]


class ConditioningMonitor:
    def __init__(self, vs: Configured) -> None:
        self.vs = vs
        self.cancel_scope = trio.CancelScope()

    async def run(self) -> None:
        with self.cancel_scope:
            while True:
                config = self.vs.pool.config.conditioning
                if config is None:  # removed by a reload; Conditioners stops us
                    return
                await trio.sleep(config.interval)
                self.round(trio.current_time())

    def round(self, now: float) -> Round[RealServer, Lease] | None:
        """One interval: plan with Geode's rule, close what it chose, log it."""
        pool = self.vs.pool
        config = pool.config.conditioning
        if config is None:
            return None
        members: list[Member[RealServer, Lease]] = [
            Member(rs, load, step) for rs, load, step in pool.balance_members()
        ]

        def candidates(rs: RealServer) -> list[Lease]:
            return idle_leases(rs, now, config.idle_for)

        plan = plan_round(
            members, pool.locator.balance, config.threshold, config.max_per_interval, candidates
        )
        if plan is None:
            return None
        closed: Counter[str] = Counter()
        for move in plan.moves:
            move.connection.handle.close()
            closed[move.server.name] += 1
            pool.conditioned[move.server.name] += 1
        targets = sorted({move.to.name for move in plan.moves})
        log.info(
            "%s: conditioning closed %d connection(s)%s%s; load %.4g..%.4g, step %.4g; %s",
            pool.name,
            len(plan.moves),
            " (" + ", ".join(f"{name} {n}" for name, n in sorted(closed.items())) + ")"
            if closed
            else "",
            f" toward {', '.join(targets)}" if targets else "",
            plan.best,
            plan.worst,
            plan.step,
            "still rebalancing" if plan.rebalancing else "balanced",
        )
        return plan

    def stop(self) -> None:
        self.cancel_scope.cancel()


class Conditioners(Reconciler["Configured", bool]):
    """One monitor per virtual server with a `conditioning:` block, kept in step with
    reloads by the one reconciler (reconcile.py). The monitor reads its block afresh
    every round, so a changed block needs no restart: the spec is only "has one"."""

    def __init__(self) -> None:
        super().__init__()
        self._monitors: dict[Configured, ConditioningMonitor] = {}
        self._running: set[Configured] = set()

    def wanted(self, virtual_servers: Iterable[Configured]) -> dict[Configured, bool]:
        running = list(virtual_servers)
        self._running = set(running)
        return {vs: True for vs in running if vs.pool.config.conditioning is not None}

    def start(self, key: Configured, spec: bool) -> Callable[[], Awaitable[None]]:
        monitor = self._monitors[key] = ConditioningMonitor(key)
        return monitor.run

    def stopped(self, key: Configured) -> None:
        self._monitors.pop(key).stop()

    def describe(self, key: Configured, event: str) -> str | None:
        if event == "removed" and key not in self._running:
            return None  # the virtual server itself went: the reload says so
        return f"{key.name}: conditioning {event}"
