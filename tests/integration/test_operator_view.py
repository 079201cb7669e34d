"""The operator's view (SPEC §24) through real `lbproxy run` processes: why a server is
down (the last check's reason in the JSON and `lbproxy status --wide`), for how long
(`since`, `downtime_s`), the connection rate, the error counts, and the routes
/api/v1/, /api/v1/process and /api/v1/virtual-servers.csv."""

from __future__ import annotations

import contextlib
import csv
import io
import socket
import struct
import time
from types import SimpleNamespace

from lbproxy import __version__
from tests.integration.harness import (
    Answering,
    ask_name,
    free_port,
    get_json,
    http,
    run_cli,
    vs_config,
    wait_for,
    wall_time,
    with_admin,
    workers_config,
)

CHECK = (
    'health_check: {type: send_expect, send: "PING\\r\\n", expect: "^PONG",'
    " interval: 200ms, timeout: 300ms, rise: 1, fall: 1}"
)
WRONG_ANSWER = "send_expect check: '^PONG' not found in 6 bytes \"NOPE\\r\\n\" within 0.3s"


def _servers(admin_port: int, vs: str = "web") -> dict[str, dict]:
    document = get_json(admin_port, f"/api/v1/virtual-servers/{vs}")
    return {rs["name"]: rs for rs in document["real_servers"]}


def test_why_a_server_is_down_json_and_status_wide(lbproxy):
    """A refused, a timed-out and an `expect` mismatch check: each reason in the JSON,
    in the CSV and in `lbproxy status --wide`; SINCE in the piped status."""
    servers = [Answering("good", b"PONG\r\n"), Answering("nope", b"NOPE\r\n")]
    servers.append(Answering("silent", b""))
    refused = SimpleNamespace(name="refused", port=free_port())  # nothing listens there
    try:
        port, admin_port = free_port(), free_port()
        started = time.time()
        lbproxy(with_admin(vs_config(port, [*servers, refused], "rr", CHECK), admin_port))
        expected = {
            "good": ("up", "ok", ""),
            "nope": ("down", "fail", WRONG_ANSWER),
            "silent": ("down", "timeout", "send_expect check: nothing received within 0.3s"),
            "refused": ("down", "fail", "send_expect check: connection refused"),
        }

        def seen() -> dict | None:
            found = _servers(admin_port)
            shown = {
                name: (
                    rs["health"],
                    (rs["check"] or {}).get("result"),
                    (rs["check"] or {}).get("reason"),
                )
                for name, rs in found.items()
            }
            return found if shown == expected else None

        found = wait_for(
            seen, 15, "each server's check result", details=lambda: str(_servers(admin_port))
        )
        for name, rs in found.items():
            assert rs["errors"] == {
                "connect_refused": 0, "connect_timeout": 0, "connect_error": 0, "reset": 0,
            }  # fmt: skip
            assert rs["max_connections"] is None
            # since: the start for good (never changed), the fall for the others
            assert started - 1 <= wall_time(rs["since"]) <= time.time() + 1, rs
            if name == "good":
                assert rs["downtime_s"] == 0

        admin = f"http://127.0.0.1:{admin_port}"
        out = run_cli("status", "--wide", "--admin", admin)
        assert out.returncode == 0, out.stderr
        header, *lines = out.stdout.splitlines()
        columns = header.split()
        assert columns[-6:] == ["QUEUED", "SINCE", "AGENT", "AGENT_DESC", "CHECK", "REASON"]
        reason_at = header.index("REASON")
        by_name = {line.split()[3]: line for line in lines if line.strip()}
        for name, (health, result, reason) in expected.items():
            fields = by_name[name].split()
            assert fields[6] == health and fields[columns.index("CHECK")] == result
            assert fields[columns.index("SINCE")].endswith("s")  # e.g. 3s, 1m2s
            assert by_name[name][reason_at:] == (reason or "-"), by_name[name]

        out = run_cli("status", "--admin", admin)  # without --wide: no check columns
        assert out.stdout.splitlines()[0].split()[-3:] == ["SINCE", "AGENT", "AGENT_DESC"]

        status, body = http("GET", f"{admin}/api/v1/virtual-servers.csv")
        assert status == 200
        rows = list(csv.DictReader(io.StringIO(body.decode())))
        assert {row["real_server"]: row["check_reason"] for row in rows} == {
            name: reason for name, (_, _, reason) in expected.items()
        }
    finally:
        for server in servers:
            server.stop()


def test_since_and_downtime_over_a_down_up_cycle(lbproxy, name_servers):
    (a,) = name_servers("a")
    (b,) = name_servers("b")
    a_port = a.port
    port, admin_port = free_port(), free_port()
    check = "health_check: {type: tcp, interval: 100ms, timeout: 500ms, rise: 1, fall: 1}"
    lbproxy(with_admin(vs_config(port, [a, b], "rr", check), admin_port))
    start = _servers(admin_port)["a"]
    assert start["health"] == "up" and start["downtime_s"] == 0

    a.stop()
    down = wait_for(
        lambda: (rs := _servers(admin_port)["a"])["health"] == "down" and rs, 10, "a down"
    )
    went_down = wall_time(down["since"])
    assert went_down > wall_time(start["since"])
    wait_for(lambda: _servers(admin_port)["a"]["downtime_s"] >= 0.5, 10, "downtime growing")

    (_again,) = name_servers("a", port=a_port)
    up = wait_for(lambda: (rs := _servers(admin_port)["a"])["health"] == "up" and rs, 10, "a up")
    assert wall_time(up["since"]) > went_down
    assert up["downtime_s"] >= 0.5
    # up: the downtime no longer grows, and `since` stays the time it came back
    wait_for(lambda: ask_name(port) and True, 5, "traffic")
    later = wait_for(
        lambda: (rs := _servers(admin_port)["a"])["check"]["at"] > up["check"]["at"] and rs,
        10,
        "a later check",
    )
    assert later["downtime_s"] == up["downtime_s"] and later["since"] == up["since"]
    assert _servers(admin_port)["b"]["downtime_s"] == 0


def test_rate_max_after_a_burst_and_connect_errors(lbproxy, name_servers):
    (a,) = name_servers("a")
    refused = SimpleNamespace(name="gone", port=free_port())
    port, admin_port = free_port(), free_port()
    config = vs_config(port, [a, refused], "rr", "health_check: {type: none}")
    lbproxy(with_admin(config, admin_port))
    burst = 40
    began = time.monotonic()
    served = [ask_name(port) for _ in range(burst)]
    took = time.monotonic() - began
    assert set(served) == {"a"}

    def sampled() -> dict | None:
        vs = get_json(admin_port, "/api/v1/virtual-servers/web")
        rs = {s["name"]: s for s in vs["real_servers"]}["a"]
        return vs if rs["rate"]["max"] > 0 and rs["rate"]["current"] == 0 else None

    vs = wait_for(
        sampled,
        15,
        "the burst sampled, then a quiet second",
        details=lambda: str(get_json(admin_port, "/api/v1/virtual-servers/web")),
    )
    rs = {s["name"]: s for s in vs["real_servers"]}
    # the burst fell within a few one-second samples: its peak is at least its average
    # over them, and no more than all of it in one
    assert burst / (took + 3) <= rs["a"]["rate"]["max"] <= burst * 2, (took, rs["a"]["rate"])
    assert vs["rate"]["max"] >= rs["a"]["rate"]["max"] and vs["rate"]["current"] == 0
    assert rs["a"]["connections_total"] == burst
    # the refused server: each connect tried counted; passive health took it down
    assert rs["gone"]["errors"]["connect_refused"] >= 1, rs["gone"]
    assert rs["gone"]["health"] == "down" and rs["gone"]["rate"]["max"] == 0


def test_routes_process_and_csv(lbproxy, name_servers, tmp_path):
    (a,) = name_servers("a")
    port, admin_port = free_port(), free_port()
    config = with_admin(vs_config(port, [a], "rr", "health_check: {type: none}"), admin_port)
    proxy = lbproxy(config)
    routes = get_json(admin_port, "/api/v1/")["routes"]
    paths = {route["path"]: route["methods"] for route in routes}
    assert paths["/api/v1/process"] == ["GET"]
    assert paths["/api/v1/virtual-servers.csv"] == ["GET"]
    assert paths["/api/v1/virtual-servers/{name}/real-servers/{name}"] == ["GET", "DELETE", "PATCH"]
    assert paths["/api/v1/virtual-servers/{name}/real-servers"] == ["POST"]
    assert paths["/api/v1/virtual-servers/{name}/explain"] == ["GET"]
    assert "/api/v1/workers" not in paths  # the supervisor's only

    process = get_json(admin_port, "/api/v1/process")
    assert process["version"] == __version__ and process["pid"] == proxy.proc.pid
    assert process["workers"] == 0 and process["connection_path"] in ("compiled", "pure")
    assert process["uptime_s"] >= 0
    assert abs(wall_time(process["started"]) + process["uptime_s"] - time.time()) < 5
    assert process["config_files"] == [str(proxy.config_path)]

    assert ask_name(port) == "a"

    def settled_row() -> dict[str, str] | None:
        # the proxy counts the connection's end when it sees the close, after the reply
        status, body = http("GET", f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers.csv")
        assert status == 200
        (row,) = list(csv.DictReader(io.StringIO(body.decode())))
        return row if row["active_connections"] == "0" else None

    row = wait_for(settled_row, 10, "the connection's end counted in the CSV")
    assert row["virtual_server"] == "web" and row["real_server"] == "a"
    assert (row["state"], row["health"], row["weight"]) == ("enabled", "up", "1")
    assert row["active_connections"] == "0" and row["connections_total"] == "1"


def test_workers_merge_rates_errors_and_process(lbproxy, name_servers):
    (a,) = name_servers("a")
    refused = SimpleNamespace(name="gone", port=free_port())
    port, admin_port = free_port(), free_port()
    proxy = lbproxy(workers_config(port, [a, refused], admin_port, workers=2))
    process = get_json(admin_port, "/api/v1/process")
    assert process["workers"] == 2 and process["pid"] == proxy.proc.pid
    served = [ask_name(port) for _ in range(20)]
    assert set(served) == {"a"}

    def merged() -> dict | None:
        rs = {s["name"]: s for s in _servers(admin_port).values()}
        if rs["a"]["connections_total"] == 20 and rs["a"]["rate"]["max"] > 0:
            return rs
        return None

    rs = wait_for(merged, 15, "both workers' counts merged")
    workers = get_json(admin_port, "/api/v1/workers")
    per_worker = [
        {
            s["name"]: s
            for s in get_json(admin_port, f"/api/v1/workers/{w['index']}/virtual-servers")[
                "virtual_servers"
            ][0]["real_servers"]
        }
        for w in workers["workers"]
    ]
    refusals = sum(w["gone"]["errors"]["connect_refused"] for w in per_worker)
    assert rs["gone"]["errors"]["connect_refused"] == refusals >= 1
    assert rs["a"]["rate"]["max"] <= sum(w["a"]["rate"]["max"] for w in per_worker) + 0.1
    assert rs["gone"]["since"] == max(w["gone"]["since"] for w in per_worker)


def test_a_reset_by_the_real_server_is_counted(lbproxy):
    """A real server that resets an established connection (RST: SO_LINGER 0) counts
    one `reset` in its `errors`; a clean close counts none."""
    resetting = socket.create_server(("127.0.0.1", 0))
    target = SimpleNamespace(name="rst", port=resetting.getsockname()[1])
    port, admin_port = free_port(), free_port()
    lbproxy(with_admin(vs_config(port, [target], "rr", "health_check: {type: none}"), admin_port))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            resetting.settimeout(10)
            accepted, _ = resetting.accept()
            client.sendall(b"hello")  # through the pump: established on both sides
            accepted.settimeout(10)
            assert accepted.recv(5) == b"hello"
            accepted.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            accepted.close()  # an RST, not a FIN
            with contextlib.suppress(ConnectionResetError):  # the proxy passes the reset on
                assert client.recv(10) == b""
        rs = wait_for(
            lambda: (s := _servers(admin_port)["rst"])["errors"]["reset"] == 1 and s,
            10,
            "the reset counted",
            details=lambda: str(_servers(admin_port)["rst"]),
        )
        assert rs["connections_total"] == 1 and rs["errors"]["connect_refused"] == 0
    finally:
        resetting.close()
