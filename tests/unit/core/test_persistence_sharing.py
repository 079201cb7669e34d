"""Shared persistence's pure half (SPEC §18, core/persistence.py): what goes into the
outbox (entries created or moved, and refreshes), what `learn` does with another
instance's entry, through the real Pool on a fake clock."""

from __future__ import annotations

from tests.unit.core.support import connect, lookups, sticky_pool


def shared_pool(timeout: float = 10.0):
    pool = sticky_pool("rr", timeout=timeout)
    pool.persistence.outbox = {}  # what the cluster sync gives every table
    return pool


def outbox(pool) -> dict[str, str]:
    return {key: entry.server.name for key, entry in pool.persistence.outbox.items()}


def test_new_entries_go_to_the_outbox_and_hits_do_not():
    pool = shared_pool()
    assert [connect(pool, host, 0) for host in ("10.0.0.1", "10.0.0.2")] == ["a", "b"]
    assert outbox(pool) == {"10.0.0.1": "a", "10.0.0.2": "b"}
    pool.persistence.outbox.clear()  # flushed
    assert connect(pool, "10.0.0.1", 1) == "a"  # a hit, shared 1 s ago: nothing to say
    assert outbox(pool) == {}


def test_a_moved_entry_goes_to_the_outbox():
    pool = shared_pool()
    connect(pool, "10.0.0.1", 0)
    pool.persistence.outbox.clear()
    pool.set_state(pool.by_name["a"], "disabled", 1)
    assert connect(pool, "10.0.0.1", 1) == "b"
    assert outbox(pool) == {"10.0.0.1": "b"}


def test_an_entry_in_use_is_shared_again_after_half_the_timeout():
    pool = shared_pool(timeout=10)
    connect(pool, "10.0.0.1", 0)
    pool.persistence.outbox.clear()
    connect(pool, "10.0.0.1", 4.9)
    assert outbox(pool) == {}
    connect(pool, "10.0.0.1", 5.0)  # the others' copies would expire at 10
    assert outbox(pool) == {"10.0.0.1": "a"}


def test_without_a_cluster_there_is_no_outbox():
    pool = sticky_pool()
    connect(pool, "10.0.0.1", 0)
    assert pool.persistence.outbox is None


def test_a_learned_entry_is_hit_without_a_lookup_or_an_outbox_line():
    pool = shared_pool(timeout=10)
    pool.persistence.learn("10.0.0.9", pool.by_name["c"], 4.0, now=0)
    assert lookups(pool) == {"hit": 0, "miss": 0, "moved": 0}
    assert outbox(pool) == {}
    assert connect(pool, "10.0.0.9", 1) == "c"  # rr would have said a
    assert lookups(pool) == {"hit": 1, "miss": 0, "moved": 0}
    assert outbox(pool) == {}  # learned at 0: shared then, not ours to repeat at once


def test_a_learned_entry_expires_with_its_time_left():
    pool = shared_pool(timeout=10)
    pool.persistence.learn("10.0.0.9", pool.by_name["c"], 4.0, now=0)
    assert pool.persistence_entries(3.9) == 1
    assert connect(pool, "10.0.0.9", 4.0) == "a"  # expired: scheduled afresh
    assert outbox(pool) == {"10.0.0.9": "a"}


def test_learning_moves_a_client_whose_connection_stays_open():
    pool = shared_pool(timeout=10)
    held: list = []
    assert connect(pool, "10.0.0.1", 0, hold=held) == "a"
    pool.persistence.learn("10.0.0.1", pool.by_name["b"], 10.0, now=1)  # moved elsewhere
    assert connect(pool, "10.0.0.1", 2) == "b"
    pool.drop(held[0], 3)  # the old connection ends on a, counted right
    assert pool.by_name["a"].active == 0 and pool.persistence.entries["10.0.0.1"].active == 0


def test_learning_beyond_max_entries_evicts_the_least_recent():
    pool = sticky_pool(max_entries=2)
    for i, name in enumerate("abc"):
        pool.persistence.learn(f"10.0.0.{i}", pool.by_name[name], 10, now=i)
    assert list(pool.persistence.entries) == ["10.0.0.1", "10.0.0.2"]
