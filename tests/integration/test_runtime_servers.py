"""Real servers added and removed at run time (SPEC §24), on real `lbproxy` processes:
POST and DELETE on the admin API and `lbproxy add-server` / `remove-server`, validated
as a file is, drained on removal, kept across a reload and a restart (state file)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.integration.client_loop import ClientLoop
from tests.integration.harness import (
    UpgradableLbproxy,
    ask_name,
    free_port,
    get_json,
    http,
    local_http,
    open_and_read_name,
    ready,
    run_cli,
    servers_of,
    vs_config,
    wait_for,
    with_admin,
    worker_servers,
    workers,
    workers_config,
)
from tests.integration.redis_server import RedisServer, requires_redis

pytestmark = pytest.mark.integration

TOKEN = "runtime-servers-token"
SERVERS = "/api/v1/virtual-servers/web/real-servers"


def url(admin_port: int, path: str) -> str:
    return f"http://127.0.0.1:{admin_port}{path}"


def token_file(folder: Path) -> Path:
    path = folder / "admin.token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


def add(admin_port: int, entry: dict) -> tuple[int, dict]:
    status, body = local_http("POST", url(admin_port, SERVERS), entry)
    return status, json.loads(body)


def remove(admin_port: int, name: str) -> tuple[int, dict]:
    status, body = local_http("DELETE", url(admin_port, f"{SERVERS}/{name}"))
    return status, json.loads(body)


def checked_config(port: int, servers, admin_port: int, extra: str = "") -> str:
    """Active TCP checks every 100ms, one success to come up."""
    checks = "health_check: {type: tcp, interval: 100ms, timeout: 1s, rise: 1, fall: 1}"
    return with_admin(vs_config(port, servers, "rr", checks + "\n" + extra), admin_port)


def test_an_added_server_gets_its_share_after_its_first_check_without_a_client_error(
    name_servers, lbproxy
):
    """Under a client loop, `POST .../real-servers` adds c: 201 with its document
    (down until its first check passes), then it takes connections; no client sees an
    error."""
    a, b, c = name_servers("a", "b", "c", greeting=False)
    port, admin_port = free_port(), free_port()
    lbproxy(checked_config(port, [a, b], admin_port))
    with ClientLoop(port, clients=4) as loop:
        loop.wait_for(50)
        status, document = add(
            admin_port, {"name": "c", "address": f"127.0.0.1:{c.port}", "weight": 2}
        )
        assert status == 201, document
        assert document["name"] == "c" and document["weight"]["static"] == 2
        assert document["health"] == "down"  # until its first check passes
        wait_for(lambda: c.accepted >= 20, 20, "c takes connections")
        loop.wait_for(50)
        counts = loop.stop()
    assert set(counts) == {"ok"}, (counts, loop.errors)
    assert servers_of(admin_port)["c"]["health"] == "up"


def test_a_removed_server_drains_and_is_gone_with_its_last_connection(name_servers, lbproxy):
    """DELETE with 50 connections open: 202 {"removing": true}; it takes no new one and
    its open ones keep working, across a reload too; gone when the last ends. DELETE of
    an idle server: 200 at once; of an unknown one: 404."""
    a, b = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    config = with_admin(vs_config(port, [a, b], "rr", "health_check: {type: none}"), admin_port)
    proxy = lbproxy(config)
    held = []
    try:
        while sum(name == "a" for _, name in held) < 50:
            held.append(open_and_read_name(port))
        status, document = remove(admin_port, "a")
        assert (status, document) == (202, {"removing": True})
        assert remove(admin_port, "a") == (202, {"removing": True})  # again: the same
        assert servers_of(admin_port)["a"]["state"] == "drain"
        for _ in range(10):
            sock, name = open_and_read_name(port)
            sock.close()
            assert name == "b"
        for sock, _ in held:  # still served by a
            sock.sendall(b"ping")
            assert sock.recv(10) == b"ping"
        proxy.reload()  # the files name a unchanged: it stays removed, still draining
        assert servers_of(admin_port)["a"]["state"] == "drain"
        assert {ask_name(port) for _ in range(6)} == {"b"}
    finally:
        for sock, _ in held:
            sock.close()
    wait_for(lambda: "a" not in servers_of(admin_port), 10, "a gone with its last connection")
    assert remove(admin_port, "a")[0] == 404
    assert add(admin_port, {"name": "c", "address": f"127.0.0.1:{a.port}"})[0] == 201
    assert remove(admin_port, "c") == (200, {"removing": False})
    assert set(servers_of(admin_port)) == {"b"}


def test_a_bad_body_gets_400_with_every_problem_and_changes_nothing(name_servers, lbproxy):
    a, b = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    lbproxy(with_admin(vs_config(port, [a], "rr"), admin_port))
    entry = {"name": "x y", "address": "nowhere", "weight": -1, "colour": "red", "state": "on"}
    status, document = add(admin_port, entry)
    assert status == 400
    errors = "\n".join(document["errors"])
    for expected in ("name must be", "address must be", "weight must be", "'colour'", "state"):
        assert expected in errors, errors
    assert len(document["errors"]) == 5
    status, document = add(admin_port, {"weight": 2})
    assert status == 400 and len(document["errors"]) == 2  # needs 'name', needs 'address'
    status, document = add(admin_port, {"name": "a", "address": f"127.0.0.1:{b.port}"})
    assert status == 409, document
    status, body = local_http("POST", url(admin_port, SERVERS), b"{not json")
    assert status == 400 and b"not valid JSON" in body
    assert set(servers_of(admin_port)) == {"a"}


def test_changes_over_tcp_need_the_token(name_servers, lbproxy, tmp_path):
    """Over TCP without a token_file the endpoint is read-only (403); with one, POST and
    DELETE need the token (401 without, 403 wrong) and work with it."""
    a, b = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    entry = {"name": "b", "address": f"127.0.0.1:{b.port}"}
    proxy = lbproxy(with_admin(vs_config(port, [a], "rr"), admin_port))
    assert http("POST", url(admin_port, SERVERS), entry)[0] == 403
    assert http("DELETE", url(admin_port, f"{SERVERS}/a"))[0] == 403
    proxy.stop()
    admin_port = free_port()
    config = with_admin(vs_config(port, [a], "rr"), admin_port, token_file(tmp_path))
    lbproxy(config)
    assert http("POST", url(admin_port, SERVERS), entry)[0] == 401
    assert http("POST", url(admin_port, SERVERS), entry, token="nope")[0] == 403
    assert http("DELETE", url(admin_port, f"{SERVERS}/a"))[0] == 401
    assert set(servers_of(admin_port)) == {"a"}
    assert http("POST", url(admin_port, SERVERS), entry, token=TOKEN)[0] == 201
    assert http("DELETE", url(admin_port, f"{SERVERS}/a"), token=TOKEN)[0] == 200
    assert set(servers_of(admin_port)) == {"b"}


def test_the_cli_adds_and_removes_through_the_admin_socket(name_servers, lbproxy):
    a, b = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    lbproxy(with_admin(vs_config(port, [a], "rr", "health_check: {type: none}"), admin_port))
    admin = ["--admin", url(admin_port, "")]
    result = run_cli(
        "add-server", "web", "b", f"127.0.0.1:{b.port}", "--weight", "3", "--max-connections",
        "10", "--backup", *admin,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "web/b: added" in result.stdout
    rs = servers_of(admin_port)["b"]
    assert (rs["weight"]["static"], rs["backup"]) == (3, True)
    result = run_cli("add-server", "web", "b", f"127.0.0.1:{b.port}", *admin)
    assert result.returncode == 1
    # the problem said once
    assert result.stderr == "lbproxy: HTTP 409: virtual server 'web' has a real server 'b'\n"
    result = run_cli("remove-server", "web", "b", *admin)
    assert result.returncode == 0 and "web/b: removed" in result.stdout, result.stderr
    result = run_cli("remove-server", "web", "b", *admin)
    assert result.returncode != 0 and "404" in result.stderr
    assert set(servers_of(admin_port)) == {"a"}


def test_added_and_removed_servers_survive_a_reload_unless_a_file_names_them(name_servers, lbproxy):
    """After a reload an added server is still there and a removed one still gone; a
    file that now names the added server, or changes the removed one's entry, wins."""
    a, b, c = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    proxy = lbproxy(with_admin(vs_config(port, [a, b], "rr"), admin_port))
    assert add(admin_port, {"name": "c", "address": f"127.0.0.1:{c.port}", "weight": 4})[0] == 201
    assert remove(admin_port, "b")[0] == 200
    proxy.reload()
    servers = servers_of(admin_port)
    assert set(servers) == {"a", "c"} and servers["c"]["weight"]["static"] == 4
    # The file now names c (weight 1) and changes b's entry (weight 2): the file wins.
    changed = vs_config(port, [a, b, c], "rr", rs_extra={"b": "weight: 2"})
    proxy.config_path.write_text(with_admin(changed, admin_port))
    proxy.reload()
    servers = servers_of(admin_port)
    assert set(servers) == {"a", "b", "c"}
    assert servers["c"]["weight"]["static"] == 1 and servers["b"]["weight"]["static"] == 2


def test_added_and_removed_servers_survive_a_restart_through_the_state_file(
    name_servers, lbproxy, tmp_path
):
    """Stopped and started again with `global.state_file`: the added server is back
    (checked again before it serves), the removed one stays removed."""
    a, b, c = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    state_file = tmp_path / "state.json"
    config = checked_config(port, [a, b], admin_port).replace(
        "global:\n", f"global:\n  state_file: {state_file}\n", 1
    )
    proxy = lbproxy(config)
    assert add(admin_port, {"name": "c", "address": f"127.0.0.1:{c.port}", "weight": 3})[0] == 201
    assert remove(admin_port, "b")[0] == 200
    written = lambda: state_file.exists() and '"removed"' in state_file.read_text()  # noqa: E731
    wait_for(written, 10, "the state file written")
    proxy.stop()
    saved = json.loads(state_file.read_text())["virtual_servers"][0]
    assert [rs["name"] for rs in saved["added"]] == ["c"] and saved["removed"][0][0] == "b"

    proxy = lbproxy(config)
    servers = servers_of(admin_port)
    assert set(servers) == {"a", "c"} and servers["c"]["weight"]["static"] == 3
    wait_for(lambda: servers_of(admin_port)["c"]["health"] == "up", 10, "c checked up")
    names = set()
    for _ in range(8):
        sock, name = open_and_read_name(port)
        sock.close()
        names.add(name)
    assert names == {"a", "c"}


def test_added_removed_and_patched_servers_survive_an_upgrade(name_servers, tmp_path):
    """`lbproxy upgrade` with no state file: the new process serves the servers as the
    API left them (c added, b removed, c's weight patched), not as the file has them,
    and c, up in the old process, takes its share from the first connection."""
    a, b, c = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    proxy = UpgradableLbproxy(
        tmp_path, with_admin(vs_config(port, [a, b], "wrr"), admin_port), admin_port
    )
    try:
        assert add(admin_port, {"name": "c", "address": f"127.0.0.1:{c.port}"})[0] == 201
        assert remove(admin_port, "b")[0] == 200
        status, body = local_http("PATCH", url(admin_port, f"{SERVERS}/c"), {"weight": 3})
        assert status == 200, body
        wait_for(lambda: servers_of(admin_port)["c"]["health"] == "up", 10, "c checked up")
        old = proxy.pid
        proxy.upgrade()
        assert proxy.pid != old
        wait_for(lambda: get_json(admin_port, "/api/v1/process")["pid"] == proxy.pid, 30, "new pid")
        servers = servers_of(admin_port)
        assert set(servers) == {"a", "c"}
        assert servers["c"]["weight"]["static"] == 3
        assert sorted(ask_name(port) for _ in range(8)) == ["a"] * 2 + ["c"] * 6
    finally:
        proxy.stop()


def test_a_virtual_server_fed_by_discovery_answers_409(name_servers, lbproxy):
    a, b = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    discovery = (
        "discovery: {dns: {name: web.example., type: A, port: 80, resolvers: [127.0.0.1:9]}}"
    )
    lbproxy(with_admin(vs_config(port, [a], "rr", discovery), admin_port))
    status, document = add(admin_port, {"name": "b", "address": f"127.0.0.1:{b.port}"})
    assert status == 409 and "discovery" in document["error"], document
    status, document = remove(admin_port, "a")
    assert status == 409 and "discovery" in document["error"], document
    assert set(servers_of(admin_port)) == {"a"}


def test_with_two_workers_every_worker_adds_and_removes_even_one_restarted(name_servers, lbproxy):
    """`workers: 2`: the supervisor checks the body (400 reaches no worker) and gives
    the change to both; a worker killed and restarted catches up, and so does a reload."""
    a, b, c = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    proxy = lbproxy(workers_config(port, [a, b], admin_port))
    wait_for(lambda: ready(admin_port), what="/readyz")
    assert add(admin_port, {"name": "c", "weight": "x"})[0] == 400
    status, document = add(admin_port, {"name": "c", "address": f"127.0.0.1:{c.port}"})
    assert status == 201 and document["name"] == "c", document
    assert remove(admin_port, "a") == (200, {"removing": False})
    for index in (1, 2):
        assert set(worker_servers(admin_port, index)) == {"b", "c"}
    old_pid = workers(admin_port)[0]["pid"]
    os.kill(old_pid, signal.SIGKILL)

    def restarted():
        first = workers(admin_port)[0]
        return first["ready"] and first["pid"] != old_pid

    wait_for(restarted, 30, "worker 1 restarted")
    assert set(worker_servers(admin_port, 1)) == {"b", "c"}
    proxy.reload()
    for index in (1, 2):
        assert set(worker_servers(admin_port, index)) == {"b", "c"}
    assert {ask_name(port) for _ in range(8)} == {"b", "c"}


@requires_redis
def test_two_cluster_instances_share_added_and_removed_servers(name_servers, lbproxy, tmp_path):
    """Through a real redis-server: a server added on lb1 appears on lb2, one removed on
    lb2 goes from lb1, and an instance started later (lb3) gets both by its resync."""
    a, b, c = name_servers("a", "b", "c")
    redis = RedisServer(tmp_path / "redis").start()
    key = tmp_path / "cluster.key"
    key.write_text("6a" * 32 + "\n")
    key.chmod(0o600)

    def instance(name: str) -> int:
        port, admin_port = free_port(), free_port()
        config = with_admin(vs_config(port, [a, b], "rr", "health_check: {type: none}"), admin_port)
        cluster = (
            f"  cluster:\n    key_file: {key}\n    redis: {{url: {redis.url}, name: {name}}}\n"
        )
        lbproxy(config.replace("global:\n", "global:\n" + cluster, 1), folder=tmp_path / name)
        wait_for(
            lambda: (get_json(admin_port, "/api/v1/virtual-servers")["cluster"] or {}).get(
                "connected"
            ),
            10,
            f"{name} connected to redis",
        )
        return admin_port

    try:
        lb1, lb2 = instance("lb1"), instance("lb2")
        assert add(lb1, {"name": "c", "address": f"127.0.0.1:{c.port}", "weight": 5})[0] == 201
        wait_for(lambda: "c" in servers_of(lb2), 10, "c added on lb2")
        assert servers_of(lb2)["c"]["weight"]["static"] == 5
        assert remove(lb2, "a")[0] == 200
        wait_for(lambda: "a" not in servers_of(lb1), 10, "a removed on lb1")
        lb3 = instance("lb3")
        wait_for(lambda: set(servers_of(lb3)) == {"b", "c"}, 10, "lb3 resynchronised")
        assert "Traceback" not in (tmp_path / "lb1" / "lbproxy.log").read_text()
    finally:
        lbproxy.stop_all()
        redis.stop()


def test_with_two_workers_an_added_server_survives_a_restart_and_takes_changes(
    name_servers, lbproxy, tmp_path
):
    a, b, c = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    state_file = tmp_path / "state.json"
    config = workers_config(port, [a, b], admin_port).replace(
        "global:\n", f"global:\n  state_file: {state_file}\n", 1
    )
    proxy = lbproxy(config)
    wait_for(lambda: ready(admin_port), what="/readyz")
    assert add(admin_port, {"name": "c", "address": f"127.0.0.1:{c.port}"})[0] == 201
    written = lambda: state_file.exists() and '"added"' in state_file.read_text()  # noqa: E731
    wait_for(written, 10, "the state file written")
    proxy.stop()
    lbproxy(config)
    wait_for(lambda: ready(admin_port), what="/readyz")
    for index in (1, 2):
        assert set(worker_servers(admin_port, index)) == {"a", "b", "c"}
    status, body = local_http("PATCH", url(admin_port, f"{SERVERS}/c"), {"state": "drain"})
    assert status == 200, body
    assert {ask_name(port) for _ in range(8)} == {"a", "b"}
