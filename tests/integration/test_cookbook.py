"""The cookbook (docs/howto/databases.md): every recipe of configs/cookbook/ run by a real
`lbproxy run` in front of the real server it is for, and the failovers it describes.

A recipe is used as shipped; `recipe()` changes only where things are: the listen address
(a free loopback port), each real server's address (the servers this test started; the
recipe's servers this test did not start are left out), a real server's own check port
where the recipe's check port is one per host (Patroni's 8008), and the files the recipe
names under /etc/lbproxy/. Every check setting (type, user, role, interval, fall, on_down
...) is the recipe's own, so the times measured are the recipe's.

Patroni itself is not here. Its REST API is stood in for by a real HTTPS server
(`PatroniRest`) that answers GET /primary as Patroni does: 200 when its PostgreSQL is a
primary (`pg_is_in_recovery()` false, asked of the real server every 100 ms), 503 when
it is in recovery or down, and 503 once `demoted` (Patroni has given up the leader key
while PostgreSQL still runs).
"""

from __future__ import annotations

import contextlib
import os
import re
import smtplib
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests import tools
from tests.integration.databases import (
    PG,
    Mariadb,
    Postgres,
    SmtpServer,
    requires_mariadb,
    requires_postgres,
)
from tests.integration.harness import counted, free_port, get_json, run_cli, wait_for
from tests.integration.redis_server import RedisServer, requires_redis
from tests.integration.tls_servers import Certificates, HttpsServer, TlsServer

ROOT = Path(__file__).resolve().parents[2]
COOKBOOK = ROOT / "configs" / "cookbook"

# A failover's bound is the recipe's fall x interval + timeout; on top of it, what the
# processes of the switch take to start and connect: `pg_ctl promote` or REPLICAOF, the
# client started again, its connect and its first transaction.
START_UP = 2.0


def recipe(
    name: str,
    admin_port: int,
    port: int,
    servers: dict[str, str | tuple[str, int]],
    files: dict[str, str] | None = None,
) -> str:
    """configs/cookbook/NAME as shipped, but listening on 127.0.0.1:`port` with the admin
    API on `admin_port`, its real servers at `servers` (name: "HOST:PORT", or (HOST:PORT,
    the server's own check port)), and `files` (a path the recipe names: the test's)."""
    document = yaml.safe_load((COOKBOOK / name).read_text())
    [vs] = document["virtual_servers"]
    vs["listen"] = f"127.0.0.1:{port}"
    assert set(servers) <= {rs["name"] for rs in vs["real_servers"]}, servers
    kept = []
    for rs in vs["real_servers"]:
        if rs["name"] not in servers:
            continue
        where = servers[rs["name"]]
        address, check_port = where if isinstance(where, tuple) else (where, None)
        rs["address"] = address
        if check_port is not None:
            rs["health_check"] = {"port": check_port}
        kept.append(rs)
    vs["real_servers"] = kept
    check = vs["health_check"]
    for key, value in check.items():
        if isinstance(value, str) and value.startswith("/etc/lbproxy/"):
            check[key] = (files or {})[value]
    document["global"] = {"admin": {"listen": f"127.0.0.1:{admin_port}"}, "drain_timeout": "2s"}
    return yaml.safe_dump(document, sort_keys=False)


def switch_bound(name: str) -> float:
    """fall x interval + timeout of the recipe's check, in seconds."""
    [vs] = yaml.safe_load((COOKBOOK / name).read_text())["virtual_servers"]
    check = vs["health_check"]

    def seconds(value: str) -> float:
        assert re.fullmatch(r"\d+(\.\d+)?s", value), value  # the recipes write seconds
        return float(value.removesuffix("s"))

    return check["fall"] * seconds(check["interval"]) + seconds(check["timeout"])


def servers(admin_port: int, vs: str) -> dict[str, dict]:
    document = get_json(admin_port, f"/api/v1/virtual-servers/{vs}")
    return {rs["name"]: rs for rs in document["real_servers"]}


def wait_health(
    admin_port: int, vs: str, name: str, health: str, reason: str = "", timeout: float = 30.0
) -> dict:
    """Until the API shows `name` with `health` and a last check whose reason matches
    `reason` (a regular expression, the whole reason; "": a passing check)."""
    seen: list[dict] = []

    def shown() -> dict | None:
        rs = servers(admin_port, vs)[name]
        seen[:] = [rs]
        check = rs.get("check")
        if rs["health"] == health and check and re.fullmatch(reason, check["reason"]):
            return rs
        return None

    return wait_for(shown, timeout, f"{vs}/{name} {health}", details=lambda: repr(seen))


# -- PostgreSQL ------------------------------------------------------------------------


class PatroniRest(HttpsServer):
    """Patroni's REST API for one PostgreSQL, over HTTPS: GET /primary answers 200 while
    that server is a primary, 503 while it is in recovery, down, or `demoted`.

    As Patroni's own loop does, a thread asks PostgreSQL for its state (every 100 ms)
    and the API answers from the last state known, so an answer takes no longer under
    load than the check's timeout allows."""

    def __init__(self, name: str, cert: tuple[str, str], pg: Postgres) -> None:
        self.pg = pg
        self.demoted = False
        self.role = "unknown"
        self.stopping = threading.Event()
        self.poller = threading.Thread(target=self._poll, daemon=True)
        self.poller.start()
        super().__init__(name, cert, (503, b""))

    def _poll(self) -> None:
        for _ in range(100_000):  # bounded; ends with stop()
            try:
                in_recovery = self.pg.psql("SELECT pg_is_in_recovery()").strip()
                self.role = "primary" if in_recovery == "f" else "replica"
            except (RuntimeError, subprocess.TimeoutExpired):
                self.role = "stopped"
            if self.stopping.wait(0.1):
                return

    @property  # type: ignore[override]
    def answer(self) -> tuple[int, bytes]:
        role = "demoted" if self.demoted else self.role
        return (200 if role == "primary" else 503), f'{{"role": "{role}"}}'.encode()

    @answer.setter
    def answer(self, value: tuple[int, bytes]) -> None:
        pass  # the server's own state decides

    def stop(self) -> None:
        self.stopping.set()
        self.poller.join(60)
        super().stop()


def psql_through(port: int, sql: str, application: str = "cookbook") -> str:
    assert PG is not None
    done = subprocess.run(
        [str(PG / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
         "-d", "postgres", "-At", "-c", sql],
        capture_output=True, text=True, timeout=30,
        env={**os.environ, "PGAPPNAME": application, "PGCONNECT_TIMEOUT": "5"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def held_session(port: int, application: str) -> subprocess.Popen:
    """A psql session through lbproxy that stays open until its stdin closes."""
    assert PG is not None
    session = subprocess.Popen(
        [str(PG / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
         "-d", "postgres", "-At"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PGAPPNAME": application},
    )  # fmt: skip
    assert session.stdin is not None and session.stdout is not None
    session.stdin.write(b"SELECT inet_server_port();\n")
    session.stdin.flush()
    session.port = int(session.stdout.readline())
    return session


def end_session(session: subprocess.Popen) -> None:
    assert session.stdin is not None and session.stdout is not None
    with contextlib.suppress(OSError):
        session.stdin.close()
    try:
        session.wait(30)
    except subprocess.TimeoutExpired:
        session.kill()
        session.wait(10)
    session.stdout.close()


def sessions_of(pg: Postgres, application: str) -> int:
    sql = f"SELECT count(*) FROM pg_stat_activity WHERE application_name = '{application}'"
    return int(pg.psql(sql))


@requires_postgres
def test_patroni_recipe_follows_the_leader_and_closes_the_old_leaders_sessions(lbproxy, tmp_path):
    """postgres-patroni.yaml: traffic to the node whose /primary answers 200 (HTTPS on
    its own port); when the leader is demoted and the replica promoted, the session left
    on the old leader is closed while its PostgreSQL still runs, and new sessions reach
    the new leader."""
    pg1 = Postgres().start()
    pg2 = rest1 = rest2 = session = None
    try:
        pg2 = pg1.replica()
        cert = Certificates(tmp_path / "certs").self_signed("patroni", "localhost")
        rest1, rest2 = PatroniRest("pg1", cert, pg1), PatroniRest("pg2", cert, pg2)
        admin_port, port = free_port(), free_port()
        config = recipe(
            "postgres-patroni.yaml",
            admin_port,
            port,
            {
                "pg1": (f"127.0.0.1:{pg1.port}", rest1.port),
                "pg2": (f"127.0.0.1:{pg2.port}", rest2.port),
            },
        )
        (tmp_path / "lb.yaml").write_text(config)
        summary = run_cli("check", str(tmp_path / "lb.yaml")).stdout
        assert "https GET /primary expecting 200 (not verified)" in summary, summary
        assert f"checked on 127.0.0.1 port {rest2.port}" in summary, summary
        proxy = lbproxy(config, wait_ports=[port])
        wait_health(admin_port, "pg-primary", "pg1", "up")
        wait_health(
            admin_port, "pg-primary", "pg2", "down", r"http check: GET /primary answered 503"
        )
        assert psql_through(port, "SELECT inet_server_port()") == str(pg1.port)
        session = held_session(port, "held")
        assert session.port == pg1.port
        assert sessions_of(pg1, "held") == 1

        rest1.demoted = True  # Patroni gives up the leader key ...
        pg2.promote()  # ... and promotes the replica
        wait_health(
            admin_port, "pg-primary", "pg1", "down", r"http check: GET /primary answered 503"
        )
        wait_for(lambda: sessions_of(pg1, "held") == 0, 10, "the held session closed")
        wait_health(admin_port, "pg-primary", "pg2", "up")
        assert psql_through(port, "SELECT inet_server_port()") == str(pg2.port)
        assert "pg-primary: closed 1 connection(s): pg1 is down (on_down: close)" in proxy.log()
        assert (
            counted(
                admin_port,
                "lbproxy_connections_closed_total",
                virtual_server="pg-primary",
                reason="marked_down",
            )
            == 1
        )
    finally:
        if session is not None:
            end_session(session)
        for rest in (rest1, rest2):
            if rest is not None:
                rest.stop()
        if pg2 is not None:
            pg2.remove()
        pg1.remove()


PROBE = """\
\\set aid random(1, 100000)
\\set delta random(-5000, 5000)
BEGIN;
UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
INSERT INTO failover_probe (client, port, at)
  VALUES (:client_id, inet_server_port(), clock_timestamp());
END;
"""


class Pgbench:
    """`pgbench -c 4 -T 10` through lbproxy, started again whenever it ends early (its
    clients abort when their sessions are closed) until the 10 s are over: four clients
    that reconnect. Each transaction also writes (client, server port, time) to
    failover_probe, so the servers say who was served where and when."""

    def __init__(self, port: int, script: Path, seconds: float = 10.0, runs: int = 200):
        self.port, self.script, self.seconds, self.runs = port, script, seconds, runs
        self.results: list[tuple[int, str]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Pgbench:
        self.thread.start()
        return self

    def _run(self) -> None:
        assert PG is not None
        deadline = time.monotonic() + self.seconds
        for _ in range(self.runs):
            left = int(deadline - time.monotonic())
            if left < 1 or self.stopping.is_set():
                return
            done = subprocess.run(
                [str(PG / "pgbench"), "-n", "-c", "4", "-T", str(left), "-f", str(self.script),
                 "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "postgres"],
                capture_output=True, text=True, timeout=left + 30,
            )  # fmt: skip
            self.results.append((done.returncode, (done.stdout + done.stderr)[-600:]))
            self.stopping.wait(0.05)  # a reconnecting client's pause before it tries again

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(60)


@pytest.mark.serial  # it measures the time of the switch
@requires_postgres
def test_postgres_recipe_fails_over_under_pgbench(lbproxy, tmp_path):
    """postgres.yaml under `pgbench -c 4 -T 10`: the primary goes into a smart shutdown
    (refusing new sessions, keeping the four of pgbench) and the streaming replica is
    promoted. The old primary is down and its sessions are closed (on_down: close), so
    its shutdown completes; every client's first transaction on the new primary comes
    within fall x interval + timeout of the demotion (+ START_UP)."""
    assert PG is not None
    pg1 = Postgres().start()
    pg2 = bench = None
    try:
        subprocess.run(
            [str(PG / "pgbench"), "-i", "-q", "-h", str(pg1.folder), "-p", str(pg1.port),
             "-U", "postgres", "postgres"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        pg1.psql("CREATE TABLE failover_probe (client int, port int, at timestamptz)")
        pg1.psql("CREATE ROLE lbproxy LOGIN")
        pg1.psql("CREATE DATABASE lbproxy OWNER lbproxy")
        pg2 = pg1.replica()
        script = tmp_path / "probe.sql"
        script.write_text(PROBE)
        admin_port, port = free_port(), free_port()
        config = recipe(
            "postgres.yaml",
            admin_port,
            port,
            {"pg1": f"127.0.0.1:{pg1.port}", "pg2": f"127.0.0.1:{pg2.port}"},
        )
        proxy = lbproxy(config, wait_ports=[port])
        wait_health(admin_port, "pg", "pg1", "up")
        wait_health(
            admin_port,
            "pg",
            "pg2",
            "down",
            r"pgsql: FATAL: the database system is not accepting connections.*",
        )
        bench = Pgbench(port, script).start()

        def served_by_pg1() -> bool:
            clients = pg1.psql("SELECT count(DISTINCT client) FROM failover_probe")
            return int(clients) == 4

        wait_for(served_by_pg1, 10, "the four pgbench clients served by pg1")
        demoted = time.time()
        pg1.stop_smart()
        pg2.promote()
        # The smart shutdown ends when the last session has: no client stayed on pg1.
        wait_for(lambda: pg1.proc.poll() is not None, 30, "pg1's smart shutdown to end")
        old_gone = time.time() - demoted

        def all_on_pg2() -> bool:
            sql = f"SELECT count(DISTINCT client) FROM failover_probe WHERE port = {pg2.port}"
            return int(pg2.psql(sql)) == 4

        wait_for(all_on_pg2, 30, "every client served by pg2", details=lambda: bench.results)
        bench.stop()
        firsts = pg2.psql(
            "SELECT client, extract(epoch FROM min(at)) FROM failover_probe "
            f"WHERE port = {pg2.port} GROUP BY client ORDER BY client"
        )
        waits = {
            int(client): float(at) - demoted
            for client, at in (line.split("|") for line in firsts.splitlines())
        }
        bound = switch_bound("postgres.yaml")
        print(f"pg1 gone after {old_gone:.2f}s; first transaction on pg2: {waits}")
        assert old_gone <= bound + START_UP, (old_gone, bound)
        assert max(waits.values()) <= bound + START_UP, (waits, bound, bench.results)
        assert "pg: closed 4 connection(s): pg1 is down (on_down: close)" in proxy.log()
        assert re.search(
            r"pg/pg1 is down \(pgsql: FATAL: the database system is shutting down", proxy.log()
        )
    finally:
        if bench is not None:
            bench.stop()
        if pg2 is not None:
            pg2.remove()
        pg1.remove()


# -- Redis -----------------------------------------------------------------------------


class Resp:
    """A Redis client connection, the protocol by hand (RESP2)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.file = self.sock.makefile("rb")

    def call(self, *words: str):
        command = f"*{len(words)}\r\n" + "".join(f"${len(w)}\r\n{w}\r\n" for w in words)
        self.sock.sendall(command.encode())
        return self._reply()

    def _reply(self):
        line = self.file.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionError("closed")
        kind, rest = line[:1], line[1:-2].decode()
        if kind in (b"+", b"-"):
            return (kind.decode(), rest)
        if kind == b":":
            return int(rest)
        if kind == b"$":
            return None if rest == "-1" else self.file.read(int(rest) + 2)[:-2].decode()
        if kind == b"*":
            return [self._reply() for _ in range(int(rest))]
        raise ConnectionError(f"not RESP: {line!r}")

    def close(self) -> None:
        self.file.close()
        self.sock.close()


class RedisClients:
    """`count` clients through lbproxy, each on one connection sending INCR in a loop;
    a client whose connection ends connects again (after a short pause). Each records
    its successes and errors with the server's port (CONFIG GET port at each connect)."""

    def __init__(self, port: int, password: str, count: int = 4, seconds: float = 30.0):
        self.port, self.password, self.seconds = port, password, seconds
        self.stopping = threading.Event()
        self.ok: list[list[tuple[float, int]]] = [[] for _ in range(count)]
        self.errors: list[list[tuple[float, int, str]]] = [[] for _ in range(count)]
        self.connects: list[list[int]] = [[] for _ in range(count)]
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)
        ]

    def start(self) -> RedisClients:
        for thread in self.threads:
            thread.start()
        return self

    def _run(self, index: int) -> None:
        deadline = time.monotonic() + self.seconds
        for _ in range(200_000):  # commands and reconnects together
            if self.stopping.is_set() or time.monotonic() > deadline:
                return
            try:
                client = Resp(self.port)
            except OSError:
                self.stopping.wait(0.05)
                continue
            try:
                client.call("AUTH", self.password)
                client.call("CLIENT", "SETNAME", f"failover-client-{index}")
                server = int(client.call("CONFIG", "GET", "port")[1])
                self.connects[index].append(server)
                for _ in range(200_000):
                    if self.stopping.is_set() or time.monotonic() > deadline:
                        return
                    answer = client.call("INCR", f"failover:{index}")
                    if isinstance(answer, int):
                        self.ok[index].append((time.time(), server))
                    else:
                        self.errors[index].append((time.time(), server, answer[1][:40]))
            except (OSError, ConnectionError, TypeError, IndexError):
                pass
            finally:
                client.close()
            self.stopping.wait(0.05)  # a reconnecting client's pause

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(30)


@pytest.mark.serial  # it measures the time of the switch
@requires_redis
def test_redis_recipe_fails_over_under_a_client_loop(lbproxy, tmp_path):
    """redis-primary.yaml (role: master, password_file, on_down: close) under four
    clients writing in a loop: REPLICAOF NO ONE on the replica, then REPLICAOF on the old
    primary. The old primary's connections are closed (no client left on it: its writes
    would be refused, READONLY) and every client writes to the new primary within
    fall x interval + timeout of the switch (+ START_UP)."""
    password = "cookbook-secret"
    r1 = RedisServer(tmp_path / "r1").start(password=password)
    r2 = RedisServer(tmp_path / "r2").start(password=password, replica_of=r1.port)
    secret = tmp_path / "redis.password"
    secret.write_text(password + "\n")
    secret.chmod(0o600)
    clients = None
    try:
        admin_port, port = free_port(), free_port()
        config = recipe(
            "redis-primary.yaml",
            admin_port,
            port,
            {"redis1": f"127.0.0.1:{r1.port}", "redis2": f"127.0.0.1:{r2.port}"},
            files={"/etc/lbproxy/redis.password": str(secret)},
        )
        proxy = lbproxy(config, wait_ports=[port])
        wait_health(admin_port, "redis", "redis1", "up")
        wait_health(admin_port, "redis", "redis2", "down", r"redis: role:slave, want master")
        clients = RedisClients(port, password).start()
        wait_for(lambda: all(len(ok) >= 10 for ok in clients.ok), 20, "every client writing to r1")
        assert all(set(c) == {r1.port} for c in clients.connects), clients.connects
        switched = time.time()
        r2.cli("REPLICAOF", "NO", "ONE")
        r1.cli("CONFIG", "SET", "masterauth", password)
        r1.cli("REPLICAOF", "127.0.0.1", str(r2.port))

        def firsts_on_r2() -> dict[int, float] | None:
            firsts = {}
            for index, ok in enumerate(clients.ok):
                on_r2 = [at for at, server in ok if server == r2.port and at > switched]
                if not on_r2:
                    return None
                firsts[index] = on_r2[0] - switched
            return firsts

        waits = wait_for(firsts_on_r2, 30, "every client writing to r2")
        wait_health(admin_port, "redis", "redis1", "down", r"redis: role:slave, want master")
        listed = r1.cli("CLIENT", "LIST")
        clients.stop()
        readonly = sum(1 for e in clients.errors for _, _, text in e if "READONLY" in text)
        bound = switch_bound("redis-primary.yaml")
        print(f"first write on r2: {waits}; READONLY answers from the old primary: {readonly}")
        assert max(waits.values()) <= bound + START_UP, (waits, bound)
        assert "failover-client" not in listed, listed  # no client left on the old primary
        assert all(c[-1] == r2.port for c in clients.connects), clients.connects
        assert "redis: closed 4 connection(s): redis1 is down (on_down: close)" in proxy.log()
    finally:
        if clients is not None:
            clients.stop()
        r2.stop()
        r1.stop()


# -- MariaDB ---------------------------------------------------------------------------


def mariadb_session(port: int) -> subprocess.Popen:
    """A `mariadb` session through lbproxy as user `app`, open until its stdin closes;
    its `port` is the server's."""
    session = subprocess.Popen(
        [tools.need("mariadb", "mariadb-client"), "--no-defaults", "-h", "127.0.0.1",
         "-P", str(port), "-uapp", "-N", "-B", "--unbuffered"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert session.stdin is not None and session.stdout is not None
    session.stdin.write(b"SELECT @@port;\n")
    session.stdin.flush()
    session.port = int(session.stdout.readline())
    return session


def app_sessions(db: Mariadb) -> int:
    return int(db.sql("SELECT count(*) FROM information_schema.processlist WHERE user = 'app'"))


@requires_mariadb
def test_mariadb_recipe_fails_over_to_the_backup_and_back(lbproxy, tmp_path):
    """mariadb.yaml: db1 takes the sessions, db2 (backup) none. db1 refusing the check's
    user takes it down: its session is closed (on_down: close) and the client's next one
    reaches db2; db1 back up closes the session on db2 (on_up: close_backups)."""
    db1, db2 = Mariadb(), Mariadb()
    sessions: list[subprocess.Popen] = []
    try:
        for db in (db1.start(), db2.start()):
            db.sql("CREATE USER lbproxy@'127.0.0.1'; CREATE USER app@'127.0.0.1'")
        admin_port, port = free_port(), free_port()
        config = recipe(
            "mariadb.yaml",
            admin_port,
            port,
            {"db1": f"127.0.0.1:{db1.port}", "db2": f"127.0.0.1:{db2.port}"},
        )
        proxy = lbproxy(config, wait_ports=[port])
        wait_health(admin_port, "mariadb", "db1", "up")
        wait_health(admin_port, "mariadb", "db2", "up")
        sessions.append(mariadb_session(port))
        assert sessions[-1].port == db1.port

        db1.sql("DROP USER lbproxy@'127.0.0.1'")  # db1 refuses the check's login
        wait_health(
            admin_port, "mariadb", "db1", "down", r"mysql: ERR (1045|1698): Access denied.*"
        )
        wait_for(lambda: app_sessions(db1) == 0, 10, "the session on db1 closed")
        sessions.append(mariadb_session(port))
        assert sessions[-1].port == db2.port

        db1.sql("CREATE USER lbproxy@'127.0.0.1'")
        wait_health(admin_port, "mariadb", "db1", "up")
        wait_for(lambda: app_sessions(db2) == 0, 10, "the session on the backup closed")
        sessions.append(mariadb_session(port))
        assert sessions[-1].port == db1.port
        log = proxy.log()
        assert "mariadb: closed 1 connection(s): db1 is down (on_down: close)" in log, log
        assert re.search(r"mariadb: closed 1 connection\(s\): .*close_backups", log), log
    finally:
        for session in sessions:
            end_session(session)
        db1.stop()
        db2.stop()


# -- SMTP and TLS ----------------------------------------------------------------------


def test_smtp_recipe_sends_mail_to_the_relay_that_says_ehlo(lbproxy, tmp_path):
    """smtp.yaml: a relay answering EHLO with 421 is down with that reason; mail goes
    through the other."""
    pytest.importorskip("aiosmtpd")
    mx1, mx2 = SmtpServer().start(), SmtpServer(refuse_ehlo=True).start()
    try:
        admin_port, port = free_port(), free_port()
        config = recipe(
            "smtp.yaml",
            admin_port,
            port,
            {"mx1": f"127.0.0.1:{mx1.port}", "mx2": f"127.0.0.1:{mx2.port}"},
        )
        lbproxy(config, wait_ports=[port])
        wait_health(admin_port, "smtp", "mx2", "down", r"smtp: EHLO answered 421.*")
        wait_health(admin_port, "smtp", "mx1", "up")
        for _ in range(3):
            with smtplib.SMTP("127.0.0.1", port, timeout=10) as mail:
                assert mail.ehlo("client.example")[0] == 250
                mail.sendmail("a@example.com", ["b@example.com"], "Subject: hi\r\n\r\nhello\r\n")
    finally:
        mx1.stop()
        mx2.stop()


def test_tls_recipe_passes_tls_through_to_the_servers_that_agree_h2(lbproxy, tmp_path):
    """tls-service.yaml: the check's handshake sends the SNI and offers h2; a server that
    speaks only http/1.1 is down with the reason; clients' TLS goes through untouched to
    the other, which sees the client's own SNI and ALPN."""
    certs = Certificates(tmp_path / "certs")
    cert = certs.signed("api", "api.example.com")
    api1 = TlsServer("api1", cert, alpn=["h2"])
    api2 = TlsServer("api2", cert, alpn=["http/1.1"])
    try:
        admin_port, port = free_port(), free_port()
        config = recipe(
            "tls-service.yaml",
            admin_port,
            port,
            {"api1": f"127.0.0.1:{api1.port}", "api2": f"127.0.0.1:{api2.port}"},
        )
        lbproxy(config, wait_ports=[port])
        wait_health(
            admin_port,
            "api-tls",
            "api2",
            "down",
            r"tls: no ALPN protocol agreed \(offered h2; the server chose none\)",
        )
        wait_health(admin_port, "api-tls", "api1", "up")
        assert "api.example.com" in api1.server_names
        context = ssl.create_default_context(cafile=certs.ca)
        context.set_alpn_protocols(["h2"])
        for _ in range(3):
            with (
                socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
                context.wrap_socket(raw, server_hostname="api.example.com") as tls,
            ):
                assert tls.selected_alpn_protocol() == "h2"
    finally:
        api1.stop()
        api2.stop()
