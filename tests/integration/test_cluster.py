"""Several instances as one through a real redis-server (SPEC §18): three `lbproxy run`
processes on loopback, each with its own admin endpoint, sharing one Redis the test
starts in its own folder on a free port."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import subprocess
import time
from pathlib import Path
from typing import Self

import pytest

from lbproxy.wire.proxy_protocol import encode_v1
from tests.integration.harness import (
    Lbproxy,
    UpgradableLbproxy,
    alive,
    free_port,
    http,
    local_http,
    metrics,
    read_name,
    run_cli,
    sample,
    stop_all,
    wait_for,
)
from tests.integration.redis_server import RedisServer, requires_redis

pytestmark = [pytest.mark.integration, requires_redis]


CLUSTER_KEY = "5f1b0c8e2d7a4b96a3e0f1c2d3b4a5968778695a4b3c2d1e0f1e2d3c4b5a6978"


def key_file(folder: Path, key: str = CLUSTER_KEY) -> Path:
    """A key file (0600) holding `key`, in `folder`, one per key."""
    path = folder / f"cluster-{hashlib.sha256(key.encode()).hexdigest()[:8]}.key"
    if not path.exists():
        path.write_text(key + "\n")
        path.chmod(0o600)
    return path


def signed(kind: str, body: bytes, key: str = CLUSTER_KEY, prefix: str = "lbproxy") -> bytes:
    """`body` signed as the how-to's construction says, written from the docs (not
    with lbproxy's code): what a compatible tool would write."""
    message = b"lbproxy-cluster/2\n" + prefix.encode() + b"\n" + kind.encode() + b"\n" + body
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest().encode() + b"." + body


@pytest.fixture
def redis(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


class Instance:
    """One `lbproxy run` of the cluster: its proxy port, admin port and process."""

    def __init__(self, proxy: Lbproxy, name: str, port: int, admin: int):
        self.name, self.port, self.admin = name, port, admin
        self.proxy = proxy

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
def cluster(tmp_path, name_servers, lbproxy):
    """cluster(redis, n, ...) -> n instances in front of the same name servers a, b, c."""
    started: list[Instance] = []
    servers = name_servers("a", "b", "c")

    def make(redis: RedisServer, count: int = 3, **options) -> list[Instance]:
        made = [instance(redis, f"lb{i + 1}", **options) for i in range(count)]
        for one in made:
            one.start()
        return made

    def instance(
        redis: RedisServer, name: str, start: bool = False, member: str | None = None, **options
    ) -> Instance:
        """`member`: its name in the cluster (`redis.name`), `name` by default."""
        port, admin = free_port(), free_port()
        config = cluster_config(redis, member or name, port, admin, servers, **options)
        proxy = lbproxy(config, start=False, folder=tmp_path / name)
        one = Instance(proxy, name, port, admin)
        started.append(one)
        return one.start() if start else one

    make.instance = instance  # type: ignore[attr-defined]
    make.servers = servers  # type: ignore[attr-defined]
    yield make
    # SIGTERM with a cluster session open (or retrying) is a clean exit, whatever Redis
    # does: stop() fails on another exit status or a traceback in the log
    stop_all([one.proxy for one in started])


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
    key: str = CLUSTER_KEY,
) -> str:
    lines = [
        "global:",
        f"  admin: {{listen: 127.0.0.1:{admin}}}",
        "  drain_timeout: 2s",
        "  cluster:",
        f"    key_file: {key_file(redis.folder, key)}",
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


def opened(kind: str, value: bytes) -> bytes:
    """The body of a value lbproxy signed, its MAC checked."""
    _, _, body = value.partition(b".")
    assert signed(kind, body) == value, value
    return body


def stored_change(redis: RedisServer, field: str) -> dict:
    return json.loads(opened("change", redis.cli("HGET", "lbproxy:state", field).strip().encode()))


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
    time.sleep(0.3)  # on purpose: time for a late message to flip it back (none may)
    assert [one.server("b")["weight"]["static"] for one in (lb1, lb2, lb3)] == [7, 7, 7]
    stored = stored_change(redis, "weight/web/b")
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
    assert sample(metrics(lb3.admin), "lbproxy_config_reloads_total", result="ok") == 1
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
    learned = time.monotonic()  # the entries are written from here on
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
    # in Redis with the timeout as TTL, counted from when it was written (not since)
    ttl = int(redis.cli("PTTL", "lbproxy:p:web:10.9.0.1"))
    since_ms = (time.monotonic() - learned) * 1000 + 100
    assert 300_000 - since_ms < ttl <= 300_000
    value = redis.cli("GET", "lbproxy:p:web:10.9.0.1").strip().encode()
    expires, server = opened("p:web:10.9.0.1", value).split()
    assert server.decode() == first[0]
    since_ms = (time.monotonic() - learned) * 1000 + 100
    assert 300_000 - since_ms < int(expires) - time.time() * 1000 <= 300_000
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


class InThread:
    """A client loop (`_run`) in a thread for the time of a `with` block; `_run` checks
    `_stop` and bounds itself."""

    def __init__(self) -> None:
        import threading

        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        raise NotImplementedError


class ConnectionLoop(InThread):
    """Connections through some instances, one after another, in a thread, until
    stopped (bounded: at most `limit` connections); every failure is kept."""

    def __init__(self, ports: list[int], limit: int = 20000) -> None:
        super().__init__()
        self.ports, self.limit = ports, limit
        self.served = 0

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
            time.sleep(0.005)  # the loop's pace


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
    assert stored_change(redis, "state/web/b")["value"] == "drain"


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


def shared_entries(redis: RedisServer) -> int:
    return len(redis.cli("--scan", "--pattern", "lbproxy:p:web:*").split())


def test_a_redis_that_restarted_empty_gets_the_persistence_entries_back(redis, cluster):
    """lb1's clients stay where lb1 sent them through a Redis restart: lb1 shares its
    live entries again at its resync, so lb2, started after the restart, reads them."""
    persistent = "accept_proxy: true\npersistence: {timeout: 5m}"
    lb1 = cluster.instance(redis, "lb1", start=True, extra=persistent)
    wait_connected(lb1)
    clients = range(30)
    first = {i: ask(lb1.port, client_header(i, lb1.port)) for i in clients}
    assert set(first.values()) == {"a", "b", "c"}
    wait_for(lambda: shared_entries(redis) == 30, 5.0, "the 30 entries in Redis")
    redis.stop()
    wait_for(lambda: not lb1.connected(), 5.0, "lb1 sees Redis gone")
    redis.start()  # the same port, and empty
    wait_for(lambda: shared_entries(redis) == 30, 10.0, "lb1's entries back in Redis")
    lb2 = cluster.instance(redis, "lb2", start=True, extra=persistent)
    assert entries(lb2) == 30  # read at its start
    # Another order than lb1's: rr alone would send most of them elsewhere.
    assert {i: ask(lb2.port, client_header(i, lb2.port)) for i in reversed(clients)} == first


def test_two_instances_given_one_name_share_persistence_and_say_so(redis, cluster):
    """Cloned hosts share a host name, the default member name: the two instances still
    take each other's persistence entries, and each says once that its name is taken."""
    persistent = "accept_proxy: true\npersistence: {timeout: 5m}"
    one = cluster.instance(redis, "one", member="twin", start=True, extra=persistent)
    two = cluster.instance(redis, "two", member="twin", start=True, extra=persistent)
    wait_connected(one, two)
    for each in (one, two):
        wait_for(
            lambda each=each: each.document()["cluster"]["name_clash"], 5.0, "the name clash seen"
        )
        assert sample(metrics(each.admin), "lbproxy_cluster_name_clash") == 1
    clients = range(30)
    first = {i: ask(one.port, client_header(i, one.port)) for i in clients}
    assert set(first.values()) == {"a", "b", "c"}
    wait_for(lambda: entries(two) == 30, 5.0, "two has one's 30 entries")
    assert {i: ask(two.port, client_header(i, two.port)) for i in reversed(clients)} == first
    for each in (one, two):  # logged once, however many heartbeats saw it
        assert each.log().count("under this instance's name 'twin'") == 1, each.log()
        assert "global.cluster.redis.name" in each.log()


# -- hostile input ------------------------------------------------------------------------


def change_body(**fields) -> bytes:
    """A change as lbproxy writes it (SPEC §18), with `fields` replaced (None: left out)."""
    document = {"v": 2, "kind": "weight", "vs": "web", "rs": "a", "value": 4,
                "version": 10**15, "origin": "mallory"}  # fmt: skip
    document.update(fields)
    return json.dumps({k: v for k, v in document.items() if v is not None}).encode()


def version_at(seconds: float) -> int:
    """A change's version made at Unix time `seconds` (wire/cluster_messages.py)."""
    return int(seconds * 1000) << 10


def ignored(one: Instance) -> dict[str, float]:
    counted = metrics(one.admin)
    return {
        reason: sample(counted, "lbproxy_cluster_ignored_messages_total", reason=reason)
        for reason in ("oversized", "garbage", "invalid", "signature", "future", "unknown")
    }


def test_garbage_and_hostile_messages_are_ignored_counted_and_logged(redis, cluster):
    lb1, lb2 = cluster(redis, 2, extra="persistence: {timeout: 5m}")
    wait_connected(lb1, lb2)
    change = change_body

    # Signed with the cluster's key (as if by a tool that has it, or a broken instance):
    # the body is still checked whole.
    hostile = [
        b"\x00\xff\xfe not json",
        b"[" * 60_000,  # deep nesting, within the size limit
        b"{}",
        b'{"v": 2, "kind": "weight", "vs": "web", "rs": "a", "value": NaN}',
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
        change(v=1),
        change(origin="a b"),
        change(version=-5),
        change(version=2**60),
        change(extra="field"),
        change(rs="nosuch"),  # well formed, but a server this instance does not have
        change(vs="nosuch"),
    ]
    for payload in hostile:
        redis.publish("lbproxy:changes", signed("change", payload))
    batch = {"v": 2, "origin": "m", "vs": "web", "time": time.time()}
    entries = [
        b"garbage",
        json.dumps({**batch, "entries": [["not-an-ip", "a", 10]]}),
        json.dumps({**batch, "entries": [["10.0.0.1", "a", -1]]}),
        json.dumps({**batch, "entries": [["10.0.0.1", "zz", 1000]]}),
        json.dumps({**batch, "entries": []}),
    ]
    for payload in entries:
        body = payload if isinstance(payload, bytes) else payload.encode()
        redis.publish("lbproxy:entries", signed("entries", body))
    # Not signed with the key, or signed for another place: refused before being read.
    valid = change(rs="b", value=9, version=version_at(time.time()))
    for payload in (valid, signed("change", valid, key="x" * 64), signed("entries", valid),
                    signed("change", valid, prefix="other"), b"0" * 64 + b"." + valid):  # fmt: skip
        redis.publish("lbproxy:changes", payload)
    # Signed, but made more than a minute ahead of the receivers' clocks.
    redis.publish("lbproxy:changes", signed("change", change(version=version_at(time.time() + 90))))
    # a valid change afterwards is still applied: nothing above stopped the sync
    redis.publish("lbproxy:changes", signed("change", change(rs="c", value=6)))
    for one in (lb1, lb2):
        wait_for(lambda o=one: o.server("c")["weight"]["static"] == 6, 3.0, f"{one.name}: c")
        assert [one.server(rs)["weight"]["static"] for rs in ("a", "b")] == [1, 1]
        assert ignored(one) == {"oversized": 1, "garbage": 4, "invalid": 18, "signature": 5,
                                "future": 1, "unknown": 3}  # fmt: skip
        counted = metrics(one.admin)
        assert sample(counted, "lbproxy_persistence_entries", virtual_server="web") == 0
        log = one.log()
        for reason in ("oversized", "garbage", "invalid", "signature", "future", "unknown"):
            assert log.count(f"ignored a message from Redis ({reason})") == 1, log  # once
    assert ask(lb1.port) in ("a", "b", "c") and ask(lb2.port) in ("a", "b", "c")  # it serves


def test_a_forged_drain_published_to_redis_disables_nothing(redis, cluster):
    """The issue's repro: whoever can write to Redis, without the key, steers nothing."""
    lb1, lb2 = cluster(redis, 2)
    wait_connected(lb1, lb2)
    ahead = version_at(time.time() + 3600)  # up to an hour ahead was accepted before
    for v, version in ((1, ahead), (2, ahead), (2, version_at(time.time()))):
        forged = change_body(v=v, kind="state", rs="b", value="disabled", version=version)
        redis.cli("PUBLISH", "lbproxy:changes", forged.decode())
        redis.cli("HSET", "lbproxy:state", "state/web/b", forged.decode())
    # the same, signed with the key but an hour ahead: refused too
    late = change_body(kind="state", rs="b", value="disabled", version=ahead)
    redis.publish("lbproxy:changes", signed("change", late))
    wait_for(lambda: ignored(lb2)["future"] == 1, 3.0, "the last message to arrive")
    lb3 = cluster.instance(redis, "lb3", start=True)  # reads the forged hash at its start
    for one in (lb1, lb2, lb3):
        assert one.server("b")["state"] == "enabled"
        assert {ask(one.port) for _ in range(6)} == {"a", "b", "c"}
    assert ignored(lb1)["signature"] == 3 and ignored(lb3)["signature"] >= 1
    # and the channel works: a change made with the key applies everywhere
    lb1.patch("b", {"state": "drain"})
    for one in (lb2, lb3):
        wait_for(lambda o=one: o.server("b")["state"] == "drain", 3.0, f"{one.name}: drain")


def test_instances_with_different_keys_do_not_apply_each_others_changes(redis, cluster):
    lb1 = cluster.instance(redis, "lb1", start=True)
    lb2 = cluster.instance(redis, "lb2", start=True, key="another-cluster-key-" + "9" * 40)
    wait_connected(lb1, lb2)
    lb1.patch("b", {"state": "drain"})
    lb2.patch("a", {"weight": 5})
    wait_for(lambda: ignored(lb2)["signature"] >= 1, 3.0, "lb2 to refuse lb1's change")
    wait_for(lambda: ignored(lb1)["signature"] >= 1, 3.0, "lb1 to refuse lb2's change")
    assert lb2.server("b")["state"] == "enabled" and lb1.server("a")["weight"]["static"] == 1
    assert member_names(lb1) == ["lb1"] and member_names(lb2) == ["lb2"]
    assert "5f1b0c8e" not in lb1.log() + lb2.log()  # the key is never logged


def test_a_hostile_state_in_redis_does_not_stop_a_start(redis, cluster):
    forged = b"0" * 64 + b"." + change_body(version=2**52)  # beats any real version
    redis.cli("HSET", "lbproxy:state", "weight/web/a", forged.decode(), "state/web/b",
              signed("change", change_body(kind="state", rs="c", value="disabled",
                                           version=1)).decode())  # fmt: skip
    redis.cli("HSET", "lbproxy:members", "evil", "not json")
    lb1 = cluster.instance(redis, "lb1", start=True)
    wait_connected(lb1)
    assert [lb1.server(rs)["state"] for rs in ("a", "b", "c")] == ["enabled"] * 3
    assert {ask(lb1.port) for _ in range(6)} == {"a", "b", "c"}
    lb1.patch("a", {"weight": 2})  # the forged value stored there loses to a real change
    wait_for(
        lambda: '"value":2' in redis.cli("HGET", "lbproxy:state", "weight/web/a"),
        2.0,
        "the change stored",
    )
    assert stored_change(redis, "weight/web/a")["origin"] == "lb1"
    assert member_names(lb1) == ["lb1"]


# -- bounded reads (SPEC §21) -------------------------------------------------------------


class Latencies(InThread):
    """Proxied connections through `port` (with a PROXY header), one after another in a
    thread, each timed (connect to the name read); bounded by `limit` connections."""

    def __init__(self, port: int, limit: int = 200_000) -> None:
        super().__init__()
        self.port, self.limit = port, limit
        self.samples: list[tuple[float, float]] = []  # (started, seconds)

    def _run(self) -> None:
        header = encode_v1(("10.250.0.1", 40000), ("127.0.0.1", self.port))  # accept_proxy
        while not self._stop.is_set() and len(self.samples) < self.limit:
            started = time.monotonic()
            try:
                name = ask(self.port, header)
            except OSError as exc:
                self.failures.append(str(exc))
                continue
            if name not in ("a", "b", "c"):
                self.failures.append(f"answered {name!r}")
            self.samples.append((started, time.monotonic() - started))
            time.sleep(0.001)  # the loop's pace

    def p99(self, since: float, until: float) -> tuple[float, int]:
        """The 99th percentile of the connections started in [since, until], and their count."""
        taken = sorted(d for started, d in self.samples if since <= started <= until)
        assert taken, "no connection in the window"
        return taken[min(len(taken) - 1, int(len(taken) * 0.99))], len(taken)


def resp(*args: bytes | str) -> bytes:
    """One Redis command in RESP, as `redis-cli --pipe` sends it."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else arg
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def pipe_to_redis(redis: RedisServer, commands: bytes) -> subprocess.Popen:
    """Send RESP commands through `redis-cli --pipe` (another process: the test's own
    threads are left to time the connections)."""
    from tests.integration.redis_server import REDIS_CLI

    assert REDIS_CLI is not None
    proc = subprocess.Popen(
        [REDIS_CLI, "-h", "127.0.0.1", "-p", str(redis.port), "--pipe"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdin is not None
    proc.stdin.write(commands)
    proc.stdin.close()
    return proc


def foreign_batches(count: int, origin: str = "elsewhere") -> bytes:
    """PUBLISH commands of `count` persistence entries from another instance, signed
    with the cluster's key, 200 to a batch, as lbproxy writes them."""
    commands = []
    now = time.time()
    for first in range(0, count, 200):
        rows = [[f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", "abc"[i % 3], 600_000]
                for i in range(first, min(count, first + 200))]  # fmt: skip
        body = json.dumps({"v": 2, "origin": origin, "vs": "web", "time": round(now, 3),
                           "entries": rows}, separators=(",", ":")).encode()  # fmt: skip
        commands.append(resp("PUBLISH", "lbproxy:entries", signed("entries", body)))
    return b"".join(commands)


@pytest.mark.serial  # measures latency
def test_100000_foreign_entries_arriving_leave_the_data_plane_serving(redis, cluster):
    persistent = "accept_proxy: true\npersistence: {timeout: 10m, max_entries: 200000}"
    lb1 = cluster.instance(redis, "lb1", start=True, extra=persistent)
    wait_connected(lb1)
    commands = foreign_batches(100_000)
    with Latencies(lb1.port) as loop:
        wait_for(lambda: len(loop.samples) >= 50, 10.0, "connections before")
        started = time.monotonic()
        sender = pipe_to_redis(redis, commands)
        # the 100,000 and the timed client's own entry
        wait_for(lambda: entries(lb1) == 100_001, 30.0, "the 100,000 entries applied")
        applied = time.monotonic()
        assert sender.wait(10) == 0
        wait_for(lambda: len([s for s in loop.samples if s[0] > applied]) >= 10, 10.0, "after")
    p99, taken = loop.p99(started, applied)
    assert loop.failures == []
    assert p99 < 0.050, f"p99 {p99 * 1000:.1f} ms over {taken} connections"
    # the entries are used: a client of the other instance reaches its server here
    header = encode_v1(("10.0.1.44", 40000), ("127.0.0.1", lb1.port))
    assert ask(lb1.port, header) == "abc"[(1 << 8 | 44) % 3]


def fill_entries(redis: RedisServer, count: int, step: int = 100_000) -> None:
    """`count` keys under lbproxy:p:web: made inside Redis (a Lua loop per `step`), with
    a value lbproxy did not sign: what a Redis shared with something else may hold."""
    script = (
        "for i = tonumber(ARGV[1]), tonumber(ARGV[2]) do "
        "redis.call('SET', string.format('lbproxy:p:web:10.%d.%d.%d', math.floor(i / 65536), "
        "math.floor(i / 256) % 256, i % 256), 'x', 'PX', 600000) end"
    )
    for first in range(0, count, step):
        redis.cli("EVAL", script, "0", str(first), str(min(count, first + step) - 1))


def skipped(one: Instance) -> float:
    return sample(metrics(one.admin), "lbproxy_cluster_skipped_total", kind="entries")


@pytest.mark.serial  # measures latency
def test_a_redis_of_two_million_entries_does_not_stall_the_data_plane(redis, cluster):
    fill_entries(redis, 2_000_000)
    lb1 = cluster.instance(
        redis, "lb1", start=True, extra="accept_proxy: true\npersistence: {timeout: 10m}"
    )
    wait_connected(lb1)
    # the start's resync read max_entries (200,000: refused, not signed) and counted the rest
    wait_for(lambda: skipped(lb1) >= 1_800_000, 30.0, "the entries not read counted")
    first = skipped(lb1)
    assert first <= 1_810_000  # (SCAN may return a key twice)
    assert ignored(lb1)["signature"] == 200_000
    assert "more than global.cluster.max_entries (200000)" in lb1.log()
    with Latencies(lb1.port) as loop:
        wait_for(lambda: len(loop.samples) >= 50, 10.0, "connections before")
        started = time.monotonic()
        lb1.proxy.reload()  # a reload resyncs: the same reads again, under traffic
        wait_for(lambda: skipped(lb1) >= first + 1_800_000, 30.0, "the second resync")
        done = time.monotonic()
    p99, taken = loop.p99(started, done)
    assert loop.failures == []
    assert p99 < 0.050, f"p99 {p99 * 1000:.1f} ms over {taken} connections"
    # 200,000 read again (one of them may be the timed client's own entry, signed)
    assert 399_999 <= ignored(lb1)["signature"] <= 400_000
    assert entries(lb1) == 1  # the timed client's own: none of the 2 million


def test_a_state_hash_of_12000_fields_is_read_up_to_10000(redis, cluster):
    fields = []
    for i in range(12_000):  # a field per server of servers this instance does not have
        body = change_body(rs=f"s{i}", version=version_at(time.time()))
        fields += [f"weight/web/s{i}", signed("change", body)]
    assert pipe_to_redis(redis, resp("HSET", "lbproxy:state", *fields)).wait(30) == 0
    lb1 = cluster.instance(redis, "lb1", start=True)
    wait_connected(lb1)
    counted = metrics(lb1.admin)
    assert sample(counted, "lbproxy_cluster_skipped_total", kind="state") == 2000
    assert ignored(lb1)["unknown"] == 10_000
    assert "lbproxy:state has 12000 fields" in lb1.log()


def test_an_upgraded_instance_stays_in_the_cluster(redis, cluster, tmp_path):
    lb2 = cluster.instance(redis, "lb2", start=True)
    port, admin = free_port(), free_port()
    (tmp_path / "lb1").mkdir()
    lb1 = UpgradableLbproxy(
        tmp_path / "lb1", cluster_config(redis, "lb1", port, admin, cluster.servers), admin
    )
    try:
        wait_for(lambda: "joined through Redis" in lb1.log(), 10.0, "lb1 joined")
        lb2.patch("a", {"weight": 4})
        wait_for(lambda: "weight 1 -> 4 (cluster: from lb2)" in lb1.log(), 2.0, "a's weight")
        lb1.upgrade()  # the new process reads the key file again, and joins as lb1
        wait_for(lambda: lb1.log().count("joined through Redis") == 2, 10.0, "the new one joined")
        # The old process beat beside the new one under one name for a moment: the same
        # instance (the id is handed over), not a clash. Wait for the old one's exit and
        # two heartbeats of the new one after it.
        wait_for(lambda: not alive(lb1.pids[0]), 10.0, "the old process to exit")
        beats = {redis.cli("HGET", "lbproxy:members", "lb1")}

        def two_more_beats() -> bool:
            beats.add(redis.cli("HGET", "lbproxy:members", "lb1"))
            return len(beats) >= 3

        wait_for(two_more_beats, 5.0, "two heartbeats of the new process")
        lb2.patch("b", {"state": "drain"})
        wait_for(
            lambda: {ask(port) for _ in range(6)} == {"a", "c"}, 3.0, "the drain in the new process"
        )
        status, body = http("GET", f"http://127.0.0.1:{admin}/api/v1/virtual-servers")
        assert status == 200
        (vs,) = json.loads(body)["virtual_servers"]
        weights = {rs["name"]: rs["weight"]["static"] for rs in vs["real_servers"]}
        assert weights["a"] == 4  # handed over, and the cluster's
        assert ignored(lb2)["signature"] == 0
        assert "under this instance's name" not in lb1.log()
        assert sample(metrics(admin), "lbproxy_cluster_name_clash") == 0
    finally:
        lb1.stop()


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
