"""Protocol health checks against the real servers (SPEC §22), through a real `lbproxy
run` and its admin API: each real server's `health` and the last check's `reason` are
what an operator reads in `GET /api/v1/virtual-servers/NAME`.

The server states are the servers' own: a PostgreSQL in smart shutdown refusing new
sessions, a standby in recovery and its promotion, a role that does not exist, a Redis
replica and its promotion, a MariaDB full (ERR 1040) and a MariaDB user
over its connection limit, an SMTP server refusing EHLO; and, for `port`/`address`, a
check port apart from the traffic port.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading

import pytest
import trio

from lbproxy.config.model import Address, HealthCheckConfig
from lbproxy.control.checks import ANSWER_LIMIT, probe
from tests.integration.databases import (
    Mariadb,
    Postgres,
    SmtpServer,
    requires_mariadb,
    requires_postgres,
)
from tests.integration.harness import (
    NameServer,
    ask_name,
    free_port,
    get_json,
    run_cli,
    wait_for,
)
from tests.integration.redis_server import RedisServer, requires_redis

FAST = "interval: 200ms, timeout: 1s, rise: 1, fall: 1"


def _config(admin_port: int, port: int, check: str, servers: list[str]) -> str:
    lines = [
        "global:",
        f"  admin: {{listen: 127.0.0.1:{admin_port}}}",
        "  drain_timeout: 2s",
        "virtual_servers:",
        "  - name: db",
        f"    listen: 127.0.0.1:{port}",
        "    scheduler: rr",
        f"    health_check: {{{check}, {FAST}}}",
        "    real_servers:",
        *(f"      - {server}" for server in servers),
    ]
    return "\n".join(lines) + "\n"


def _server(admin_port: int, name: str, vs: str = "db") -> dict:
    document = get_json(admin_port, f"/api/v1/virtual-servers/{vs}")
    return next(rs for rs in document["real_servers"] if rs["name"] == name)


def _wait_check(
    admin_port: int, name: str, health: str, reason: str = "", vs: str = "db", timeout=20.0
) -> dict:
    """Wait until the API shows `name` with `health` and a last check whose reason
    matches the regular expression `reason` (the whole of it; "" : an ok check)."""
    seen: list[dict] = []

    def shown() -> dict | None:
        rs = _server(admin_port, name, vs)
        seen[:] = [rs]
        check = rs.get("check")
        if rs["health"] != health or check is None:
            return None
        if not re.fullmatch(reason, check["reason"]):
            return None
        return rs

    return wait_for(
        shown, timeout, f"{name} {health} ({reason!r})", details=lambda: repr(seen[-1:])
    )


# -- port and address ------------------------------------------------------------------


def test_checks_go_to_the_check_port_and_address(lbproxy, tmp_path):
    """The traffic port answers for both servers; `a`'s checks go to a management port
    on another loopback address (up), `b`'s own override to a closed port (down)."""
    a, b = NameServer("a"), NameServer("b")
    management = socket.create_server(("127.0.0.2", 0))
    closed = free_port()
    try:
        admin_port, port = free_port(), free_port()
        mgmt_port = management.getsockname()[1]
        config = _config(
            admin_port,
            port,
            f"type: tcp, address: 127.0.0.2, port: {mgmt_port}",
            [
                f"{{name: a, address: 127.0.0.1:{a.port}}}",
                f"{{name: b, address: 127.0.0.1:{b.port}, "
                f"health_check: {{address: 127.0.0.1, port: {closed}}}}}",
            ],
        )
        (tmp_path / "lb.yaml").write_text(config)
        summary = run_cli("check", str(tmp_path / "lb.yaml")).stdout
        assert f"tcp on 127.0.0.2 port {mgmt_port} every 0.2s" in summary, summary
        assert f"checked on 127.0.0.1 port {closed}" in summary, summary

        proxy = lbproxy(config, wait_ports=[port])
        down = _wait_check(admin_port, "b", "down", "tcp check: connection refused")
        assert down["check"]["result"] == "fail"
        up = _wait_check(admin_port, "a", "up")
        assert up["check"]["result"] == "ok" and up["check"]["duration_ms"] >= 0
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", up["check"]["at"])
        # b's traffic port is fine, but only a takes the traffic
        assert {ask_name(port) for _ in range(4)} == {"a"}

        # a reload with an invalid check key keeps the running checks ...
        proxy.reload(config.replace("type: tcp,", "type: tcp, role: master,"))
        assert "health_check.role is for redis checks, not tcp" in proxy.log()
        assert _server(admin_port, "b")["health"] == "down"
        # ... and one without b's override sends b's checks where a's go (up)
        b_own = f", health_check: {{address: 127.0.0.1, port: {closed}}}"
        proxy.reload(config.replace(b_own, ""))
        _wait_check(admin_port, "b", "up")
    finally:
        management.close()
        a.stop()
        b.stop()


# -- pgsql -----------------------------------------------------------------------------


@requires_postgres
def test_pgsql_check_follows_the_server(lbproxy, tmp_path):
    pg = Postgres()
    try:
        pg.start()
        admin_port, port = free_port(), free_port()
        config = _config(
            admin_port,
            port,
            "type: pgsql, user: postgres",
            [
                f"{{name: primary, address: 127.0.0.1:{pg.port}}}",
            ],
        )
        # a second virtual server's check as the default user, whom this server lacks
        config += (
            "  - name: default-user\n"
            f"    listen: 127.0.0.1:{free_port()}\n"
            f"    health_check: {{type: pgsql, {FAST}}}\n"
            f"    real_servers: [{{name: primary, address: 127.0.0.1:{pg.port}}}]\n"
        )
        (tmp_path / "lb.yaml").write_text(config)
        summary = run_cli("check", str(tmp_path / "lb.yaml")).stdout
        assert "pgsql as user postgres every 0.2s" in summary, summary
        assert "pgsql as user lbproxy every 0.2s" in summary, summary

        proxy = lbproxy(config, wait_ports=[port])
        _wait_check(admin_port, "primary", "up")
        missing_role = 'pgsql: FATAL: role "lbproxy" does not exist'
        _wait_check(admin_port, "primary", "down", missing_role, vs="default-user")

        client = pg.hold_client()  # smart shutdown waits for it: new sessions are refused
        pg.stop_smart()
        down = _wait_check(
            admin_port, "primary", "down", "pgsql: FATAL: the database system is shutting down"
        )
        assert down["check"]["result"] == "fail"
        logged = "db/primary is down (pgsql: FATAL: the database system is shutting down)"
        wait_for(lambda: logged in proxy.log(), 10, "the transition in the log", proxy.log)
        pg.release(client)  # the server stops: the check cannot connect
        _wait_check(admin_port, "primary", "down", "pgsql: connection refused")
    finally:
        pg.remove()


@requires_postgres
def test_pgsql_password_request_is_healthy():
    """A server asking for a password is up and accepting (SCRAM: AuthenticationSASL)."""
    pg = Postgres(auth="scram-sha-256")
    try:
        pg.start()
        address = Address("127.0.0.1", pg.port)
        check = HealthCheckConfig(type="pgsql", user="nobody-here", timeout=5)
        assert _probe(address, check) == ("ok", "")
    finally:
        pg.remove()


# -- redis -----------------------------------------------------------------------------


@requires_redis
def test_redis_role_follows_a_promotion(lbproxy, tmp_path):
    password = "s3cret-for-the-check"
    primary, replica = RedisServer(tmp_path / "primary"), RedisServer(tmp_path / "replica")
    secret = tmp_path / "redis.pass"
    secret.write_text(password + "\n")
    os.chmod(secret, 0o600)
    try:
        primary.start(password=password)
        replica.start(password=password, replica_of=primary.port)
        admin_port, port = free_port(), free_port()
        config = _config(
            admin_port,
            port,
            f"type: redis, role: master, password_file: {secret}",
            [
                f"{{name: primary, address: 127.0.0.1:{primary.port}}}",
                f"{{name: replica, address: 127.0.0.1:{replica.port}}}",
            ],
        )
        (tmp_path / "lb.yaml").write_text(config)
        summary = run_cli("check", str(tmp_path / "lb.yaml")).stdout
        assert "redis PING after AUTH, role master every 0.2s" in summary, summary

        lbproxy(config, wait_ports=[port])
        _wait_check(admin_port, "primary", "up")
        _wait_check(admin_port, "replica", "down", "redis: role:slave, want master")

        replica.cli("REPLICAOF", "NO", "ONE")  # promoted
        _wait_check(admin_port, "replica", "up")
        primary.cli("REPLICAOF", "127.0.0.1", str(replica.port))  # the old one demoted
        _wait_check(admin_port, "primary", "down", "redis: role:slave, want master")
    finally:
        replica.stop()
        primary.stop()


@requires_redis
def test_redis_wrong_password_and_no_auth(tmp_path):
    redis = RedisServer(tmp_path / "redis")
    wrong = tmp_path / "wrong.pass"
    wrong.write_text("wrong\n")
    os.chmod(wrong, 0o600)
    try:
        redis.start(password="right")
        address = Address("127.0.0.1", redis.port)
        result, reason = _probe(address, HealthCheckConfig(type="redis", password_file=str(wrong)))
        assert result == "fail" and reason.startswith("redis: AUTH: WRONGPASS"), reason
        result, reason = _probe(address, HealthCheckConfig(type="redis"))
        assert result == "fail" and reason.startswith("redis: NOAUTH"), reason
    finally:
        redis.stop()


# -- mysql -----------------------------------------------------------------------------


@requires_mariadb
def test_mysql_check_logs_in_and_reports_refusals(lbproxy, tmp_path):
    db = Mariadb(max_connections=10)  # MariaDB's least
    busy: list = []
    try:
        db.start()
        db.sql(
            "CREATE USER lbproxy@'127.0.0.1' WITH MAX_USER_CONNECTIONS 1;"
            "CREATE USER busy@'127.0.0.1';"
        )
        admin_port, port = free_port(), free_port()
        config = _config(
            admin_port,
            port,
            "type: mysql, user: lbproxy",
            [
                f"{{name: maria, address: 127.0.0.1:{db.port}}}",
            ],
        )
        (tmp_path / "lb.yaml").write_text(config)
        assert (
            "mysql login as user lbproxy every 0.2s"
            in run_cli("check", str(tmp_path / "lb.yaml")).stdout
        )
        lbproxy(config, wait_ports=[port])
        _wait_check(admin_port, "maria", "up")

        session = db.client("lbproxy")  # the check's user is now at its limit
        try:
            _wait_check(
                admin_port,
                "maria",
                "down",
                r"mysql: ERR 1226: User 'lbproxy' has exceeded the 'max_user_connections'"
                r" resource \(current value: 1\)",
            )
        finally:
            db.end(session)
        _wait_check(admin_port, "maria", "up")

        busy = [db.client("busy") for _ in range(10)]  # the server is full
        _wait_check(admin_port, "maria", "down", "mysql: ERR 1040: Too many connections")
        for session in busy:
            db.end(session)
        _wait_check(admin_port, "maria", "up")

        address = Address("127.0.0.1", db.port)
        assert _probe(address, HealthCheckConfig(type="mysql")) == ("ok", "")  # handshake
        result, reason = _probe(address, HealthCheckConfig(type="mysql", user="stranger"))
        assert result == "fail", reason
        assert reason.startswith("mysql: ERR 1045: Access denied for user 'stranger'"), reason
    finally:
        for session in busy:
            db.end(session)
        db.stop()


# -- smtp ------------------------------------------------------------------------------


def test_smtp_check(lbproxy, tmp_path):
    pytest.importorskip("aiosmtpd")
    good, refusing = SmtpServer(), SmtpServer(refuse_ehlo=True)
    try:
        good.start()
        refusing.start()
        admin_port, port = free_port(), free_port()
        config = _config(
            admin_port,
            port,
            "type: smtp, helo: lb.example",
            [
                f"{{name: good, address: 127.0.0.1:{good.port}}}",
                f"{{name: busy, address: 127.0.0.1:{refusing.port}}}",
            ],
        )
        lbproxy(config, wait_ports=[port])
        _wait_check(admin_port, "good", "up")
        _wait_check(admin_port, "busy", "down", "smtp: EHLO answered 421 too busy, try later")
    finally:
        good.stop()
        refusing.stop()


# -- bounds ----------------------------------------------------------------------------


def _probe(address: Address, check: HealthCheckConfig) -> tuple[str, str]:
    async def main():
        with trio.fail_after(30):
            return await probe(address, check)

    return trio.run(main)


class _Talker:
    """A loopback server that answers every connection with `answer`, then either
    keeps sending `forever` or holds the connection open, until stopped."""

    def __init__(self, answer: bytes, forever: bytes = b"") -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.answer, self.forever = answer, forever
        self.stopping = threading.Event()
        self.sent = 0
        self.heard = b""  # what the checks sent
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    conn.sendall(self.answer)
                    self.sent += len(self.answer)
                    while self.forever and not self.stopping.is_set() and self.sent < 1 << 30:
                        conn.sendall(self.forever)
                        self.sent += len(self.forever)
                    while data := conn.recv(100):  # until the check closes
                        self.heard += data
                except OSError:
                    pass

    def stop(self) -> None:
        self.stopping.set()
        self.server.close()


@pytest.mark.parametrize("kind", ["pgsql", "redis", "mysql", "smtp"])
def test_an_endless_answer_fails_at_the_bound(kind):
    """A server that never stops sending is a failed check once 16 KiB have arrived,
    whatever protocol: a notice that never ends, a bulk string, a packet, a reply line."""
    starts = {
        "pgsql": b"N\x7f\xff\xff\xff",  # a NoticeResponse of 2 GiB
        "redis": b"$500000000\r\n",  # a 500 MB bulk string
        "mysql": b"\xff\xff\xff\x00\x0a",  # a 16 MiB packet
        "smtp": b"220-",
    }
    talker = _Talker(starts[kind], forever=b"x" * 4096)
    try:
        result, reason = _probe(
            Address("127.0.0.1", talker.port), HealthCheckConfig(type=kind, timeout=10)
        )
        assert (result, reason) == ("fail", f"{kind}: answer longer than {ANSWER_LIMIT} bytes")
    finally:
        talker.stop()


def test_an_answer_that_never_ends_fails_within_the_timeout():
    talker = _Talker(b"R\x00\x00\x00\x08\x00\x00")  # 7 of an AuthenticationRequest's 9 bytes
    try:
        address = Address("127.0.0.1", talker.port)
        result, reason = _probe(address, HealthCheckConfig(type="pgsql", timeout=0.5))
        assert (result, reason) == ("fail", "pgsql: answer incomplete after 7 bytes within 0.5s")
    finally:
        talker.stop()
    silent = _Talker(b"")
    try:
        address = Address("127.0.0.1", silent.port)
        result, reason = _probe(address, HealthCheckConfig(type="mysql", timeout=0.3))
        assert (result, reason) == ("timeout", "mysql: no answer within 0.3s")
    finally:
        silent.stop()


def test_send_expect_in_hex():
    talker = _Talker(b"\x00\x01\x02\xfe\xffOK")
    try:
        address = Address("127.0.0.1", talker.port)
        found = HealthCheckConfig(
            type="send_expect", send_hex=b"\x01\x02", expect_hex=b"\xfe\xff", timeout=1
        )
        assert _probe(address, found) == ("ok", "")
        missing = HealthCheckConfig(type="send_expect", expect_hex=b"\xab\xcd", timeout=0.3)
        result, reason = _probe(address, missing)
        assert result == "fail"
        assert reason.startswith("send_expect check: hex abcd not found in 7 bytes"), reason
    finally:
        talker.stop()


# -- configuration -----------------------------------------------------------------------


def test_invalid_check_keys_are_file_line_errors(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "virtual_servers:\n"
        "  - name: db\n"
        "    listen: 127.0.0.1:15432\n"
        "    health_check:\n"
        "      type: pgsql\n"
        "      role: master\n"
        "      port: 0\n"
        "    real_servers:\n"
        "      - {name: a, address: 127.0.0.1:5432, health_check: {address: 'not a host'}}\n"
        "  - name: cache\n"
        "    listen: 127.0.0.1:16379\n"
        "    health_check: {type: redis, user: x, role: primary}\n"
        "    real_servers: [{name: a, address: 127.0.0.1:6379}]\n"
        "  - name: bin\n"
        "    listen: 127.0.0.1:17000\n"
        "    health_check:\n"
        "      type: send_expect\n"
        "      send: PING\n"
        "      send_hex: '0d0a'\n"
        "      expect_hex: 'zz'\n"
        "    real_servers: [{name: a, address: 127.0.0.1:7000}]\n"
    )
    done = run_cli("check", str(config))
    assert done.returncode == 2, done.stdout + done.stderr
    problems = [line for line in done.stderr.splitlines() if line.startswith(str(config))]
    assert problems == [
        f"{config}:6: health_check.role is for redis checks, not pgsql",
        f"{config}:7: health_check.port must be an integer from 1 to 65535, got 0",
        f"{config}:9: health_check.address must be a host name or IP address, got 'not a host'"
        " ('not a host' is not an IP address or host name)",
        f"{config}:12: health_check.role must be one of master, replica, got 'primary'",
        f"{config}:12: health_check.user is for pgsql and mysql checks, not redis",
        f"{config}:19: health_check has both 'send' and 'send_hex': give one",
        f"{config}:20: health_check.expect_hex must be hex digits, two a byte (quoted, e.g."
        " \"0d0a\"), got 'zz'",
    ]


@requires_postgres
def test_pgsql_failover_to_a_promoted_standby(lbproxy, tmp_path):
    """A standby in recovery refuses sessions and is down; the primary goes, the standby
    is promoted (`pg_ctl promote`), and psql through lbproxy reaches the new primary."""
    primary, standby = Postgres(), Postgres(standby=True)
    try:
        primary.start()
        standby.start()
        admin_port, port = free_port(), free_port()
        config = _config(
            admin_port,
            port,
            "type: pgsql, user: postgres",
            [
                f"{{name: primary, address: 127.0.0.1:{primary.port}}}",
                f"{{name: standby, address: 127.0.0.1:{standby.port}}}",
            ],
        )
        lbproxy(config, wait_ports=[port])
        _wait_check(
            admin_port,
            "standby",
            "down",
            re.escape(
                "pgsql: FATAL: the database system is not accepting connections"
                " (Hot standby mode is disabled.)"
            ),
        )
        _wait_check(admin_port, "primary", "up")
        assert {_served_by(primary, port) for _ in range(3)} == {str(primary.port)}

        primary.stop()
        _wait_check(admin_port, "primary", "down", "pgsql: connection refused")
        standby.promote()
        _wait_check(admin_port, "standby", "up")
        assert _served_by(standby, port) == str(standby.port)
    finally:
        primary.remove()
        standby.remove()


def _served_by(pg: Postgres, port: int) -> str:
    """`SHOW port` through lbproxy's port: the port of the server that answered."""
    done = subprocess.run(
        [pg.psql_path, "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-d", "postgres",
         "-At", "-c", "SHOW port"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_pgsql_ends_the_session_it_opened():
    """With trust authentication the check reaches ReadyForQuery and then says
    Terminate, as a client that is done does, before it closes."""
    ready = b"R\x00\x00\x00\x08\x00\x00\x00\x00" + b"Z\x00\x00\x00\x05I"
    talker = _Talker(ready)
    try:
        address = Address("127.0.0.1", talker.port)
        assert _probe(address, HealthCheckConfig(type="pgsql", timeout=2)) == ("ok", "")
        wait_for(lambda: talker.heard.endswith(b"X\x00\x00\x00\x04"), 10, "a Terminate")
        assert b"user\x00lbproxy\x00database\x00lbproxy\x00" in talker.heard
    finally:
        talker.stop()
