"""Connection conditioning through a real `lbproxy run` (SPEC §11): the LVS rejoin problem
of long-lived connections, and Geode's answer to it.

wlc, servers a, b, c of equal weight, c down; 30 long-lived idle clients that reconnect
whenever they are closed; c comes back. Without conditioning the split stays 15/15/0;
with it, it reaches 10/10/10 within a few intervals, at most max_per_interval closed per
interval, never a connection that moved a byte within idle_for.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest

from tests.integration.harness import (
    NameServer,
    free_port,
    http,
    local_http,
    metrics,
    read_name,
    sample,
    wait_for,
)


class Client(threading.Thread):
    """One long-lived client connection through the proxy that reconnects when closed.

    `busy` clients send a byte every 100 ms (and read it back): they are never idle.
    """

    def __init__(self, port: int, stop: threading.Event, busy: bool = False) -> None:
        super().__init__(daemon=True)
        self.port, self.stop, self.busy = port, stop, busy
        self.servers: list[str] = []  # the server of each connection, in order
        self.closed_by_peer = 0

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
                    name = read_name(sock)
                    if not name:
                        continue
                    self.servers.append(name)
                    sock.settimeout(0.1)
                    while not self.stop.is_set():
                        if self.busy:
                            sock.sendall(b"x")
                        try:
                            data = sock.recv(100)
                        except TimeoutError:
                            continue
                        if not data:
                            self.closed_by_peer += 1
                            break
                        time.sleep(0.1)  # the client's pace
            except OSError:
                time.sleep(0.05)  # the client's pace before it connects again


def config(
    port: int,
    admin_port: int,
    servers: dict[str, int],
    conditioning: str,
    backups: tuple[str, ...] = (),
) -> str:
    lines = [
        "global:",
        f"  admin: {{listen: 127.0.0.1:{admin_port}}}",
        "  drain_timeout: 1s",
        "virtual_servers:",
        "  - name: pool",
        f"    listen: 127.0.0.1:{port}",
        "    scheduler: wlc",
        "    health_check: {type: tcp, interval: 200ms, timeout: 200ms, rise: 1, fall: 1}",
    ]
    if conditioning:
        lines.append(f"    conditioning: {conditioning}")
    lines.append("    real_servers:")
    lines += [
        f"      - {{name: {n}, address: 127.0.0.1:{p}{', backup: true' if n in backups else ''}}}"
        for n, p in servers.items()
    ]
    return "\n".join(lines) + "\n"


def split(admin: str) -> dict[str, int]:
    status, body = http("GET", f"{admin}/api/v1/virtual-servers/pool")
    assert status == 200
    return {rs["name"]: rs["active_connections"] for rs in json.loads(body)["real_servers"]}


def health(admin: str) -> dict[str, str]:
    _, body = http("GET", f"{admin}/api/v1/virtual-servers/pool")
    return {rs["name"]: rs["health"] for rs in json.loads(body)["real_servers"]}


def rejoin(lbproxy, name_servers, conditioning: str):
    """a, b up; c down; 30 clients (4 busy); then c comes back. Returns what is needed
    (the real servers a and b last)."""
    a, b = name_servers("a", "b")
    c_port, port, admin_port = free_port(), free_port(), free_port()
    proxy = lbproxy(config(port, admin_port, {"a": a.port, "b": b.port, "c": c_port}, conditioning))
    admin = f"http://127.0.0.1:{admin_port}"
    wait_for(lambda: health(admin)["c"] == "down", 10, "c down")
    stop = threading.Event()
    clients = [Client(port, stop, busy=i < 4) for i in range(30)]
    for client in clients:
        client.start()
    wait_for(lambda: split(admin) == {"a": 15, "b": 15, "c": 0}, 10, "15/15/0")
    c = NameServer("c", port=c_port)
    wait_for(lambda: health(admin)["c"] == "up", 10, "c up")
    return proxy, admin, clients, stop, c, (a, b)


@pytest.fixture
def cleanup():
    stops: list = []
    yield stops
    for stop, clients, server in stops:
        stop.set()
        for client in clients:
            client.join(5)
        if server is not None:
            server.stop()


def test_without_conditioning_the_rejoined_server_stays_empty(lbproxy, name_servers, cleanup):
    _, admin, clients, stop, c, _ = rejoin(lbproxy, name_servers, "")
    cleanup.append((stop, clients, c))
    for _ in range(6):  # 3 s: as long as you like, nothing moves
        time.sleep(0.5)  # on purpose: time goes by
        assert split(admin) == {"a": 15, "b": 15, "c": 0}
    assert sum(client.closed_by_peer for client in clients) == 0


def test_conditioning_moves_idle_connections_to_the_rejoined_server(lbproxy, name_servers, cleanup):
    conditioning = "{interval: 1s, idle_for: 500ms, max_per_interval: 5}"
    proxy, admin, clients, stop, c, (a, b) = rejoin(lbproxy, name_servers, conditioning)
    cleanup.append((stop, clients, c))
    wait_for(lambda: split(admin) == {"a": 10, "b": 10, "c": 10}, 8, "10/10/10")
    time.sleep(1.5)  # on purpose: balanced, the next round moves nothing
    assert split(admin) == {"a": 10, "b": 10, "c": 10}
    rounds = [int(n) for n in re.findall(r"conditioning closed (\d+) connection", proxy.log())]
    assert rounds and all(n <= 5 for n in rounds) and sum(rounds) == 10, proxy.log()
    assert "toward c" in proxy.log()
    busy = [client for client in clients if client.busy]
    assert all(client.closed_by_peer == 0 and len(client.servers) == 1 for client in busy)
    closed = sum(client.closed_by_peer for client in clients)
    assert closed == 10

    # a clean close of both sides: the real servers read EOF (a FIN), never an RST. The
    # health checks' connections (200 ms timeout) are the short ones, and left out.
    def held(server):
        return [end for end, seconds in server.ends if seconds >= 0.5]

    wait_for(
        lambda: len(held(a)) + len(held(b)) == 10,
        5,
        "10 held connections ended at a and b",
        details=lambda: f"{a.ends} {b.ends}",
    )
    assert held(a) + held(b) == ["eof"] * 10
    samples = metrics(int(admin.rsplit(":", 1)[1]))
    moved = {
        name: sample(
            samples,
            "lbproxy_conditioned_connections_total",
            virtual_server="pool",
            real_server=name,
        )
        for name in "abc"
    }
    assert moved == {"a": 5, "b": 5, "c": 0}


def test_conditioning_leaves_draining_servers_alone(lbproxy, name_servers, cleanup):
    a, b = name_servers("a", "b")
    c_port, port, admin_port = free_port(), free_port(), free_port()
    servers = {"a": a.port, "b": b.port, "c": c_port}
    conditioning = "{interval: 500ms, idle_for: 200ms, max_per_interval: 20, threshold: 2}"
    lbproxy(config(port, admin_port, servers, conditioning))
    admin = f"http://127.0.0.1:{admin_port}"
    wait_for(lambda: health(admin)["c"] == "down", 10, "c down")
    stop = threading.Event()
    clients = [Client(port, stop) for _ in range(12)]
    for client in clients:
        client.start()
    wait_for(lambda: split(admin) == {"a": 6, "b": 6, "c": 0}, 10, "6/6/0")
    url = f"{admin}/api/v1/virtual-servers/pool/real-servers/b"
    assert local_http("PATCH", url, {"state": "drain"})[0] == 200
    c = NameServer("c", port=c_port)
    cleanup.append((stop, clients, c))
    # a and c balance; b's connections stay where they are
    wait_for(lambda: split(admin) == {"a": 3, "b": 6, "c": 3}, 8, "3/6/3")
    time.sleep(1.0)  # on purpose: two more rounds move nothing
    assert split(admin) == {"a": 3, "b": 6, "c": 3}


def test_conditioning_closes_nothing_toward_an_idle_backup(lbproxy, name_servers, cleanup):
    a, b, c = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    servers = {"a": a.port, "b": b.port, "c": c.port}
    conditioning = "{interval: 300ms, idle_for: 100ms, max_per_interval: 10, threshold: 2}"
    proxy = lbproxy(config(port, admin_port, servers, conditioning, backups=("c",)))
    admin = f"http://127.0.0.1:{admin_port}"
    stop = threading.Event()
    clients = [Client(port, stop) for _ in range(10)]
    cleanup.append((stop, clients, None))
    for client in clients:
        client.start()
    wait_for(lambda: split(admin) == {"a": 5, "b": 5, "c": 0}, 10, "5/5/0")
    time.sleep(1.5)  # on purpose: five rounds, none of which may close anything
    assert split(admin) == {"a": 5, "b": 5, "c": 0}
    assert "conditioning closed" not in proxy.log()
    assert sum(client.closed_by_peer for client in clients) == 0
