"""Passive health in the pure pool, on a fake clock: `health_check.type: none` trials,
health settings changed by a reload, and what a trial must not do (quiesce, slow start).
"""

from __future__ import annotations

from dataclasses import replace

from lbproxy.config.model import HealthCheckConfig
from lbproxy.core.pool import Pool
from tests.factories import virtual_server

PASSIVE = HealthCheckConfig(type="none", interval=2.0, rise=2, fall=3)


def first_pool(**options) -> Pool:
    # `first`: the first available server in configuration order, so a trial of `a`
    # shows as `a` being picked again.
    options.setdefault("health_check", PASSIVE)
    return Pool(virtual_server("first", {"a": {}, "b": {}}, **options), 0.0)


def fail(pool: Pool, name: str, times: int, now: float) -> None:
    for _ in range(times):
        pool.record_health(pool.by_name[name], False, now)


def picked(pool: Pool, now: float) -> str | None:
    rs = pool.pick(now)
    return rs.name if rs else None


def test_down_after_fall_failures_then_one_trial_per_interval():
    pool = first_pool()
    a = pool.by_name["a"]
    fail(pool, "a", 2, 0.0)
    assert a.health.up and picked(pool, 0.0) == "a"
    fail(pool, "a", 1, 1.0)  # the third in a row
    assert not a.health.up
    assert picked(pool, 1.0) == "b" and picked(pool, 2.999) == "b"
    assert picked(pool, 3.0) == "a"  # interval after going down: one trial
    lease = pool.take(a, 3.0)
    assert picked(pool, 3.0) == "b"  # only one: a is not available while it is tried
    pool.record_health(a, True, 3.01)  # the trial's connect succeeded: up at once
    assert a.health.up and a.health.counter == a.health.rise + a.health.fall - 1
    assert picked(pool, 3.01) == "a"
    pool.drop(lease, 4.0)


def test_a_failed_trial_waits_another_interval():
    pool = first_pool()
    a = pool.by_name["a"]
    fail(pool, "a", 3, 0.0)
    assert picked(pool, 2.0) == "a"
    pool.drop(pool.take(a, 2.0), 2.0)
    fail(pool, "a", 1, 2.5)  # the trial was refused
    assert not a.health.up
    assert picked(pool, 4.4) == "b"
    assert picked(pool, 4.5) == "a"


def test_a_trial_without_a_result_is_offered_again():
    # e.g. the client went away while the proxy was connecting
    pool = first_pool()
    a = pool.by_name["a"]
    fail(pool, "a", 3, 0.0)
    assert picked(pool, 2.0) == "a"
    pool.drop(pool.take(a, 2.0), 2.0)
    assert picked(pool, 3.9) == "b"
    assert picked(pool, 4.0) == "a"


def test_with_active_checks_a_down_server_gets_no_trial():
    pool = first_pool(health_check=replace(PASSIVE, type="tcp"))
    fail(pool, "a", 3, 0.0)
    assert [picked(pool, t) for t in (2.0, 10.0, 100.0)] == ["b", "b", "b"]
    pool.record_health(pool.by_name["a"], True, 101.0)  # rise 2: one is not enough
    assert picked(pool, 101.0) == "b"
    pool.record_health(pool.by_name["a"], True, 103.0)
    assert picked(pool, 103.0) == "a"


def test_a_trial_is_not_a_rejoin_but_its_success_is():
    # quiesce: the table is reset when the server comes back up, not when it is tried
    config = virtual_server(
        "wlc", {"a": {}, "b": {}}, quiesce=True, slow_start=10.0, health_check=PASSIVE
    )
    pool = Pool(config, 0.0)
    a, b = pool.by_name["a"], pool.by_name["b"]
    fail(pool, "a", 3, 20.0)
    held = [pool.take(b, 20.0) for _ in range(5)]
    assert pool.pick(22.0) is a  # the trial: a has 0 connections against b's 5
    epoch = pool.epoch
    trial = pool.take(a, 22.0)
    assert pool.epoch == epoch and a.ramp_start is None and b.sched_active == 5
    pool.record_health(a, True, 22.1)
    assert pool.epoch == epoch + 1 and b.sched_active == 0  # quiesce reset on rejoin
    assert a.ramp_start == 22.1  # and the slow-start ramp begins
    for lease in [*held, trial]:
        pool.drop(lease, 23.0)
    assert a.active == b.active == 0 and a.sched_active == b.sched_active == 0


def test_drained_or_disabled_down_server_gets_no_trial():
    pool = first_pool()
    a = pool.by_name["a"]
    fail(pool, "a", 3, 0.0)
    pool.set_state(a, "drain", 0.5)
    assert picked(pool, 5.0) == "b"
    pool.set_state(a, "enabled", 5.0)
    assert picked(pool, 5.0) == "a"  # its trial was due: offered now


def test_reload_retunes_rise_and_fall_and_keeps_up_or_down():
    config = virtual_server("first", {"a": {}, "b": {}}, health_check=replace(PASSIVE, type="tcp"))
    pool = Pool(config, 0.0)
    a = pool.by_name["a"]
    fail(pool, "a", 3, 0.0)
    assert not a.health.up
    changes = pool.reconfigure(replace(config, health_check=HealthCheckConfig(rise=1, fall=1)), 1.0)
    assert "health_check changed" in changes
    assert not a.health.up and (a.health.rise, a.health.fall) == (1, 1)
    pool.record_health(a, True, 2.0)  # rise 1 now
    assert a.health.up
    pool.record_health(a, False, 3.0)  # fall 1 now
    assert not a.health.up


def test_reload_to_passive_only_schedules_a_trial_and_back_cancels_it():
    active = virtual_server("first", {"a": {}, "b": {}}, health_check=replace(PASSIVE, type="tcp"))
    passive = replace(active, health_check=PASSIVE)
    pool = Pool(active, 0.0)
    a = pool.by_name["a"]
    fail(pool, "a", 3, 0.0)
    pool.reconfigure(passive, 10.0)
    assert picked(pool, 11.9) == "b" and picked(pool, 12.0) == "a"
    pool.reconfigure(active, 12.0)  # active checks again: they bring it back, not trials
    assert not a.trial and picked(pool, 12.0) == "b" and picked(pool, 50.0) == "b"


def test_a_removed_server_gets_no_trial():
    config = virtual_server("first", {"a": {}, "b": {}}, health_check=PASSIVE)
    pool = Pool(config, 0.0)
    a = pool.by_name["a"]
    fail(pool, "a", 3, 0.0)
    pool.reconfigure(replace(config, real_servers=config.real_servers[1:]), 1.0)
    assert picked(pool, 5.0) == "b"
    assert not a.trial and not a.available
