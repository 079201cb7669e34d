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
from tests.integration.harness import Lbproxy, free_port, read_name, wait_for
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
