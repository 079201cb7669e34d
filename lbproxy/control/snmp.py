"""The SNMP pollers: one GET per real server every `snmp.interval`, feeding the pool.

`SnmpPollers` runs one task per real server of every virtual server whose scheduler is
`dwd`, `dwr`, or `least-load` with `load_source: snmp`, in the Server's service
nursery, kept in step by the one reconciler (reconcile.py): `sync()` is called after
start-up and after every reload; it starts pollers for new real servers, stops those of
removed ones, and restarts one whose `snmp` block changed. The first poll comes within
a second of the start, later ones at a random phase within the interval, so many
servers' polls spread out instead of arriving together. Each poll's result goes
through dynamic_weight.py (on_no_answer, stale_after, smoothing) into the pool's two
validated entry points, `report_value` and `set_dynamic_weight`; counts go to
`RealServer.counters.snmp_polls` and `Pool.poll_durations`, which the metrics module reads at
scrape time.

One GET (v2c or v3, retransmissions, timeouts) is control/snmp_client.py's `SnmpClient`.
"""

from __future__ import annotations

import functools
import logging
import math
import random
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace

import trio

from lbproxy.config.model import SnmpConfig
from lbproxy.control.reconcile import Configured, Reconciler
from lbproxy.control.snmp_client import SnmpClient
from lbproxy.core.dynamic_weight import DynamicWeight, Report, SetWeight
from lbproxy.core.pool import Pool, RealServer
from lbproxy.net.barrier import record
from lbproxy.wire.snmp import ERROR, OK, PollResult

log = logging.getLogger("lbproxy.snmp")

FIRST_POLL_WITHIN = 1.0  # seconds: see Poller.run


# --------------------------------------------------------------------------------------
# The poller of one real server


class Poller:
    """Polls one real server's agent and feeds its pool, until cancelled."""

    def __init__(self, pool: Pool, rs: RealServer, snmp: SnmpConfig) -> None:
        self.pool = pool
        self.rs = rs
        self.snmp = snmp
        self.last: PollResult | None = None
        if snmp.host is None:  # the loader fills it in; a hand-made config may not
            snmp = replace(snmp, host=rs.address.host)
        self.client = SnmpClient(snmp)
        self.state = DynamicWeight(
            snmp.on_no_answer, snmp.stale_after or 3 * snmp.interval, snmp.smoothing
        )
        self.where = f"{pool.name}/{rs.name} (snmp {snmp.host}:{snmp.port})"  # for the log
        self._logged_failure: str | None = None

    async def run(self) -> None:
        clock = trio.current_time
        # Timing: the first poll comes within min(interval, 1 s) of the start, so weights
        # are known soon after start-up or a reload (not up to a whole interval later);
        # the second one to two intervals after it (a random phase), then one every
        # interval. Many servers' polls so spread over the interval instead of arriving
        # together, and a poll slower than the interval skips a beat, never bursts.
        interval = self.snmp.interval
        await trio.sleep(random.uniform(0, min(interval, FIRST_POLL_WITHIN)))
        next_poll: float | None = None
        while True:
            started = clock()
            result = await self.client.get()
            now = clock()
            self.record(result, now - started)
            self.apply(result, now)
            if next_poll is None:
                next_poll = started + random.uniform(0, interval)
            next_poll += interval
            if next_poll <= now:  # a poll longer than the interval: skip, don't burst
                next_poll = now + interval - (now - next_poll) % interval
            while True:
                hold_until = self.state.hold_until()
                wake = next_poll if hold_until is None else min(next_poll, hold_until)
                await trio.sleep_until(wake)
                if wake >= next_poll:
                    break
                self._set(self.state.expire(clock()), clock())

    def record(self, result: PollResult, duration: float) -> None:
        """Count the poll where the metrics module reads it at scrape time."""
        self.rs.counters.snmp_polls[result.result] += 1
        self.rs.counters.snmp_last = (result.result, result.value)  # for the admin API's document
        self.pool.poll_durations.observe(duration)
        self.last = result

    def apply(self, result: PollResult, now: float) -> None:
        """Feed one poll's result through dynamic_weight.py into the pool."""
        if result.result == OK:
            assert result.value is not None
            first = self.state.answering is not True
            self._set(self.state.answered(result.value, now), now)
            if first:
                log.info(
                    "%s answers: value %d, dynamic weight %s",
                    self.where,
                    result.value,
                    _fmt(self.rs.dynamic_weight),
                )
                self._logged_failure = None
            else:
                log.debug("%s: value %d", self.where, result.value)
            return
        action = self.state.unanswered(now, self.rs.static_weight)
        message = f"{result.result}: {result.detail}"
        if message != self._logged_failure:
            self._logged_failure = message
            if action is None:
                what = (
                    f"holding weight {_fmt(self.rs.dynamic_weight)} for up to "
                    f"{self.state.stale_after:g}s"
                )
            else:
                what = (
                    f"on_no_answer {self.snmp.on_no_answer}: dynamic weight {_fmt(action.weight)}"
                )
            level = logging.ERROR if result.result == ERROR else logging.WARNING
            self._set(action, now)
            if self.pool.fallback:  # nothing else says so when no agent ever answered
                what += f"; {self.pool.name} is on static weights (every dynamic weight is 0)"
            log.log(level, "%s: no usable answer (%s); %s", self.where, message, what)
            return
        self._set(action, now)

    def _set(self, action: Report | SetWeight | None, now: float) -> None:
        if action is None:
            return
        if isinstance(action, Report):
            self.pool.report_value(self.rs, action.value, now)
        else:
            if action.reason == "hold expired":
                log.warning(
                    "%s: held value is older than stale_after (%gs); dynamic weight 0",
                    self.where,
                    self.state.stale_after,
                )
            self.pool.set_dynamic_weight(self.rs, action.weight, now)


def _fmt(weight: float | None) -> str:
    if weight is None:
        return "none"
    return str(int(weight)) if math.isfinite(weight) and weight == int(weight) else f"{weight:g}"


# --------------------------------------------------------------------------------------
# All pollers of the running Server


class SnmpPollers(Reconciler[tuple[str, str], tuple[Pool, RealServer, SnmpConfig]]):
    """The SNMP pollers of a Server, kept in step with its virtual servers.

    Poll counts go where the metrics module reads them: `RealServer.counters.snmp_polls[result]`
    and the per-virtual-server histogram `Pool.poll_durations`.
    """

    def wanted(
        self, virtual_servers: Iterable[Configured]
    ) -> dict[tuple[str, str], tuple[Pool, RealServer, SnmpConfig]]:
        wanted = {}
        for vs in virtual_servers:
            pool = vs.pool
            if not pool.polls_snmp:
                continue
            for rs in pool.servers:
                if rs.config.snmp is not None:
                    wanted[(pool.name, rs.name)] = (pool, rs, rs.config.snmp)
        return wanted

    def start(
        self, key: tuple[str, str], spec: tuple[Pool, RealServer, SnmpConfig]
    ) -> Callable[[], Awaitable[None]]:
        return functools.partial(self._run_one, Poller(*spec))

    @staticmethod
    async def _run_one(poller: Poller) -> None:
        # A poller that fails unexpectedly must not take the proxy down with it (its
        # exception would cancel the service nursery): log it and start it again.
        while True:
            try:
                await poller.run()
            except Exception as exc:  # restarted after an interval
                record("poll", exc, poller.where)
                await trio.sleep(poller.snmp.interval)

    @property
    def polled(self) -> list[tuple[str, str]]:
        return sorted(self._tasks)
