"""`lbproxy simulate --clients K` (SPEC §12): client addresses, their servers, who moved."""

from __future__ import annotations

from collections import Counter

from lbproxy.config.model import PersistenceConfig
from lbproxy.tools.simulate import Event, client_address, simulate
from tests.factories import virtual_server

LEAVE_AND_JOIN = [
    Event(301, (("leave", "b"),)),
    Event(601, (("join", "b"),)),
]


def test_client_addresses_in_turn():
    assert [client_address(k, 3)[0] for k in range(1, 8)] == [
        "10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.1",
    ]  # fmt: skip
    assert client_address(256, 1000)[0] == "10.0.1.0"
    assert client_address(5, None)[0] == "10.0.0.5"  # without K: one address each


def test_maglev_clients_keep_their_server_and_only_the_leavers_move():
    vs = virtual_server("maglev", {n: {} for n in "abcd"})
    result = simulate(vs, 900, events=LEAVE_AND_JOIN, clients=100)
    assert len(result.clients) == 100
    for servers in result.clients.values():
        before, during, after = servers[:3], servers[3:6], servers[6:]
        assert len(set(before)) == 1 and len(set(during)) == 1 and after == before
        assert during == before or before[0] == "b"
    leave, join = result.moves
    on_b = sum(1 for servers in result.clients.values() if servers[0] == "b")
    assert (leave.event, leave.seen, leave.moved) == ("leave b", 100, on_b)
    assert leave.moved_from == {"b": on_b}
    assert (join.event, join.moved) == ("join b", on_b)  # and they all move back
    assert 15 <= on_b <= 35  # ~1/4 of 100 clients
    assert result.as_json()["moves"][0] == {
        "before": 301, "event": "leave b", "clients": 100, "moved": on_b,
        "moved_from": {"b": on_b},
    }  # fmt: skip
    assert "10.0.0.1" in result.as_json()["clients"]


def test_with_persistence_clients_stay_after_the_join_until_the_timeout():
    persistence = PersistenceConfig(timeout=60, max_entries=1000)
    vs = virtual_server("rr", {n: {} for n in "abc"}, persistence=persistence)
    result = simulate(vs, 90, events=[Event(31, (("leave", "b"),)), Event(61, (("join", "b"),))],
                      clients=10)  # fmt: skip
    leave, join = result.moves
    assert leave.moved == Counter(s[0] for s in result.clients.values())["b"]
    assert join.moved == 0  # persistence keeps them where they moved
    for servers in result.clients.values():
        assert len(set(servers[:3])) == 1 and len(set(servers[3:])) == 1  # moved once at most


def test_without_clients_the_result_has_no_clients():
    result = simulate(virtual_server("rr", {"a": {}}), 3)
    assert result.clients is None and "clients" not in result.as_json()


def test_locate_answers_each_client_as_the_live_locator_does():
    """--locate with maglev: a client's answers are its own server's, as a connection's."""
    vs = virtual_server("maglev", {n: {} for n in "abcd"})
    located = simulate(vs, 400, clients=40, locate=True)
    connected = simulate(vs, 400, clients=40)
    assert located.clients == connected.clients
    assert all(len(set(servers)) == 1 for servers in located.clients.values())
    assert len({servers[0] for servers in located.clients.values()}) == 4
