"""Hypothesis over every scheduler with outlier ejection and panic (SPEC §23): whatever
happens (connect failures and successes, health, states, weights, time), the pool's
kept counts agree with a recount from scratch, the cap holds, and picks follow the rule
in force: available and not ejected, or, in panic, any enabled primary with room."""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from lbproxy.config.model import HealthCheckConfig, OutlierDetectionConfig
from lbproxy.core import schedulers
from lbproxy.core.pool import ENABLED, Pool
from tests.factories import virtual_server

# Schedulers without SNMP weights: a server's base weight is its static weight here.
SCHEDULERS = [name for name in schedulers.available() if name not in ("dwd", "dwr")]
CHECKS = HealthCheckConfig(type="tcp", rise=1, fall=1)

server_options = st.fixed_dictionaries(
    {
        "weight": st.integers(0, 3),
        "max_connections": st.integers(0, 3),
        "state": st.sampled_from(["enabled", "enabled", "drain", "disabled"]),
        "backup": st.sampled_from([False, False, False, True]),
    }
)

operations = st.lists(
    st.one_of(
        st.tuples(st.just("connect"), st.integers(0, 7)),
        st.tuples(st.just("fail"), st.integers(0, 7)),
        # a connect picked earlier fails now (a server that was not ejected then)
        st.tuples(st.just("fail_on"), st.integers(0, 7)),
        st.tuples(st.just("fail_on"), st.integers(0, 7)),
        st.tuples(st.just("close"), st.integers(0, 50)),
        st.tuples(
            st.just("state"), st.integers(0, 7), st.sampled_from(["enabled", "drain", "disabled"])
        ),
        st.tuples(st.just("health"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("weight"), st.integers(0, 7), st.integers(0, 3)),
        st.tuples(st.just("tick"), st.integers(1, 40)),
    ),
    min_size=10,
    max_size=80,
)


def assert_heap_keys_current(pool: Pool) -> None:
    """A heap scheduler holds each available server at the key it gives now: a change
    of panic re-applies servers mid-change, and their weights must not go stale."""
    scheduler = pool.scheduler
    if isinstance(scheduler, schedulers.HeapScheduler):
        assert set(scheduler.heap.entries) == {rs for rs in pool.servers if rs.available}
        for rs, entry in scheduler.heap.entries.items():
            assert entry[:-2] == scheduler.key(rs), (scheduler.name, rs.name)


def ejected(pool: Pool, rs) -> bool:
    return pool.ejected_until(rs) is not None


def has_room(rs) -> bool:
    return rs.max_connections == 0 or rs.active < rs.max_connections


def enabled_primary(rs) -> bool:
    return not rs.backup and rs.state == ENABLED and rs.static_weight > 0


def up(rs) -> bool:
    return rs.state == ENABLED and rs.health.up and rs.static_weight > 0


def panic_now(pool: Pool) -> bool:
    threshold = pool.config.panic_threshold
    enabled = [rs for rs in pool.servers if enabled_primary(rs)]
    available = [rs for rs in enabled if up(rs) and not ejected(pool, rs)]
    backup_up = any(rs.backup and up(rs) for rs in pool.servers)
    return bool(threshold and enabled and len(available) * 100 < threshold * len(enabled)) and (
        not backup_up
    )


def may_pick(pool: Pool, rs) -> bool:
    if pool.panic:
        return enabled_primary(rs) and has_room(rs)
    primary_free = any(
        up(s) and not ejected(pool, s) and has_room(s) and not s.backup for s in pool.servers
    )
    return up(rs) and not ejected(pool, rs) and has_room(rs) and not (rs.backup and primary_free)


@settings(max_examples=200, deadline=None)
@given(
    scheduler=st.sampled_from(SCHEDULERS),
    options=st.lists(server_options, min_size=2, max_size=8),
    ops=operations,
    threshold=st.sampled_from([0, 30, 50, 75, 100]),
    percent=st.sampled_from([0, 34, 50, 100]),
)
def test_ejection_and_panic_keep_their_rules(scheduler, options, ops, threshold, percent):
    outlier = OutlierDetectionConfig(
        consecutive_failures=2,
        base_ejection_time=1.0,
        max_ejection_time=3.0,
        max_ejection_percent=percent,
    )
    servers = {f"s{i}": opts for i, opts in enumerate(options)}
    extra = {"table_size": 101} if scheduler == "maglev" else {}
    config = virtual_server(
        scheduler,
        servers,
        health_check=CHECKS,
        outlier_detection=outlier,
        panic_threshold=threshold,
        slow_start=2.0,
        **extra,
    )
    pool = Pool(config, 0.0)
    leases = []
    now = 0.0
    saw_panic = False
    primaries = sum(1 for rs in pool.servers if not rs.backup)
    for op in ops:
        kind = op[0]
        if kind in ("connect", "fail"):
            client = (f"10.0.0.{op[1]}", 40000 + op[1])
            rs = pool.pick(now, (), client)
            if rs is None:
                assert not any(may_pick(pool, s) for s in pool.servers)
                continue
            assert may_pick(pool, rs), (rs, pool.panic, ejected(pool, rs), rs.health.up)
            lease = pool.take(rs, now, None, client)
            if kind == "fail":
                pool.drop(lease, now)
                pool.connect_failed(rs, now)
            else:
                if rs.outlier is not None:
                    pool.connect_completed(rs, now)
                leases.append(lease)
        elif kind == "close":
            if leases:
                pool.drop(leases.pop(op[1] % len(leases)), now)
        elif kind == "fail_on":
            pool.connect_failed(pool.servers[op[1] % len(pool.servers)], now)
        elif kind == "tick":
            now += op[1] / 10
            pool.advance(now)
        else:
            rs = pool.servers[op[1] % len(pool.servers)]
            if kind == "state":
                pool.set_state(rs, op[2], now)
            elif kind == "health":
                pool.record_health(rs, op[2], now)
            else:
                assert pool.set_weight(rs, op[2], now) is None
        held_back = [rs for rs in pool.servers if ejected(pool, rs)]
        assert len(held_back) <= max(0, min(primaries * percent // 100, primaries - 1))
        assert not any(rs.backup for rs in held_back)
        saw_panic |= pool.panic
        assert pool.panic == panic_now(pool), (
            threshold,
            [(s.name, s.health.up) for s in pool.servers],
        )
        assert pool.available_servers == sum(1 for rs in pool.servers if rs.available)
        assert_heap_keys_current(pool)
    event(f"ejections: {sum(rs.counters.ejections for rs in pool.servers) > 0}")
    event(f"panic seen: {saw_panic}")
    # once every ejection's time is up, none is left
    pool.advance(now + 10.0)
    assert not any(ejected(pool, rs) for rs in pool.servers)
