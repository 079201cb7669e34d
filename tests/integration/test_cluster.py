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
from tests.integration.harness import Lbproxy, free_port, local_http, read_name, run_cli, wait_for
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

    def stop(self) -> int:
        return self.proxy.stop()

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
        status, body = local_http(
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
    codes = {one.name: one.stop() for one in started}
    # SIGTERM with a cluster session open (or retrying) is a clean exit, whatever Redis does
    assert codes == dict.fromkeys(codes, 0), codes
    for one in started:
        assert "Traceback" not in one.log(), one.log()


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


@pytest.mark.serial  # its deadline (SPEC §18) is measured time
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


@pytest.mark.serial  # its deadline (SPEC §18) is measured time
def test_a_load_report_to_one_instance_changes_the_locate_answer_of_another(redis, cluster):
    lb1, lb2, lb3 = cluster(redis, scheduler="least-load", extra="load_source: report")
    wait_connected(lb1, lb2, lb3)

    def located(one: Instance) -> str:
        status, body = http("GET", one.url("/api/v1/virtual-servers/web/locate"))
        assert status == 200, body
        return json.loads(body)["real_server"]

    for rs, load in (("a", 0.9), ("b", 0.8), ("c", 0.1)):
        status, body = local_http(
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
        lambda: (
            not next(m for m in lb1.document()["cluster"]["members"] if m["name"] == "lb3")["alive"]
        ),
        15.0,
        "lb3's heartbeat to expire",
    )
    gone = next(m for m in lb1.document()["cluster"]["members"] if m["name"] == "lb3")
    assert abs(gone["last_seen"] - last["last_seen"]) < 2.5


# -- shared persistence -----------------------------------------------------------------


def client_header(index: int, port: int) -> bytes:
    source = (f"10.9.{index // 250}.{index % 250 + 1}", 40000 + index)
    return encode_v1(source, ("127.0.0.1", port))


def entries(one: Instance) -> float:
    return sample(metrics(one.admin), "lbproxy_persistence_entries", virtual_server="web")


def test_persistence_follows_a_client_to_every_instance_and_survives_one(redis, cluster):
    persistent = "accept_proxy: true\npersistence: {timeout: 5m}"
    lb1, lb2, lb3 = cluster(redis, extra=persistent)
    wait_connected(lb1, lb2, lb3)
    clients = range(200)
    first = {i: ask(lb1.port, client_header(i, lb1.port)) for i in clients}
    assert set(first.values()) == {"a", "b", "c"}
    for other in (lb2, lb3):
        wait_for(lambda o=other: entries(o) == 200, 5.0, f"{other.name} has the 200 entries")
    # Another order than lb1's: rr alone would give other servers; the entries do not.
    assert {i: ask(lb2.port, client_header(i, lb2.port)) for i in reversed(clients)} == first
    assert {i: ask(lb3.port, client_header(i, lb3.port)) for i in clients[1::2]} == {
        i: first[i] for i in clients[1::2]
    }
    lb1.stop()  # the instance the clients used is gone: the survivors still agree
    assert {i: ask(lb3.port, client_header(i, lb3.port)) for i in clients} == first
    assert {i: ask(lb2.port, client_header(i, lb2.port)) for i in clients[::3]} == {
        i: first[i] for i in clients[::3]
    }
    # in Redis with the timeout as TTL
    ttl = int(redis.cli("PTTL", "lbproxy:p:web:10.9.0.1"))
    assert 295_000 < ttl <= 300_000
    assert redis.cli("GET", "lbproxy:p:web:10.9.0.1").strip() == first[0]
    # and a new instance starts with them
    lb4 = cluster.instance(redis, "lb4", start=True, extra=persistent)
    assert entries(lb4) == 200
    assert {i: ask(lb4.port, client_header(i, lb4.port)) for i in clients[::7]} == {
        i: first[i] for i in clients[::7]
    }


def test_a_moved_client_moves_on_every_instance(redis, cluster):
    persistent = "accept_proxy: true\npersistence: {timeout: 5m}"
    lb1, lb2 = cluster(redis, 2, extra=persistent)
    wait_connected(lb1, lb2)
    before = ask(lb1.port, client_header(7, lb1.port))
    wait_for(lambda: entries(lb2) == 1, 3.0, "lb2 has the entry")
    lb1.patch(before, {"state": "disabled"})  # on every instance: the client moves
    wait_for(lambda: lb2.server(before)["state"] == "disabled", 2.0, "disabled on lb2")
    moved = ask(lb1.port, client_header(7, lb1.port))
    assert moved != before
    lb1.patch(before, {"state": "enabled"})
    wait_for(lambda: lb2.server(before)["state"] == "enabled", 2.0, "enabled on lb2")
    # The move replicates (batched every 50 ms); until then lb2 would answer `before`.
    wait_for(lambda: ask(lb2.port, client_header(7, lb2.port)) == moved, 1.0, "the move")


# -- Redis gone --------------------------------------------------------------------------


class ConnectionLoop:
    """Connections through some instances, one after another, in a thread, until
    stopped (bounded: at most `limit` connections); every failure is kept."""

    def __init__(self, ports: list[int], limit: int = 20000) -> None:
        import threading

        self.ports, self.limit = ports, limit
        self.served = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ConnectionLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set() and self.served + len(self.failures) < self.limit:
            for port in self.ports:
                try:
                    name = ask(port)
                except OSError as exc:
                    self.failures.append(f"{port}: {exc}")
                    continue
                if name in ("a", "b", "c"):
                    self.served += 1
                else:
                    self.failures.append(f"{port}: answered {name!r}")
            time.sleep(0.005)


@pytest.mark.serial  # its deadline (SPEC §18) is measured time
def test_redis_stopped_for_ten_seconds_under_a_connection_loop(redis, cluster):
    lb1, lb2, lb3 = cluster(redis)
    wait_connected(lb1, lb2, lb3)
    with ConnectionLoop([lb1.port, lb2.port, lb3.port]) as loop:
        redis.stop()
        stopped = time.monotonic()
        for one in (lb1, lb2, lb3):
            wait_for(lambda o=one: not o.connected(), 5.0, f"{one.name} sees Redis gone")
        lb2.patch("b", {"state": "drain"})  # applies on lb2 now, published when Redis is back
        assert lb2.server("b")["state"] == "drain"
        assert lb1.server("b")["state"] == lb3.server("b")["state"] == "enabled"
        # an instance started while Redis is down serves from its file
        lb4 = cluster.instance(redis, "lb4", start=True)
        assert {ask(lb4.port) for _ in range(6)} == {"a", "b", "c"}
        assert sample(metrics(lb4.admin), "lbproxy_cluster_connected") == 0
        assert sample(metrics(lb1.admin), "lbproxy_cluster_sync_lag_seconds") > 0
        wait_for(lambda: time.monotonic() - stopped >= 10, 12.0, "ten seconds without Redis")
        redis.start()  # the same port, and empty: the instances rebuild it
        back = time.monotonic()
        for one in (lb1, lb3, lb4):
            wait_for(lambda o=one: o.server("b")["state"] == "drain", 2.0, f"{one.name}: drain")
        assert time.monotonic() - back < 2.0
        served = loop.served
        wait_for(lambda: loop.served > served + 30, 5.0, "connections after Redis' return")
    assert loop.failures == []
    assert loop.served > 300  # the loop did run through the whole outage
    for one in (lb1, lb2, lb3):
        log = one.log()
        assert log.count("is unreachable") == 1, log  # the outage, logged once
        assert "is reachable after" in log
    assert "state enabled -> drain (cluster: from lb2)" in lb1.log()
    assert json.loads(redis.cli("HGET", "lbproxy:state", "state/web/b"))["value"] == "drain"


def test_a_change_made_while_redis_was_away_loses_to_a_later_one(redis, cluster):
    lb1, lb2 = cluster(redis, 2)
    wait_connected(lb1, lb2)
    redis.stop()
    wait_for(lambda: not lb1.connected() and not lb2.connected(), 5.0, "Redis gone")
    lb1.patch("a", {"weight": 2})  # earlier, held by lb1 until Redis is back
    lb2.patch("a", {"weight": 9})  # later
    redis.start()
    for one in (lb1, lb2):
        wait_for(lambda o=one: o.server("a")["weight"]["static"] == 9, 3.0, f"{one.name}: 9")
    wait_connected(lb1, lb2)
    assert lb1.server("a")["weight"]["static"] == 9


# -- hostile input ------------------------------------------------------------------------


def test_garbage_and_hostile_messages_are_ignored_counted_and_logged(redis, cluster):
    lb1, lb2 = cluster(redis, 2, extra="persistence: {timeout: 5m}")
    wait_connected(lb1, lb2)

    def change(**fields) -> bytes:
        document = {"v": 1, "kind": "weight", "vs": "web", "rs": "a", "value": 4,
                    "version": 10**15, "origin": "mallory"}  # fmt: skip
        document.update(fields)
        return json.dumps({k: v for k, v in document.items() if v is not None}).encode()

    hostile = [
        b"\x00\xff\xfe not json",
        b"[" * 60_000,  # deep nesting, within the size limit
        b"{}",
        b'{"v": 1, "kind": "weight", "vs": "web", "rs": "a", "value": NaN}',
        b"x" * 200_000,  # oversized
        change(value=70000),  # out of range
        change(value=-1),
        change(value="4"),
        change(value=True),
        change(value=4.5),
        change(kind="state", value="drained"),
        change(kind="state", value="drain", per_connection=0.1),
        change(kind="shutdown"),
        change(vs="web/../x"),
        change(v=2),
        change(origin="a b"),
        change(version=-5),
        change(version=2**60),
        change(extra="field"),
        change(rs="nosuch"),  # well formed, but a server this instance does not have
        change(vs="nosuch"),
    ]
    for payload in hostile:
        redis.publish("lbproxy:changes", payload)
    entries = [
        b"garbage",
        json.dumps({"v": 1, "origin": "m", "vs": "web", "entries": [["not-an-ip", "a", 10]]}),
        json.dumps({"v": 1, "origin": "m", "vs": "web", "entries": [["10.0.0.1", "a", -1]]}),
        json.dumps({"v": 1, "origin": "m", "vs": "web", "entries": [["10.0.0.1", "zz", 1000]]}),
        json.dumps({"v": 1, "origin": "m", "vs": "web", "entries": []}),
    ]
    for payload in entries:
        redis.publish(
            "lbproxy:entries", payload if isinstance(payload, bytes) else payload.encode()
        )
    # a valid change afterwards is still applied: nothing above stopped the sync
    redis.publish("lbproxy:changes", change(rs="c", value=6))
    for one in (lb1, lb2):
        wait_for(lambda o=one: o.server("c")["weight"]["static"] == 6, 3.0, f"{one.name}: c")
        assert [one.server(rs)["weight"]["static"] for rs in ("a", "b")] == [1, 1]
        counted = metrics(one.admin)
        ignored = {
            reason: sample(counted, "lbproxy_cluster_ignored_messages_total", reason=reason)
            for reason in ("oversized", "garbage", "invalid", "unknown")
        }
        assert ignored == {"oversized": 1, "garbage": 4, "invalid": 18, "unknown": 3}
        assert sample(counted, "lbproxy_persistence_entries", virtual_server="web") == 0
        log = one.log()
        for reason in ("oversized", "garbage", "invalid", "unknown"):  # rate limited: once
            assert log.count(f"ignored a message from Redis ({reason})") == 1, log
    assert ask(lb1.port) in ("a", "b", "c") and ask(lb2.port) in ("a", "b", "c")  # it serves


def test_a_hostile_state_in_redis_does_not_stop_a_start(redis, cluster):
    redis.cli("HSET", "lbproxy:state", "weight/web/a", "garbage", "state/web/b",
              json.dumps({"v": 1, "kind": "state", "vs": "web", "rs": "c", "value": "disabled",
                          "version": 1, "origin": "x"}))  # fmt: skip
    redis.cli("HSET", "lbproxy:members", "evil", "not json")
    lb1 = cluster.instance(redis, "lb1", start=True)
    wait_connected(lb1)
    assert [lb1.server(rs)["state"] for rs in ("a", "b", "c")] == ["enabled"] * 3
    assert {ask(lb1.port) for _ in range(6)} == {"a", "b", "c"}
    lb1.patch("a", {"weight": 2})  # the garbage stored there loses to a real change
    wait_for(
        lambda: '"value":2' in redis.cli("HGET", "lbproxy:state", "weight/web/a"),
        2.0,
        "the change stored",
    )
    assert member_names(lb1) == ["lb1"]


# -- AUTH -------------------------------------------------------------------------------


def password_file(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "redis.password"
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def test_auth_with_a_password_file(tmp_path, cluster):
    with RedisServer(tmp_path / "redis-auth").start(password="s3cret-pass") as redis:
        secret = password_file(tmp_path / "secret", "s3cret-pass")
        lb1, lb2 = cluster(redis, 2, redis_extra=f"password_file: {secret}")
        wait_connected(lb1, lb2)
        lb1.patch("a", {"state": "drain"})
        wait_for(lambda: lb2.server("a")["state"] == "drain", 2.0, "drain through AUTH")
        assert "s3cret" not in lb1.log()


def test_a_wrong_password_is_a_clear_error_and_the_instance_serves_unclustered(tmp_path, cluster):
    with RedisServer(tmp_path / "redis-auth").start(password="right") as redis:
        secret = password_file(tmp_path / "secret", "wrong")
        lb1 = cluster.instance(redis, "lb1", start=True, redis_extra=f"password_file: {secret}")
        wait_for(lambda: "refused this instance" in lb1.log(), 5.0, "the error")
        line = next(line for line in lb1.log().splitlines() if "refused this instance" in line)
        assert " ERROR " in line and redis.url in line and "password" in line, line
        assert {ask(lb1.port) for _ in range(6)} == {"a", "b", "c"}
        assert lb1.document()["cluster"]["connected"] is False
        lb1.patch("b", {"state": "drain"})  # still applies here
        assert {ask(lb1.port) for _ in range(6)} == {"a", "c"}
        assert lb1.log().count("refused this instance") == 1  # retried, logged once
        assert "wrong" not in lb1.log()
