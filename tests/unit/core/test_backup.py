"""Backup servers in the pure pool (SPEC §13): offered to the scheduler only while no
primary is available (online and below max_connections); the scheduler applies among
them; primaries take over again."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lbproxy.config.model import HealthCheckConfig
from lbproxy.core.pool import DISABLED, ENABLED, Pool
from tests.factories import virtual_server

CHECKS = HealthCheckConfig(type="tcp", rise=1, fall=1)


def pool_of(scheduler: str = "rr", **options) -> Pool:
    servers = {"p1": {}, "p2": {}, "b1": {"backup": True}, "b2": {"backup": True, "weight": 3}}
    return Pool(virtual_server(scheduler, servers, health_check=CHECKS, **options), 0.0)


def picks(pool: Pool, n: int, now: float = 0.0) -> list[str]:
    names = []
    for _ in range(n):
        rs = pool.pick(now)
        names.append(rs.name if rs else None)
        if rs is not None:  # a short connection: the scheduler sees the take and drop
            pool.drop(pool.take(rs, now), now)
    return names


def down(pool: Pool, *names: str) -> None:
    for name in names:
        pool.record_health(pool.by_name[name], False, 1.0)


def up(pool: Pool, *names: str) -> None:
    for name in names:
        pool.record_health(pool.by_name[name], True, 2.0)


def test_backups_stand_by_while_a_primary_is_online():
    pool = pool_of()
    assert picks(pool, 4) == ["p1", "p2", "p1", "p2"]
    down(pool, "p1")
    assert picks(pool, 3) == ["p2", "p2", "p2"]
    assert not pool.by_name["b1"].available and not pool.by_name["b2"].available


def test_the_scheduler_applies_among_backups_and_primaries_take_over_again():
    pool = pool_of("wrr")
    down(pool, "p1", "p2")
    got = picks(pool, 8)
    assert got.count("b1") == 2 and got.count("b2") == 6  # weights 1:3
    up(pool, "p2")
    assert picks(pool, 3) == ["p2", "p2", "p2"]
    assert not pool.by_name["b1"].available


def test_full_primaries_send_new_connections_to_the_backups():
    # SPEC §3 and §13: a primary at its max_connections is not available, so backups
    # serve while every primary is full (nginx `backup` with `max_conns`) instead of
    # the client being refused.
    pool = Pool(
        virtual_server(
            "rr",
            {
                "p1": {"max_connections": 1},
                "p2": {"max_connections": 1},
                "b1": {"backup": True, "max_connections": 2},
                "b2": {"backup": True, "max_connections": 2},
            },
            health_check=CHECKS,
        ),
        0.0,
    )
    p1, p2, b1, b2 = (pool.by_name[name] for name in ("p1", "p2", "b1", "b2"))
    held = [pool.take(pool.pick(0.0), 0.0) for _ in range(2)]
    assert {lease.server for lease in held} == {p1, p2}
    assert b1.available and b2.available  # every primary full: the backups serve
    on_backups = [pool.take(pool.pick(1.0), 1.0) for _ in range(3)]
    assert [lease.server.name for lease in on_backups] == ["b1", "b2", "b1"]  # rr among them

    # A freed primary slot takes the next new connection; the backups' connections go on.
    first = held.pop(0)
    pool.drop(first, 2.0)
    assert not b1.available and not b2.available
    assert pool.pick(2.0) is first.server
    held.append(pool.take(first.server, 2.0))
    assert b1.active == 2 and b2.active == 1

    # Everything full: nothing to pick, and the pool says why (the queue reads this).
    held.append(pool.take(pool.pick(3.0), 3.0))
    assert held[-1].server is b2
    assert pool.pick(3.0) is None
    assert (pool.available_servers, pool.full_servers) == (0, 4)
    for lease in on_backups:
        pool.drop(lease, 4.0)
    assert pool.pick(4.0) in (b1, b2)  # primaries still full: a backup again


def test_a_primary_freeing_its_slot_wakes_a_waiting_client_and_backups_stand_by():
    pool = Pool(
        virtual_server(
            "rr",
            {"p": {"max_connections": 1}, "b": {"backup": True, "max_connections": 1}},
            health_check=CHECKS,
        ),
        0.0,
    )
    wakes = []
    pool.on_available = lambda: wakes.append(pool.available_servers)
    p, b = pool.by_name["p"], pool.by_name["b"]
    on_p = pool.take(pool.pick(0.0), 0.0)
    assert on_p.server is p and wakes == [1]  # b joined as p filled
    on_b = pool.take(pool.pick(0.0), 0.0)
    assert on_b.server is b and pool.pick(0.0) is None
    pool.drop(on_p, 1.0)
    assert wakes[-1] >= 1 and pool.pick(1.0) is p  # the freed primary slot, not b's
    pool.drop(on_b, 1.0)
    assert not b.available and pool.pick(1.0) is p


def test_backup_leases_finish_on_their_own_when_a_primary_returns():
    pool = Pool(
        virtual_server(
            "rr",
            {"p": {"max_connections": 1}, "b": {"backup": True}},
            health_check=CHECKS,
        ),
        0.0,
    )
    p, b = pool.by_name["p"], pool.by_name["b"]
    down(pool, "p")
    backup_lease = pool.take(pool.pick(1.0), 1.0)
    assert backup_lease.server is b
    up(pool, "p")
    assert b.active == 1 and backup_lease in b.leases  # still open, not closed
    pool.drop(backup_lease, 3.0)
    assert b.active == 0 and pool.pick(3.0) is p


@pytest.mark.parametrize("how", ["disabled", "weight 0", "removed"])
def test_a_primary_gone_any_way_brings_the_backups_in(how):
    pool = Pool(virtual_server("rr", {"p": {}, "b": {"backup": True}}), 0.0)
    p = pool.by_name["p"]
    if how == "disabled":
        pool.set_state(p, DISABLED, 1.0)
    elif how == "weight 0":
        pool.set_weight(p, 0, 1.0)
    else:
        config = pool.config
        pool.reconfigure(replace(config, real_servers=config.real_servers[1:]), 1.0)
    assert picks(pool, 2, 1.0) == ["b", "b"]
    if how == "disabled":
        pool.set_state(p, ENABLED, 2.0)
        assert picks(pool, 2, 2.0) == ["p", "p"]


def test_a_reload_may_turn_a_primary_into_a_backup_and_back():
    pool = Pool(virtual_server("rr", {"a": {}, "b": {}}), 0.0)
    config = pool.config
    a, b = config.real_servers
    pool.reconfigure(replace(config, real_servers=(a, replace(b, backup=True))), 1.0)
    assert picks(pool, 2, 1.0) == ["a", "a"]
    pool.reconfigure(replace(config, real_servers=(replace(a, backup=True), b)), 2.0)
    assert picks(pool, 2, 2.0) == ["b", "b"]
    pool.reconfigure(
        replace(config, real_servers=(replace(a, backup=True), replace(b, backup=True))), 3.0
    )
    assert sorted(picks(pool, 2, 3.0)) == ["a", "b"]  # only backups: they serve
    assert pool.statistics().real_servers[0].backup is True
