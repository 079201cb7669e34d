"""Drains that end: a drained real server's connections closed after `close_after`, oldest
first, at most `close_rate` a second (SPEC §23), and `shutdown-sessions` at once.

A drain lets a server's connections finish; one with `close_after` closes those still
open when it runs out, so a drain of a server holding long-lived connections (a database
pool, a message bus) ends at a known time, at a pace the other servers absorb as the
clients reconnect (HAProxy's `shutdown sessions server` closes them all at once; Envoy's
drain closes nothing by itself). One task per server with pending closes; setting the
server's state again (enabled, disabled, another drain) cancels them, and the task
stops by itself when the server is no longer drained (a reload, the cluster, the state
file) or no longer in the pool. Each close is counted in `pool.closed`
(`reason="drain"` or `"shutdown"`).

Cost: nothing per connection; a drain sorts its server's connections once (oldest
first) when `close_after` runs out, and wakes at most PACE_WAKEUPS times a second.
"""

from __future__ import annotations

import logging
import math
from collections import deque

import trio

from lbproxy.core.closing import DRAIN, SHUTDOWN, oldest_first
from lbproxy.core.pool import Lease, Pool, RealServer

__all__ = ["PACE_WAKEUPS", "DrainCloses", "shutdown_sessions"]

log = logging.getLogger("lbproxy.drain")

#: A paced drain closes in batches, waking at most this many times a second.
PACE_WAKEUPS = 50


def shutdown_sessions(pool: Pool, rs: RealServer) -> int:
    """Close every connection of `rs` now (counted `reason="shutdown"`); how many."""
    closed = _close(pool, rs, list(rs.leases))
    if closed:
        pool.closed[SHUTDOWN] += closed
    log.info("%s/%s: shutdown-sessions closed %d connection(s)", pool.name, rs.name, closed)
    return closed


def _close(pool: Pool, rs: RealServer, leases: list[Lease]) -> int:
    closed = 0
    for lease in leases:
        handle = lease.handle
        if handle is not None and lease in rs.leases:  # still open
            handle.close()
            closed += 1
    return closed


class DrainCloses:
    """The pending drain closes of one process, one task per drained server."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, str], trio.CancelScope] = {}

    @property
    def pending(self) -> int:
        """How many servers have closes pending."""
        return len(self._pending)

    def cancel(self, pool: Pool, rs: RealServer) -> bool:
        """Cancel `rs`'s pending closes, if any; whether there were."""
        scope = self._pending.pop((pool.name, rs.name), None)
        if scope is None:
            return False
        scope.cancel()
        log.info("%s/%s: pending drain closes cancelled", pool.name, rs.name)
        return True

    def schedule(
        self,
        nursery: trio.Nursery,
        pool: Pool,
        rs: RealServer,
        close_after: float,
        close_rate: float | None,
    ) -> None:
        """From now, `close_after` seconds on: close `rs`'s connections still open, oldest
        first, at most `close_rate` a second (None: all at once). Replaces pending ones."""
        self.cancel(pool, rs)
        scope = trio.CancelScope()
        key = (pool.name, rs.name)
        self._pending[key] = scope
        nursery.start_soon(self._run, scope, key, pool, rs, close_after, close_rate)

    async def _run(
        self,
        scope: trio.CancelScope,
        key: tuple[str, str],
        pool: Pool,
        rs: RealServer,
        close_after: float,
        close_rate: float | None,
    ) -> None:
        try:
            with scope:
                await trio.sleep(close_after)
                if self._still_drained(pool, rs):
                    await self._close_paced(pool, rs, close_rate)
        finally:
            if self._pending.get(key) is scope:
                del self._pending[key]

    @staticmethod
    def _still_drained(pool: Pool, rs: RealServer) -> bool:
        return rs.state == DRAIN and pool.by_name.get(rs.name) is rs

    async def _close_paced(self, pool: Pool, rs: RealServer, rate: float | None) -> None:
        queue = deque(oldest_first(rs.leases))
        total = len(queue)
        log.info(
            "%s/%s: drain's close_after ran out: closing %d connection(s)%s",
            pool.name,
            rs.name,
            total,
            f", at most {rate:g}/s" if rate else "",
        )
        if rate is None:
            closed = _close(pool, rs, list(queue))
            pool.closed[DRAIN] += closed
            return
        step = max(1, math.ceil(rate / PACE_WAKEUPS))
        start = trio.current_time()
        done = 0
        while queue:
            if not self._still_drained(pool, rs):
                return
            # By time t at most (t - start) x rate + step closes: a batch of `step` at most
            # every step / rate seconds, the first at once.
            budget = int((trio.current_time() - start) * rate) + step - done
            closed = 0
            while queue and closed < budget:
                lease = queue.popleft()
                if lease.handle is not None and lease in rs.leases:
                    lease.handle.close()
                    closed += 1
            if closed:
                done += closed
                pool.closed[DRAIN] += closed
            if queue:
                await trio.sleep_until(start + done / rate)
