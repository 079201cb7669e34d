"""The per-source table (core/per_source.py) with a fake clock: limits, window, bound."""

from __future__ import annotations

import pytest

from lbproxy.core.per_source import Limits, PerSourceTable, SourceEntry, network_key


def admitted(result: SourceEntry | bool | None) -> bool:
    return result is not None


def test_max_connections_per_network_and_release() -> None:
    table = PerSourceTable(Limits(max_connections=2))
    a = table.admit("10.0.0.1", 0.0)
    b = table.admit("10.0.0.1", 0.0)
    assert isinstance(a, SourceEntry) and isinstance(b, SourceEntry)
    assert table.admit("10.0.0.1", 0.0) is None  # the third
    assert admitted(table.admit("10.0.0.2", 0.0))  # another network
    table.release(a)
    assert admitted(table.admit("10.0.0.1", 0.0))
    assert table.refused == 1


def test_prefix_groups_addresses() -> None:
    table = PerSourceTable(Limits(max_connections=1, prefix_v4=24, prefix_v6=64))
    assert admitted(table.admit("10.0.0.1", 0.0))
    assert table.admit("10.0.0.200", 0.0) is None
    assert admitted(table.admit("10.0.1.1", 0.0))
    assert admitted(table.admit("2001:db8::1", 0.0))
    assert table.admit("2001:db8::ffff:1", 0.0) is None  # same /64
    assert admitted(table.admit("2001:db8:0:1::1", 0.0))
    assert table.admit("::ffff:10.0.0.7", 0.0) is None  # the IPv4 address, same /24


def test_network_key() -> None:
    assert network_key("10.1.2.3", 32, 64) == "10.1.2.3"
    assert network_key("::ffff:10.1.2.3", 32, 64) == "10.1.2.3"
    assert network_key("10.1.2.3", 24, 64) == (4, 0x0A0102)
    assert network_key("fe80::1%eth0", 32, 64) == network_key("fe80::2", 32, 64)
    assert network_key("not an address", 32, 64) == "not an address"


def test_rate_is_a_sliding_window() -> None:
    table = PerSourceTable(Limits(rate=3, interval=1.0))
    for t in (0.0, 0.4, 0.8):
        assert admitted(table.admit("10.0.0.1", t))
    assert table.admit("10.0.0.1", 0.9) is None  # 3 within (−0.1, 0.9]
    assert table.admit("10.0.0.1", 0.99) is None  # refused ones do not count ...
    assert admitted(table.admit("10.0.0.1", 1.0))  # ... so 0.0 has left the window here
    assert table.admit("10.0.0.1", 1.3) is None  # 0.4, 0.8, 1.0 within
    assert admitted(table.admit("10.0.0.1", 1.45))  # 0.4 left
    assert admitted(table.admit("10.0.0.1", 1.85))  # 0.8 left
    assert table.admit("10.0.0.1", 1.9) is None  # 1.0, 1.45, 1.85: not a fixed bucket


def test_refused_arrival_counts_as_seen_and_idle_lru_is_forgotten_first() -> None:
    table = PerSourceTable(Limits(max_connections=1, max_tracked=3))
    a = table.admit("10.0.0.1", 0.0)  # busy
    assert isinstance(a, SourceEntry)
    b = table.admit("10.0.0.2", 0.0)
    assert isinstance(b, SourceEntry)
    table.release(b)  # idle, seen at its end
    c = table.admit("10.0.0.3", 0.0)
    assert isinstance(c, SourceEntry)
    table.release(c)
    assert table.admit("10.0.0.1", 0.1) is None  # refused: still busy, tracked
    b = table.admit("10.0.0.2", 0.2)  # seen again: now .3 is the least recently seen idle
    assert isinstance(b, SourceEntry)
    table.release(b)
    assert table.admit("10.0.0.4", 0.3) is not None  # forgets .3
    assert len(table) == 3
    keys = {e.key for e in table.entries()}
    assert keys == {"10.0.0.1", "10.0.0.2", "10.0.0.4"}


def test_full_of_busy_networks_admits_untracked() -> None:
    table = PerSourceTable(Limits(max_connections=1, max_tracked=2))
    table.admit("10.0.0.1", 0.0)
    table.admit("10.0.0.2", 0.0)
    assert table.admit("10.0.0.3", 0.0) is True
    assert table.untracked == 1 and len(table) == 2


def test_remote_counts_add_to_local() -> None:
    table = PerSourceTable(Limits(max_connections=3, rate=4, interval=1.0))
    table.set_remote({"10.0.0.1": (2, 0)})
    assert admitted(table.admit("10.0.0.1", 0.0))
    assert table.admit("10.0.0.1", 0.0) is None  # 1 here + 2 there
    table.set_remote({"10.0.0.2": (0, 3)})  # the last publication replaces the one before
    assert admitted(table.admit("10.0.0.1", 0.1))
    assert admitted(table.admit("10.0.0.2", 0.1))
    assert table.admit("10.0.0.2", 0.2) is None  # 1 here + 3 there within the interval
    assert sorted(table.local_counts(0.3)) == [("10.0.0.1", 2, 2), ("10.0.0.2", 1, 1)]


def test_reconfigure_keeps_counts_unless_prefixes_change() -> None:
    table = PerSourceTable(Limits(max_connections=5, rate=4))
    for t in (0.0, 0.1, 0.2):
        table.admit("10.0.0.1", t)
    same = table.reconfigure(Limits(max_connections=2, rate=2))
    assert same is table
    assert table.admit("10.0.0.1", 0.3) is None  # 3 open > 2
    other = table.reconfigure(Limits(max_connections=2, rate=2, prefix_v4=24))
    assert other is not table and len(other) == 0


@pytest.mark.parametrize("rate", [1, 2, 7])
def test_rate_change_recuts_the_ring(rate: int) -> None:
    table = PerSourceTable(Limits(rate=5, interval=10.0))
    for i in range(5):
        table.admit("10.0.0.1", float(i))
    table.reconfigure(Limits(rate=rate, interval=10.0))
    entry = next(table.entries())
    assert list(entry.times) == [float(i) for i in range(5)][-rate:]


def test_bounded_under_200000_distinct_sources() -> None:
    """200,000 distinct IPv4 and IPv6 networks, each once, a few holding a connection:
    the table stays at max_tracked, the busy networks are still there (their next
    connection refused), and the networks seen last are remembered."""
    table = PerSourceTable(Limits(max_connections=1, rate=2, max_tracked=100_000))
    busy = [table.admit(f"192.0.2.{i}", 0.0) for i in range(1, 6)]
    for i in range(100_000):
        entry = table.admit(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", 1.0 + i * 1e-5)
        assert isinstance(entry, SourceEntry)
        table.release(entry)
        entry = table.admit(f"2001:db8:{i >> 16:x}:{i & 0xFFFF:x}::1", 2.0 + i * 1e-5)
        assert isinstance(entry, SourceEntry)
        table.release(entry)
        assert len(table) <= 100_000
    assert len(table) == 100_000
    assert all(isinstance(entry, SourceEntry) and entry.open == 1 for entry in busy)
    assert all(table.admit(f"192.0.2.{i}", 3.0) is None for i in range(1, 6))
    assert table.untracked == 0
    keys = {entry.key for entry in table.entries()}
    assert network_key("2001:db8:1:869f::1", 32, 64) in keys  # the last one
    assert "10.0.0.0" not in keys  # among the first: forgotten
