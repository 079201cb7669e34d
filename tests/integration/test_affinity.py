"""Affinity end to end (SPEC §12): persistence and maglev through real `lbproxy run`
processes, clients from several loopback addresses and from PROXY headers."""

from __future__ import annotations

import socket
import time
from collections import Counter

import pytest

from lbproxy.wire.proxy_protocol import encode_v1
from tests.integration.harness import (
    Lbproxy,
    NameServer,
    free_port,
    http,
    metrics,
    read_name,
    ready,
    sample,
    vs_config,
    wait_for,
    with_admin,
    worker_servers,
)

FAST_HEALTH = "health_check: {type: tcp, interval: 200ms, timeout: 200ms, rise: 1, fall: 1}"


def ask_from(port: int, source: str) -> str:
    """The real server's name, through the proxy, from the loopback address `source`."""
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)) as s:
        return read_name(s)


def ask_as(port: int, client: tuple[str, int]) -> str:
    """The real server's name for a client announced by a PROXY v1 header."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(encode_v1(client, ("127.0.0.1", port)))
        return read_name(s)


def up(admin_port: int, name: str) -> float:
    samples = metrics(admin_port)
    return sample(samples, "lbproxy_real_server_up", virtual_server="web", real_server=name)


def lookups(admin_port: int) -> dict[str, float]:
    samples = metrics(admin_port)
    counts = {
        result: sample(
            samples, "lbproxy_persistence_lookups_total", virtual_server="web", result=result
        )
        for result in ("hit", "miss", "moved")
    }
    counts["entries"] = sample(samples, "lbproxy_persistence_entries", virtual_server="web")
    return counts


@pytest.fixture
def processes(tmp_path, lbproxy):
    """start(config, name) -> a started `lbproxy run` in a folder of its own."""

    def start(config: str, name: str, wait_ports=()) -> Lbproxy:
        return lbproxy(config, wait_ports, folder=tmp_path / name)

    return start


def test_persistence_keeps_moves_and_forgets_clients_by_source_address(name_servers, processes):
    servers = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    extra = f"{FAST_HEALTH}\npersistence: {{timeout: 1500ms}}"
    processes(with_admin(vs_config(port, servers, "rr", extra), admin_port), "p", [port])
    sources = [f"127.0.0.{i}" for i in range(2, 8)]
    first = {source: ask_from(port, source) for source in sources}
    assert len(set(first.values())) >= 2  # rr spread the new clients
    for _ in range(3):  # rr alone would rotate; persistence keeps each client's server
        assert {source: ask_from(port, source) for source in sources} == first
    counts = lookups(admin_port)
    # (+1 miss and entry: the harness's connection from 127.0.0.1 that waited for the port)
    assert counts == {"hit": 18, "miss": 7, "moved": 0, "entries": 7}

    # Its server goes down: the client moves once, then stays where it moved.
    source = sources[0]
    gone = next(s for s in servers if s.name == first[source])
    gone.stop()
    wait_for(lambda: up(admin_port, gone.name) == 0, what=f"{gone.name} down")
    moved_to = ask_from(port, source)
    assert moved_to != gone.name
    assert [ask_from(port, source) for _ in range(3)] == [moved_to] * 3
    counts = lookups(admin_port)
    assert (counts["moved"], counts["hit"]) == (1, 21)

    # 1.5 s after its last connection ended the client is forgotten: the entries gauge
    # falls with no connection arriving, and the next connection is the scheduler's.
    wait_for(lambda: lookups(admin_port)["entries"] == 0, timeout=5, what="entries expired")
    ask_from(port, source)
    counts = lookups(admin_port)
    assert (counts["miss"], counts["entries"]) == (8, 1)


def test_a_sticky_client_does_not_move_round_robin(name_servers, processes):
    # A sticky connection must not advance its server's rr turn: were it to, after one
    # client's ten connections to a, three new clients would get b, c, b.
    servers = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    extra = f"{FAST_HEALTH}\npersistence: {{timeout: 30s}}"
    processes(with_admin(vs_config(port, servers, "rr", extra), admin_port), "p", [port])
    # (the harness's probe from 127.0.0.1 that waited for the port was the first pick)
    held = []
    for _ in range(10):
        sock = socket.create_connection(("127.0.0.1", port), 5, source_address=("127.0.0.2", 0))
        held.append(sock)
        assert read_name(sock) == "b"
    try:
        samples = metrics(admin_port)
        active = sample(
            samples, "lbproxy_active_connections", virtual_server="web", real_server="b"
        )
        assert active == 10  # sticky connections count as any other
        new_clients = [ask_from(port, f"127.0.0.{i}") for i in (3, 4, 5)]
        assert new_clients == ["c", "a", "b"]
    finally:
        for sock in held:
            sock.close()
    counts = lookups(admin_port)
    assert (counts["hit"], counts["miss"]) == (9, 5)


MAGLEV_EXTRA = "accept_proxy: true\nhealth_check: {type: none}"


def maglev_config(port: int, servers, admin_port: int | None = None, workers: int = 1) -> str:
    config = vs_config(port, servers, "maglev", MAGLEV_EXTRA)
    if admin_port is not None:
        config = with_admin(config, admin_port)
    return config.replace("global:\n", f"global:\n  workers: {workers}\n", 1)


CLIENTS = [(f"10.{i // 250}.{i % 250}.{1 + i % 7}", 1024 + i) for i in range(1000)]


def mapping(port: int) -> dict[tuple, str]:
    return {client: ask_as(port, client) for client in CLIENTS}


def test_two_processes_and_two_workers_send_every_client_to_the_same_server(
    name_servers, processes
):
    servers = name_servers("a", "b", "c")
    one, two, multi, admin_port = free_port(), free_port(), free_port(), free_port()
    processes(maglev_config(one, servers), "one", [one])
    processes(maglev_config(two, servers), "two", [two])
    processes(maglev_config(multi, servers, admin_port, workers=2), "workers", [multi])
    wait_for(lambda: ready(admin_port), what="both workers ready")
    started = time.monotonic()
    first = mapping(one)
    assert mapping(two) == first
    assert mapping(multi) == first
    assert time.monotonic() - started < 60
    shares = Counter(first.values())
    assert set(shares) == {"a", "b", "c"}
    assert all(250 <= n <= 420 for n in shares.values()), shares  # ~1/3 each
    served = [
        sum(rs["connections_total"] for rs in worker_servers(admin_port, i).values())
        for i in (1, 2)
    ]
    assert sum(served) == len(CLIENTS) and min(served) > 0, served  # both workers took part


def test_maglev_moves_only_the_clients_of_a_server_that_goes_down_and_back(name_servers, processes):
    servers = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    config = vs_config(port, servers, "maglev", f"accept_proxy: true\n{FAST_HEALTH}")
    processes(with_admin(config, admin_port), "p", [port])
    clients = CLIENTS[:300]
    before = {client: ask_as(port, client) for client in clients}
    b = next(s for s in servers if s.name == "b")
    b.stop()
    wait_for(lambda: up(admin_port, "b") == 0, what="b down")
    during = {client: ask_as(port, client) for client in clients}
    for client in clients:
        if before[client] == "b":
            assert during[client] in ("a", "c")
        else:
            assert during[client] == before[client], client  # nobody else moved
    again = NameServer("b", port=b.port)
    try:
        wait_for(lambda: up(admin_port, "b") == 1, what="b up")
        assert {client: ask_as(port, client) for client in clients} == before
    finally:
        again.stop()
    status, _ = http("GET", f"http://127.0.0.1:{admin_port}/healthz")
    assert status == 200
