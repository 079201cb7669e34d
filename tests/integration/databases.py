"""Real database servers on loopback ports, each in its own temporary folder, for the
protocol health checks (SPEC §22): Debian's PostgreSQL and MariaDB, and an SMTP server
(aiosmtpd). Redis is tests/integration/redis_server.py.

    pg = Postgres().start()               # initdb + postgres on 127.0.0.1:pg.port
    pg.psql("CREATE ROLE lbproxy LOGIN")  # psql as the superuser `postgres`, its output
    client = pg.hold_client()             # a psql session kept open (smart shutdown waits)
    standby = Postgres(standby=True).start()  # in recovery, refusing sessions
    standby.promote()                     # pg_ctl promote: accepting
    pg.stop_smart()                       # pg_ctl stop -m smart, without waiting
    pg.stop()                             # fast shutdown by PID, waited for
    pg.remove()                           # ... and its folder removed

    db = Mariadb().start()                # mariadb-install-db + mariadbd on db.port
    db.sql("CREATE USER lbproxy@'127.0.0.1'")
    db.stop()

    mail = SmtpServer().start()           # aiosmtpd in a child process, on mail.port
    smtps = SmtpServer(tls=(cert, key)).start()  # the same over implicit TLS (SMTPS)

As root the servers run as their Debian accounts (`postgres`, `mysql`), started as those
users directly (no wrapper process: the PID is the server's); as another user, as that
user. Their folders are made under /tmp, where those accounts can reach them (pytest's
own tmp_path is private to root). Every wait is bounded; every stop is by PID.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from tests import tools
from tests.integration.harness import free_port, wait_for, wait_port


def _pg_bin() -> Path | None:
    found = tools.find("pg_config")
    if found:
        bindir = subprocess.run([found, "--bindir"], capture_output=True, text=True).stdout
        if bindir.strip() and Path(bindir.strip(), "postgres").exists():
            return Path(bindir.strip())
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    return versions[-1].parent if versions else None


PG = _pg_bin()
# Debian keeps the server's programs in /usr/lib/postgresql/VERSION/bin (PG), off PATH;
# psql is on PATH through postgresql-client-common.
requires_postgres = tools.requires("psql", package="postgresql")
requires_mariadb = tools.requires(
    "mariadbd", "mariadb-install-db", "mariadb", package="mariadb-server"
)


def _account(name: str) -> tuple[int, int] | None:
    """(uid, gid) of a system account to run a server as when we are root; None: as we are."""
    if os.geteuid() != 0:
        return None
    entry = pwd.getpwnam(name)
    return entry.pw_uid, entry.pw_gid


def _as(account: tuple[int, int] | None) -> dict:
    """Popen's arguments to run a child as `account` (no supplementary groups)."""
    if account is None:
        return {}
    return {"user": account[0], "group": account[1], "extra_groups": []}


def _folder(prefix: str, account: tuple[int, int] | None) -> Path:
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(folder, 0o755)
    if account is not None:
        os.chown(folder, *account)
    return folder


def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _end_session(client: subprocess.Popen) -> None:
    """Close a client session's stdin (it quits), wait for it, close its pipes."""
    if client.stdin and not client.stdin.closed:
        client.stdin.close()
    try:
        client.wait(30)
    except subprocess.TimeoutExpired:
        client.kill()
        client.wait(10)
    if client.stdout:
        client.stdout.close()


class Postgres:
    """A PostgreSQL server of its own: `initdb` with trust authentication from loopback
    (method `trust`, or `scram-sha-256` with `auth=`), listening on 127.0.0.1 only."""

    def __init__(self, auth: str = "trust", standby: bool = False) -> None:
        if PG is None:
            tools.missing("postgres", "postgresql")
        self.account = _account("postgres")
        self.folder = _folder("lbproxy-pg-", self.account)
        self.data = self.folder / "data"
        self.port = free_port()
        self.auth = auth
        # A standby without a primary and with hot_standby off: in recovery for good,
        # refusing every session until `promote`.
        self.standby = standby
        self.proc: subprocess.Popen | None = None
        self.clients: list[subprocess.Popen] = []

    def _bin(self, name: str) -> str:
        assert PG is not None
        return str(PG / name)

    @property
    def psql_path(self) -> str:
        return self._bin("psql")

    def start(self, timeout: float = 60.0) -> Postgres:
        if not self.data.exists():
            subprocess.run(
                [self._bin("initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
                 "--no-sync", "--no-instructions"],
                check=True, capture_output=True, timeout=120, **_as(self.account),
            )  # fmt: skip
            # Sessions over the Unix socket (psql, pg_basebackup here) are trusted; over
            # TCP, `auth`.
            hba = (
                "local all all trust\nlocal replication all trust\n"
                f"host all all 127.0.0.1/32 {self.auth}\n"
            )
            (self.data / "pg_hba.conf").write_text(hba)
            if self.standby:
                with open(self.data / "postgresql.conf", "a") as conf:
                    conf.write("hot_standby = off\n")
                (self.data / "standby.signal").touch()
                if self.account:
                    os.chown(self.data / "standby.signal", *self.account)
        log = open(self.folder / "postgres.log", "ab")  # noqa: SIM115 - the child's stderr
        self.proc = subprocess.Popen(
            [self._bin("postgres"), "-D", str(self.data), "-p", str(self.port),
             "-k", str(self.folder), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
            stdout=log, stderr=log, **_as(self.account),
        )  # fmt: skip
        log.close()

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited: {self.log()}")
            done = subprocess.run(
                [self._bin("pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-q"],
                timeout=10,
            )
            # 0: accepting; 1: rejecting (a standby in recovery, as asked)
            return done.returncode == 0 or (self.standby and done.returncode == 1)

        wait_for(ready, timeout, "postgres to accept connections", details=self.log)
        return self

    def log(self) -> str:
        try:
            return (self.folder / "postgres.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def psql(self, sql: str, user: str = "postgres") -> str:
        done = subprocess.run(
            [self._bin("psql"), "-h", str(self.folder), "-p", str(self.port), "-U", user,
             "-d", "postgres", "-At", "-v", "ON_ERROR_STOP=1", "-c", sql],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"psql {sql!r}: {done.stderr}")
        return done.stdout

    def hold_client(self) -> subprocess.Popen:
        """A psql session that stays connected until `release` (its stdin stays open)."""
        client = subprocess.Popen(
            [self._bin("psql"), "-h", str(self.folder), "-p", str(self.port), "-U", "postgres",
             "-d", "postgres", "-At"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        assert client.stdin is not None and client.stdout is not None
        client.stdin.write(b"SELECT 'connected';\n")
        client.stdin.flush()
        line = client.stdout.readline()  # bounded: psql exits on a failed connect
        if line.strip() != b"connected":
            raise RuntimeError(f"psql session did not connect: {line!r}")
        self.clients.append(client)
        return client

    def release(self, client: subprocess.Popen) -> None:
        _end_session(client)

    def replica(self) -> Postgres:
        """A streaming replica of this (running) server, made with `pg_basebackup -R` and
        started: in recovery with hot_standby off, refusing sessions until `promote`,
        with this server's data (pg_hba included) as of now."""
        standby = Postgres(auth=self.auth, standby=True)
        try:
            # A fast checkpoint: the default (spread) one waits minutes after a bulk load.
            subprocess.run(
                [self._bin("pg_basebackup"), "-h", str(self.folder), "-p", str(self.port),
                 "-U", "postgres", "-D", str(standby.data), "-R", "-X", "stream",
                 "--checkpoint=fast", "--no-sync"],
                check=True, capture_output=True, timeout=120, **_as(self.account),
            )  # fmt: skip
            with open(standby.data / "postgresql.conf", "a") as conf:
                conf.write("hot_standby = off\n")
            return standby.start()
        except BaseException:
            standby.remove()
            raise

    def promote(self) -> None:
        """`pg_ctl promote`: a standby ends its recovery and accepts sessions."""
        subprocess.run(
            [self._bin("pg_ctl"), "promote", "-D", str(self.data), "-w", "-t", "60"],
            check=True, capture_output=True, timeout=90, **_as(self.account),
        )  # fmt: skip

    def stop_smart(self) -> None:
        """`pg_ctl stop -m smart` without waiting: new sessions are refused while the
        sessions already there go on."""
        subprocess.run(
            [self._bin("pg_ctl"), "stop", "-D", str(self.data), "-m", "smart", "-W"],
            check=True, capture_output=True, timeout=30, **_as(self.account),
        )  # fmt: skip

    def stop(self) -> None:
        """Fast shutdown, waited for; the folder stays until `remove` (or the end)."""
        for client in self.clients:
            _end_session(client)
        self.clients = []
        _stop(self.proc, signal.SIGINT)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


class Mariadb:
    """A MariaDB server of its own: `mariadb-install-db` on a temporary data folder,
    `mariadbd` on 127.0.0.1; `sql` runs statements as root over its Unix socket."""

    def __init__(self, max_connections: int | None = None) -> None:
        self.account = _account("mysql")
        self.folder = _folder("lbproxy-mariadb-", self.account)
        self.data = self.folder / "data"
        self.socket = self.folder / "mysqld.sock"
        self.port = free_port()
        self.max_connections = max_connections
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> Mariadb:
        user = ["--user=mysql"] if self.account else []
        if not self.data.exists():
            subprocess.run(
                [tools.need("mariadb-install-db", "mariadb-server"), "--no-defaults",
                 f"--datadir={self.data}", "--auth-root-authentication-method=normal",
                 "--skip-test-db", *user],
                check=True, capture_output=True, timeout=180,
            )  # fmt: skip
        options = [
            "--no-defaults", f"--datadir={self.data}", f"--socket={self.socket}",
            f"--port={self.port}", "--bind-address=127.0.0.1", "--skip-name-resolve",
            f"--pid-file={self.folder / 'mariadbd.pid'}",
            f"--log-error={self.folder / 'error.log'}",
            "--innodb-buffer-pool-size=16M", "--skip-log-bin", *user,
        ]  # fmt: skip
        if self.max_connections is not None:
            options.append(f"--max-connections={self.max_connections}")
        self.proc = subprocess.Popen(
            [tools.need("mariadbd", "mariadb-server"), *options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"mariadbd exited: {self.log()}")
            return self.socket.exists()

        wait_for(ready, timeout, "mariadbd to open its socket", details=self.log)
        wait_port(self.port, timeout)
        return self

    def log(self) -> str:
        try:
            return (self.folder / "error.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def sql(self, statements: str) -> str:
        done = subprocess.run(
            [tools.need("mariadb", "mariadb-client"), "--no-defaults", f"--socket={self.socket}",
             "-uroot", "-N", "-B", "-e", statements],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"mariadb {statements!r}: {done.stderr}")
        return done.stdout

    def client(self, user: str) -> subprocess.Popen:
        """A `mariadb` session as `user` over TCP, kept open until its stdin closes."""
        session = subprocess.Popen(
            [tools.need("mariadb", "mariadb-client"), "--no-defaults", "-h", "127.0.0.1",
             "-P", str(self.port), f"-u{user}", "-N", "-B", "--unbuffered"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        assert session.stdin is not None and session.stdout is not None
        session.stdin.write(b"SELECT 'connected';\n")
        session.stdin.flush()
        line = session.stdout.readline()
        if line.strip() != b"connected":
            _end_session(session)
            raise RuntimeError(f"mariadb session did not connect: {line!r}")
        return session

    def end(self, session: subprocess.Popen) -> None:
        _end_session(session)

    def stop(self) -> None:
        """Stop it by PID (waited for) and remove its folder."""
        _stop(self.proc, signal.SIGTERM, timeout=60)
        shutil.rmtree(self.folder, ignore_errors=True)


_SMTP_MAIN = textwrap.dedent(
    """
    import asyncio, signal, ssl, sys
    from aiosmtpd.controller import Controller
    from aiosmtpd.handlers import Sink
    port, greeting = int(sys.argv[1]), sys.argv[2]
    # implicit TLS (SMTPS): the handshake first, then the greeting inside it
    tls = None
    if len(sys.argv) > 3:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(sys.argv[3], sys.argv[4])

    class Refusing(Sink):
        async def handle_EHLO(self, server, session, envelope, hostname, responses):
            session.host_name = hostname
            if greeting == "refuse-ehlo":
                return ["421 too busy, try later"]
            return responses

    controller = Controller(Refusing(), hostname="127.0.0.1", port=port,
                            ident="lbproxy-test", ssl_context=tls)
    controller.start()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    controller.stop()
    """
)


class SmtpServer:
    """aiosmtpd (a real SMTP server from PyPI) in its own process on 127.0.0.1; with
    `refuse_ehlo` it answers EHLO with 421; with `tls` (certificate and key files) it
    speaks SMTPS, implicit TLS: the handshake before the greeting."""

    def __init__(self, refuse_ehlo: bool = False, tls: tuple[str, str] | None = None) -> None:
        self.port = free_port()
        self.mode = "refuse-ehlo" if refuse_ehlo else "serve"
        self.tls = tls
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> SmtpServer:
        tls = list(self.tls) if self.tls else []
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SMTP_MAIN, str(self.port), self.mode, *tls],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        wait_port(self.port, timeout)
        return self

    def stop(self) -> None:
        _stop(self.proc)
