"""`lbproxy simulate --replay` (SPEC §25) on real logs: a real lbproxy's JSON access log
and a real HAProxy's `option tcplog`, made by real connections, replayed through the
CLI; the replay's figures checked against what the live proxies did."""

from __future__ import annotations

import gzip
import json
import socket
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from tests import tools
from tests.integration.harness import (
    free_port,
    listening,
    read_name,
    run_cli,
    vs_config,
    wait_for,
)

pytestmark = pytest.mark.integration

CLIENTS = [f"127.0.0.{i}" for i in range(2, 10)]  # loopback addresses: eight clients
ROUNDS = 2  # each client connects this many times, in turn


def access_records(text: str) -> list[dict]:
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return [r for r in records if r["logger"] == "lbproxy.access"]


def connect_in_turn(port: int, logged) -> list[tuple[str, str]]:
    """Each client, in turn, ROUNDS times: connect from its address, read the server's
    name, close, and wait until the proxy has logged it (so the next one starts after it
    ended, on both sides). Returns (client, server) per connection."""
    served = []
    for number in range(len(CLIENTS) * ROUNDS):
        client = CLIENTS[number % len(CLIENTS)]
        with socket.create_connection(
            ("127.0.0.1", port), timeout=5, source_address=(client, 0)
        ) as s:
            served.append((client, read_name(s)))
        wait_for(lambda n=number: logged() > n, 10, f"log line {number + 1}")
    return served


def first_servers(served: list[tuple[str, str]]) -> dict[str, str]:
    first: dict[str, str] = {}
    for client, server in served:
        first.setdefault(client, server)
    return first


def replay_json(*args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = run_cli("simulate", "--replay", *args, "--json")
    return out, (json.loads(out.stdout) if out.stdout.strip() else None)


def test_a_real_access_log_replays_as_lbproxy_served_it(tmp_path, name_servers, lbproxy):
    servers = name_servers("a", "b")
    lives = {}
    for scheduler in ("rr", "maglev"):
        port = free_port()
        text = vs_config(port, servers, scheduler).replace(
            "  drain_timeout: 5s", "  drain_timeout: 5s\n  log_format: json\n  access_log: true"
        )
        folder = tmp_path / scheduler
        proxy = lbproxy(text, folder=folder)
        served = connect_in_turn(port, lambda p=proxy: len(access_records(p.log())))
        proxy.stop()
        lives[scheduler] = (proxy, served)
    rr_proxy, rr_served = lives["rr"]
    _, maglev_served = lives["maglev"]
    log = tmp_path / "access.log"
    log.write_text(rr_proxy.log() + "this line is not JSON\n")
    bad_line = len(rr_proxy.log().splitlines()) + 1
    rr_config = str(rr_proxy.config_path)
    maglev_config = str(lives["maglev"][0].config_path)

    out, replayed = replay_json(str(log), rr_config, rr_config, maglev_config)
    assert out.returncode == 0, out.stderr
    assert replayed is not None
    connections = len(CLIENTS) * ROUNDS
    assert (replayed["connections"], replayed["clients"], replayed["malformed"]) == (
        connections,
        len(CLIENTS),
        1,
    )
    # the malformed line is named with its line number, and the replay went on
    assert f"{log}:{bad_line}: malformed: not a JSON object: this line is not JSON" in out.stderr
    rr, again, maglev = replayed["configurations"]
    # rr, replayed, places the connections as the live rr did
    live_rr = Counter(server for _, server in rr_served)
    web = rr["virtual_servers"]["web"]
    assert {n: s["connections"] for n, s in web["real_servers"].items()} == live_rr
    assert {n: s["share"] for n, s in web["real_servers"].items()} == {"a": 0.5, "b": 0.5}
    # one connection at a time: each server's peak is 1
    assert {n: s["peak"] for n, s in web["real_servers"].items()} == {"a": 1, "b": 1}
    assert web["peak_ratio"] == 1.0
    assert again["moved"]["moved"] == 0  # the same configuration moves nobody
    # maglev, replayed, places the clients as the live maglev did...
    live_maglev = Counter(server for _, server in maglev_served)
    web = maglev["virtual_servers"]["web"]
    assert {n: s["connections"] for n, s in web["real_servers"].items()} == {
        "a": live_maglev["a"],
        "b": live_maglev["b"],
    }
    # ... so the clients that moved are those the two live proxies served differently
    before, after = first_servers(rr_served), first_servers(maglev_served)
    moved = sum(before[c] != after[c] for c in CLIENTS)
    assert (maglev["moved"]["clients"], maglev["moved"]["moved"]) == (len(CLIENTS), moved)
    percent = 100 * moved / len(CLIENTS)
    assert maglev["moved"]["percent"] == percent

    # the gates, as CI would use them: passing, then each exceeded
    out = run_cli(
        "simulate", "--replay", str(log), rr_config, maglev_config,
        "--max-moved", str(percent), "--max-peak-ratio", "1",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "moved from " in out.stdout and f"{moved} of {len(CLIENTS)} clients" in out.stdout
    # (maglev hashes the server names and the client addresses, both fixed here: for these
    # eight clients it disagrees with rr's turns for 7)
    assert moved == 7
    out = run_cli(
        "simulate", "--replay", str(log), rr_config, maglev_config,
        "--max-moved", str(percent - 10),
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert (
        f"gate --max-moved {percent - 10:g} exceeded by 10 points: {maglev_config}, "
        f"virtual server web: {moved} of {len(CLIENTS)} clients moved"
    ) in out.stderr


def test_replay_refuses_connections_and_names_a_missing_virtual_server(tmp_path):
    config = tmp_path / "other.yaml"
    config.write_text(
        "virtual_servers:\n  - name: api\n    listen: 127.0.0.1:8080\n"
        "    real_servers: [{name: a, address: 127.0.0.1:9001}]\n"
    )
    log = tmp_path / "access.log"
    log.write_text(
        json.dumps(
            {
                "logger": "lbproxy.access",
                "start": "2026-12-05T10:00:00.000000Z",
                "duration_s": 1.0,
                "client": "10.0.0.1",
                "client_port": 1000,
                "virtual_server": "web",
            }
        )
        + "\n"
    )
    out = run_cli("simulate", "--replay", str(log), str(config), "-n", "10")
    assert out.returncode == 2
    assert "--connections not allowed with --replay" in out.stderr
    out = run_cli("simulate", str(config))
    assert out.returncode == 2 and "Missing option '--connections'" in out.stderr
    out = run_cli("simulate", str(config), "-n", "1", "--max-moved", "5")
    assert out.returncode == 2 and "--max-moved only with --replay" in out.stderr
    out = run_cli("simulate", "--replay", str(log), str(config))
    assert out.returncode == 0, out.stderr
    assert f"{config}: no virtual server 'web': its 1 connection not replayed" in out.stderr
    out = run_cli("simulate", "--replay", str(tmp_path / "nope.log"), str(config))
    assert out.returncode == 2 and "No such file or directory" in out.stderr
    # gzip'd, cut short, from stdin
    packed = gzip.compress(log.read_bytes())
    (tmp_path / "access.log.gz").write_bytes(packed)
    out = run_cli("simulate", "--replay", str(tmp_path / "access.log.gz"), str(config))
    assert out.returncode == 0 and "replayed 1 connections" in out.stdout, out.stderr
    (tmp_path / "cut.log.gz").write_bytes(packed[: len(packed) // 2])
    out = run_cli("simulate", "--replay", str(tmp_path / "cut.log.gz"), str(config))
    assert out.returncode == 2 and out.stderr.startswith(f"{tmp_path / 'cut.log.gz'}: ")
    out = run_cli("simulate", "--replay", "-", str(config), input=log.read_text())
    assert out.returncode == 0 and "replayed 1 connections from -" in out.stdout, out.stderr
    # an invalid configuration: FILE:LINE, exit 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(config.read_text().replace("name: a,", "name: a, weight: -1,"))
    out = run_cli("simulate", "--replay", str(log), str(config), str(bad))
    assert out.returncode == 2 and f"{bad}:4: weight must be" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


HAPROXY = """\
global
  log stdout format raw local0
defaults
  mode tcp
  log global
  option tcplog
  timeout connect 5s
  timeout client 30s
  timeout server 30s
frontend fe
  bind 127.0.0.1:{port}
  default_backend web
backend web
  balance roundrobin
  server a 127.0.0.1:{a}
  server b 127.0.0.1:{b}
"""


@tools.requires("haproxy", package="haproxy")
def test_a_real_haproxy_tcplog_replays_as_haproxy_served_it(tmp_path, name_servers):
    a, b = name_servers("a", "b")
    port = free_port()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(HAPROXY.format(port=port, a=a.port, b=b.port))
    log_path = tmp_path / "haproxy.log"
    with open(log_path, "wb") as log_file:
        haproxy = subprocess.Popen(
            [tools.need("haproxy", "haproxy"), "-db", "-f", str(cfg)],
            stdout=log_file,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for(lambda: listening(port), 10, "HAProxy listening")
            served = connect_in_turn(port, lambda: _tcplog_lines(log_path))
        finally:
            haproxy.terminate()
            haproxy.wait(10)
    # the same servers behind lbproxy, under the backend's name
    config = tmp_path / "lbproxy.yaml"
    config.write_text(vs_config(free_port(), [a, b], "rr"))
    log = Path(log_path)
    out, replayed = replay_json(str(log), "--log-format", "haproxy", str(config))
    assert out.returncode == 0, out.stderr
    assert replayed is not None
    assert (replayed["connections"], replayed["clients"]) == (len(served), len(CLIENTS))
    assert replayed["malformed"] == 0, out.stderr  # every line HAProxy wrote is read
    # HAProxy's roundrobin and lbproxy's rr: the same counts, one at a time
    web = replayed["configurations"][0]["virtual_servers"]["web"]
    live = Counter(server for _, server in served)
    assert {n: s["connections"] for n, s in web["real_servers"].items()} == live
    assert {n: s["peak"] for n, s in web["real_servers"].items()} == {"a": 1, "b": 1}


def _tcplog_lines(path: Path) -> int:
    """The tcplog lines HAProxy has written."""
    return sum(1 for line in path.read_text(errors="replace").splitlines() if " [" in line)
