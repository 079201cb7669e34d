"""Several instances as one through a real redis-server (SPEC §18): three `lbproxy run`
processes on loopback, each with its own admin endpoint, sharing one Redis the test
starts in its own folder on a free port."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from lbproxy.wire.proxy_protocol import encode_v1
from tests.integration.harness import Lbproxy, free_port, read_name, run_cli, wait_for
from tests.integration.redis_server import RedisServer, requires_redis
from tests.integration.test_admin import http, metrics, sample

pytestmark = [pytest.mark.integration, requires_redis]


@pytest.fixture
def redis(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


class Instance:
    """One `lbproxy run` of the cluster: its proxy port, admin port and process."""

    def __init__(self, folder: Path, name: str, config: str, port: int, admin: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.name, self.port, self.admin = name, port, admin
        self.proxy = Lbproxy(folder, config)

    def start(self) -> Instance:
        self.proxy.start([self.admin])
        return self

    def stop(self) -> None:
        self.proxy.stop()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.admin}{path}"

    def document(self) -> dict:
        status, body = http("GET", self.url("/api/v1/virtual-servers"))
        assert status == 200, body
        return json.loads(body)

    def server(self, rs: str, vs: str = "web") -> dict:
        status, body = http("GET", self.url(f"/api/v1/virtual-servers/{vs}/real-servers/{rs}"))
        assert status == 200, body
        return json.loads(body)

    def patch(self, rs: str, change: dict, vs: str = "web") -> dict:
        status, body = http(
            "PATCH", self.url(f"/api/v1/virtual-servers/{vs}/real-servers/{rs}"), change
        )
        assert status == 200, body
        return json.loads(body)

    def connected(self) -> bool:
        return bool((self.document().get("cluster") or {}).get("connected"))

    def log(self) -> str:
        return self.proxy.log()


@pytest.fixture
def cluster(tmp_path, name_servers):
    """cluster(redis, n, ...) -> n instances in front of the same name servers a, b, c."""
    started: list[Instance] = []
    servers = name_servers("a", "b", "c")

    def make(redis: RedisServer, count: int = 3, **options) -> list[Instance]:
        made = [instance(redis, f"lb{i + 1}", **options) for i in range(count)]
        for one in made:
            one.start()
        return made

    def instance(redis: RedisServer, name: str, start: bool = False, **options) -> Instance:
        port, admin = free_port(), free_port()
        config = cluster_config(redis, name, port, admin, servers, **options)
        one = Instance(tmp_path / name, name, config, port, admin)
        started.append(one)
        return one.start() if start else one

    make.instance = instance  # type: ignore[attr-defined]
    make.servers = servers  # type: ignore[attr-defined]
    yield make
    for one in started:
        one.stop()


def cluster_config(
    redis: RedisServer,
    name: str,
    port: int,
    admin: int,
    servers,
    *,
    scheduler: str = "rr",
    extra: str = "",
    redis_extra: str = "",
) -> str:
    lines = [
        "global:",
        f"  admin: {{listen: 127.0.0.1:{admin}}}",
        "  drain_timeout: 2s",
        "  cluster:",
        "    redis:",
        f"      url: {redis.url}",
        f"      name: {name}",
    ]
    lines += [f"      {line}" for line in redis_extra.strip().splitlines() if line.strip()]
    lines += [
        "virtual_servers:",
        "  - name: web",
        f"    listen: 127.0.0.1:{port}",
        f"    scheduler: {scheduler}",
        "    health_check: {type: none}",
    ]
    lines += [f"    {line}" for line in extra.strip().splitlines() if line.strip()]
    lines.append("    real_servers:")
    for server in servers:
        lines.append(
            f"      - {{name: {server.name}, address: 127.0.0.1:{server.port}, "
            "max_connections: 100}"
        )
    return "\n".join(lines) + "\n"


def member_names(one: Instance) -> list[str]:
    return [m["name"] for m in one.document()["cluster"]["members"]]


def wait_connected(*instances: Instance, timeout: float = 10.0) -> None:
    for one in instances:
        wait_for(one.connected, timeout, f"{one.name} connected to Redis")


# -- runtime changes ----------------------------------------------------------------------


def test_a_drain_on_one_instance_reaches_the_others_within_a_second(redis, cluster):
    lb1, lb2, lb3 = cluster(redis)
    wait_connected(lb1, lb2, lb3)
    lb1.patch("b", {"state": "drain"})
    started = time.monotonic()
    for other in (lb2, lb3):
        wait_for(lambda o=other: o.server("b")["state"] == "drain", 1.0, f"{other.name}: b drains")
    assert time.monotonic() - started < 1.0
    assert "state enabled -> drain (cluster: from lb1)" in lb2.log()
    # and the others no longer send new connections there
    names = {ask(lb3.port) for _ in range(6)}
    assert names == {"a", "c"}


def ask(port: int, header: bytes = b"") -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        if header:
            s.sendall(header)
        return read_name(s)


def test_two_conflicting_weight_changes_settle_on_the_later_everywhere(redis, cluster):
    lb1, lb2, lb3 = cluster(redis)
    wait_connected(lb1, lb2, lb3)
    lb1.patch("b", {"weight": 3})
    lb2.patch("b", {"weight": 7})  # later: it wins, wherever the earlier one arrives last
    for one in (lb1, lb2, lb3):
        wait_for(lambda o=one: o.server("b")["weight"]["static"] == 7, 2.0, f"{one.name}: 7")
    time.sleep(0.3)  # nothing flips it back afterwards
    assert [one.server("b")["weight"]["static"] for one in (lb1, lb2, lb3)] == [7, 7, 7]
    stored = json.loads(redis.cli("HGET", "lbproxy:state", "weight/web/b"))
    assert (stored["value"], stored["origin"]) == (7, "lb2")


def test_an_instance_started_later_begins_with_the_cluster_state(redis, cluster):
    lb1, lb2 = cluster(redis, 2)
    wait_connected(lb1, lb2)
    lb1.patch("a", {"weight": 5})
    lb2.patch("c", {"state": "disabled"})
    wait_for(lambda: lb1.server("c")["state"] == "disabled", 2.0, "lb1 sees c disabled")
    lb3 = cluster.instance(redis, "lb3", start=True)  # the file first, then the cluster
    assert lb3.server("a")["weight"]["static"] == 5
    assert lb3.server("c")["state"] == "disabled"
    assert {ask(lb3.port) for _ in range(6)} == {"a", "b"}
    # a reload applies the file, and the cluster's changes again on top
    lb3.proxy.reload()
    wait_for(lambda: "reloaded" in lb3.log(), 5.0, "reload")
    assert lb3.server("a")["weight"]["static"] == 5
    assert lb3.server("c")["state"] == "disabled"


def test_a_load_report_to_one_instance_changes_the_locate_answer_of_another(redis, cluster):
    lb1, lb2, lb3 = cluster(redis, scheduler="least-load", extra="load_source: report")
    wait_connected(lb1, lb2, lb3)

    def located(one: Instance) -> str:
        status, body = http("GET", one.url("/api/v1/virtual-servers/web/locate"))
        assert status == 200, body
        return json.loads(body)["real_server"]

    for rs, load in (("a", 0.9), ("b", 0.8), ("c", 0.1)):
        status, body = http(
            "PUT", lb1.url(f"/api/v1/virtual-servers/web/real-servers/{rs}/load"), {"load": load}
        )
        assert status == 200, body
    started = time.monotonic()
    wait_for(lambda: lb3.server("a")["load"] == 0.9, 1.0, "lb3 has a's report")
    wait_for(lambda: lb3.server("c")["load"] == 0.1, 1.0 - (time.monotonic() - started), "c")
    assert located(lb3) == "c"
    assert sample(metrics(lb3.admin), "lbproxy_real_server_load", virtual_server="web",
                  real_server="b") == 0.8  # fmt: skip


def test_metrics_count_the_messages_each_way(redis, cluster):
    lb1, lb2 = cluster(redis, 2)
    wait_connected(lb1, lb2)
    lb1.patch("a", {"state": "drain"})
    wait_for(lambda: lb2.server("a")["state"] == "drain", 2.0, "drain reaches lb2")
    one, two = metrics(lb1.admin), metrics(lb2.admin)
    assert sample(one, "lbproxy_cluster_connected") == 1
    out = "lbproxy_cluster_messages_total"
    assert sample(one, out, kind="state", direction="out") == 1
    assert sample(two, out, kind="state", direction="in") == 1
    assert sample(two, out, kind="state", direction="out") == 0
    assert 0 <= sample(two, "lbproxy_cluster_sync_lag_seconds") < 1


# -- members --------------------------------------------------------------------------


def test_status_and_the_document_list_the_members(redis, cluster):
    lb1, lb2, lb3 = cluster(redis)
    wait_connected(lb1, lb2, lb3)
    for one in (lb1, lb2, lb3):  # each reads the member list at its heartbeat (1 s)
        wait_for(lambda o=one: member_names(o) == ["lb1", "lb2", "lb3"], 3.0, "three members")
    members = lb1.document()["cluster"]["members"]
    now = time.time()
    assert all(now - 5 < m["last_seen"] <= now + 1 and m["alive"] for m in members)
    done = run_cli("status", "--admin", lb2.url(""))
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    header = rows.index(["CLUSTER", "MEMBER", "LAST_SEEN", "ALIVE"])
    assert [row[1] for row in rows[header + 1 :]] == ["lb1", "lb2", "lb3"]
    assert all(row[0] == "connected" and row[3] == "yes" for row in rows[header + 1 :])
    lb3.stop()  # its heartbeat key expires; it stays listed with its last heartbeat
    last = next(m for m in lb1.document()["cluster"]["members"] if m["name"] == "lb3")
    wait_for(
        lambda: not next(m for m in lb1.document()["cluster"]["members"] if m["name"] == "lb3")[
            "alive"
        ],
        15.0,
        "lb3's heartbeat to expire",
    )
    gone = next(m for m in lb1.document()["cluster"]["members"] if m["name"] == "lb3")
    assert abs(gone["last_seen"] - last["last_seen"]) < 2.5
