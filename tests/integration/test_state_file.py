"""`global.state_file` (SPEC §17): runtime state kept across a stop and a start of a real
`lbproxy run`; a corrupt or truncated file is one warning and a start from the files."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from pathlib import Path

import pytest

from tests.integration.harness import (
    Lbproxy,
    free_port,
    http,
    local_http,
    metrics,
    read_name,
    ready,
    sample,
    wait_for,
    worker_servers,
    workers_config,
)

pytestmark = pytest.mark.integration

CLIENTS = 100
MIB = 1 << 20


def config(port: int, admin_port: int, servers, state_file) -> str:
    rs = "\n".join(f"      - {{name: {s.name}, address: 127.0.0.1:{s.port}}}" for s in servers)
    return f"""
global:
  admin: {{listen: 127.0.0.1:{admin_port}}}
  drain_timeout: 2s
  state_file: {state_file}
virtual_servers:
  - name: web
    listen: 127.0.0.1:{port}
    scheduler: rr
    health_check: {{type: none}}
    persistence: {{timeout: 10m}}
    real_servers:
{rs}
  - name: grid
    listen: none
    scheduler: least-load
    load_source: report
    health_check: {{type: none}}
    real_servers:
{rs}
"""


def name_from(port: int, source: str) -> str:
    """Connect through the proxy from `source` (a loopback address) and read the name."""
    with socket.socket() as s:
        s.settimeout(5)
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        return read_name(s)


def clients() -> list[str]:
    return [f"127.0.1.{i}" for i in range(1, CLIENTS + 1)]


def servers_of(admin_port: int, vs: str) -> dict[str, dict]:
    status, body = http("GET", f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers/{vs}")
    assert status == 200, body
    return {rs["name"]: rs for rs in json.loads(body)["real_servers"]}


def api(admin_port: int, method: str, path: str, body) -> None:
    status, answer = local_http(method, f"http://127.0.0.1:{admin_port}/api/v1/{path}", body)
    assert status == 200, answer


@pytest.fixture
def setup(tmp_path, name_servers, lbproxy):
    servers = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    state_file = tmp_path / "state.json"
    text = config(port, admin_port, servers, state_file)

    def start() -> Lbproxy:
        return lbproxy(text, [port, admin_port])

    return start, port, admin_port, state_file


def test_drain_weight_load_and_entries_survive_a_restart(setup):
    start, port, admin_port, state_file = setup
    proxy = start()
    placed = {client: name_from(port, client) for client in clients()}
    assert set(placed.values()) == {"a", "b", "c"}  # rr spread them over all three
    api(admin_port, "PATCH", "virtual-servers/web/real-servers/b", {"state": "drain"})
    api(admin_port, "PATCH", "virtual-servers/web/real-servers/a", {"weight": 7})
    api(admin_port, "PUT", "virtual-servers/grid/real-servers/c/load", {"load": 0.25})
    proxy.stop()
    saved = json.loads(state_file.read_bytes())
    assert saved["lbproxy_state"] == 1
    assert state_file.stat().st_mode & 0o777 == 0o600  # client addresses: not for everyone

    proxy = start()
    assert "restored from state file" in proxy.log(), proxy.log()
    web, grid = servers_of(admin_port, "web"), servers_of(admin_port, "grid")
    assert web["b"]["state"] == "drain"
    assert web["a"]["weight"]["static"] == 7
    assert web["c"]["weight"]["static"] == 1 and web["c"]["state"] == "enabled"
    assert grid["c"]["load"] == 0.25 and grid["a"]["load"] == 0
    samples = metrics(admin_port)
    # ... and 127.0.0.1, the harness's probe of the listener before the first start
    assert sample(samples, "lbproxy_persistence_entries", virtual_server="web") == CLIENTS + 1
    # Every client of a and c goes back to its server (with a at weight 7, c would get
    # few of them by the scheduler); b is drained, so its clients move.
    for client, name in placed.items():
        now = name_from(port, client)
        assert now == name if name != "b" else now in ("a", "c"), client
    assert "Traceback" not in proxy.log()


@pytest.mark.parametrize("spoil", ["corrupt", "truncated"])
def test_a_spoilt_state_file_is_one_warning_and_a_start_from_the_files(setup, spoil):
    start, port, admin_port, state_file = setup
    proxy = start()
    for client in clients()[:10]:
        name_from(port, client)
    api(admin_port, "PATCH", "virtual-servers/web/real-servers/b", {"state": "drain"})
    proxy.stop()
    data = state_file.read_bytes()
    if spoil == "truncated":
        state_file.write_bytes(data[: len(data) // 2])
    else:
        state_file.write_bytes(data.replace(b'"drain"', b'"drained"'))

    proxy = start()
    log = proxy.log()
    warnings = [line for line in log.splitlines() if "state file" in line and "WARN" in line]
    assert len(warnings) == 1, log
    assert "unusable" in warnings[0] and "starting from the configuration files" in warnings[0]
    assert servers_of(admin_port, "web")["b"]["state"] == "enabled"
    samples = metrics(admin_port)
    # only 127.0.0.1, the harness's probe of the listener: none of the ten came back
    assert sample(samples, "lbproxy_persistence_entries", virtual_server="web") == 1
    assert name_from(port, "127.0.1.1") in ("a", "b", "c")
    # The spoilt file is replaced by a good one within a second or so.
    wait_for(lambda: json.loads(state_file.read_bytes())["lbproxy_state"] == 1, 5, "a good file")
    assert "Traceback" not in log


@pytest.mark.parametrize("untrusted", ["symlink", "group-writable", "too-large"])
def test_an_untrusted_state_file_is_one_warning_and_a_start_from_the_files(
    setup, tmp_path, untrusted
):
    """SPEC §21: a symlink at the path, a file writable by group or others, or one over
    64 MiB is ignored with one warning; lbproxy never writes through the link."""
    start, port, admin_port, state_file = setup
    proxy = start()
    api(admin_port, "PATCH", "virtual-servers/web/real-servers/b", {"state": "drain"})
    proxy.stop()
    good = state_file.read_bytes()
    assert b'"drain"' in good
    target = tmp_path / "elsewhere" / "x"
    if untrusted == "symlink":
        target.parent.mkdir()
        target.write_bytes(good)
        target.chmod(0o600)
        state_file.unlink()
        state_file.symlink_to(target)
    elif untrusted == "group-writable":
        state_file.chmod(0o664)
    else:  # still good JSON: whitespace after the object
        state_file.write_bytes(good + b" " * (64 * MIB + 1 - len(good)))
    reason = {
        "symlink": "is a symbolic link",
        "group-writable": "is writable by group or others (mode 0664)",
        "too-large": "is larger than 64 MiB",
    }[untrusted]

    proxy = start()
    log = proxy.log()
    warnings = [line for line in log.splitlines() if "state file" in line and "WARN" in line]
    assert len(warnings) == 1, log
    assert reason in warnings[0] and "starting from the configuration files" in warnings[0]
    assert servers_of(admin_port, "web")["b"]["state"] == "enabled"  # nothing restored
    assert name_from(port, "127.0.1.1") in ("a", "b", "c")
    # A change is written within a second or so: a new file at the path, never through
    # the link.
    api(admin_port, "PATCH", "virtual-servers/web/real-servers/a", {"weight": 3})
    wait_for(
        lambda: not state_file.is_symlink() and b'"weight":3' in state_file.read_bytes(),
        5,
        "the state written to a file of its own",
    )
    assert state_file.stat().st_mode & 0o777 == 0o600
    if untrusted == "symlink":
        assert target.read_bytes() == good
    assert "Traceback" not in log


def test_gone_and_moved_servers_are_skipped_and_logged(setup, name_servers, lbproxy):
    start, port, admin_port, state_file = setup
    proxy = start()
    api(admin_port, "PATCH", "virtual-servers/web/real-servers/b", {"state": "drain"})
    api(admin_port, "PATCH", "virtual-servers/web/real-servers/c", {"state": "drain"})
    proxy.stop()
    # The next configuration: b is gone, c has another address.
    (other,) = name_servers("c")
    text = proxy.config_path.read_text()
    saved = json.loads(state_file.read_bytes())
    old_c = next(
        rs["address"] for rs in saved["virtual_servers"][0]["real_servers"] if rs["name"] == "c"
    )
    text = text.replace(f"address: {old_c}", f"address: 127.0.0.1:{other.port}")
    lines = [line for line in text.splitlines() if "name: b," not in line]
    proxy = lbproxy("\n".join(lines) + "\n", [port, admin_port])
    log = proxy.log()
    assert "web/b is no longer configured; skipped" in log, log
    assert "web/c is now" in log and "its runtime state is reset" in log, log
    assert servers_of(admin_port, "web")["c"]["state"] == "enabled"


def test_with_workers_every_worker_restores_what_worker_1_wrote(tmp_path, name_servers, lbproxy):
    servers = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    state_file = tmp_path / "state.json"
    text = workers_config(port, servers, admin_port).replace(
        "global:\n", f"global:\n  state_file: {state_file}\n", 1
    )
    proxy = lbproxy(text, [port, admin_port])
    wait_for(lambda: ready(admin_port), 20, "both workers ready")
    api(admin_port, "PATCH", "virtual-servers/web/real-servers/b", {"state": "drain"})
    api(admin_port, "PATCH", "virtual-servers/web/real-servers/a", {"weight": 7})
    proxy.stop()
    proxy = lbproxy(text, [port, admin_port])
    wait_for(lambda: ready(admin_port), 20, "both workers ready again")
    for index in (1, 2):
        restored = worker_servers(admin_port, index)
        assert restored["b"]["state"] == "drain", index
        assert restored["a"]["weight"]["static"] == 7, index
    assert proxy.log().count("restored from state file") == 2, proxy.log()


def test_the_state_crosses_an_upgrade_and_the_old_process_stops_writing(setup):
    start, port, admin_port, state_file = setup
    proxy = start()
    proxy.may_exit = True  # the upgrade ends it
    api(admin_port, "PATCH", "virtual-servers/web/real-servers/b", {"state": "drain"})
    api(admin_port, "PATCH", "virtual-servers/web/real-servers/a", {"weight": 7})
    held = socket.socket()
    held.settimeout(5)
    held.bind(("127.0.1.50", 0))
    held.connect(("127.0.0.1", port))
    assert read_name(held) in ("a", "c")  # through the old process; ends in its drain
    status, body = local_http("POST", f"http://127.0.0.1:{admin_port}/api/v1/upgrade", {})
    assert status == 200, body
    new = json.loads(body)["pid"]
    try:
        web = servers_of(admin_port, "web")  # the new process answers now
        assert web["b"]["state"] == "drain" and web["a"]["weight"]["static"] == 7
        api(admin_port, "PATCH", "virtual-servers/web/real-servers/b", {"state": "enabled"})

        def b_enabled() -> bool:
            # b enabled (no entry) in a file written after the PATCHes (a's weight 7):
            # the file the old process wrote at its start has no entry for b either
            saved = json.loads(state_file.read_bytes())
            web = next(vs for vs in saved["virtual_servers"] if vs["name"] == "web")
            servers = {rs["name"]: rs for rs in web["real_servers"]}
            return "b" not in servers and servers.get("a", {}).get("weight") == 7

        wait_for(b_enabled, 5, "the new process to write b enabled")
        held.close()  # the old process's persistence entry changes: it would write now
        assert proxy.proc.wait(20) == 0
        assert b_enabled()  # not the old process's stale drain
        saved = json.loads(state_file.read_bytes())
        web_saved = next(vs for vs in saved["virtual_servers"] if vs["name"] == "web")
        assert {rs["name"]: rs.get("weight") for rs in web_saved["real_servers"]}["a"] == 7
    finally:
        held.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(new, signal.SIGTERM)
        wait_for(lambda: _zombie(new), 20, "the new process to exit")


def _zombie(pid: int) -> bool:
    """Gone, or exited and not reaped (it is not our child: nobody here reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_with_workers_every_workers_persistence_entries_survive_a_restart(
    tmp_path, name_servers, lbproxy
):
    """Each worker has its own persistence table; the saved state holds all of them (worker
    k's part in STATE_FILE.wK beside the file) and every worker restores all of them."""
    servers = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    state_file = tmp_path / "state.json"
    text = (
        config(port, admin_port, servers, state_file)
        .replace("global:\n", "global:\n  workers: 2\n", 1)
        .replace("  - name: grid", "  - name: grid-unused", 1)
    )
    proxy = lbproxy(text, [port, admin_port])
    wait_for(lambda: ready(admin_port), 20, "both workers ready")
    placed = {client: name_from(port, client) for client in clients()}
    proxy.stop()
    assert (tmp_path / "state.json.w2").stat().st_mode & 0o777 == 0o600  # worker 2's part
    proxy = lbproxy(text, [port, admin_port])
    wait_for(lambda: ready(admin_port), 20, "both workers ready again")
    # Whichever worker accepts a client now, the client goes back to its server.
    moved = [
        client
        for client, name in placed.items()
        for _ in range(3)
        if name_from(port, client) != name
    ]
    assert moved == [], (len(moved), moved[:10])
    assert "Traceback" not in proxy.log()
    proxy.stop()
    # Back to one process: it restores both parts, merges them into its file and
    # removes worker 2's part.
    proxy = lbproxy(text.replace("  workers: 2\n", ""), [port, admin_port])
    wait_for(lambda: not (tmp_path / "state.json.w2").exists(), 5, "the part removed")
    assert [c for c, name in placed.items() if name_from(port, c) != name] == []
    proxy.stop()
    proxy = lbproxy(text, [port, admin_port])  # from the merged file
    wait_for(lambda: ready(admin_port), 20, "both workers ready a third time")
    assert [c for c, name in placed.items() if name_from(port, c) != name] == []


@pytest.mark.parametrize("after", [2, 1])
def test_with_workers_every_workers_persistence_entries_survive_an_upgrade(
    tmp_path, name_servers, lbproxy, after
):
    """An upgrade of workers: 2 hands over worker 1's state; the new process (workers 2,
    or one process) also reads worker 2's entries from its part of the state file, so no
    client of either old worker moves."""
    servers = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    state_file = tmp_path / "state.json"
    text = config(port, admin_port, servers, state_file).replace(
        "global:\n", "global:\n  workers: 2\n", 1
    )
    proxy = lbproxy(text, [port, admin_port])
    proxy.may_exit = True  # the upgrade ends it
    wait_for(lambda: ready(admin_port), 20, "both workers ready")
    placed = {client: name_from(port, client) for client in clients()}

    def saved_clients() -> set[str]:
        saved = set()
        for path in (state_file, tmp_path / "state.json.w2"):
            with contextlib.suppress(OSError, ValueError):
                document = json.loads(path.read_bytes())
                web = next(vs for vs in document["virtual_servers"] if vs["name"] == "web")
                saved |= {client for client, _, _ in web["persistence"]}
        return saved

    # Worker 2's entries reach the new process only through its part, written within a
    # second; worker 1's come with its state.
    wait_for(lambda: saved_clients() >= set(placed), 10, "every entry written")
    if after == 1:
        proxy.config_path.write_text(text.replace("  workers: 2\n", ""))
    status, body = local_http("POST", f"http://127.0.0.1:{admin_port}/api/v1/upgrade", {})
    assert status == 200, body
    new = json.loads(body)["pid"]
    try:
        # The old supervisor gone, and its workers with it: until their SIGTERM, an old
        # worker may still accept a client, and it knows only its own entries.
        assert proxy.proc.wait(20) == 0
        # In the reverse order: rr would give a client that lost its entry the server it
        # had before in the same order.
        moved = [c for c, name in reversed(placed.items()) if name_from(port, c) != name]
        assert moved == [], (len(moved), moved[:10])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(new, signal.SIGTERM)
        wait_for(lambda: _zombie(new), 20, "the new process to exit")
