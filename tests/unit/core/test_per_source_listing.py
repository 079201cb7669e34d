"""The operator's view of the per-source table (core/per_source.py): `listing` (what
`lbproxy per-source` shows, HAProxy's `show table`), `clear` (HAProxy's `clear table`)
and `network_named` (the network an operator types)."""

from __future__ import annotations

import pytest

from lbproxy.core.per_source import Limits, PerSourceTable, SourceEntry, network_named


def entry(result: SourceEntry | bool | None) -> SourceEntry:
    assert isinstance(result, SourceEntry), result
    return result


def test_listing_orders_by_open_connections_then_arrivals_and_is_bounded() -> None:
    table = PerSourceTable(Limits(max_connections=3, rate=10, interval=10.0))
    for _ in range(2):
        entry(table.admit("10.0.0.1", 0.0))  # 2 open, 2 arrivals
    table.release(entry(table.admit("10.0.0.2", 0.0)))  # 0 open, 1 arrival
    for _ in range(3):
        table.release(entry(table.admit("10.0.0.3", 0.0)))  # 0 open, 3 arrivals
    held = [entry(table.admit("10.0.0.4", 0.0)) for _ in range(3)]  # 3 open: at its limit
    rows = table.listing(1.0, 100)
    assert [(r.network, r.open, r.arrivals) for r in rows] == [
        ("10.0.0.4", 3, 3),
        ("10.0.0.1", 2, 2),
        ("10.0.0.3", 0, 3),
        ("10.0.0.2", 0, 1),
    ]
    assert [r.limited_by for r in rows] == ["max_connections", None, None, None]
    assert [r.network for r in table.listing(1.0, 2)] == ["10.0.0.4", "10.0.0.1"]
    # The window slides: past the interval the arrivals are 0, the open ones stay.
    late = table.listing(20.0, 100)
    assert [(r.network, r.open, r.arrivals) for r in late][:2] == [
        ("10.0.0.4", 3, 0),
        ("10.0.0.1", 2, 0),
    ]
    assert len(table) == 4 and held


def test_listing_names_networks_at_their_prefix_and_says_which_limit() -> None:
    table = PerSourceTable(Limits(rate=2, interval=1.0, prefix_v4=24, prefix_v6=64))
    table.release(entry(table.admit("203.0.113.7", 0.0)))
    table.release(entry(table.admit("203.0.113.9", 0.1)))  # the same /24: at its rate
    entry(table.admit("2001:db8::1", 0.2))
    rows = table.listing(0.5, 10)
    assert [(r.network, r.open, r.arrivals, r.limited_by) for r in rows] == [
        ("2001:db8::/64", 1, 1, None),
        ("203.0.113.0/24", 0, 2, "rate"),
    ]
    assert rows[0].remote_open == rows[0].remote_arrivals == 0


def test_without_rate_no_arrivals_are_kept() -> None:
    table = PerSourceTable(Limits(max_connections=5))
    entry(table.admit("10.0.0.1", 0.0))
    (row,) = table.listing(0.0, 10)
    assert row.arrivals is None and row.open == 1 and row.limited_by is None


def test_clearing_a_network_lets_a_rate_limited_client_in_again() -> None:
    table = PerSourceTable(Limits(rate=2, interval=60.0))
    for t in (0.0, 1.0):
        table.release(entry(table.admit("10.0.0.1", t)))
    table.release(entry(table.admit("10.0.0.2", 1.0)))
    assert table.admit("10.0.0.1", 2.0) is None  # at its rate for the next 58 s
    assert table.clear(network_named("10.0.0.1", 32, 64)) == (1, 0)  # idle: forgotten
    assert len(table) == 1  # 10.0.0.2 untouched
    assert [r.network for r in table.listing(2.0, 10)] == ["10.0.0.2"]
    assert table.admit("10.0.0.1", 2.0) is not None
    assert table.clear(network_named("10.9.9.9", 32, 64)) == (0, 0)  # not tracked


def test_clearing_never_forgets_open_connections() -> None:
    """A network at `max_connections` with connections open: the clear empties its
    window but keeps its entry and its count (the open ones still end through it), so it
    stays at its limit until they end, and each end is counted."""
    table = PerSourceTable(Limits(max_connections=2, rate=5, interval=60.0))
    a, b = entry(table.admit("10.0.0.1", 0.0)), entry(table.admit("10.0.0.1", 0.0))
    assert table.clear() == (1, 1)
    (row,) = table.listing(0.0, 10)
    assert (row.open, row.arrivals, row.limited_by) == (2, 0, "max_connections")
    assert table.admit("10.0.0.1", 0.0) is None  # still 2 open
    table.release(a)
    again = entry(table.admit("10.0.0.1", 0.0))
    assert again is b  # the same entry: one count, never two
    table.release(b)
    table.release(again)
    (row,) = table.listing(0.0, 10)
    assert (row.open, row.arrivals) == (0, 1)  # the arrival since the clear
    assert table.clear() == (1, 0) and len(table) == 0


def test_clear_all_keeps_networks_the_other_instances_hold() -> None:
    table = PerSourceTable(Limits(max_connections=4, rate=5, interval=60.0))
    table.release(entry(table.admit("10.0.0.1", 0.0)))
    table.release(entry(table.admit("10.0.0.2", 0.0)))
    table.set_remote({"10.0.0.2": (3, 1), "10.0.0.3": (1, 0)})
    assert table.clear() == (3, 2)  # 10.0.0.1 forgotten; .2 and .3 held elsewhere
    rows = {r.network: r for r in table.listing(0.0, 10)}
    assert set(rows) == {"10.0.0.2", "10.0.0.3"}
    assert (rows["10.0.0.2"].remote_open, rows["10.0.0.2"].remote_arrivals) == (3, 1)
    assert rows["10.0.0.2"].arrivals == 0


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("203.0.113.7", (4, 0xCB0071)),
        ("203.0.113.0/24", (4, 0xCB0071)),
        ("::ffff:203.0.113.7", (4, 0xCB0071)),
        ("2001:db8::7", (6, 0x20010DB800000000)),
        ("2001:db8::/64", (6, 0x20010DB800000000)),
    ],
)
def test_network_named(text: str, key: tuple[int, int]) -> None:
    assert network_named(text, 24, 64) == key


def test_network_named_at_32_is_the_address() -> None:
    assert network_named("10.0.0.1", 32, 64) == "10.0.0.1"
    assert network_named("10.0.0.1/32", 32, 64) == "10.0.0.1"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("web", "is not an address"),
        ("203.0.113.0/16", "by /24"),
        ("203.0.113.7/24", "host bits"),
        ("203.0.113.0/x", "by /24"),
        ("fe80::1%eth0", "zone"),
        ("", "is not an address"),
        ("1" * 500, "..."),
    ],
)
def test_a_bad_network_is_a_clear_error(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=None) as raised:
        network_named(text, 24, 64)
    assert says in str(raised.value)
    assert len(str(raised.value)) < 200
