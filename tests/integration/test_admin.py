"""The admin endpoint over real HTTP against real `lbproxy run` processes."""

from __future__ import annotations

import json
import re
import select
import socket
import subprocess
import time

import pytest

from tests import tools
from tests.integration.harness import (
    ask_name,
    counted,
    free_port,
    http,
    local_http,
    metrics,
    open_and_read_name,
    run_cli,
    sample,
    vs_config,
    wait_for,
    with_admin,
)


@pytest.fixture
def proxied(name_servers, lbproxy):
    """Three name servers behind an rr virtual server with the admin endpoint on."""
    servers = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    config = with_admin(vs_config(port, servers, "rr", "health_check: {type: none}"), admin_port)
    proxy = lbproxy(config)
    return proxy, servers, port, admin_port


def test_health_and_readiness(proxied):
    _, _, _, admin_port = proxied
    assert http("GET", f"http://127.0.0.1:{admin_port}/healthz")[0] == 200
    assert http("GET", f"http://127.0.0.1:{admin_port}/readyz")[0] == 200
    assert http("GET", f"http://127.0.0.1:{admin_port}/nope")[0] == 404


def test_metrics_count_connections_bytes_and_active(proxied):
    _, _, port, admin_port = proxied
    sent = received = 0
    for i in range(30):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            payload = b"x" * (100 + i)
            greeting = s.recv(2)  # "a\n"
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            echo = b""
            while chunk := s.recv(65536):
                echo += chunk
            sent += len(payload)
            received += len(greeting) + len(echo)
    held = [open_and_read_name(port) for _ in range(4)]

    def held_alone_active() -> bool:  # the 30 are over in the proxy too (and counted)
        return counted(admin_port, "lbproxy_active_connections", virtual_server="web") == 4

    wait_for(held_alone_active, what="only the 4 held connections active")
    samples = metrics(admin_port)
    for name in "abc":
        assert (
            sample(samples, "lbproxy_connections_total", virtual_server="web", real_server=name)
            >= 10
        )
    total = sum(
        sample(samples, "lbproxy_connections_total", virtual_server="web", real_server=n)
        for n in "abc"
    )
    assert total == 34
    bytes_in = sum(
        sample(samples, "lbproxy_bytes_total", virtual_server="web", real_server=n, direction="in")
        for n in "abc"
    )
    bytes_out = sum(
        sample(samples, "lbproxy_bytes_total", virtual_server="web", real_server=n, direction="out")
        for n in "abc"
    )
    assert bytes_in == sent
    assert bytes_out == received + 4 * 2  # the held connections' greetings
    active = sum(
        sample(samples, "lbproxy_active_connections", virtual_server="web", real_server=n)
        for n in "abc"
    )
    assert active == 4
    for s, _ in held:
        s.close()
    assert sample(samples, "lbproxy_config_reloads_total", result="ok") == 0


def test_exact_counts_after_thirty_rr_connections(proxied):
    _, _, port, admin_port = proxied
    for _ in range(30):
        ask_name(port)
    samples = metrics(admin_port)
    for name in "abc":
        assert (
            sample(samples, "lbproxy_connections_total", virtual_server="web", real_server=name)
            == 10
        )
        assert (
            sample(samples, "lbproxy_real_server_up", virtual_server="web", real_server=name) == 1
        )


def test_real_server_up_follows_health(proxied):
    _, servers, port, admin_port = proxied
    servers[1].stop()
    names = [ask_name(port) for _ in range(12)]  # passive failures: fall = 3
    assert "b" not in names
    samples = metrics(admin_port)
    assert sample(samples, "lbproxy_real_server_up", virtual_server="web", real_server="b") == 0
    assert (
        sample(
            samples,
            "lbproxy_connect_failures_total",
            virtual_server="web",
            real_server="b",
            reason="refused",
        )
        >= 3
    )


@tools.requires("promtool", package="prometheus")
def test_promtool_accepts_the_metrics(proxied):
    _, _, port, admin_port = proxied
    ask_name(port)
    _, body = http("GET", f"http://127.0.0.1:{admin_port}/metrics")
    check = subprocess.run(
        ["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.strip() == b"" and check.stderr.strip() == b""


def test_patch_weight_and_state_change_the_distribution(proxied):
    _, _, port, admin_port = proxied
    url = f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers/web/real-servers"
    status, body = local_http("PATCH", f"{url}/b", {"state": "drain"})
    assert status == 200, body
    assert json.loads(body)["state"] == "drain"
    assert "b" not in [ask_name(port) for _ in range(6)]
    status, body = local_http("PATCH", f"{url}/b", {"state": "enabled"})
    assert status == 200
    status, body = local_http("PATCH", f"{url}/a", {"weight": 0})
    assert status == 200 and json.loads(body)["weight"]["static"] == 0
    assert "a" not in [ask_name(port) for _ in range(6)]
    assert local_http("PATCH", f"{url}/a", {"weight": -1})[0] == 400
    assert local_http("PATCH", f"{url}/a", {"colour": "red"})[0] == 400
    assert local_http("PATCH", f"{url}/zz", {"weight": 1})[0] == 404
    assert (
        local_http(
            "PATCH",
            f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers/no/real-servers/a",
            {"weight": 1},
        )[0]
        == 404
    )


def test_drain_keeps_existing_connections_working(proxied):
    _, _, port, admin_port = proxied
    held = [open_and_read_name(port) for _ in range(3)]
    by_name = {name: sock for sock, name in held}
    out = run_cli("drain", "web", "a", "--admin", f"http://127.0.0.1:{admin_port}")
    assert out.returncode == 0, out.stderr
    assert "state drain" in out.stdout
    assert "a" not in [ask_name(port) for _ in range(4)]
    by_name["a"].sendall(b"still")
    assert by_name["a"].recv(10) == b"still"
    for sock, _ in held:
        sock.close()


def test_disable_closes_existing_connections(proxied):
    _, _, port, admin_port = proxied
    held = [open_and_read_name(port) for _ in range(3)]
    by_name = {name: sock for sock, name in held}
    out = run_cli("disable", "web", "c", "--admin", f"127.0.0.1:{admin_port}")
    assert out.returncode == 0, out.stderr
    by_name["c"].settimeout(5)
    assert by_name["c"].recv(10) == b""
    by_name["a"].sendall(b"ok")
    assert by_name["a"].recv(10) == b"ok"
    for sock, _ in held:
        sock.close()


def test_status_json_is_the_api_document(proxied):
    _, _, port, admin_port = proxied
    ask_name(port)
    out = run_cli("status", "--json", "--admin", f"http://127.0.0.1:{admin_port}")
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    (vs,) = document["virtual_servers"]
    assert vs["name"] == "web" and vs["scheduler"] == "rr" and vs["throttle_mode"] == "low"
    assert [rs["name"] for rs in vs["real_servers"]] == ["a", "b", "c"]
    first = vs["real_servers"][0]
    assert set(first) == {
        "name", "address", "state", "health", "backup", "weight", "active_connections",
        "connections_total", "bytes_in", "bytes_out", "snmp", "load", "discovered", "check",
        "agent", "ejected_until", "since", "downtime_s", "rate", "errors", "max_connections",
    }  # fmt: skip
    assert first["agent"] is None  # no agent_check
    assert first["ejected_until"] is None and vs["panic"] is False  # SPEC §23
    assert first["discovered"] is False  # from the file, not from DNS (SPEC §14)
    assert first["weight"] == {"static": 1, "dynamic": None, "effective": 1}
    assert first["snmp"] is None and first["load"] is None  # rr polls no SNMP, has no load
    assert first["connections_total"] == 1
    table = run_cli("status", "--admin", f"http://127.0.0.1:{admin_port}")
    assert table.returncode == 0 and "web" in table.stdout and "enabled" in table.stdout


def test_status_against_a_dead_endpoint_is_a_clear_error():
    out = run_cli("status", "--admin", f"http://127.0.0.1:{free_port()}")
    assert out.returncode == 1
    assert "cannot reach the lbproxy admin endpoint" in out.stderr
    assert "Traceback" not in out.stderr


def test_reload_with_a_broken_file_answers_400_and_keeps_serving(proxied):
    proxy, _, port, admin_port = proxied
    good = proxy.config_path.read_text()
    proxy.config_path.write_text(good.replace("scheduler: rr", "scheduler: nope"))
    status, body = local_http("POST", f"http://127.0.0.1:{admin_port}/api/v1/reload", {})
    assert status == 400
    errors = json.loads(body)["errors"]
    assert any("unknown scheduler 'nope'" in e and f"{proxy.config_path}:" in e for e in errors)
    assert ask_name(port) in "abc"
    out = run_cli("reload", "--admin", f"http://127.0.0.1:{admin_port}")
    assert out.returncode == 1 and "unknown scheduler 'nope'" in out.stderr
    proxy.config_path.write_text(good.replace("scheduler: rr", "scheduler: wlc"))
    out = run_cli("reload", "--admin", f"http://127.0.0.1:{admin_port}")
    assert out.returncode == 0, out.stderr
    samples = metrics(admin_port)
    assert sample(samples, "lbproxy_config_reloads_total", result="error") == 2
    assert sample(samples, "lbproxy_config_reloads_total", result="ok") == 1


def test_token_is_required_for_changes(name_servers, lbproxy, tmp_path, monkeypatch):
    servers = name_servers("a")
    port, admin_port = free_port(), free_port()
    token_file = tmp_path / "admin.token"
    token_file.write_text("s3cret-token\n")
    token_file.chmod(0o600)
    # No admin socket: the CLI, too, goes over TCP, with the token or without one.
    lbproxy(with_admin(vs_config(port, servers), admin_port, token_file, socket="none"))
    url = f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers/web/real-servers/a"
    assert http("PATCH", url, {"weight": 2})[0] == 401
    assert http("PATCH", url, {"weight": 2}, token="wrong")[0] == 403
    assert http("PATCH", url, {"weight": 2}, token="s3cret-token")[0] == 200
    assert http("GET", f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers")[0] == 200
    admin = f"http://127.0.0.1:{admin_port}"
    assert run_cli("set-weight", "web", "a", "3", "--admin", admin).returncode == 1
    ok = run_cli("set-weight", "web", "a", "3", "--admin", admin, "--token-file", str(token_file))
    assert ok.returncode == 0 and "weight 3" in ok.stdout
    monkeypatch.setenv("LBPROXY_TOKEN", "s3cret-token")
    assert run_cli("set-weight", "web", "a", "4", "--admin", admin).returncode == 0
    assert "s3cret" not in (tmp_path / "lbproxy.log").read_text()


def test_world_readable_token_file_refuses_to_start(name_servers, tmp_path):
    servers = name_servers("a")
    token_file = tmp_path / "admin.token"
    token_file.write_text("token\n")
    token_file.chmod(0o644)
    config = tmp_path / "c.yaml"
    config.write_text(with_admin(vs_config(free_port(), servers), free_port(), token_file))
    out = run_cli("run", str(config), timeout=30)
    assert out.returncode == 2
    assert f"admin.token_file {token_file} is open to other users (mode 0644" in out.stderr


def test_access_log_and_decision_explain_lines(name_servers, lbproxy):
    servers = name_servers("a", "b")
    port = free_port()
    config = vs_config(port, servers, "wlc").replace(
        "  drain_timeout: 5s", "  drain_timeout: 5s\n  access_log: true"
    )
    proxy = lbproxy(config, args=("--log-level", "debug"))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        assert s.recv(2) == b"a\n"
        s.sendall(b"hello")
        s.shutdown(socket.SHUT_WR)
        while s.recv(100):
            pass
    wait_for(lambda: "lbproxy.access" in proxy.log(), 5, "the access line", details=proxy.log)
    log = proxy.log()
    # one access line: client, virtual server, real server, bytes each way, how it ended
    assert re.search(
        r"lbproxy\.access: 127\.0\.0\.1:\d+ vs=web rs=a in=5 out=7 duration=\d+\.\d{3}s end=closed",
        log,
    ), log
    # the decision explain line lists every candidate with its score
    assert re.search(r"web: wlc picked a \[a=\(1, 0\), b=\(1, 1\)\]", log), log


def test_simulate_explain_prints_each_pick_with_scores(tmp_path):
    config = tmp_path / "vs.yaml"
    config.write_text(
        "virtual_servers:\n"
        "  - name: web\n"
        "    listen: 127.0.0.1:8080\n"
        "    scheduler: wlc\n"
        "    real_servers:\n"
        "      - {name: a, address: 127.0.0.1:9001, weight: 1}\n"
        "      - {name: b, address: 127.0.0.1:9002, weight: 3}\n"
    )
    out = run_cli("simulate", str(config), "-n", "3", "--hold", "--explain")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("#")]
    assert lines[0] == "#1 t=0.00s -> b  [a=(1, 0), b=(0.3333, 1)]"
    assert lines[1].startswith("#2 t=0.10s -> b  [a=(1, 0), b=(0.6667, ")
    assert len(lines) == 3
    # the scores come with their legend, before the first pick
    legend = "scores (wlc): ((active + 1) / effective weight, order last picked): the lowest wins"
    assert out.stdout.splitlines()[0] == legend


def test_json_log_format_writes_one_object_per_line(name_servers, lbproxy):
    servers = name_servers("a")
    port = free_port()
    config = vs_config(port, servers).replace(
        "  drain_timeout: 5s", "  drain_timeout: 5s\n  log_format: json\n  access_log: true"
    )
    proxy = lbproxy(config)
    assert ask_name(port) == "a"
    wait_for(lambda: "lbproxy.access" in proxy.log(), 5, "the access line", details=proxy.log)
    proxy.stop()
    records = [json.loads(line) for line in proxy.log().splitlines() if line.strip()]
    assert {"time", "level", "logger", "message"} <= set(records[0])
    access = [r for r in records if r["logger"] == "lbproxy.access"]
    assert len(access) == 1 and "vs=web rs=a" in access[0]["message"]
    assert any(r["message"] == "stopped" for r in records)


def test_disable_while_connecting_closes_the_client_and_frees_the_slot(lbproxy):
    """A real server that never answers the handshake (its accept queue is full, so the
    kernel drops our SYNs): the connection waits in connect. Disabling the server must
    close the client at once and give the connection slot back, not leave it counted
    until connect_timeout, or for ever."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(0)
    fillers = []
    try:
        for _ in range(2):  # fill the accept queue (backlog 0 admits one, and one more)
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(hole.getsockname())
            fillers.append(filler)
        # the first handshake is complete: the queue is full, so SYNs to `hole` are dropped
        wait_for(lambda: select.select([], fillers[:1], [], 0)[1], 5, "the accept queue full")

        class Hole:
            name = "h"
            port = hole.getsockname()[1]

        port, admin_port = free_port(), free_port()
        extra = "health_check: {type: none}\nconnect_timeout: 30s"
        proxy = lbproxy(with_admin(vs_config(port, [Hole], "rr", extra), admin_port))
        url = f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers/web"

        def active() -> int:
            status, body = http("GET", url)
            assert status == 200
            return json.loads(body)["active_connections"]

        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            # counted from the SYN on, as IPVS does
            wait_for(lambda: active() == 1, 5, "the connecting connection counted")
            started = time.monotonic()
            assert local_http("PATCH", f"{url}/real-servers/h", {"state": "disabled"})[0] == 200
            assert client.recv(100) == b""  # closed, not left hanging for 30 s
            assert time.monotonic() - started < 2
        wait_for(lambda: active() == 0, 2, "the connection's slot given back")
        assert proxy.proc.poll() is None
    finally:
        for filler in fillers:
            filler.close()
        hole.close()


def test_a_keep_alive_connection_is_not_recycled_after_1000_requests(proxied):
    """A client pool keeps its one connection: 1,200 requests (more than the 1,000 after
    which some servers end a keep-alive connection), each sent as soon as the previous
    answer's body is in, over one socket: every one answered, none with
    `Connection: close`."""
    _, _, _, admin_port = proxied
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", admin_port), timeout=10) as s:
        buffer = b""
        for _ in range(1200):
            s.sendall(request)
            while b"ok\n" not in buffer:
                data = s.recv(65536)
                assert data, "the admin endpoint closed the keep-alive connection"
                buffer += data
            head, _, buffer = buffer.partition(b"ok\n")
            assert head.startswith(b"HTTP/1.1 200")
            assert b"connection: close" not in head.lower()
