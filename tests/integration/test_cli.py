"""The command line as a user runs it: real `python -m lbproxy` processes."""

from __future__ import annotations

import json
import signal
import socket
import time

import lbproxy
from tests.integration.harness import (
    ROOT,
    compiled_path_expected,
    free_port,
    listening,
    open_and_read_name,
    run_cli,
    vs_config,
    wait_for,
)

SAP = """\
virtual_servers:
  - name: gateway
    listen: 127.0.0.1:{port}
    scheduler: sap
    real_servers:
      - {{name: Server1, address: 127.0.0.1:9001, load_factor: 2}}
      - {{name: Server2, address: 127.0.0.1:9002, load_factor: 3}}
      - {{name: Server3, address: 127.0.0.1:9003, load_factor: 4}}
      - {{name: Server4, address: 127.0.0.1:9004, load_factor: 4, state: disabled}}
"""

LVS = """\
virtual_servers:
  - name: lvs
    listen: 127.0.0.1:{port}
    scheduler: wlc
    quiesce: {quiesce}
    real_servers:
      - {{name: A, address: 127.0.0.1:9001, weight: 1}}
      - {{name: B, address: 127.0.0.1:9002, weight: 1}}
      - {{name: C, address: 127.0.0.1:9003, weight: 2}}
"""


def test_simulate_reproduces_the_sap_table(tmp_path):
    config = tmp_path / "sap.yaml"
    config.write_text(SAP.format(port=free_port()))
    events = tmp_path / "events.yaml"
    events.write_text("- {before: 8, join: Server4}\n")
    out = run_cli("simulate", str(config), "--connections", "8", "--events", str(events), "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["virtual_server"] == "gateway"
    assert result["sequence"] == [f"Server{i}" for i in (1, 2, 3, 1, 2, 1, 3, 1)]
    assert result["picks"] == {"Server1": 4, "Server2": 2, "Server3": 2, "Server4": 0}


def test_simulate_sap_load_factor_change_at_run_time(tmp_path):
    """seeds/004: "Server1=3" gives Server1 a new load at run time, "Server2=0" removes
    Server2. After the document's 8 jobs (loads 8, 6, 8, 8) Server1 adds 3 per job, not 2;
    its accumulated load stays, and ties go in configuration order."""
    config = tmp_path / "sap.yaml"
    config.write_text(SAP.format(port=free_port()))
    events = tmp_path / "events.yaml"
    events.write_text(
        "- {before: 8, join: Server4}\n"
        "- {before: 9, load_factor: {Server1: 3}}\n"
        "- {before: 19, weight: {Server2: 0}}\n"
    )
    out = run_cli("simulate", str(config), "-n", "22", "--events", str(events), "--json")
    assert out.returncode == 0, out.stderr
    sequence = json.loads(out.stdout)["sequence"]
    assert sequence[:8] == [f"Server{i}" for i in (1, 2, 3, 1, 2, 1, 3, 1)]
    # loads 8 6 8 8 -> S2 9; S1 11 (tie at 8, first in order, +3); S3 12; S4 12; S2 12;
    # S1 14; S2 15 (tie at 12); S3 16; S4 16; S1 17
    assert sequence[8:18] == [f"Server{i}" for i in (2, 1, 3, 4, 2, 1, 2, 3, 4, 1)]
    # Server2 removed at 15: S3 20; S4 20; S1 20; S1 23 (tie at 20, first in order)
    assert sequence[18:] == [f"Server{i}" for i in (3, 4, 1, 1)]


def _lvs_flood(tmp_path, quiesce: bool) -> dict:
    config = tmp_path / f"lvs-{quiesce}.yaml"
    config.write_text(LVS.format(port=free_port(), quiesce=str(quiesce).lower()))
    events = tmp_path / "lvs-events.yaml"
    events.write_text("- {before: 1, leave: C}\n- {before: 61, join: C}\n")
    out = run_cli("simulate", str(config), "-n", "90", "--hold", "--events", str(events), "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_simulate_reproduces_the_lvs_rejoin_flood(tmp_path):
    flood = _lvs_flood(tmp_path, quiesce=False)
    assert flood["sequence"][60:] == ["C"] * 30
    quiesced = _lvs_flood(tmp_path, quiesce=True)
    after = quiesced["sequence"][60:]
    assert after.count("C") == 15 and after.count("A") + after.count("B") == 15


def test_simulate_prints_a_share_table(tmp_path):
    config = tmp_path / "sap.yaml"
    config.write_text(SAP.format(port=free_port()))
    out = run_cli("simulate", str(config), "-n", "7")
    assert out.returncode == 0, out.stderr
    assert "Server1" in out.stdout and "42.9%" in out.stdout


def test_simulate_bad_events_file_exits_2(tmp_path):
    config = tmp_path / "sap.yaml"
    config.write_text(SAP.format(port=free_port()))
    events = tmp_path / "events.yaml"
    events.write_text("- {before: 2, join: Server9}\n- {befor: 3}\n")
    out = run_cli("simulate", str(config), "-n", "8", "--events", str(events))
    assert out.returncode == 2
    assert f"{events}:1: join: unknown real server 'Server9'" in out.stderr
    assert f"{events}:2: unknown event key 'befor'" in out.stderr
    assert "Traceback" not in out.stderr


def test_check_valid_configuration(tmp_path):
    config = tmp_path / "sap.yaml"
    config.write_text(SAP.format(port=free_port()))
    out = run_cli("check", str(config))
    assert out.returncode == 0
    assert "gateway" in out.stdout and "Server4" in out.stdout


def test_invalid_configuration_exits_2_with_every_problem(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "virtual_servers:\n"
        "  - name: web\n"
        "    lisen: 127.0.0.1:8080\n"
        "    scheduler: wlcc\n"
        "    real_servers:\n"
        "      - {name: a, address: 127.0.0.1:notaport, weight: heavy}\n"
    )
    for command in ("check", "run"):
        out = run_cli(command, str(config))
        assert out.returncode == 2, out
        assert "Traceback" not in out.stderr
        assert f"{config}:3: unknown key 'lisen'" in out.stderr
        assert "did you mean 'listen'" in out.stderr
        assert f"{config}:4: unknown scheduler 'wlcc'" in out.stderr
        assert f"{config}:6:" in out.stderr


def test_missing_configuration_file_exits_2(tmp_path):
    out = run_cli("run", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2
    assert "nope.yaml" in out.stderr and "Traceback" not in out.stderr


def test_address_in_use_exits_1_naming_the_address(tmp_path):
    busy = socket.create_server(("127.0.0.1", 0))
    port = busy.getsockname()[1]

    class Server:
        name = "a"

    Server.port = free_port()
    config = tmp_path / "busy.yaml"
    config.write_text(vs_config(port, [Server]))
    try:
        out = run_cli("run", str(config), timeout=30)
    finally:
        busy.close()
    assert out.returncode == 1
    assert f"127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr


def test_sigterm_stops_accepting_and_lets_held_connections_finish(name_servers, lbproxy):
    servers = name_servers("a")
    port = free_port()
    proxy = lbproxy(vs_config(port, servers))
    sock, name = open_and_read_name(port)
    assert name == "a"
    proxy.signal(signal.SIGTERM)
    wait_for(lambda: not listening(port), 5, "the listener closed")
    try:  # no new connections
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        raise AssertionError("a new connection was accepted while draining")
    except ConnectionRefusedError:
        pass
    sock.sendall(b"still here")  # the held one keeps working
    assert sock.recv(100) == b"still here"
    assert proxy.proc.poll() is None
    sock.close()
    assert proxy.proc.wait(10) == 0


def test_sigterm_closes_what_is_left_after_drain_timeout(name_servers, lbproxy):
    servers = name_servers("a")
    port = free_port()
    proxy = lbproxy(vs_config(port, servers).replace("drain_timeout: 5s", "drain_timeout: 1s"))
    sock, _ = open_and_read_name(port)
    started = time.monotonic()
    proxy.signal(signal.SIGTERM)
    assert proxy.proc.wait(10) == 0
    assert time.monotonic() - started < 5
    sock.settimeout(5)
    assert sock.recv(100) == b""
    sock.close()


def test_python_dash_m_and_version():
    out = run_cli("--version")
    assert out.returncode == 0 and "lbproxy" in out.stdout
    assert (ROOT / "lbproxy" / "__main__.py").exists()


def test_version_says_which_connection_path_runs(monkeypatch):
    # `pip install -e .` builds the C extension in place: the compiled path runs unless
    # LBPROXY_PURE=1 forces the pure one.
    monkeypatch.delenv("LBPROXY_PURE", raising=False)
    built = compiled_path_expected()
    compiled = run_cli("--version").stdout.splitlines()
    monkeypatch.setenv("LBPROXY_PURE", "1")
    pure = run_cli("--version").stdout.splitlines()
    if built:
        assert compiled[1] == "connection path: compiled (lbproxy.net._cpump)"
    else:
        assert compiled[1].startswith("connection path: pure Python (no compiled extension")
    assert pure[1] == "connection path: pure Python (LBPROXY_PURE=1)"
    assert compiled[0] == pure[0] == f"lbproxy, version {lbproxy.__version__}"


MAGLEV = """\
virtual_servers:
  - name: cache
    listen: 127.0.0.1:{port}
    scheduler: maglev
    real_servers:
      - {{name: s1, address: 127.0.0.1:9001}}
      - {{name: s2, address: 127.0.0.1:9002}}
      - {{name: s3, address: 127.0.0.1:9003}}
"""


def test_simulate_clients_says_how_many_moved_on_leave_and_join(tmp_path):
    config = tmp_path / "maglev.yaml"
    config.write_text(MAGLEV.format(port=free_port()))
    events = tmp_path / "events.yaml"
    events.write_text("- {before: 301, leave: s2}\n- {before: 601, join: s2}\n")
    args = ["simulate", str(config), "-n", "900", "--clients", "100", "--events", str(events)]
    out = run_cli(*args, "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    clients = result["clients"]
    assert list(clients)[:3] == ["10.0.0.1", "10.0.0.2", "10.0.0.3"] and len(clients) == 100
    on_s2 = [a for a, servers in clients.items() if servers[0] == "s2"]
    for address, servers in clients.items():
        assert servers[:3] == servers[6:] == [servers[0]] * 3  # back where it was
        if address not in on_s2:
            assert servers[3:6] == servers[:3]  # a leave moves only s2's clients
    text = run_cli(*args)
    assert text.returncode == 0, text.stderr
    assert "clients: 100" in text.stdout
    n = len(on_s2)
    assert f"leave s2 (before #301): {n} of 100 clients moved (from s2: {n})" in text.stdout
    assert f"join s2 (before #601): {n} of 100 clients moved" in text.stdout
