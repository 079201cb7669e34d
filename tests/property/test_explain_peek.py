"""Hypothesis over every scheduler: explain's peek is the next pick, and changes nothing.

`lbproxy explain` and `GET .../explain` (SPEC §24) answer from `Scheduler.peek` and
`Persistence.peek`; for random states of every scheduler (with and without persistence)
the answer must be the server the very next `Pool.pick` returns for that client, and
asking must not change which servers later picks return.
"""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from lbproxy.core import schedulers
from lbproxy.core.explain import BACKUP, PERSISTENCE, REJECT, SCHEDULER, explain
from lbproxy.core.persistence import Persistence
from lbproxy.core.schedulers.heap import KeyedHeap
from tests.property.support import build, operations, server_options

# The states explored are those of the scheduler properties (tests/property/support.py).
SCHEDULERS = schedulers.available()


def run(pool, ops, leases, now):
    for op in ops:
        kind = op[0]
        if kind == "connect":
            client = (f"10.0.0.{op[1]}", 40000 + op[1])
            rs = pool.pick(now, (), client)
            if rs is not None:
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
                pool.set_weight(rs, op[2], now)
            else:
                pool.report_value(rs, op[2], now)
    return now


@settings(max_examples=200, deadline=None)
@given(
    scheduler=st.sampled_from(SCHEDULERS),
    options=st.lists(server_options, min_size=1, max_size=8),
    ops=operations,
    persistence=st.booleans(),
    asker=st.integers(0, 9),
    later=st.lists(st.integers(0, 9), min_size=1, max_size=12),
)
def test_explain_names_the_next_pick_and_changes_nothing(
    scheduler, options, ops, persistence, asker, later
):
    pool = build(scheduler, options, persistence)
    leases: list = []
    now = run(pool, ops, leases, 0.0)
    twin = copy.deepcopy((pool, leases))  # the same state, never explained
    client = (f"10.0.0.{asker}", 40000 + asker)
    pool.advance(now)  # what pick and explain both do first
    peeked = pool.scheduler.peek(client if pool.reads_client else None, now)
    answer = explain(pool, client, now)
    picked = pool.pick(now, (), client)
    assert answer.pick == (picked.name if picked is not None else None)
    if answer.by != PERSISTENCE:  # the scheduler's own peek is its next pick
        assert peeked is picked
    if picked is None:
        assert answer.by == REJECT
    elif answer.by != PERSISTENCE:
        assert answer.by == (
            BACKUP if picked.backup else "maglev" if scheduler == "maglev" else SCHEDULER
        )
    for verdict in answer.servers:
        rs = pool.by_name[verdict.name]
        assert verdict.eligible == rs.available
        assert (verdict.why is None) == rs.available
        assert (verdict.score is None) != rs.available
    # Asking changed nothing: the twin, never asked, makes the same picks from here on.
    twin_pool = twin[0]
    for number in [asker, *later]:
        address = (f"10.0.0.{number}", 40000 + number)
        ours, theirs = pool.pick(now, (), address), twin_pool.pick(now, (), address)
        assert (ours and ours.name) == (theirs and theirs.name)
        if ours is not None:
            pool.take(ours, now, None, address)
            twin_pool.take(theirs, now, None, address)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["set", "discard", "min"]), st.integers(0, 9), st.integers(0, 5)),
        max_size=80,
    )
)
def test_heap_peek_is_min_and_leaves_the_heap_as_it_was(ops):
    heap = KeyedHeap()
    for op, item, key in ops:
        if op == "set":
            heap.set(item, (key,))
        elif op == "discard":
            heap.discard(item)
        else:
            heap.min()
        before = list(heap._heap)
        peeked = heap.peek()
        assert heap._heap == before  # nothing popped, nothing pushed
        assert peeked == heap.min()


def test_persistence_peek_changes_nothing_and_agrees_with_lookup():
    table = Persistence(timeout=10.0, max_entries=4)
    entry = table.acquire("10.0.0.1", "a", now=0.0)
    table.release(entry, now=1.0)  # idle: expires at 11
    counts = dict(table.lookups)
    assert table.peek("10.0.0.1", 5.0) is entry and table.peek("10.0.0.2", 5.0) is None
    assert table.peek("10.0.0.1", 11.0) is None  # expired, but not dropped by a peek
    assert "10.0.0.1" in table.entries and table.lookups == counts
    assert table.lookup("10.0.0.1", 11.0) is None  # the lookup the pick makes agrees
