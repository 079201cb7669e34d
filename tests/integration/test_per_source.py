"""`per_source:` (SPEC §23) through real `lbproxy run` processes and loopback sockets:
limits per client network, applied at accept before a byte is read.

- 50 connections held from 127.0.0.2 against `max_connections: 10`: 10 served, 40
  closed unread and counted `rejected{reason="per_source"}`, 127.0.0.3 unaffected;
  `lbproxy status` shows the rejections; compiled and pure paths.
- `rate` over a 2 s sliding window: a burst beyond it is refused, and the network is
  served again once its first accepted connection is 2 s old, however many refused
  arrivals came meanwhile (they do not count).
- The table's bound, with PROXY headers from a trusted peer naming hundreds of sources:
  it holds at most `max_tracked` networks, forgets an idle one (whose rate window goes
  with it) and never a network with an open connection.

Clients that must come from another address bind to another loopback address
(127.0.0.2, ...): all of 127.0.0.0/8 is local on Linux.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from types import SimpleNamespace

import pytest

from lbproxy.wire.proxy_protocol import encode_v1
from tests.factories import real_hello
from tests.integration.harness import (
    free_port,
    metrics,
    run_cli,
    sample,
    sni_config,
    stop_all,
    virtual_server_document,
    vs_config,
    wait_for,
    with_admin,
)
from tests.integration.redis_server import RedisServer, requires_redis
from tests.integration.shared_per_source import (
    cluster_connected,
    connect_from,
    served,
    shared_config,
)

REJECTED = "lbproxy_rejected_connections_total"


def rejected(admin: int, reason: str = "per_source", vs: str = "web") -> float:
    return sample(metrics(admin), REJECTED, virtual_server=vs, reason=reason)


@pytest.fixture(params=["default", "pure"])
def path(request, monkeypatch):
    """The connection path the lbproxy process runs: the default (compiled where it is
    built) or the pure-Python one."""
    if request.param == "pure":
        monkeypatch.setenv("LBPROXY_PURE", "1")
    return request.param


def first_line(sock: socket.socket) -> str:
    """The real server's name line, whatever of the echo of what the client sent came
    behind it in the same reads; "" when the connection closes first."""
    data = b""
    while b"\n" not in data:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            return ""
        if not chunk:
            return ""
        data += chunk
    return data.split(b"\n", 1)[0].decode()


def config(port: int, admin: int, server, per_source: str, extra: str = "") -> str:
    text = vs_config(
        port,
        [server],
        extra=f"connect_timeout: 60s\nhealth_check: {{type: none}}\nper_source: {per_source}\n"
        + extra,
    )
    return with_admin(text, admin)


def test_a_reload_names_the_resilience_keys_it_changed(name_servers, lbproxy):
    """Only per_source, allow/deny and max_connection_duration(_jitter) change: the
    reload's summary names each (not "no changes"), and they apply to the next clients."""
    (server,) = name_servers("a")
    port, admin = free_port(), free_port()
    proxy = lbproxy(config(port, admin, server, "{max_connections: 5}"), [admin])
    proxy.reload()  # the same file
    assert proxy.log().splitlines()[-1].endswith("reloaded: no changes"), proxy.log()
    changed = (
        "deny: [127.0.0.3]\nmax_connection_duration: 1h\nmax_connection_duration_jitter: 10%\n"
    )
    proxy.reload(config(port, admin, server, "{max_connections: 1}", changed))
    (line,) = [line for line in proxy.log().splitlines() if "reloaded:" in line][-1:]
    assert line.endswith(
        "reloaded: web: deny changed; web: per_source changed; "
        "web: max_connection_duration changed; web: max_connection_duration_jitter changed"
    ), line
    with connect_from("127.0.0.3", port) as denied:
        assert not served(denied)
    with connect_from("127.0.0.2", port) as first, connect_from("127.0.0.2", port) as second:
        assert served(first)
        assert not served(second)  # max_connections: 1 now
    proxy.reload(config(port, admin, server, "{max_connections: 1}", "allow: [127.0.0.0/8]\n"))
    line = [line for line in proxy.log().splitlines() if "reloaded:" in line][-1]
    assert line.endswith(
        "reloaded: web: allow changed; web: deny changed; web: max_connection_duration "
        "changed; web: max_connection_duration_jitter changed"
    ), line


def test_max_connections_per_source_closes_the_rest_at_accept(name_servers, lbproxy, path):
    (server,) = name_servers("a")
    port, admin = free_port(), free_port()
    lbproxy(config(port, admin, server, "{max_connections: 10}"))
    held = []
    try:
        verdicts = []
        for _ in range(50):
            sock = connect_from("127.0.0.2", port)
            held.append(sock)
            verdicts.append(served(sock))
        assert verdicts.count(True) == 10
        assert verdicts[:10] == [True] * 10  # the first ten, while they stay open
        wait_for(lambda: rejected(admin) == 40, what="40 per_source rejections")
        # Another client network is not held back by 127.0.0.2's.
        with connect_from("127.0.0.3", port) as other:
            assert served(other)
        assert server.accepted == 11
        document = virtual_server_document(admin)
        assert document["rejected"]["per_source"] == 40
        assert document["per_source"]["tracked"] == 2
        status = run_cli("status", "--admin", f"http://127.0.0.1:{admin}")
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        header = lines.index(next(line for line in lines if line.startswith("PER_SOURCE")))
        assert lines[header + 1].split() == ["web", "40", "2", "100000"]
    finally:
        for sock in held:
            sock.close()
    # Their ends give the network's count back: 127.0.0.2 is served again.
    wait_for(lambda: virtual_server_document(admin)["clients"] == 0, what="every end")
    with connect_from("127.0.0.2", port) as again:
        assert served(again)
    assert rejected(admin) == 40


def test_a_reload_keeps_the_open_connections_counted(name_servers, lbproxy):
    """10 connections held from 127.0.0.2 at `max_connections: 10`; a reload to 12 lets
    exactly 2 more in: the 10 stay counted across it (a table made afresh would let 12
    more in)."""
    (server,) = name_servers("a")
    port, admin = free_port(), free_port()
    proxy = lbproxy(config(port, admin, server, "{max_connections: 10}"))
    held = [connect_from("127.0.0.2", port) for _ in range(10)]
    try:
        assert all(served(sock) for sock in held)
        proxy.reload(config(port, admin, server, "{max_connections: 12}"))
        more = [connect_from("127.0.0.2", port) for _ in range(3)]
        held += more
        assert [served(sock) for sock in more] == [True, True, False]
        wait_for(lambda: rejected(admin) == 1, what="the 13th refused")
    finally:
        for sock in held:
            sock.close()


def test_rate_is_a_sliding_window_that_refused_arrivals_do_not_fill(name_servers, lbproxy):
    """`rate: 5` over `interval: 2s`: of a burst of 8, 5 are served and 3 closed unread.
    Then a client tries every 0.1 s: each try is refused until the first served
    connection is 2 s old -- never sooner -- and then served (the refused tries would
    keep the window full forever if they counted)."""
    (server,) = name_servers("a")
    port, admin = free_port(), free_port()
    lbproxy(config(port, admin, server, "{rate: 5, interval: 2s}"))
    start = time.monotonic()
    burst = []
    for _ in range(8):
        with connect_from("127.0.0.2", port) as sock:
            burst.append(served(sock))
    if time.monotonic() - start < 2.0:  # a loaded machine may take longer for the burst
        assert burst == [True] * 5 + [False] * 3
    assert burst[:5] == [True] * 5
    first_refusals = burst.count(False)
    with connect_from("127.0.0.3", port) as other:  # another network: its own window
        assert served(other)

    tries = 0

    def served_again() -> bool:
        nonlocal tries
        tries += 1
        with connect_from("127.0.0.2", port) as sock:
            return served(sock)

    if first_refusals:
        wait_for(served_again, timeout=30, interval=0.1, what="127.0.0.2 served again")
        assert time.monotonic() - start >= 2.0
        assert tries > 1
        assert rejected(admin) == first_refusals + tries - 1


def proxied(port: int, source: str) -> socket.socket:
    """A connection from 127.0.0.1 (a trusted PROXY sender) naming `source`."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(encode_v1((source, 40000), ("127.0.0.1", port)))
    return sock


def test_ipv6_clients_count_by_their_prefix(name_servers, lbproxy):
    """PROXY headers from a trusted peer name IPv6 clients: with `prefix_v6: 64` two
    addresses of one /64 hold its two connections, a third address in it is refused, an
    address in the next /64 is served."""
    (server,) = name_servers("a")
    port, admin = free_port(), free_port()
    per_source = "{max_connections: 2, prefix_v6: 64}"
    lbproxy(config(port, admin, server, per_source, "accept_proxy: true"))

    def proxied6(source: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(encode_v1((source, 40000), ("::1", port)))
        return sock

    held = [proxied6("2001:db8::1"), proxied6("2001:db8::ffff:1")]
    try:
        assert all(served(sock) for sock in held)
        with proxied6("2001:db8::5") as third:
            assert not served(third)
        with proxied6("2001:db8:0:1::1") as neighbour:
            assert served(neighbour)
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: rejected(admin) == 1, what="one per_source rejection")


def test_the_table_is_bounded_and_forgets_idle_networks_first(name_servers, lbproxy):
    """`max_tracked: 50` under 400 client addresses named by PROXY headers from a
    trusted peer: the table never holds more than 50; a network with an open connection
    is never forgotten (its second connection is still refused after the flood); an idle
    one is (its rate window, full before the flood, is gone after it)."""
    (server,) = name_servers("a")
    port, admin = free_port(), free_port()
    per_source = "{max_connections: 1, rate: 1, interval: 1h, max_tracked: 50}"
    lbproxy(config(port, admin, server, per_source, "accept_proxy: true"))
    busy = proxied(port, "10.1.0.1")
    try:
        assert served(busy)
        with proxied(port, "10.1.0.2") as idle:
            assert served(idle)
        wait_for(lambda: virtual_server_document(admin)["clients"] == 1, what="the idle end")
        with proxied(port, "10.1.0.2") as again:  # its one connection an hour is spent
            assert not served(again)
        for i in range(400):
            with proxied(port, f"10.2.{i // 250}.{i % 250 + 1}") as sock:
                assert served(sock)
            if i % 100 == 99:
                assert virtual_server_document(admin)["per_source"]["tracked"] <= 50
        with proxied(port, "10.1.0.1") as second:  # busy: still counted, still refused
            assert not served(second)
        with proxied(port, "10.1.0.2") as forgotten:  # idle: forgotten, its window too
            assert served(forgotten)
        document = virtual_server_document(admin)
        assert document["per_source"]["tracked"] == 50
        assert document["per_source"]["max_tracked"] == 50
        assert document["rejected"]["per_source"] == 2
    finally:
        busy.close()


def test_on_an_sni_address_the_routes_per_source_applies(name_servers, lbproxy):
    """Two virtual servers share an address by SNI; only `api` has `per_source:
    {max_connections: 1}`. A second ClientHello for api from the same client, while
    the first is open, is closed and counted on api; the same client reaches the other
    route as often as it likes."""
    api, plain = name_servers("api", "plain")
    port, admin = free_port(), free_port()
    groups = [("api", ["api.example.com"], [api]), ("plain", None, [plain])]
    text = sni_config(port, groups, admin, "connect_timeout: 60s")
    text = text.replace(
        "    sni: ['api.example.com']\n",
        "    sni: ['api.example.com']\n    per_source: {max_connections: 1}\n",
    )
    lbproxy(text)
    first = connect_from("127.0.0.2", port)
    try:
        first.sendall(real_hello("api.example.com"))
        assert first_line(first) == "api"
        with connect_from("127.0.0.2", port) as second:
            second.sendall(real_hello("api.example.com"))
            assert first_line(second) == ""
        wait_for(lambda: rejected(admin, vs="api") == 1, what="api's per_source rejection")
        others = [connect_from("127.0.0.2", port) for _ in range(3)]
        try:
            for sock in others:
                sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
                assert first_line(sock) == "plain"
        finally:
            for sock in others:
                sock.close()
    finally:
        first.close()
    assert rejected(admin, vs="plain") == 0
    assert api.accepted == 1


def test_bad_per_source_blocks_are_file_line_errors(tmp_path):
    """`lbproxy check`: a block with neither limit, `shared` without `global.cluster`, a
    bad value and a UDP virtual server's `per_source` are each named with file and line;
    exit 2."""
    path = tmp_path / "bad.yaml"
    path.write_text(
        "virtual_servers:\n"
        "  - name: web\n"
        "    listen: 127.0.0.1:18080\n"
        "    per_source:\n"
        "      interval: 2s\n"
        "      shared: true\n"
        "    real_servers: [{name: a, address: 127.0.0.1:18081}]\n"
        "  - name: api\n"
        "    listen: 127.0.0.1:18082\n"
        "    per_source: {max_connections: 0, prefix_v6: 129}\n"
        "    real_servers: [{name: a, address: 127.0.0.1:18081}]\n"
        "  - name: dns\n"
        "    protocol: udp\n"
        "    listen: 127.0.0.1:18083\n"
        "    per_source: {rate: 3}\n"
        "    real_servers: [{name: a, address: 127.0.0.1:18081}]\n"
    )
    result = run_cli("check", str(path))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert f"{path}:4: per_source needs max_connections or rate (or both)" in lines
    assert f"{path}:6: per_source.shared needs global.cluster" in lines
    assert any(line.startswith(f"{path}:10: per_source.max_connections") for line in lines)
    assert any(line.startswith(f"{path}:10: per_source.prefix_v6") for line in lines)
    assert f"{path}:15: per_source is for TCP; a UDP virtual server refuses it" in lines


# -- shared across a cluster ---------------------------------------------------------------


@requires_redis
def test_shared_limits_add_the_other_instances_counts(tmp_path, name_servers, lbproxy):
    """Two instances and a real redis-server, `max_connections: 10, shared: true`: 6
    connections held from 127.0.0.2 through lb1 leave 4 for it through lb2 (the 5th is
    closed at accept there and counted); 127.0.0.3 is not held back; once lb1's six
    close, lb2 serves 127.0.0.2 again."""
    redis = RedisServer(tmp_path / "redis").start()
    try:
        (server,) = name_servers("a")
        lb1, lb2 = (SimpleNamespace(port=free_port(), admin=free_port()) for _ in range(2))
        for name, one in (("lb1", lb1), ("lb2", lb2)):
            text = shared_config(redis, name, one.port, one.admin, server, "max_connections: 10")
            lbproxy(text, [one.admin], folder=tmp_path / name)
        for one in (lb1, lb2):
            wait_for(lambda one=one: cluster_connected(one.admin), what="connected to Redis")
        held = [connect_from("127.0.0.2", lb1.port) for _ in range(6)]
        try:
            assert all(served(sock) for sock in held)
            wait_for(
                lambda: virtual_server_document(lb2.admin)["per_source"]["remote_open"] == 6,
                what="lb1's six connections counted at lb2",
            )
            more = [connect_from("127.0.0.2", lb2.port) for _ in range(5)]
            held += more
            assert [served(sock) for sock in more] == [True] * 4 + [False]
            wait_for(lambda: rejected(lb2.admin) == 1, what="lb2's per_source rejection")
            with connect_from("127.0.0.3", lb2.port) as other:
                assert served(other)
        finally:
            for sock in held:
                sock.close()
        wait_for(
            lambda: virtual_server_document(lb2.admin)["per_source"]["remote_open"] == 0,
            what="lb1's ends seen at lb2",
        )
        wait_for(lambda: virtual_server_document(lb2.admin)["clients"] == 0, what="lb2's ends")
        again = [connect_from("127.0.0.2", lb2.port) for _ in range(10)]
        try:
            assert all(served(sock) for sock in again)
        finally:
            for sock in again:
                sock.close()
        assert rejected(lb1.admin) == 0
    finally:
        stop_all(lbproxy.started)
        redis.stop()


def two_sharing(tmp_path, redis, server, lbproxy, limits: str):
    """lb1 and lb2 on `redis`, both connected, with `per_source: {limits, shared: true}`:
    (lb1, lb2, lb2's process)."""
    lb1, lb2 = (SimpleNamespace(port=free_port(), admin=free_port()) for _ in range(2))
    processes = []
    for name, one in (("lb1", lb1), ("lb2", lb2)):
        text = shared_config(redis, name, one.port, one.admin, server, limits)
        processes.append(lbproxy(text, [one.admin], folder=tmp_path / name))
    for one in (lb1, lb2):
        wait_for(lambda one=one: cluster_connected(one.admin), what="connected to Redis")
    return lb1, lb2, processes[1]


def hold_at_limit(lb1, lb2, count: int) -> list[socket.socket]:
    """`count` connections from 127.0.0.2 held through lb2, seen by lb1, which then
    refuses 127.0.0.2."""
    held = [connect_from("127.0.0.2", lb2.port) for _ in range(count)]
    assert all(served(sock) for sock in held)
    wait_for(
        lambda: virtual_server_document(lb1.admin)["per_source"]["remote_open"] == count,
        what="lb2's connections counted at lb1",
    )
    with connect_from("127.0.0.2", lb1.port) as refused:
        assert not served(refused)
    return held


def admits(port: int, source: str = "127.0.0.2") -> bool:
    with connect_from(source, port) as sock:
        return served(sock)


@requires_redis
def test_without_redis_each_instance_serves_on_its_own_counts(tmp_path, name_servers, lbproxy):
    """lb2 holds 127.0.0.2's whole shared limit; Redis stops and lb2's clients leave:
    lb1, which can no longer hear from lb2, admits 127.0.0.2 again within a second or
    two (on its own counts), not for as long as Redis is away."""
    redis = RedisServer(tmp_path / "redis").start()
    try:
        (server,) = name_servers("a")
        lb1, lb2, _ = two_sharing(tmp_path, redis, server, lbproxy, "max_connections: 2")
        held = hold_at_limit(lb1, lb2, 2)
        redis.stop()
        for sock in held:
            sock.close()
        left = time.monotonic()
        wait_for(lambda: admits(lb1.port), timeout=5.0, what="lb1 admitting 127.0.0.2")
        waited = time.monotonic() - left
        print(f"lb1 admitted 127.0.0.2 {waited:.2f}s after lb2's clients left")
        assert waited < 3.0
        assert not cluster_connected(lb1.admin)
        assert virtual_server_document(lb1.admin)["per_source"]["remote_open"] == 0
    finally:
        stop_all(lbproxy.started)
        redis.stop()


@requires_redis
def test_a_silent_instances_counts_stop_counting_within_a_second_and_a_half(
    tmp_path, name_servers, lbproxy
):
    """lb2 holds 127.0.0.2's whole shared limit, then stops publishing (SIGSTOP, Redis
    still up): lb1 drops lb2's last counts about a second after they stop coming."""
    redis = RedisServer(tmp_path / "redis").start()
    stopped = None
    try:
        (server,) = name_servers("a")
        lb1, lb2, process = two_sharing(tmp_path, redis, server, lbproxy, "max_connections: 2")
        held = hold_at_limit(lb1, lb2, 2)
        stopped = process.proc.pid
        os.kill(stopped, signal.SIGSTOP)
        silent = time.monotonic()
        wait_for(lambda: admits(lb1.port), timeout=5.0, what="lb1 admitting 127.0.0.2")
        waited = time.monotonic() - silent
        print(f"lb1 admitted 127.0.0.2 {waited:.2f}s after lb2 went silent")
        assert waited < 2.5  # TTL 1 s + one 0.5 s turn, and the scheduling of a busy host
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        for sock in held:
            sock.close()
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        stop_all(lbproxy.started)
        redis.stop()


@requires_redis
def test_shared_limits_hold_across_workers(tmp_path, name_servers, lbproxy):
    """One lbproxy with `workers: 2` and `shared: true` (each worker a cluster member):
    4 connections held from 127.0.0.2 at `max_connections: 4`, whichever workers accepted
    them; once each worker has the other's counts (their remote counts add up to the 4),
    the next ones are refused whichever worker accepts them."""
    redis = RedisServer(tmp_path / "redis").start()
    try:
        (server,) = name_servers("a")
        port, admin = free_port(), free_port()
        text = shared_config(redis, "lb1", port, admin, server, "max_connections: 4")
        lbproxy(text.replace("global:\n", "global:\n  workers: 2\n", 1), [admin])
        held = []
        try:
            for _ in range(4):
                held.append(connect_from("127.0.0.2", port))
                assert served(held[-1])
            wait_for(
                lambda: virtual_server_document(admin)["per_source"]["remote_open"] == 4,
                what="each worker counting the other's connections",
            )
            for _ in range(3):
                with connect_from("127.0.0.2", port) as extra:
                    assert not served(extra)
            wait_for(lambda: rejected(admin) == 3, what="3 per_source rejections")
        finally:
            for sock in held:
                sock.close()
    finally:
        stop_all(lbproxy.started)
        redis.stop()


def test_simulate_refuses_what_the_table_would(tmp_path):
    """`lbproxy simulate` admits each arrival through the per-source table: 8 held
    connections from one /24 with `max_connections: 3`, one closed before #6."""
    path = tmp_path / "web.yaml"
    path.write_text(
        "virtual_servers:\n"
        "  - name: web\n"
        "    listen: 127.0.0.1:18080\n"
        "    scheduler: rr\n"
        "    per_source: {max_connections: 3, prefix_v4: 24}\n"
        "    real_servers:\n"
        "      - {name: a, address: 127.0.0.1:19001}\n"
        "      - {name: b, address: 127.0.0.1:19002}\n"
    )
    events = tmp_path / "events.yaml"
    events.write_text("- {before: 6, close: {a: 1}}\n")
    args = ("simulate", str(path), "-n", "8", "--hold", "--events", str(events))
    result = run_cli(*args, "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["sequence"] == ["a", "b", "a", None, None, "b", None, None]
    assert document["rejected"] == {"per_source": 4}
    text = run_cli(*args)
    assert "refused before a pick: per_source 4" in text.stdout
