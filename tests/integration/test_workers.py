"""`global.workers: 2`: a supervisor and two real worker processes sharing one listener."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess

import pytest
from prometheus_client import ProcessCollector

from lbproxy import __version__
from lbproxy.runtime.workers import MetricSums, merge_documents, parse_metrics
from tests import tools
from tests.integration.harness import (
    alive,
    ask_name,
    free_port,
    get_json,
    http,
    local_http,
    metrics,
    open_and_read_name,
    ready,
    run_cli,
    sample,
    wait_for,
    worker_servers,
    workers,
    workers_config,
)

NAMES = "abc"


@pytest.fixture
def two_workers(name_servers, lbproxy):
    servers = name_servers(*NAMES)
    port, admin_port = free_port(), free_port()
    proxy = lbproxy(workers_config(port, servers, admin_port))
    wait_for(lambda: ready(admin_port), what="/readyz")
    return proxy, servers, port, admin_port


def test_two_workers_serve_and_the_parent_adds_up(two_workers):
    proxy, _, port, admin_port = two_workers
    assert "all 2 workers ready" in proxy.log()
    names = [ask_name(port) for _ in range(60)]
    assert set(names) == set(NAMES)
    samples = metrics(admin_port)
    per_server = {
        n: sample(samples, "lbproxy_connections_total", virtual_server="web", real_server=n)
        for n in NAMES
    }
    assert sum(per_server.values()) == 60
    assert sample(samples, "lbproxy_workers_ready") == 2
    # each worker balances its own share: rr in each, so every server gets about a third
    assert all(count >= 15 for count in per_server.values()), per_server
    listed = workers(admin_port)
    assert [w["index"] for w in listed] == [1, 2]
    assert len({w["pid"] for w in listed}) == 2
    assert all(w["ready"] and w["connections_total"] > 0 for w in listed), listed
    assert sum(w["connections_total"] for w in listed) == 60
    (vs,) = get_json(admin_port, "/api/v1/virtual-servers")["virtual_servers"]
    assert sum(rs["connections_total"] for rs in vs["real_servers"]) == 60
    assert {rs["name"]: rs["connections_total"] for rs in vs["real_servers"]} == per_server
    assert http("GET", f"http://127.0.0.1:{admin_port}/healthz")[0] == 200
    if tools.need("promtool", "prometheus"):
        _, body = http("GET", f"http://127.0.0.1:{admin_port}/metrics")
        check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_patch_and_reload_reach_every_worker(two_workers):
    proxy, servers, port, admin_port = two_workers
    url = f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers/web/real-servers"
    status, body = local_http("PATCH", f"{url}/b", {"state": "drain"})
    assert status == 200, body
    assert json.loads(body)["state"] == "drain"
    assert "b" not in [ask_name(port) for _ in range(30)]
    for index in (1, 2):
        assert worker_servers(admin_port, index)["b"]["state"] == "drain"
    status, body = local_http("PATCH", f"{url}/a", {"weight": -1})
    assert status == 400 and "weight" in json.loads(body)["error"]
    assert local_http("PATCH", f"{url}/zz", {"weight": 1})[0] == 404

    good = proxy.config_path.read_text()
    proxy.config_path.write_text(good.replace("scheduler: rr", "scheduler: nope"))
    proxy.signal(signal.SIGHUP)
    wait_for(lambda: "reload failed" in proxy.log(), what="the failed reload")
    assert f"{proxy.config_path}:" in proxy.log() and "unknown scheduler 'nope'" in proxy.log()
    assert ask_name(port) in NAMES

    a = f"{{name: a, address: 127.0.0.1:{servers[0].port}}}"
    proxy.config_path.write_text(good.replace(a, a[:-1] + ", weight: 3}"))
    proxy.signal(signal.SIGHUP)
    wait_for(lambda: "reloaded 2 workers" in proxy.log(), what="the reload")
    for index in (1, 2):
        by_name = worker_servers(admin_port, index)
        assert by_name["a"]["weight"]["static"] == 3
        assert by_name["b"]["state"] == "enabled"  # a reload applies the file as written
    samples = metrics(admin_port)
    assert sample(samples, "lbproxy_config_reloads_total", result="ok") == 1
    assert sample(samples, "lbproxy_config_reloads_total", result="error") == 1
    assert (
        sample(
            samples,
            "lbproxy_real_server_weight",
            virtual_server="web",
            real_server="a",
            kind="static",
        )
        == 3
    )
    status, body = local_http("POST", f"http://127.0.0.1:{admin_port}/api/v1/reload", {})
    assert status == 200 and json.loads(body)["result"] == "ok"


def test_a_killed_worker_is_restarted_with_the_runtime_changes(two_workers):
    proxy, _, port, admin_port = two_workers
    url = f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers/web/real-servers"
    assert local_http("PATCH", f"{url}/c", {"state": "drain"})[0] == 200
    for _ in range(20):
        ask_name(port)
    before = metrics(admin_port)
    served_before = sum(
        sample(before, "lbproxy_connections_total", virtual_server="web", real_server=n)
        for n in NAMES
    )
    old_pid = workers(admin_port)[0]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    wait_for(lambda: not alive(old_pid), what="the worker to die")
    names = [ask_name(port) for _ in range(20)]  # the other worker serves meanwhile
    assert set(names) == {"a", "b"}

    def restarted():
        first = workers(admin_port)[0]
        return first["ready"] and first["pid"] != old_pid and first["restarts"] == 1

    wait_for(restarted, what="the restart")
    assert f"worker 1 (pid {old_pid}) was killed by SIGKILL; restarting it" in proxy.log()
    assert worker_servers(admin_port, 1)["c"]["state"] == "drain"  # the PATCH, replayed
    assert ready(admin_port)
    names = [ask_name(port) for _ in range(20)]
    assert set(names) == {"a", "b"}
    after = metrics(admin_port)
    served_after = sum(
        sample(after, "lbproxy_connections_total", virtual_server="web", real_server=n)
        for n in NAMES
    )
    assert served_after >= served_before + 20  # the dead worker's counts stay in the sum
    assert sample(after, "lbproxy_worker_restarts_total") == 1


def test_sigterm_drains_every_worker_and_exits_0(two_workers):
    proxy, _, port, admin_port = two_workers
    pids = [w["pid"] for w in workers(admin_port)]
    held, _ = open_and_read_name(port)
    proxy.signal(signal.SIGTERM)
    wait_for(
        lambda: http("GET", f"http://127.0.0.1:{admin_port}/readyz")[0] == 503,
        what="/readyz 503",
    )
    held.sendall(b"still here")
    assert held.recv(100) == b"still here"  # connections finish during the drain
    held.close()
    assert proxy.proc.wait(15) == 0
    assert not any(alive(pid) for pid in pids)
    assert "received SIGTERM; stopping 2 workers" in proxy.log()


def test_workers_stop_when_the_supervisor_is_killed(two_workers):
    proxy, _, port, admin_port = two_workers
    pids = [w["pid"] for w in workers(admin_port)]
    proxy.expected_exit = -signal.SIGKILL  # the harness's teardown: killed on purpose
    proxy.signal(signal.SIGKILL)
    proxy.proc.wait(5)
    wait_for(lambda: not any(alive(pid) for pid in pids), what="the orphaned workers to stop")
    with socket.socket() as s:  # nobody keeps the port
        s.bind(("127.0.0.1", port))


def test_a_reload_adds_more_listeners_than_one_sendmsg_carries(two_workers):
    """300 TCP listen addresses added by one reload: the supervisor binds them and sends
    them to each worker over its channel, more descriptors than the kernel takes in one
    sendmsg (SCM_MAX_FD, 253); the reload succeeds and every new port is served."""
    proxy, _, port, admin_port = two_workers
    added = [free_port() for _ in range(300)]
    listen = ", ".join(f"127.0.0.1:{p}" for p in [port, *added])
    config = proxy.config_path.read_text()
    proxy.config_path.write_text(config.replace(f"listen: 127.0.0.1:{port}", f"listen: [{listen}]"))
    status, body = local_http("POST", f"http://127.0.0.1:{admin_port}/api/v1/reload", {})
    assert status == 200, body
    for index in (1, 2):  # each worker reloaded, on the sockets it was sent
        document = get_json(admin_port, f"/api/v1/workers/{index}/virtual-servers")
        assert len(document["virtual_servers"][0]["listen"]) == 301
    assert {ask_name(p) for p in [port, *added]} <= set(NAMES)


def test_an_address_in_use_stops_everything_with_exit_1(name_servers, tmp_path):
    servers = name_servers(*NAMES)
    port, admin_port = free_port(), free_port()
    config = tmp_path / "lbproxy.yaml"
    config.write_text(workers_config(port, servers, admin_port))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        out = run_cli("run", str(config), timeout=30)
    assert out.returncode == 1
    # the supervisor binds the TCP addresses (it owns them): it says so before any worker
    assert f"lbproxy.workers: cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "worker 1 started" not in out.stderr
    assert "Traceback" not in out.stderr
    with socket.socket() as s:  # the admin endpoint is closed too
        s.bind(("127.0.0.1", admin_port))


def test_a_udp_address_in_use_is_reported_once_before_any_worker_starts(name_servers, tmp_path):
    """The workers bind UDP themselves (SO_REUSEPORT), yet a UDP address in use is
    reported as a TCP one is: once, by the supervisor, beside the TCP address in use,
    before any worker starts, and without a hint about systemd's socket unit (no
    socket came from systemd)."""
    servers = name_servers(*NAMES)
    port, udp_port, admin_port = free_port(), free_port(), free_port()
    config = tmp_path / "lbproxy.yaml"
    config.write_text(
        workers_config(port, servers, admin_port)
        + f"""  - name: dns
    protocol: udp
    listen: 127.0.0.1:{udp_port}
    real_servers:
      - {{name: a, address: 127.0.0.1:{servers[0].port}}}
"""
    )
    with socket.socket() as tcp_taken, socket.socket(type=socket.SOCK_DGRAM) as udp_taken:
        tcp_taken.bind(("127.0.0.1", port))
        tcp_taken.listen()
        udp_taken.bind(("127.0.0.1", udp_port))
        out = run_cli("run", str(config), timeout=30)
    assert out.returncode == 1
    errors = [line.split(" ERROR ", 1)[1] for line in out.stderr.splitlines() if " ERROR " in line]
    assert errors == [
        f"lbproxy.workers: cannot listen on 127.0.0.1:{port}: Address already in use"
        " (virtual server web)",
        f"lbproxy.workers: cannot listen on 127.0.0.1:{udp_port}/udp: Address already in use"
        " (virtual server dns)",
    ], out.stderr
    assert "starting 2 workers" not in out.stderr
    assert "lbproxy.socket" not in out.stderr


# -- the merging rules, without processes ------------------------------------------------

WORKER_METRICS = """\
# HELP lbproxy_connections_total Connections sent to each real server.
# TYPE lbproxy_connections_total counter
lbproxy_connections_total{{real_server="a",virtual_server="web"}} {n}
# HELP lbproxy_real_server_up 1 when the real server's health is up.
# TYPE lbproxy_real_server_up gauge
lbproxy_real_server_up{{real_server="a",virtual_server="web"}} {up}
# HELP lbproxy_active_connections Connections open to each real server.
# TYPE lbproxy_active_connections gauge
lbproxy_active_connections{{real_server="a",virtual_server="web"}} {n}
# HELP lbproxy_config_reloads_total Configuration reloads, by result.
# TYPE lbproxy_config_reloads_total counter
lbproxy_config_reloads_total{{result="ok"}} 1
"""


def test_metric_sums_add_counters_and_take_the_highest_state():
    sums = MetricSums()
    sums.add(parse_metrics(WORKER_METRICS.format(n=3, up=0)))
    sums.add(parse_metrics(WORKER_METRICS.format(n=4, up=1)))
    values = {
        (s.name, s.labels.get("real_server")): s.value
        for family in sums.metrics()
        for s in family.samples
    }
    assert values == {
        ("lbproxy_connections_total", "a"): 7,
        ("lbproxy_real_server_up", "a"): 1,
        ("lbproxy_active_connections", "a"): 7,
    }  # the reload count is the supervisor's own


def test_merged_document_adds_counts_and_keeps_the_first_workers_state():
    def document(total, health, mode):
        rs = {"name": "a", "state": "drain", "health": health, "weight": {"static": 2}}
        rs |= {"active_connections": 1, "connections_total": total, "bytes_in": 10}
        rs |= {"bytes_out": 20}
        vs = {"name": "web", "throttle_mode": mode, "active_connections": 1, "clients": 1}
        vs |= {"rejected": {"acl": 1}, "dynamic_weight_fallback": False, "real_servers": [rs]}
        return {"virtual_servers": [vs]}

    merged = merge_documents([document(5, "down", "low"), document(7, "up", "high")])
    (vs,) = merged["virtual_servers"]
    (rs,) = vs["real_servers"]
    assert (vs["active_connections"], vs["clients"], vs["rejected"]) == (2, 2, {"acl": 2})
    assert vs["throttle_mode"] == "high"
    assert (rs["connections_total"], rs["bytes_in"], rs["bytes_out"]) == (12, 20, 40)
    assert (rs["state"], rs["weight"], rs["health"]) == ("drain", {"static": 2}, "up")


def test_process_metrics_are_the_supervisors_and_client_counts_add_up(name_servers, lbproxy):
    """process_* describe the process scraped (the supervisor), once, not a sum of the
    workers'; each worker takes `max_clients` for itself, so the limit adds up."""
    servers = name_servers(*NAMES)
    port, admin_port = free_port(), free_port()
    config = workers_config(port, servers, admin_port)
    proxy = lbproxy(config.replace("global:\n", "global:\n  max_clients: 50\n", 1))
    wait_for(lambda: ready(admin_port), what="/readyz")
    samples = metrics(admin_port)
    assert sample(samples, "lbproxy_build_info", version=__version__) == 1
    assert [key for key in samples if key[0] == "lbproxy_build_info"] == [
        ("lbproxy_build_info", (("version", __version__),))
    ]
    assert sample(samples, "lbproxy_max_clients") == 100
    assert sample(samples, "lbproxy_open_clients") == 0
    own = {
        s.name: s.value
        for family in ProcessCollector(pid=lambda: proxy.proc.pid, registry=None).collect()
        for s in family.samples
    }
    for name in ("process_open_fds", "process_max_fds", "process_start_time_seconds"):
        assert [key for key in samples if key[0] == name] == [(name, ())], name
    assert sample(samples, "process_start_time_seconds") == own["process_start_time_seconds"]
    assert sample(samples, "process_max_fds") == own["process_max_fds"]
    assert sample(samples, "process_resident_memory_bytes") > 0
