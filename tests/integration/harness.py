"""Real things for the integration tests, in one place: free ports and bounded waits,
name-saying TCP servers and UDP echo servers, `lbproxy` processes (one, under a descriptor
limit, across upgrades), configurations, the admin endpoint over HTTP (the API's documents,
/metrics), a systemd notify socket, the UDP relay in process, and the CLI."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import pty
import random
import re
import resource
import select
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import termios
import textwrap
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from http.client import HTTPConnection
from pathlib import Path

import trio
import yaml
from prometheus_client.parser import text_string_to_metric_families

from lbproxy.config.model import (
    Address,
    HealthCheckConfig,
    RealServerConfig,
    UdpConfig,
    VirtualServerConfig,
)
from lbproxy.core.pool import Pool
from lbproxy.dataplane.udp import UdpRelay, udp_relay
from tests import tools

ROOT = Path(__file__).resolve().parents[2]

# lbproxy's admin socket (SPEC §21) goes to /run/lbproxy/ as root, else to
# $XDG_RUNTIME_DIR/lbproxy/: a run as another user without one gets a private folder,
# which the lbproxy processes and the CLI the tests start inherit.
if os.geteuid() != 0 and not os.environ.get("XDG_RUNTIME_DIR"):
    os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="lbproxy-tests-run-")


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


# Ports handed out come from below the kernel's ephemeral range: a port from inside it
# (what a bind to port 0 gives) can be taken, between this call and the test's own bind,
# by any outgoing connection on the machine — a client, a health check, a proxied
# connect — and the test then fails with "Address already in use".
_EPHEMERAL_LOW = _ephemeral_range()[0]


def _worker_slice() -> tuple[int, int]:
    """(index, count) of this pytest-xdist worker, (0, 1) outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    return (index, count) if 0 <= index < count else (0, 1)


# Under pytest-xdist each worker hands out only every count-th port, from its own index
# on: two workers of one run never hand out the same port, even when both ask in the
# same instant, before either has bound it.
_INDEX, _COUNT = _worker_slice()
_OURS = range(10000 + _INDEX, _EPHEMERAL_LOW, _COUNT)
_PORTS = random.Random(os.getpid()).sample(_OURS, len(_OURS)) if _EPHEMERAL_LOW > 12000 else []


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and not one this process handed out before: a test
    asking for two ports needs two different ones. Taken below the ephemeral range (see
    above) in an order of its own per process, so parallel test runs rarely meet."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    while _PORTS:
        port = _PORTS.pop()
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    while True:  # no room below the ephemeral range: let the kernel choose
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: NameServer = self.server  # type: ignore[assignment]
        sock: socket.socket = self.request
        server.accepted += 1
        started, end = time.monotonic(), ""
        try:
            if server.greeting:
                sock.sendall(f"{server.name}\n".encode())
            while True:
                data = sock.recv(65536)
                if not data:
                    end = "eof"
                    break
                server.received.append(data)
                sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError as error:
            end = end or type(error).__name__
        server.ends.append((end, time.monotonic() - started))


class NameServer(socketserver.ThreadingTCPServer):
    """A real server on loopback: says its name and a newline, then echoes."""

    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog is 5: a burst of proxied connects (a drained
    # backlog, say) would overflow it and stall connects for a SYN retry. Real servers
    # listen with more (nginx 511, the kernel's default somaxconn 4096).
    request_queue_size = 511

    def __init__(self, name: str, port: int = 0, host: str = "127.0.0.1", greeting=True):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.name = name
        self.greeting = greeting
        self.accepted = 0
        self.received: list[bytes] = []
        # how each connection ended, as this server saw it: ("eof" (the peer's FIN) or
        # the error's name ("ConnectionResetError": an RST), seconds it was open)
        self.ends: list[tuple[str, float]] = []
        super().__init__((host, port), _Handler)
        self.port = self.server_address[1]
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def __enter__(self) -> NameServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def open_and_read_name(
    port: int, host: str = "127.0.0.1", timeout: float = 5.0
) -> tuple[socket.socket, str]:
    """A held connection: returns the open socket and the name it was served by."""
    s = socket.create_connection((host, port), timeout=timeout)
    try:
        name = read_name(s)
    except BaseException:
        s.close()
        raise
    return s, name


def read_name(s) -> str:
    """The line a real server says first (its name), read from a connected socket (plain
    or TLS); "" when the connection closes before a whole line."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(100)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


def ask_name(port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> str:
    """Connect through the proxy and read the real server's name line."""
    sock, name = open_and_read_name(port, host, timeout)
    sock.close()
    return name


def closed_without_a_byte(port: int, timeout: float = 5.0, host: str = "127.0.0.1") -> bool:
    """True when the proxy accepts the connection and closes it (FIN or RST) without
    sending a byte: how lbproxy turns a client away. A refused connect is False — nothing
    listens, so the process is gone; a rejection test also shows the process alive and
    the rejection counted (see `assert_rejected`)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            return s.recv(100) == b""
    except ConnectionResetError:
        return True
    except ConnectionRefusedError:
        return False


def assert_rejected(port: int, counted, expected: float, what: str = "rejection") -> None:
    """One client turned away on `port` by a live process, and counted: the connection is
    accepted and closed without a byte, then `counted()` (a metric or JSON counter read
    from the admin endpoint) reaches `expected`."""
    assert closed_without_a_byte(port), f"the {what} was not a close without a byte"
    wait_for(lambda: counted() == expected, timeout=5, what=f"the {what} counted {expected:g}")


TRACEBACK = "Traceback (most recent call last):"


class Process(subprocess.Popen):
    """A Popen that remembers whether the test signalled it: a process that ends after
    the test sent it SIGTERM, SIGINT, SIGKILL, ... ended on purpose; one that ends on its
    own ended unexpectedly. SIGHUP (reload) is not a stop."""

    signalled = False

    def send_signal(self, sig: int) -> None:
        if sig != signal.SIGHUP:
            self.signalled = True
        super().send_signal(sig)


class Lbproxy:
    """A real `lbproxy run` process on a configuration written to a temporary folder.

    `stop()` (and so every fixture's teardown) fails the test when the process exited
    before the test stopped it, when its exit status is not `expected_exit` (0: SIGTERM
    is a clean stop), or when its log holds a traceback. A test that means one of these
    says so on the object:

        proxy.expected_exit = None            # any status (the test checks it itself)
        proxy.expected_tracebacks = ("RuntimeError: injected",)  # a traceback is fine
                                              # when it contains one of these texts
        proxy.may_exit = True                 # it may end before stop() (e.g. handed over)

    `nofile_limit` runs it under `ulimit -n` that many descriptors.

    `start()` returns once the process says it is ready, as a user's tooling would learn
    it: `GET /readyz` answers 200 when the configuration has an admin endpoint (in
    every worker, with `workers: N`); without one, lbproxy's `READY=1` on a NOTIFY_SOCKET
    the harness listens on. `reload()` waits the same way: the reload counter
    (`lbproxy_config_reloads_total`, applied or refused) moves on, or RELOADING=1 is
    followed by READY=1. Where the harness cannot listen on NOTIFY_SOCKET (the test sets
    its own, or `nofile_limit` counts the process's descriptors to the one, and lbproxy's
    notify socket would take one), it waits until the process catches SIGHUP and SIGTERM,
    which lbproxy sets up last before it is ready (one process; not for `workers: N`).
    """

    def __init__(
        self,
        tmp_path: Path,
        config: str,
        *args: str,
        name: str = "lbproxy.yaml",
        expected_exit: int | None = 0,
        expected_tracebacks: tuple[str, ...] = (),
        may_exit: bool = False,
        nofile_limit: int | None = None,
    ):
        self.config_path = tmp_path / name
        self.config_path.write_text(textwrap.dedent(config))
        self.log_path = tmp_path / "lbproxy.log"
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.expected_exit = expected_exit
        self.expected_tracebacks = expected_tracebacks
        self.may_exit = may_exit
        self.nofile_limit = nofile_limit
        self._start_failed = False
        self._checked = False
        self.admin: tuple[str, int] | None = None  # the admin endpoint it was started with
        self.notifications: Notifications | None = None  # the harness's NOTIFY_SOCKET

    def start(self, wait_ports: list[int] = (), timeout: float = 30.0) -> Lbproxy:
        """Start the process and return once it is ready (see the class docstring) and
        each of `wait_ports` accepts a connection; RuntimeError when it exits first."""
        self.admin = admin_address(self.config_path)
        env = None
        if self.admin is None and "NOTIFY_SOCKET" not in os.environ and not self.nofile_limit:
            self.notifications = Notifications()
            env = {**os.environ, "NOTIFY_SOCKET": self.notifications.address}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = Process(
            [sys.executable, "-m", "lbproxy", "run", str(self.config_path), *self.args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            preexec_fn=self._lower_nofile if self.nofile_limit is not None else None,
        )
        deadline = time.monotonic() + timeout

        def ready_or_exited() -> bool:
            assert self.proc is not None
            if self._ready():
                return True
            if self.proc.poll() is not None:
                self._start_failed = True  # reported here: stop() checks only the log
                raise RuntimeError(f"lbproxy exited {self.proc.returncode}:\n{self.log()}")
            return False

        wait_for(ready_or_exited, timeout, "lbproxy to be ready", details=self.log)
        for port in wait_ports:
            wait_port(port, deadline - time.monotonic())
        return self

    def _ready(self) -> bool:
        if self.admin is not None:
            host, port = self.admin
            return ready(port, host)
        if self.notifications is not None:
            return self.notifications.count("READY") > 0
        assert self.proc is not None
        return catches_reload_and_stop(self.proc.pid)

    def reloads(self) -> int:
        """Reloads done, applied or refused: the reload counter, or the READY=1 that
        ended each RELOADING=1 on the harness's NOTIFY_SOCKET."""
        if self.admin is not None:
            host, port = self.admin
            return reloads_done(port, host)
        if self.notifications is not None:
            return self.notifications.reloads()
        raise RuntimeError("no admin endpoint and no NOTIFY_SOCKET of the harness's")

    def _lower_nofile(self) -> None:
        """In the child, before exec."""
        assert self.nofile_limit is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile_limit, self.nofile_limit))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def reload(self, config: str | None = None, timeout: float = 10.0) -> None:
        """Rewrite the configuration (if given), send SIGHUP, and wait until the process
        has applied or refused it (see the class docstring)."""
        before = self.reloads()
        if config is not None:
            self.config_path.write_text(textwrap.dedent(config))
        self.signal(signal.SIGHUP)
        wait_for(lambda: self.reloads() != before, timeout, "the reload", details=self.log)

    def stop(self, timeout: float = 15.0, check: bool = True) -> int:
        """SIGTERM, wait, and (with `check`) fail on what the class docstring lists. Once
        checked, a second stop() (a fixture's teardown after the test's own) does nothing."""
        if self.proc is None:
            return 0
        if self._checked:
            return self.proc.returncode
        ended_alone = self.proc.poll() is not None and not getattr(self.proc, "signalled", True)
        killed = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                killed = True
        self._log.close()
        if self.notifications is not None:
            self.notifications.close()
        if check:
            self._checked = True
            self.check(ended_alone, killed, timeout)
        return self.proc.returncode

    def check(self, ended_alone: bool = False, killed: bool = False, timeout: float = 0) -> None:
        assert self.proc is not None
        code = self.proc.returncode
        problems = []
        if self._start_failed:  # start() raised with the status; the test expected it
            ended_alone, killed = False, False
        if ended_alone and not self.may_exit:
            problems.append(f"lbproxy exited by itself (status {code}) before the test stopped it")
        if killed:
            problems.append(f"lbproxy did not stop within {timeout:g}s of SIGTERM (killed)")
        elif (
            self.expected_exit is not None and code != self.expected_exit and not self._start_failed
        ):
            problems.append(f"lbproxy exited {code}, expected {self.expected_exit}")
        unexpected = [
            block
            for block in tracebacks(self.log())
            if not any(text in block for text in self.expected_tracebacks)
        ]
        if unexpected:
            problems.append(f"lbproxy logged {len(unexpected)} unexpected traceback(s)")
        if problems:
            tail = "\n".join(self.log().splitlines()[-80:])
            raise AssertionError("; ".join(problems) + f"\n--- {self.log_path} (tail) ---\n{tail}")

    def __enter__(self) -> Lbproxy:
        return self.start() if self.proc is None else self

    def __exit__(self, exc_type, *exc) -> None:
        # After a failure inside the block, stop without checking: the test's own
        # error is the one to report.
        self.stop(check=exc_type is None)


class Lbproxies:
    """Starts `lbproxy run` processes, each on its configuration in `folder` (or in a folder
    of its own), and stops them all at the end: the `lbproxy` fixture, and a module's
    fixture that shares one process among its tests.

        proxy = lbproxy(config)                    # started: every listener bound
        proxy = lbproxy(config, [port])            # ... and `port` accepts a connection
        proxy = lbproxy(config, start=False)       # to start (or see fail) in the test
        proxy = lbproxy(config, folder=tmp_path / "two", args=("--log-level", "debug"),
                        expected_exit=None, nofile_limit=64)   # any Lbproxy option
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.started: list[Lbproxy] = []

    def __call__(
        self,
        config: str,
        wait_ports=(),
        start: bool = True,
        *,
        folder: Path | None = None,
        args: tuple[str, ...] = (),
        **options,
    ) -> Lbproxy:
        folder = self.folder if folder is None else folder
        folder.mkdir(parents=True, exist_ok=True)
        proxy = Lbproxy(folder, config, *args, **options)
        self.started.append(proxy)
        return proxy.start(list(wait_ports)) if start else proxy

    def stop_all(self) -> None:
        stop_all(self.started)


def stop_all(proxies) -> None:
    """Stop every process (a fixture's teardown), then fail with the first one's problem:
    one failing check must not leave the others running."""
    errors = []
    for proxy in proxies:
        try:
            proxy.stop()
        except AssertionError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def tracebacks(log: str) -> list[str]:
    """Each traceback in a log: from its first line through the first line after it that
    is not indented (the exception's own line, for a plain traceback)."""
    lines = log.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if TRACEBACK not in line:
            continue
        end = i + 1
        while end < len(lines) and (lines[end][:1].isspace() or TRACEBACK in lines[end]):
            end += 1
        blocks.append("\n".join(lines[i : end + 1]))
    return blocks


def wait_port(port: int, timeout: float = 10.0, host: str = "127.0.0.1") -> None:
    """Until `port` accepts a connection (closed at once: through a proxy, one client)."""

    def accepts() -> bool:
        try:
            with socket.create_connection((host, port), timeout=1):
                return True
        except OSError:
            return False

    wait_for(accepts, timeout, f"{host}:{port} to accept a connection")


def stop_traced(tracer: subprocess.Popen, timeout: float = 30.0) -> int | None:
    """Stop a command run under `strace -f`, and strace with it; strace's exit status,
    or None when they had to be killed. Stopping strace alone would detach it and leave
    its tracee running: the traced command gets SIGTERM (lbproxy drains and exits), and
    strace ends with it; after `timeout` both are killed."""
    try:
        children = [
            int(pid)
            for pid in Path(f"/proc/{tracer.pid}/task/{tracer.pid}/children").read_text().split()
        ]
    except OSError:  # strace has ended already
        children = []
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    try:
        return tracer.wait(timeout)
    except subprocess.TimeoutExpired:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        tracer.kill()
        tracer.wait()
        return None


def wait_for(
    condition,
    timeout: float = 10.0,
    what: str = "condition",
    interval: float = 0.02,
    details: Callable[[], str] | None = None,
):
    """Poll `condition` every `interval` seconds until it returns something true (which
    is returned), or fail after `timeout` seconds naming `what`, and adding `details()`
    (a log, say) when given. Bounded in time."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            more = f"\n{details()}" if details is not None else ""
            raise AssertionError(f"timed out waiting for {what} ({timeout:g}s){more}")
        time.sleep(interval)


def listening(port: int) -> bool:
    """A TCP socket listens on `port` (any address): the kernel's table, no connection."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            for line in list(lines)[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


def accept_queue(port: int) -> int:
    """Connections the kernel has made on listening `port` that no accept() took yet."""
    waiting = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    waiting += int(fields[4].split(":")[1], 16)  # rx_queue: the accept queue
    return waiting


def admin_address(config_path: Path) -> tuple[str, int] | None:
    """(host, port) a client reaches the admin endpoint at, as `global.admin.listen` in
    the configuration file names it; None for `listen: none`, for a file that names none
    (lbproxy's default, 127.0.0.1:9100, is no test's own port), or for a folder."""
    if not config_path.is_file():
        return None
    try:
        document = yaml.safe_load(config_path.read_text())
    except yaml.YAMLError:
        return None
    section = document.get("global") if isinstance(document, dict) else None
    admin = section.get("admin") if isinstance(section, dict) else None
    listen = admin.get("listen") if isinstance(admin, dict) else None
    if not isinstance(listen, str) or ":" not in listen:
        return None
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host), int(port)


def catches_reload_and_stop(pid: int) -> bool:
    """Process `pid` has handlers for SIGHUP and SIGTERM (SigCgt in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line.split()[1] for line in status.splitlines() if line[:7] == "SigCgt:")
    wanted = (1 << (signal.SIGHUP - 1)) | (1 << (signal.SIGTERM - 1))
    return int(caught, 16) & wanted == wanted


class Notifications:
    """What systemd would bind for lbproxy's NOTIFY_SOCKET (sd_notify(3)): an abstract
    AF_UNIX datagram socket (no file, so a process that dropped its privileges can send
    too), read by a thread of its own so that its small queue never fills."""

    def __init__(self) -> None:
        self.address = f"@lbproxy-harness/{os.getpid()}/{random.getrandbits(64):016x}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(b"\0" + self.address[1:].encode())
        self.messages: list[dict[str, str]] = []
        self._open = True
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096)
            except OSError:
                return
            if not self._open:  # close()'s wake-up datagram
                return
            lines = data.decode(errors="replace").splitlines()
            self.messages.append(dict(line.split("=", 1) for line in lines if "=" in line))

    def count(self, key: str) -> int:
        return sum(key in fields for fields in list(self.messages))

    def starts(self) -> int:
        """READY=1 messages that were no reload's end: one per process that started."""
        return self.count("READY") - self.reloads()

    def reloads(self) -> int:
        """RELOADING=1 messages a READY=1 has followed."""
        done, reloading = 0, False
        for fields in list(self.messages):
            if "RELOADING" in fields:
                reloading = True
            elif "READY" in fields and reloading:
                done, reloading = done + 1, False
        return done

    def close(self) -> None:
        self._open = False
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as waker:
            waker.sendto(b"", b"\0" + self.address[1:].encode())
        self._reader.join(5)
        self.sock.close()


def admin_socket_path(admin_port: int) -> str:
    """The default admin socket of the lbproxy whose TCP admin port is `admin_port`, as
    the tests run it (root: /run/lbproxy/admin-PORT.sock; SPEC §21)."""
    folder = (
        "/run/lbproxy"
        if os.geteuid() == 0
        else os.path.join(os.environ["XDG_RUNTIME_DIR"], "lbproxy")
    )
    return os.path.join(folder, f"admin-{admin_port}.sock")


class _UnixConnection(HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def unix_http(
    path: str, method: str, target: str, body=None, headers=None, timeout: float = 10.0
) -> tuple[int, bytes]:
    """One HTTP request over the Unix socket `path` (a dict/list body is sent as JSON)."""
    data = json.dumps(body).encode() if isinstance(body, dict | list) else body
    connection = _UnixConnection(path, timeout)
    try:
        connection.request(method, target, body=data, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def wall_time(stamp: str) -> float:
    """An ISO 8601 UTC time as the API and the access log write it (e.g.
    2026-12-05T15:04:23.120Z) in seconds since 1970."""
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def local_http(method: str, url: str, body=None, headers=None, timeout: float = 10.0):
    """`method url` sent through the admin socket of the lbproxy whose TCP admin
    endpoint `url` names, as `lbproxy drain` sends it on the proxy's host: a change
    there needs no token (over TCP it does, SPEC §21). (status, body)."""
    parts = urllib.parse.urlsplit(url)
    assert parts.port is not None, url
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    return unix_http(admin_socket_path(parts.port), method, target, body, headers, timeout)


def run_cli(*args: str, timeout: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="120")
    return subprocess.run(
        [sys.executable, "-m", "lbproxy", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
        **kwargs,
    )


def compiled_path_expected() -> bool:
    """Whether this checkout's lbproxy should run the compiled connection path: its C
    extension is built here (`pip install -e .` builds it in place; an install that did
    not build it has none) and LBPROXY_PURE does not force the pure one. CI
    (CI=true) always builds it: there, a missing extension is a failure."""
    built = any((ROOT / "lbproxy" / "net").glob("_cpump*.so"))
    if not built and os.environ.get("CI") == "true":
        raise AssertionError("CI=true but lbproxy/net/_cpump*.so was not built")
    return built and os.environ.get("LBPROXY_PURE", "") in ("", "0")


def alive(pid: int) -> bool:
    """Running: not gone, and not a zombie waiting for a reaper that may never come."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def stop_pids(pids: list[int], timeout: float = 15.0) -> None:
    """SIGTERM to each process still running, then SIGKILL to any that outlives
    `timeout` (a test's own processes, by PID)."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGTERM)
    for pid in pids:
        try:
            wait_for(lambda pid=pid: not alive(pid), timeout, f"pid {pid} to exit")
        except AssertionError:
            os.kill(pid, signal.SIGKILL)


# -- configurations ---------------------------------------------------------------------


def vs_config(port: int, servers, scheduler: str = "rr", extra: str = "", rs_extra=None) -> str:
    """YAML for one virtual server in front of NameServers (admin endpoint off)."""
    rs_extra = rs_extra or {}
    lines = [
        "global:",
        "  admin: {listen: none}",
        "  drain_timeout: 5s",
        "virtual_servers:",
        "  - name: web",
        f"    listen: 127.0.0.1:{port}",
        f"    scheduler: {scheduler}",
    ]
    lines += [f"    {line}" for line in extra.strip().splitlines() if line.strip()]
    lines.append("    real_servers:")
    for server in servers:
        more = rs_extra.get(server.name, "")
        lines.append(
            f"      - {{name: {server.name}, address: 127.0.0.1:{server.port}"
            f"{', ' + more if more else ''}}}"
        )
    return "\n".join(lines) + "\n"


def with_admin(config: str, admin_port: int, token_file=None, socket=None) -> str:
    admin = f"{{listen: 127.0.0.1:{admin_port}"
    admin += f", token_file: {token_file}" if token_file else ""
    admin += f", socket: {socket}}}" if socket else "}"
    return config.replace("admin: {listen: none}", f"admin: {admin}")


def workers_config(port: int, servers, admin_port: int, workers: int = 2, rs_extra=None) -> str:
    config = with_admin(
        vs_config(port, servers, "rr", "health_check: {type: none}", rs_extra), admin_port
    )
    return config.replace("global:\n", f"global:\n  workers: {workers}\n", 1)


def sni_config(port: int, groups, admin_port: int | None = None, extra: str = "") -> str:
    """Virtual servers sharing 127.0.0.1:`port`; groups: (name, sni list or None, servers),
    or (name, sni list or None, servers, alpn list)."""
    lines = [
        "global:",
        f"  admin: {{listen: {'127.0.0.1:' + str(admin_port) if admin_port else 'none'}}}",
        "  drain_timeout: 2s",
        "virtual_servers:",
    ]
    for name, sni, servers, *alpn in groups:
        lines += [f"  - name: {name}", f"    listen: 127.0.0.1:{port}"]
        if sni:
            lines.append(f"    sni: [{', '.join(repr(n) for n in sni)}]")
        if alpn:
            lines.append(f"    alpn: [{', '.join(repr(p) for p in alpn[0])}]")
        lines += [f"    {line}" for line in extra.strip().splitlines() if line.strip()]
        lines.append("    health_check: {type: none}")
        lines.append("    real_servers:")
        lines += [f"      - {{name: {s.name}, address: 127.0.0.1:{s.port}}}" for s in servers]
    return "\n".join(lines) + "\n"


# -- the admin endpoint: HTTP, /metrics, the API's documents ----------------------------


def http(method: str, url: str, body=None, token=None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def metrics(admin_port: int) -> dict[tuple, float]:
    status, body = http("GET", f"http://127.0.0.1:{admin_port}/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def sample(samples, name, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def get_json(admin_port: int, path: str):
    status, body = http("GET", f"http://127.0.0.1:{admin_port}{path}")
    assert status == 200, body
    return json.loads(body)


def ready(admin_port: int, host: str = "127.0.0.1") -> bool:
    """`GET /readyz` answers 200: every listener is bound (every worker ready)."""
    try:
        return http("GET", f"http://{url_host(host)}:{admin_port}/readyz")[0] == 200
    except OSError:
        return False


def counted(admin_port: int, name: str, host: str = "127.0.0.1", **labels) -> float:
    """The sum of metric `name` over its samples that have `labels` (every `result` of a
    counter, say): how many health checks, discovery rounds, polls, reloads there were.
    Read from /metrics line by line: cheap enough to poll a large page."""
    status, body = http("GET", f"http://{url_host(host)}:{admin_port}/metrics")
    assert status == 200, body
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith((name + "{", name + " ")):
            head, _, value = line.rpartition(" ")
            if all(label in head for label in wanted):
                total += float(value)
    return total


def reloads_done(admin_port: int, host: str = "127.0.0.1") -> int:
    """lbproxy_config_reloads_total, applied and refused, from /metrics."""
    return int(counted(admin_port, "lbproxy_config_reloads_total", host))


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def workers(admin_port: int) -> list[dict]:
    return get_json(admin_port, "/api/v1/workers")["workers"]


def worker_servers(admin_port: int, index: int) -> dict[str, dict]:
    document = get_json(admin_port, f"/api/v1/workers/{index}/virtual-servers")
    (vs,) = document["virtual_servers"]
    return {rs["name"]: rs for rs in vs["real_servers"]}


def virtual_server_document(admin_port: int) -> dict:
    status, body = http("GET", f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers")
    assert status == 200
    return json.loads(body)["virtual_servers"][0]


def servers_of(admin_port: int) -> dict[str, dict]:
    return {rs["name"]: rs for rs in virtual_server_document(admin_port)["real_servers"]}


# -- the admin endpoint's HTTP server, byte by byte -------------------------------------


# Over TCP every change needs the bearer token (SPEC §21): the changes below carry it.
HTTP_SERVER_TOKEN = "http-server-token"


def http_server_config(admin: str, folder) -> str:
    token_file = folder / "admin.token"
    token_file.write_text(HTTP_SERVER_TOKEN)
    token_file.chmod(0o600)
    return f"""
global:
  admin: {{listen: "{admin}", token_file: {token_file}}}
virtual_servers:
  - name: db
    listen: none
    scheduler: least-load
    load_source: report
    health_check: {{type: none}}
    real_servers:
      - {{name: a, address: 127.0.0.1:1}}
      - {{name: b, address: 127.0.0.1:2}}
"""


def read_answer(sock: socket.socket, buffer: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One answer (status, headers, body) framed by Content-Length, from `buffer` and
    the socket; what follows it stays in `buffer`."""
    while b"\r\n\r\n" not in buffer:
        data = sock.recv(65536)
        assert data, f"closed before an answer; got {bytes(buffer)!r}"
        buffer += data
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(rest) < length:
        data = sock.recv(65536)
        assert data, "closed in the middle of a body"
        rest += data
    buffer[:] = rest[length:]
    return status, headers, rest[:length]


def http_server_healthy(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        return read_answer(s, bytearray())[:1] == (200,)


# -- lbproxy processes beyond Lbproxy ---------------------------------------------------


def wait_for_log(proxy: Lbproxy, pattern: str, timeout: float = 10.0, after: int = 0) -> float:
    """Poll the log until `pattern` (a regular expression) appears past offset `after`;
    returns the monotonic time it was seen."""
    regex = re.compile(pattern)

    def seen() -> float | None:
        return time.monotonic() if regex.search(proxy.log()[after:]) else None

    return wait_for(seen, timeout, f"{pattern!r} in the log", interval=0.005, details=proxy.log)


class LimitedLbproxy(Lbproxy):
    """`lbproxy run` under `ulimit -n LIMIT` (the `lbproxy` fixture's `nofile_limit=`)."""

    def __init__(self, *args, limit: int, **kwargs) -> None:
        super().__init__(*args, nofile_limit=limit, **kwargs)


class UpgradableLbproxy:
    """The first `lbproxy run` and whichever process serves after each upgrade."""

    def __init__(self, tmp_path: Path, yaml: str, admin: int, env=None, cwd=ROOT) -> None:
        self.path = tmp_path / "lbproxy.yaml"
        self.path.write_text(yaml)
        self.admin = admin
        self.log_path = tmp_path / "lbproxy.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.first = subprocess.Popen(
            [sys.executable, "-m", "lbproxy", "run", str(self.path)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        )
        self.pids = [self.first.pid]
        try:  # a start that fails stops what it started: no test leaves a process behind
            wait_for(lambda: ready(admin) or self.first.poll() is not None, 30, "/readyz")
            assert self.first.poll() is None, self.log()
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.pids[-1]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def upgrade(self) -> dict:
        """POST /api/v1/upgrade (what `lbproxy upgrade` sends: through the admin socket,
        as over TCP a change needs the token), the answer."""
        url = f"http://127.0.0.1:{self.admin}/api/v1/upgrade"
        status, body = local_http("POST", url, b"{}", timeout=90)
        assert status == 200, body
        answer = json.loads(body)
        assert answer["old_pid"] == self.pid
        self.pids.append(answer["pid"])
        return answer

    def stop(self) -> None:
        stop_pids(self.pids)
        self.first.wait(5)
        self._log.close()


def front_door_proxy(name_servers, lbproxy, queued: int = 2):
    """A real proxy whose virtual server `web` has a primary and a backup server with
    one slot each and a queue: one connection holds the primary's slot, the next the
    backup's (every primary full: the backup serves), and `queued` clients wait.
    Returns (port, admin_port, the open sockets); the caller closes them."""
    primary, backup = name_servers("primary", "standby")
    port, admin_port = free_port(), free_port()
    config = with_admin(
        "global:\n"
        "  admin: {listen: none}\n"
        "virtual_servers:\n"
        "  - name: web\n"
        f"    listen: 127.0.0.1:{port}\n"
        "    scheduler: rr\n"
        "    health_check: {type: none}\n"
        "    queue: {max: 10, timeout: 30s}\n"
        "    real_servers:\n"
        f"      - {{name: primary, address: 127.0.0.1:{primary.port}, max_connections: 1}}\n"
        f"      - {{name: standby, address: 127.0.0.1:{backup.port}, backup: true,"
        " max_connections: 1}\n",
        admin_port,
    )
    lbproxy(config, [port])
    admin = f"http://127.0.0.1:{admin_port}"

    def web() -> dict:
        out = run_cli("status", "--json", "--admin", admin)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["virtual_servers"][0]

    # the start-up probe of the listen port took the one slot for a moment
    wait_for(lambda: web()["real_servers"][0]["active_connections"] == 0, what="the probe to end")
    holder, name = open_and_read_name(port)
    opened = [holder]
    assert name == "primary"
    holder, name = open_and_read_name(port)
    opened.append(holder)
    assert name == "standby"  # the primary is full: the backup serves (SPEC §3, §13)
    for n in range(1, queued + 1):
        opened.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        wait_for(lambda n=n: web()["queued"] == n, what=f"{n} queued")
    return port, admin_port, opened


# -- UDP: echo real servers, clients, dig, the relay in process -------------------------


class Echo:
    """A UDP real server in a thread: answers each datagram with `reply` + the payload."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                data, peer = self.sock.recvfrom(70000)
                self.sock.sendto(self.reply + data, peer)

    def close(self) -> None:
        """Nothing listens on the port any more: the kernel answers ICMP port unreachable."""
        self.sock.close()

    def restart(self) -> None:
        """Listen on the same port again (after `close`), as a restarted server does."""
        self.thread.join(timeout=5)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", self.port))
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()


def udp_client(source: str = "127.0.0.1", timeout: float = 2.0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((source, 0))
    sock.settimeout(timeout)
    return sock


def udp_ask(sock: socket.socket, port: int, payload: bytes) -> bytes | None:
    sock.sendto(payload, ("127.0.0.1", port))
    try:
        return sock.recvfrom(70000)[0]
    except TimeoutError:
        return None


requires_dig = tools.requires("dig", package="bind9-dnsutils")


def dig(port: int, name: str) -> str:
    out = subprocess.run(
        ["dig", "@127.0.0.1", "-p", str(port), "+short", "+notcp", "+tries=1", "+time=3", name],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return out.stdout.strip()


OPEN_UDP_SOCKETS: list[socket.socket] = []


def udp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    OPEN_UDP_SOCKETS.append(sock)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


def relay_for(servers: dict[str, socket.socket], **udp) -> UdpRelay:
    config = VirtualServerConfig(
        name="dns",
        listen=(Address("127.0.0.1", 0),),
        real_servers=tuple(
            RealServerConfig(name, Address("127.0.0.1", sock.getsockname()[1]))
            for name, sock in servers.items()
        ),
        scheduler="rr",
        protocol="udp",
        udp=UdpConfig(**udp),
        health_check=HealthCheckConfig(type="none"),
    )
    return udp_relay(Pool(config, trio.current_time()), udp_socket())


# -- systemd's notify socket ------------------------------------------------------------


class NotifySocket:
    """What systemd binds: an AF_UNIX datagram socket that records every message."""

    def __init__(self, address: str) -> None:
        self.address = address
        target = b"\0" + address[1:].encode() if address.startswith("@") else address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(target)
        self.messages: list[tuple[int, dict[str, str]]] = []  # (sender pid, fields)

    def _receive(self, timeout: float) -> bool:
        self.sock.settimeout(timeout)
        try:
            data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
        except TimeoutError:
            return False
        pid = -1
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid, _, _ = struct.unpack("3i", payload[:12])
        fields = dict(line.split("=", 1) for line in data.decode().splitlines())
        self.messages.append((pid, fields))
        return True

    def wait_for(self, key: str, timeout: float = 10.0) -> dict[str, str]:
        """The next message (after those seen) that has `key`."""
        seen = len(self.messages)
        deadline = time.monotonic() + timeout
        while True:
            for _, fields in self.messages[seen:]:
                if key in fields:
                    return fields
            seen = len(self.messages)
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {key} message; got {self.messages}")
            self._receive(left)

    def drain(self, quiet: float = 0.3) -> None:
        while self._receive(quiet):
            pass

    def events(self) -> list[str]:
        """The state changes in order (STATUS-only updates left out)."""
        names = ("READY", "RELOADING", "STOPPING")
        return [key for _, fields in self.messages for key in names if key in fields]

    def close(self) -> None:
        self.sock.close()


TERMINAL_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_in_terminal(columns: int, *args: str, timeout: float = 30.0) -> str:
    """A real `lbproxy` process on a pseudo-terminal `columns` wide; its screen text."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env = {k: v for k, v in env.items() if not k.startswith(("TTY_", "FORCE_COLOR"))}
    env["TERM"] = "xterm-256color"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lbproxy", *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=ROOT,
        env=env,
    )
    os.close(slave)
    output = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            output += chunk
        assert proc.wait(timeout=10) == 0, output
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return TERMINAL_ESCAPES.sub("", output.decode()).replace("\r", "")


# -- a real server answering a check -------------------------------------------------


class _Answer(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: Answering = self.server  # type: ignore[assignment]
        sock: socket.socket = self.request
        sock.settimeout(10)
        try:
            request = sock.recv(100)
            server.requests.append(request)
            if server.answer:
                sock.sendall(server.answer)
            while sock.recv(100):  # keep the connection open until the checker closes it
                pass
        except OSError:
            pass


class Answering(socketserver.ThreadingTCPServer):
    """A real server that reads the check's request, sends `answer` (b"": nothing) and
    keeps the connection open."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, name: str, answer: bytes) -> None:
        self.name = name
        self.answer = answer
        self.requests: list[bytes] = []
        super().__init__(("127.0.0.1", 0), _Answer)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
