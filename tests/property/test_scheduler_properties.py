"""Hypothesis over every registered scheduler: what any scheduler must never do.

Connections come from a few client addresses (maglev hashes them), and half of the
examples run with client persistence on (SPEC §12), which must obey the same rules.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from lbproxy.core import schedulers
from lbproxy.core.pool import ENABLED, Pool
from tests.factories import SNMP, virtual_server
from tests.property.support import build, operations, server_options

SCHEDULERS = schedulers.available()


def online(rs) -> bool:
    return rs.state == ENABLED and rs.health.up and rs.effective_weight > 0


def has_room(rs) -> bool:
    return rs.max_connections == 0 or rs.active < rs.max_connections


def must_be_available(pool: Pool, rs) -> bool:
    # a backup only while no primary is available: a primary at its max_connections is
    # not (SPEC §3, §13, §16: backups serve while every primary is full)
    primaries_available = any(online(s) and has_room(s) and not s.backup for s in pool.servers)
    return online(rs) and has_room(rs) and not (rs.backup and primaries_available)


def assert_heap_keys_current(pool: Pool) -> None:
    """A heap scheduler's heap holds each available server at the key its key() gives
    now: the inline fast paths of take and drop (rr, wrr; the aliases of _rekey) must
    not drift from key()."""
    scheduler = pool.scheduler
    if isinstance(scheduler, schedulers.HeapScheduler):
        for rs, entry in scheduler.heap.entries.items():
            assert entry[:-2] == scheduler.key(rs), (scheduler.name, rs.name)


@settings(max_examples=150, deadline=None)
@given(
    scheduler=st.sampled_from(SCHEDULERS),
    options=st.lists(server_options, min_size=1, max_size=8),
    ops=operations,
    persistence=st.booleans(),
)
def test_never_picks_an_unavailable_server_and_none_only_when_none_is_available(
    scheduler, options, ops, persistence
):
    pool = build(scheduler, options, persistence)
    leases = []
    now = 0.0
    for op in ops:
        kind = op[0]
        if kind == "connect":
            client = (f"10.0.0.{op[1]}", 40000 + op[1])
            rs = pool.pick(now, (), client)
            if rs is None:
                assert not any(must_be_available(pool, s) for s in pool.servers)
            else:
                assert must_be_available(pool, rs), (rs, rs.state, rs.health.up)
                leases.append(pool.take(rs, now, None, client))
        elif kind == "close" and leases:
            pool.drop(leases.pop(op[1] % len(leases)), now)
        elif kind == "tick":
            now += op[1] / 10
        elif kind in ("state", "health", "weight", "snmp"):
            rs = pool.servers[op[1] % len(pool.servers)]
            if kind == "state":
                pool.set_state(rs, op[2], now)
            elif kind == "health":
                for _ in range(3):
                    pool.record_health(rs, op[2], now)
            elif kind == "weight":
                assert pool.set_weight(rs, op[2], now) is None
            else:
                pool.report_value(rs, op[2], now)
        assert_heap_keys_current(pool)
    # the counts stay true whatever happened
    for rs in pool.servers:
        assert rs.active == sum(1 for lease in leases if lease.server is rs)
        assert 0 <= rs.sched_active <= rs.active
    assert pool.active == len(leases)
    if pool.persistence is not None:
        table = pool.persistence
        assert len(table) <= table.max_entries
        live = [lease.sticky for lease in leases if lease.sticky is not None]
        # (an entry evicted while its connection was open no longer counts)
        open_by_client = Counter(e.key for e in live if table.entries.get(e.key) is e)
        for key, entry in table.entries.items():
            assert entry.active == open_by_client[key], (key, entry.active)
        assert pool.persistence_entries(now + 1.0) == sum(
            1 for e in table.entries.values() if e.active
        )


@settings(max_examples=60, deadline=None)
@given(
    scheduler=st.sampled_from(["wrr", "wlc", "dwd"]),
    weights=st.lists(st.integers(1, 6), min_size=2, max_size=6),
    hold=st.booleans(),
)
def test_long_run_shares_match_weights(scheduler, weights, hold):
    if scheduler == "wlc" and not hold:
        hold = True  # least-connections follows weights only over open connections
    if scheduler == "dwd":
        hold = True
    servers = {f"s{i}": {"weight": w, "snmp": SNMP} for i, w in enumerate(weights)}
    extra = {"snmp": SNMP} if scheduler == "dwd" else {}
    pool = Pool(virtual_server(scheduler, servers, **extra), 0)
    if scheduler == "dwd":
        for rs, w in zip(pool.servers, weights, strict=True):
            pool.report_value(rs, w, 0)
    total = sum(weights) * 20
    counts: Counter[str] = Counter()
    for _ in range(total):
        rs = pool.pick(0)
        lease = pool.take(rs, 0)
        if not hold:
            pool.drop(lease, 0)
        counts[rs.name] += 1
    for i, w in enumerate(weights):
        assert abs(counts[f"s{i}"] - w * 20) <= 1, (counts, weights)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12))
def test_rr_and_lc_give_equal_shares(n):
    for scheduler in ("rr", "lc"):
        pool = Pool(virtual_server(scheduler, {f"s{i}": {} for i in range(n)}), 0)
        counts = Counter()
        for _ in range(n * 7):
            rs = pool.pick(0)
            pool.drop(pool.take(rs, 0), 0)
            counts[rs.name] += 1
        assert set(counts.values()) == {7}


@settings(max_examples=150, deadline=None)
@given(
    scheduler=st.sampled_from(SCHEDULERS),
    options=st.lists(server_options, min_size=1, max_size=6),
    asks=st.lists(st.one_of(st.none(), st.integers(0, 7)), max_size=40),
)
def test_locate_answers_only_available_servers_and_holds_nothing(scheduler, options, asks):
    """A locator answer (SPEC §10) is a pick like any other: never an unavailable server,
    None only when none is available, and no connection stays counted."""
    pool = build(scheduler, options)
    for ask in asks:
        current = None if ask is None else f"s{ask}"
        located = pool.locator.locate(1.0, current)
        if located is None:
            assert not any(must_be_available(pool, s) for s in pool.servers)
            continue
        if located.replace is False:
            assert located.server.name == current and must_be_available(pool, located.server)
        else:
            assert must_be_available(pool, located.server)
            assert located.server.name != current or located.replace is None
    assert pool.active == 0 and all(rs.active == 0 for rs in pool.servers)
