"""Client persistence (SPEC §12) through the real Pool, on a fake clock, and maglev's
fixed hashes."""

from __future__ import annotations

import subprocess
import sys

from lbproxy.config.model import PersistenceConfig
from lbproxy.core.persistence import Persistence
from lbproxy.core.pool import Pool
from lbproxy.core.schedulers.maglev import MaglevOptions, client_hash, permutation, populate
from tests.factories import virtual_server
from tests.unit.core.support import connect, lookups, sticky_pool


def test_a_client_keeps_its_server_where_rr_would_rotate():
    pool = sticky_pool()
    assert [connect(pool, "10.0.0.1", t) for t in range(4)] == ["a"] * 4
    assert connect(pool, "10.0.0.2", 5) == "b"
    assert connect(pool, "10.0.0.1", 6) == "a"
    assert lookups(pool) == {"hit": 4, "miss": 2, "moved": 0}
    assert pool.persistence_entries(6) == 2


def test_a_persistence_hit_is_not_a_pick_rr_keeps_its_turn():
    # Were a hit a pick, ten sticky connections to a would advance a's turn each, and
    # the next new clients would get b, c, b. A hit bypasses the scheduler (LVS templates,
    # HAProxy stick tables): the rotation goes on from where the last pick left it.
    pool = sticky_pool()
    assert [connect(pool, "10.0.0.1", t) for t in range(10)] == ["a"] * 10
    assert [connect(pool, f"10.0.1.{i}", 11) for i in range(3)] == ["b", "c", "a"]
    assert lookups(pool) == {"hit": 9, "miss": 4, "moved": 0}


def test_wrr_keeps_its_shares_whatever_a_sticky_client_does():
    pool = Pool(
        virtual_server(
            "wrr",
            {"a": {"weight": 1}, "b": {"weight": 2}},
            persistence=PersistenceConfig(timeout=10.0, max_entries=100),
        ),
        0,
    )
    sticky = connect(pool, "10.0.0.1", 0)
    for t in range(20):
        assert connect(pool, "10.0.0.1", t) == sticky
    new_clients = [connect(pool, f"10.0.1.{i}", 21) for i in range(6)]
    # Six picks after the first: weights 1:2 hold over the seven picks in all.
    picked = [sticky, *new_clients]
    assert sorted(picked[:6].count(name) for name in "ab") == [2, 4]


def test_sticky_connections_still_count_for_least_connections():
    pool = sticky_pool("lc")
    held: list = []
    assert [connect(pool, "10.0.0.1", t, held) for t in range(3)] == ["a"] * 3
    assert pool.by_name["a"].active == 3 and pool.by_name["a"].sched_active == 3
    # a holds 3 sticky connections: new clients go to b and c, not to a.
    assert sorted(connect(pool, f"10.0.1.{i}", 4, held) for i in range(4)) == [
        "b",
        "b",
        "c",
        "c",
    ]


def test_a_locator_answer_from_persistence_does_not_move_rr():
    pool = sticky_pool()
    client = ("10.0.0.1", 5353)
    assert [pool.locator.locate(t, client=client).server.name for t in range(5)] == ["a"] * 5
    assert [pool.locator.locate(6, client=(f"10.0.1.{i}", 53)).server.name for i in range(3)] == [
        "b",
        "c",
        "a",
    ]


def test_an_unavailable_server_moves_the_client_once_and_the_entry_follows():
    pool = sticky_pool()
    assert connect(pool, "10.0.0.1", 0) == "a"
    pool.set_state(pool.by_name["a"], "drain", 1)
    moved_to = connect(pool, "10.0.0.1", 2)
    assert moved_to in ("b", "c")
    pool.set_state(pool.by_name["a"], "enabled", 3)
    assert connect(pool, "10.0.0.1", 4) == moved_to  # stays where it moved
    assert lookups(pool) == {"hit": 1, "miss": 1, "moved": 1}


def test_an_entry_expires_timeout_after_the_last_connection_ended():
    pool = sticky_pool(timeout=10)
    held: list = []
    assert connect(pool, "10.0.0.1", 0, held) == "a"
    # Open for 100 s: an entry with an open connection never expires.
    assert connect(pool, "10.0.0.1", 100) == "a"
    assert pool.persistence_entries(100) == 1
    pool.drop(held.pop(), 100)
    assert pool.persistence_entries(109.9) == 1
    assert pool.persistence_entries(110) == 0  # the gauge falls with no client arriving
    assert connect(pool, "10.0.0.1", 111) == "b"  # back to the scheduler: rr's next
    assert lookups(pool) == {"hit": 1, "miss": 2, "moved": 0}


def test_expired_entries_are_dropped_lazily_and_by_the_bounded_sweep():
    table = Persistence(timeout=1.0, max_entries=1000)
    for i in range(20):
        table.release(table.acquire(f"c{i}", "a", 0.0), 0.0)
    assert table.lookup("c3", 5.0) is None  # expired: dropped on sight
    assert len(table) == 20 - 1 - 4  # ... and four more from the front
    assert table.expire(5.0) == 15 and len(table) == 0


def test_a_lookup_sweeps_only_once_the_oldest_idle_entry_is_due():
    table = Persistence(timeout=1.0, max_entries=1000)
    for i in range(10):
        table.release(table.acquire(f"c{i}", "a", 0.1 * i), 0.1 * i)  # expire at 1.0 .. 1.9
    table.lookup("x", 0.5)
    table.lookup("x", 0.99)
    assert len(table) == 10
    table.lookup("x", 1.25)  # c0, c1, c2 are due: dropped from the front
    assert next(iter(table.entries)) == "c3"
    table.release(table.acquire("late", "a", 1.3), 1.3)  # expires at 2.3, at the end
    assert table.lookup("c9", 1.3) is not None  # and c3, due at 1.3, is swept
    assert table.expire(2.0) == 6 and list(table.entries) == ["late"]
    assert table.lookup("late", 2.3) is None and len(table) == 0


def test_lru_eviction_beyond_max_entries_prefers_idle_entries():
    pool = sticky_pool(max_entries=2)
    held: list = []
    connect(pool, "10.0.0.1", 0, held)
    connect(pool, "10.0.0.2", 1)
    connect(pool, "10.0.0.1", 2)  # touched: 10.0.0.2 is now the least recently used
    connect(pool, "10.0.0.3", 3)
    assert list(pool.persistence.entries) == ["10.0.0.1", "10.0.0.3"]
    # 10.0.0.1 is the least recently touched, but a connection of it is open: in use,
    # so the idle 10.0.0.3 goes first.
    connect(pool, "10.0.0.4", 4)
    assert list(pool.persistence.entries) == ["10.0.0.1", "10.0.0.4"]
    assert pool.persistence.evicted == 2


def test_when_every_entry_is_in_use_the_oldest_is_evicted_and_its_release_changes_nothing():
    pool = sticky_pool(max_entries=2)
    held: list = []
    connect(pool, "10.0.0.1", 0, held)
    connect(pool, "10.0.0.2", 1, held)
    connect(pool, "10.0.0.3", 2, held)
    assert len(pool.persistence) == 2 and pool.persistence.evicted == 1
    evicted = next(lease for lease in held if lease.sticky.key not in pool.persistence.entries)
    before = list(pool.persistence.entries)
    pool.drop(evicted, 3)
    assert list(pool.persistence.entries) == before
    assert all(entry.active == 1 for entry in pool.persistence.entries.values())


def test_persistence_works_with_every_scheduler_and_ipv4_mapped_addresses():
    pool = sticky_pool("wlc")
    first = connect(pool, "10.0.0.9", 0)
    assert connect(pool, "::ffff:10.0.0.9", 1) == first
    assert lookups(pool)["hit"] == 1


def test_a_reload_keeps_the_entries_and_removing_persistence_drops_them():
    pool = sticky_pool()
    connect(pool, "10.0.0.1", 0)
    config = pool.config
    pool.reconfigure(config.__class__(**{**_fields(config), "scheduler": "lc"}), 1)
    assert connect(pool, "10.0.0.1", 2) == "a"
    changes = pool.reconfigure(config.__class__(**{**_fields(config), "persistence": None}), 3)
    assert "persistence changed" in changes
    assert pool.persistence is None and pool.persistence_entries(3) == 0


def _fields(config) -> dict:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def test_without_persistence_the_client_is_not_looked_at():
    pool = Pool(virtual_server("rr", {"a": {}, "b": {}}), 0)
    names = [pool.pick(0, (), ("10.0.0.1", 1)).name for _ in range(1)]
    lease = pool.take(pool.by_name["a"], 0, None, ("10.0.0.1", 1))
    assert lease.sticky is None and pool.persistence is None and names == ["a"]


# -- maglev -------------------------------------------------------------------------


def test_maglev_test_vector():
    # Pinned: a change here changes which server every client of a running cluster
    # gets, so lbproxy versions could no longer be mixed behind one ECMP route.
    assert permutation("s1", 65537) == PERMUTATION_S1
    table = populate(["a", "b", "c"], ["a", "b", "c"], [1.0, 1.0, 1.0], 101)
    assert "".join(table) == VECTOR
    assert client_hash(("192.0.2.1", 1234)) == CLIENT_HASH
    assert client_hash(("192.0.2.1", 1234), with_port=True) == CLIENT_PORT_HASH


VECTOR = (
    "aaaacaccbbcbcacacabbaaaabcacbbbcbcacacbbaaaacbcabbcbcbcacabbaaaabcccbbbcbcccacbb"
    "aaaaabccbbbbcbcacacbb"
)
PERMUTATION_S1 = (18845, 21665)  # (offset, skip) from BLAKE2b of "s1"
CLIENT_HASH = 0xDB610037  # CRC-32 of "192.0.2.1"
CLIENT_PORT_HASH = 0xDD6F1F56  # ... continued over the port, 2 bytes big-endian


def test_maglev_picks_do_not_depend_on_the_process_hash_seed():
    code = (
        "from lbproxy.core.pool import Pool\n"
        "from tests.factories import virtual_server\n"
        "pool = Pool(virtual_server('maglev', {n: {} for n in 'abcdefg'}), 0)\n"
        "print(''.join(pool.pick(0, (), (f'10.0.{i}.{j}', 1)).name"
        " for i in range(4) for j in range(50)))\n"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout
        for seed in ("1", "2", "random")
    }
    assert len(outputs) == 1
    assert len(set(outputs.pop().strip())) == 7  # 200 clients reach all seven servers


def test_the_maglev_table_is_rebuilt_only_when_servers_or_weights_change():
    pool = Pool(virtual_server("maglev", {"a": {"max_connections": 1}, "b": {}, "c": {}}), 0)
    clients = [(f"10.0.0.{i}", 1) for i in range(1, 60)]
    pool.pick(0)
    table = pool.scheduler.table
    leases = [pool.take(pool.pick(0, (), c), 0, None, c) for c in clients[:5]]
    for lease in leases:
        pool.drop(lease, 0)
    assert pool.scheduler.table is table  # connections come and go: same table
    a = pool.by_name["a"]
    on_a = [c for c in clients if pool.pick(0, (), c) is a]
    held = pool.take(a, 0, None, on_a[0])  # a is full now: its clients spill over...
    assert all(pool.pick(0, (), c) is not a for c in on_a)
    assert pool.scheduler.table is table  # ...without a rebuild
    pool.drop(held, 0)
    assert all(pool.pick(0, (), c) is a for c in on_a) and pool.scheduler.table is table
    pool.set_weight(pool.by_name["b"], 3, 1)
    pool.pick(1)
    assert pool.scheduler.table is not table  # a weight change rebuilds, once
    rebuilt = pool.scheduler.table
    pool.set_state(pool.by_name["c"], "drain", 2)
    pool.set_state(pool.by_name["c"], "enabled", 2)
    pool.pick(2)
    assert pool.scheduler.table is not rebuilt
    assert pool.scheduler.explain(a) == f"{pool.scheduler.entries[a]}/65537 slots"


def test_hash_key_source_port_spreads_one_client_and_source_keeps_it_on_one_server():
    servers = {f"s{i}": {} for i in range(5)}
    by_port = Pool(virtual_server("maglev", servers, hash_key="source_port"), 0)
    by_source = Pool(virtual_server("maglev", servers), 0)
    ports = range(40000, 40500)
    spread = {by_port.pick(0, (), ("192.0.2.1", p)).name for p in ports}
    kept = {by_source.pick(0, (), ("192.0.2.1", p)).name for p in ports}
    assert spread == set(servers) and len(kept) == 1
    slot = client_hash(("192.0.2.1", 40000), with_port=True) % 65537
    assert by_port.pick(0, (), ("192.0.2.1", 40000)) is by_port.scheduler.table[slot]


def test_a_reload_with_another_table_size_rebuilds_the_table():
    pool = Pool(virtual_server("maglev", {n: {} for n in "abc"}), 0)
    pool.pick(0)
    assert len(pool.scheduler.table) == 65537
    config = pool.config
    options = MaglevOptions(table_size=101)
    changes = pool.reconfigure(config.__class__(**{**_fields(config), "options": options}), 1)
    assert changes == ["maglev table_size or hash_key changed"]
    pool.pick(1)
    assert len(pool.scheduler.table) == 101
    assert "".join(rs.name for rs in pool.scheduler.table) == VECTOR


# -- a locator answer is a connection that ends at once (SPEC §10) ------------------------


def test_a_locate_makes_an_entry_that_lives_timeout_from_the_answer():
    pool = sticky_pool(timeout=10.0)
    asker = ("10.0.0.1", 40000)

    def locate(now: float, client=asker) -> str:
        return pool.locator.locate(now, client=client).server.name

    assert locate(0.0) == "a"  # a miss: rr picks, the entry is made
    assert locate(0.0, ("10.0.0.2", 1)) == "b"  # another asker: rr goes on
    assert [locate(t) for t in (5.0, 14.9)] == ["a", "a"]  # hits; each renews the entry
    assert lookups(pool) == {"hit": 2, "miss": 2, "moved": 0}
    assert pool.persistence_entries(24.8) == 2 - 1  # 10.0.0.2's ended at 10.0
    assert locate(24.9) == "c"  # 10 s after the last answer: gone, rr picks afresh
    assert lookups(pool) == {"hit": 2, "miss": 3, "moved": 0}
    # no asking address (a worker's endpoint without the supervisor's header): the
    # scheduler alone, nothing looked up or remembered
    assert pool.locator.locate(25.0) is not None
    assert lookups(pool) == {"hit": 2, "miss": 3, "moved": 0}
    assert pool.persistence_entries(25.0) == 1


def test_a_locate_for_an_unavailable_server_moves_the_entry():
    pool = sticky_pool(timeout=10.0)
    asker = ("10.0.0.1", 40000)
    assert pool.locator.locate(0.0, client=asker).server.name == "a"
    pool.set_state(pool.by_name["a"], "drain", 0.0)
    assert pool.locator.locate(1.0, client=asker).server.name == "b"
    pool.set_state(pool.by_name["a"], "enabled", 1.0)
    assert pool.locator.locate(2.0, client=asker).server.name == "b"  # stays where it moved
    assert lookups(pool) == {"hit": 1, "miss": 1, "moved": 1}


def test_maglev_locate_answers_an_asker_as_its_connections_are_picked():
    servers = {name: {} for name in "abcd"}
    pool = Pool(virtual_server("maglev", servers, table_size=101), 0)
    for n in range(1, 20):
        client = (f"10.0.0.{n}", 1000 + n)
        picked = pool.pick(0.0, (), client).name
        assert {pool.locator.locate(0.0, client=client).server.name for _ in range(3)} == {picked}
