"""Active checks over client connects, and connections closed on purpose (SPEC §22),
through real `lbproxy run` processes, on both connection paths (compiled and
LBPROXY_PURE=1) and with `workers: 2`.

A real server here says its name and echoes. Its health check wants that bare name
line (`^\\w+\\n`); a server "starting up" answers `<name>-starting` instead, and still
accepts TCP and serves clients: a database that accepts connections but refuses
service (a PostgreSQL in recovery or smart shutdown, a demoted Redis) as lbproxy sees
it.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections import Counter

import pytest

from tests.integration.harness import (
    NameServer,
    ask_name,
    counted,
    free_port,
    open_and_read_name,
    run_cli,
    servers_of,
    vs_config,
    wait_for,
    with_admin,
)
from tests.integration.redis_server import RedisServer, requires_redis

CLOSED = "lbproxy_connections_closed_total"


def check(interval: str, timeout: str, rise: int, fall: int, more: str = "") -> str:
    return (
        "health_check: {type: send_expect, expect: '^\\w+\\n', "
        f"interval: {interval}, timeout: {timeout}, rise: {rise}, fall: {fall}{more}}}"
    )


@pytest.fixture(params=["default", "pure"])
def path(request, monkeypatch):
    """The connection path the lbproxy processes of the test run: the default one
    (compiled where it is built) or the pure-Python one."""
    if request.param == "pure":
        monkeypatch.setenv("LBPROXY_PURE", "1")
    return request.param


def starting(server: NameServer) -> None:
    server.name = f"{server.name}-starting"


def ready_again(server: NameServer) -> None:
    server.name = server.name.removesuffix("-starting")


def health(admin_port: int, name: str) -> str:
    return servers_of(admin_port)[name]["health"]


def hold(port: int, n: int) -> list[tuple]:
    held: list[tuple] = []
    try:
        for _ in range(n):
            held.append(open_and_read_name(port))
    except BaseException:
        close_all(held)
        raise
    return held


def close_all(held) -> None:
    for sock, _ in held:
        sock.close()


def closed_by_proxy(sock, timeout: float = 5.0) -> bool:
    """The client sees its connection end: end of file or a reset."""
    sock.settimeout(timeout)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def still_served(sock) -> bool:
    sock.settimeout(5)
    sock.sendall(b"ping")
    return sock.recv(100) == b"ping"


class ClientLoop(threading.Thread):
    """Clients connecting through lbproxy one after another, each reading the name of
    the real server it reached, until stopped (and at most `limit` seconds)."""

    def __init__(self, port: int, limit: float = 60.0) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.deadline = time.monotonic() + limit
        self.stopped = threading.Event()
        self.names: Counter[str] = Counter()
        self.failures = 0

    def run(self) -> None:
        while not self.stopped.is_set() and time.monotonic() < self.deadline:
            try:
                self.names[ask_name(self.port, timeout=5)] += 1
            except OSError:
                self.failures += 1

    def stop(self) -> None:
        self.stopped.set()
        self.join(10)


def test_a_server_that_accepts_but_fails_its_check_goes_down_under_traffic(
    path, name_servers, lbproxy
):
    a, b = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    interval, timeout, fall = 0.2, 0.2, 3
    proxy = lbproxy(
        with_admin(vs_config(port, [a, b], "rr", check("200ms", "200ms", 2, fall)), admin_port)
    )
    clients = ClientLoop(port)
    clients.start()
    try:
        wait_for(lambda: clients.names["a"] >= 5, what="clients reaching a")
        starting(a)  # TCP still accepted, clients still served: only the check fails
        began = time.monotonic()
        wait_for(
            lambda: health(admin_port, "a") == "down",
            timeout=15,
            what="a down under traffic",
            details=proxy.log,
        )
        took = time.monotonic() - began
        reached = clients.names["a-starting"]
    finally:
        clients.stop()
    print(
        f"down after {took:.2f}s (fall × interval + timeout = {fall * interval + timeout:g}s)"
        f" while {reached} client(s) connected to it"
    )
    assert reached >= fall  # under traffic: clients kept connecting to it meanwhile
    assert "web/a is down (send_expect check" in proxy.log()
    assert [ask_name(port) for _ in range(6)] == ["b"] * 6
    assert clients.failures == 0
    # a passing check, not a client connect, brings it back
    ready_again(a)
    wait_for(lambda: health(admin_port, "a") == "up", what="a up again", details=proxy.log)
    assert {ask_name(port) for _ in range(6)} == {"a", "b"}


def test_on_down_close_closes_the_connections_of_a_server_marked_down(path, name_servers, lbproxy):
    a, b = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    config = vs_config(port, [a, b], "rr", check("100ms", "100ms", 2, 2, ", on_down: close"))
    proxy = lbproxy(with_admin(config, admin_port))
    held = hold(port, 6)
    try:
        on_a = [sock for sock, name in held if name == "a"]
        on_b = [sock for sock, name in held if name == "b"]
        assert len(on_a) == 3 and len(on_b) == 3
        assert counted(admin_port, CLOSED, virtual_server="web", reason="marked_down") == 0
        starting(a)  # a's handler threads would keep serving these connections
        for sock in on_a:
            assert closed_by_proxy(sock)
        for sock in on_b:
            assert still_served(sock)
        assert counted(admin_port, CLOSED, virtual_server="web", reason="marked_down") == 3
        assert counted(admin_port, CLOSED, reason="backup_returned") == 0
        assert "web: closed 3 connection(s): a is down (on_down: close)" in proxy.log()
    finally:
        close_all(held)


def test_on_up_close_backups_closes_the_backups_connections_when_the_primary_returns(
    path, name_servers, lbproxy
):
    primary, spare = name_servers("primary", "spare")
    port, admin_port = free_port(), free_port()
    config = vs_config(
        port,
        [primary, spare],
        "rr",
        check("100ms", "100ms", 2, 2, ", on_up: close_backups"),
        rs_extra={"spare": "backup: true"},
    )
    proxy = lbproxy(with_admin(config, admin_port))
    assert {ask_name(port) for _ in range(4)} == {"primary"}
    starting(primary)
    wait_for(lambda: health(admin_port, "primary") == "down", what="primary down")
    held = hold(port, 3)
    try:
        assert [name for _, name in held] == ["spare"] * 3
        ready_again(primary)
        for sock, _ in held:
            assert closed_by_proxy(sock)
        assert health(admin_port, "primary") == "up"
        assert counted(admin_port, CLOSED, virtual_server="web", reason="backup_returned") == 3
        assert counted(admin_port, CLOSED, reason="marked_down") == 0  # on_down: keep
        assert {ask_name(port) for _ in range(4)} == {"primary"}
        assert "spare is a backup and primary primary is up" in proxy.log()
    finally:
        close_all(held)


def test_on_down_close_with_workers_counts_every_workers_closes(name_servers, lbproxy):
    a, b = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    config = with_admin(
        vs_config(port, [a, b], "rr", check("100ms", "100ms", 2, 2, ", on_down: close")),
        admin_port,
    ).replace("global:\n", "global:\n  workers: 2\n", 1)
    lbproxy(config)
    held = hold(port, 8)
    try:
        on_a = [sock for sock, name in held if name == "a"]
        on_b = [sock for sock, name in held if name == "b"]
        assert on_a and on_b
        starting(a)
        for sock in on_a:
            assert closed_by_proxy(sock)
        for sock in on_b:
            assert still_served(sock)
        # the supervisor's /metrics adds up its workers' counts
        wait_for(
            lambda: (
                counted(admin_port, CLOSED, virtual_server="web", reason="marked_down") == len(on_a)
            ),
            what=f"{len(on_a)} closes counted",
        )
    finally:
        close_all(held)


def test_bad_on_down_and_on_up_values_are_file_line_errors(tmp_path):
    path = tmp_path / "lbproxy.yaml"
    path.write_text(
        "virtual_servers:\n"
        "  - name: web\n"
        "    listen: 127.0.0.1:8080\n"
        "    health_check:\n"
        "      on_down: shutdown\n"
        "      on_up: close\n"
        "    real_servers: [{name: a, address: 127.0.0.1:9001, backup: true}]\n"
    )
    out = run_cli("check", str(path))
    assert out.returncode == 2, out
    assert out.stderr.splitlines() == [
        f"{path}:5: health_check.on_down must be one of keep, close, got 'shutdown'",
        f"{path}:6: health_check.on_up must be one of keep, close_backups, got 'close'",
        "lbproxy: configuration invalid (2 problems)",
    ]


# -- a real Redis failover -------------------------------------------------------------


def redis_role(port: int, sock=None, timeout: float = 5.0) -> str:
    """`INFO replication` through lbproxy (a new connection, or `sock`): the role that
    answered, `master` or `slave`."""
    own = sock is None
    if own:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        sock.settimeout(timeout)
        sock.sendall(b"INFO replication\r\n")
        answer = b""
        while (found := re.search(rb"role:(\w+)\r\n", answer)) is None:
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionResetError("closed by the proxy")
            answer += chunk
        return found.group(1).decode()
    finally:
        if own:
            sock.close()


class RedisClients(ClientLoop):
    def run(self) -> None:
        while not self.stopped.is_set() and time.monotonic() < self.deadline:
            try:
                self.names[redis_role(self.port)] += 1
            except OSError:
                self.failures += 1


@requires_redis
def test_redis_failover_under_traffic_closes_the_old_primarys_sessions(tmp_path, lbproxy):
    """A Redis primary demoted to replica keeps accepting TCP: its `role:master` check
    fails, it goes down while clients keep connecting, its sessions are closed
    (`on_down: close`), and clients reach the promoted replica."""
    one = RedisServer(tmp_path / "one").start()
    two = RedisServer(tmp_path / "two").start()
    try:
        two.cli("REPLICAOF", "127.0.0.1", str(one.port))
        port, admin_port = free_port(), free_port()
        check = (
            'health_check: {type: send_expect, send: "INFO replication\\r\\n", '
            "expect: 'role:master', interval: 200ms, timeout: 200ms, rise: 2, fall: 2, "
            "on_down: close}"
        )
        config = f"""\
global:
  admin: {{listen: 127.0.0.1:{admin_port}}}
  drain_timeout: 2s
virtual_servers:
  - name: cache
    listen: 127.0.0.1:{port}
    scheduler: first
    {check}
    real_servers:
      - {{name: one, address: 127.0.0.1:{one.port}}}
      - {{name: two, address: 127.0.0.1:{two.port}}}
"""
        proxy = lbproxy(config)
        wait_for(lambda: health(admin_port, "two") == "down", what="the replica down")
        sessions = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
        clients = RedisClients(port)
        try:
            assert [redis_role(port, s) for s in sessions] == ["master"] * 3
            clients.start()
            wait_for(lambda: clients.names["master"] >= 5, what="clients on the primary")
            two.cli("REPLICAOF", "NO", "ONE")  # the failover: two promoted, one demoted
            one.cli("REPLICAOF", "127.0.0.1", str(two.port))
            began = time.monotonic()
            wait_for(
                lambda: health(admin_port, "one") == "down",
                timeout=15,
                what="the demoted primary down under traffic",
                details=proxy.log,
            )
            took = time.monotonic() - began
            for sock in sessions:  # no client stays on the old primary
                assert closed_by_proxy(sock)
            wait_for(lambda: health(admin_port, "two") == "up", what="the new primary up")
            seen = clients.names["master"]
            wait_for(lambda: clients.names["master"] > seen, what="clients on the new primary")
        finally:
            clients.stop()
            for sock in sessions:
                sock.close()
        print(f"the demoted primary was down {took:.2f}s after the failover")
        assert clients.names["slave"] >= 1  # clients kept reaching it until then
        assert redis_role(port) == "master"
        # the held sessions, and any of the loop's still open on the old primary then
        assert counted(admin_port, CLOSED, virtual_server="cache", reason="marked_down") >= 3
    finally:
        one.stop()
        two.stop()
