"""The pure pool's counters and time-driven state, as metrics and the admin API read them."""

from __future__ import annotations

import pytest

from lbproxy.config.model import HealthCheckConfig
from lbproxy.core.pool import SLOW_START_STEPS, Pool
from tests.factories import virtual_server


def test_a_taken_lease_counts_as_a_connection_only_once_established():
    pool = Pool(virtual_server("wlc", {"a": {}, "b": {}}), 0)
    a, b = pool.by_name["a"], pool.by_name["b"]
    attempt = pool.take(pool.pick(0), 0)  # a: taken before the connect, as IPVS does
    assert attempt.server is a
    # while it connects, a concurrent arrival already sees it and goes elsewhere
    assert pool.pick(0) is b
    pool.drop(attempt, 0.1)  # the connect failed
    assert (a.counters.connections_total, a.active) == (0, 0)
    lease = pool.take(pool.pick(0.2), 0.2)
    pool.established(lease)
    pool.drop(lease, 0.3)
    stats = {rs.name: rs.connections_total for rs in pool.statistics().real_servers}
    assert stats == {lease.server.name: 1, ({"a", "b"} - {lease.server.name}).pop(): 0}


# -- slow start, read live -------------------------------------------------------------

RAMP = 4.0  # slow_start: 4s
CHECKS = HealthCheckConfig(rise=1, fall=1)


def ramp_pool() -> Pool:
    """wrr, a and b weight 10, slow_start 4 s; b goes down at 20 and comes back at 30."""
    config = virtual_server(
        "wrr", {"a": {"weight": 10}, "b": {"weight": 10}}, slow_start=RAMP, health_check=CHECKS
    )
    pool = Pool(config, 0.0)
    b = pool.by_name["b"]
    pool.record_health(b, False, 20.0)
    pool.record_health(b, True, 30.0)
    return pool


def effective(pool: Pool, name: str, now: float) -> float:
    (stats,) = (rs for rs in pool.statistics(now).real_servers if rs.name == name)
    return stats.weight_effective


def test_effective_weight_is_the_ramp_at_read_time_without_any_pick():
    pool = ramp_pool()
    b = pool.by_name["b"]
    assert effective(pool, "b", 30.0) == 1.0  # the 10 % floor
    assert effective(pool, "b", 31.6) == pytest.approx(4.0)  # 10 x 1.6 / 4: no pick needed
    assert effective(pool, "b", 33.0) == pytest.approx(7.5)
    assert effective(pool, "b", 34.0) == 10.0
    assert effective(pool, "a", 34.0) == 10.0
    assert b not in pool._ramping  # the ramp is over: nothing left to step


def test_what_is_shown_is_what_the_scheduler_uses():
    pool = ramp_pool()
    b = pool.by_name["b"]
    step = RAMP / SLOW_START_STEPS  # 80 ms: the ramp is stepped, never more than this late
    now = 30.0
    while now < 34.5:
        shown = effective(pool, "b", now)
        exact = 10 * min(1.0, max(0.1, (now - 30.0) / RAMP))
        assert shown == b.effective_weight  # the value the scheduler's keys are built on
        assert exact - 10 * step / RAMP - 1e-9 <= shown <= exact + 1e-9, now
        now += 0.013


def per_second_shares(pool: Pool, start: float, seconds: int, per_second: int) -> list[float]:
    """b's share of short connections (each closed before the next) arriving at
    `per_second` from `start`, in each second."""
    shares = []
    for second in range(seconds):
        picks = []
        for i in range(per_second):
            now = start + second + i / per_second
            rs = pool.pick(now)
            pool.drop(pool.take(rs, now), now)
            picks.append(rs.name)
        shares.append(picks.count("b") / per_second)
    return shares


def expected_shares(seconds: int, samples: int = 1000) -> list[float]:
    """b's share with weights 10 x f(t) against 10, f = max(0.1, t / 4), averaged over
    each second."""
    out = []
    for second in range(seconds):
        total = 0.0
        for i in range(samples):
            f = min(1.0, max(0.1, (second + (i + 0.5) / samples) / RAMP))
            total += f / (1 + f)
        out.append(total / samples)
    return out


def test_the_scheduler_follows_the_ramp_in_every_second():
    shares = per_second_shares(ramp_pool(), 30.0, 5, 100)
    expected = expected_shares(5)  # 0.13, 0.27, 0.38, 0.46, 0.50
    assert shares == pytest.approx(expected, abs=0.03), (shares, expected)
    assert shares == sorted(shares) and len(set(shares[:4])) == 4  # a ramp, not one step


# -- the operator's view: since, downtime, rates -------------------------------------------


def test_since_and_downtime_follow_health_and_state_changes():
    check = HealthCheckConfig(type="tcp", rise=1, fall=1)
    pool = Pool(virtual_server("rr", {"a": {}, "b": {}}, health_check=check), 100.0)
    a = pool.by_name["a"]
    assert a.changed_at == 100.0 and pool.downtime(a, 150.0) == 0.0
    pool.record_health(a, False, 110.0, "tcp check: connection refused")
    assert a.changed_at == 110.0 and pool.downtime(a, 115.0) == 5.0
    pool.record_health(a, False, 112.0)  # still down: no change
    assert a.changed_at == 110.0
    pool.record_health(a, True, 120.0)
    assert a.changed_at == 120.0 and pool.downtime(a, 200.0) == 10.0
    pool.set_state(a, "drain", 130.0)
    assert a.changed_at == 130.0 and pool.downtime(a, 200.0) == 10.0
    pool.set_state(a, "drain", 140.0)  # the same state: no change
    assert a.changed_at == 130.0


def test_sample_rates_reads_each_servers_count_and_sums_them_for_the_pool():
    pool = Pool(virtual_server("rr", {"a": {}, "b": {}}), 0.0)
    a, b = pool.by_name["a"], pool.by_name["b"]
    a.counters.connections_total, b.counters.connections_total = 30, 10
    pool.sample_rates(1.0)
    assert (a.rate.current, b.rate.current, pool.rate.current) == (30.0, 10.0, 40.0)
    a.counters.connections_total = 32
    pool.sample_rates(3.0)
    assert (a.rate.current, a.rate.max) == (1.0, 30.0)
    assert (pool.rate.current, pool.rate.max) == (1.0, 40.0)
