"""`global.user` and `global.group` (SPEC §21) with real processes started as root.

lbproxy runs from a Python that `nobody` can run (service_user.py), on files in a folder
`nobody` can read; the admin token is root's (mode 0600), which `nobody` cannot read: a
process started after the drop (a worker, the new process of an upgrade) gets it from
the one that read it. Each process is looked at in /proc/PID/status, as `ps` shows it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import (
    Echo,
    NameServer,
    Notifications,
    alive,
    ask_name,
    free_port,
    http,
    ready,
    run_cli,
    stop_pids,
    wait_for,
)
from tests.integration.service_user import (
    nobody,
    readable_folder,
    service_python,
    status_ids,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="starts lbproxy as root"),
]

TOKEN = "s3cret-token"
CAP_NET_BIND_SERVICE = 1 << 10


@pytest.fixture(scope="session")
def python() -> Path:
    return service_python()


@pytest.fixture
def folder():
    """A folder nobody can read: the configuration, root's token, a state folder."""
    path = readable_folder()
    token = path / "admin.token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)  # root's alone: nobody cannot read it
    state = path / "state"
    state.mkdir()
    account = nobody()
    os.chown(state, account.pw_uid, account.pw_gid)  # the state folder: the user's
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def low_port(udp: bool = False) -> int:
    """A free port below 1024 on loopback (only root, or CAP_NET_BIND_SERVICE, binds it)."""
    kind = socket.SOCK_DGRAM if udp else socket.SOCK_STREAM
    for port in random.sample(range(700, 1024), 324):
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    pytest.skip("no free port below 1024")


def assert_runs_as_nobody(pid: int) -> None:
    """Uid, Gid (real, effective, saved, filesystem) nobody's, no supplementary group, and
    of every capability only CAP_NET_BIND_SERVICE: no way back to root."""
    account = nobody()
    ids = status_ids(pid)
    assert ids["Uid"] == [account.pw_uid] * 4, ids
    assert ids["Gid"] == [account.pw_gid] * 4, ids
    assert ids["Groups"] == [], ids
    assert ids["CapPrm"] == ids["CapEff"] == ids["CapAmb"] == [CAP_NET_BIND_SERVICE], ids


class Service:
    """`lbproxy run` started as root from `python`, and the processes that follow it."""

    def __init__(self, command: list[str], folder: Path, admin: int, cwd: Path) -> None:
        self.admin = admin
        self.log_path = folder / "lbproxy.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.first = subprocess.Popen(
            [*command, "run", str(folder / "lbproxy.yaml")],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
        )
        self.pids = [self.first.pid]

    def wait_ready(self) -> None:
        """Until /readyz answers 200 (with `workers: N`, once every worker is ready)."""
        wait_for(lambda: ready(self.admin) or self.first.poll() is not None, 30, "/readyz")
        assert self.first.poll() is None, self.log()

    @property
    def pid(self) -> int:
        return self.pids[-1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.admin}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def upgrade(self, token_file: Path) -> int:
        """`lbproxy upgrade` (as root, the operator): the new process's pid."""
        result = run_cli("upgrade", "--admin", self.url, "--token-file", str(token_file))
        assert result.returncode == 0, (result.stderr, self.log())
        new = int(re.search(r"upgraded: pid (\d+) serves now", result.stdout)[1])
        self.pids.append(new)
        return new

    def stop(self) -> None:
        stop_pids(self.pids)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.first.wait(5)
        self._log.close()


def write_config(folder: Path, text: str) -> None:
    path = folder / "lbproxy.yaml"
    path.write_text(text)
    path.chmod(0o644)


def config(
    folder: Path, admin: int | None, listen: list[str], backend: int, extra: str = ""
) -> str:
    token = folder / "admin.token"
    admin_line = f"listen: 127.0.0.1:{admin}, token_file: {token}" if admin else "listen: none"
    return f"""\
global:
  user: nobody
  admin: {{{admin_line}}}
  drain_timeout: 1s
  state_file: {folder / "state" / "lbproxy.state"}
{extra}virtual_servers:
  - name: web
    listen: [{", ".join(listen)}]
    scheduler: rr
    health_check: {{type: none}}
    real_servers:
      - {{name: a, address: 127.0.0.1:{backend}}}
"""


def test_runs_as_nobody_once_bound_and_reloads_and_upgrades(python, folder, monkeypatch):
    """Started as root with `user: nobody`: once ready, the process is nobody's (no
    group, only CAP_NET_BIND_SERVICE), serves, reloads onto a port below 1024, writes
    its state file, and `lbproxy upgrade` hands over to a new process that is nobody's
    too, has root's token (which it could not read itself) and serves. Its admin socket
    (in the runtime folder systemd's RuntimeDirectory= names) is nobody's, and the
    operator's `lbproxy drain` works through it before and after the upgrade."""
    port, admin, low = free_port(), free_port(), low_port()
    runtime = folder / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(runtime))
    admin_socket = runtime / f"admin-{admin}.sock"
    with NameServer("a") as backend:
        write_config(folder, config(folder, admin, [f"127.0.0.1:{port}"], backend.port))
        service = Service([str(python), "-m", "lbproxy"], folder, admin, cwd=Path("/"))
        try:
            service.wait_ready()
            assert "running as user nobody" in service.log()
            assert_runs_as_nobody(service.pid)
            assert ask_name(port) == "a"
            assert admin_socket.stat().st_uid == nobody().pw_uid
            drained = run_cli("drain", "--admin", service.url, "web", "a")
            assert drained.returncode == 0, (drained.stderr, service.log())
            enabled = run_cli("enable", "--admin", service.url, "web", "a")
            assert enabled.returncode == 0, (enabled.stderr, service.log())

            # A reload that binds a port below 1024, as nobody.
            listen = [f"127.0.0.1:{port}", f"127.0.0.1:{low}"]
            write_config(folder, config(folder, admin, listen, backend.port))
            status, body = http("POST", f"{service.url}/api/v1/reload", {}, token=TOKEN)
            assert status == 200, (body, service.log())
            assert ask_name(low) == "a"
            # The state file, written by nobody in nobody's folder.
            patch = f"{service.url}/api/v1/virtual-servers/web/real-servers/a"
            assert http("PATCH", patch, {"weight": 5}, token=TOKEN)[0] == 200
            state = folder / "state" / "lbproxy.state"
            wait_for(lambda: state.exists() and state.stat().st_uid == nobody().pw_uid, 10)

            old = service.pid
            new = service.upgrade(folder / "admin.token")
            assert new != old
            assert_runs_as_nobody(new)
            wait_for(lambda: not alive(old), 15, "the old process to exit")
            assert ask_name(port) == "a" and ask_name(low) == "a"
            # The new process has the token nobody cannot read: a change needs it.
            assert http("POST", f"{service.url}/api/v1/reload", {})[0] == 401
            assert http("POST", f"{service.url}/api/v1/reload", {}, token=TOKEN)[0] == 200
            drained = run_cli("drain", "--admin", service.url, "web", "a")
            assert drained.returncode == 0, (drained.stderr, service.log())
            assert "Traceback" not in service.log()
        finally:
            service.stop()


def test_every_worker_runs_as_nobody(python, folder):
    """`workers: 2`: the supervisor binds and drops before it starts a worker; each
    worker binds its own UDP socket, on a port below 1024, as nobody."""
    port, admin, udp = free_port(), free_port(), low_port(udp=True)
    echo = Echo(b"echo:")
    try:
        with NameServer("a") as backend:
            udp_server = f"""\
  - name: dns
    protocol: udp
    listen: 127.0.0.1:{udp}
    health_check: {{type: none}}
    real_servers:
      - {{name: e, address: 127.0.0.1:{echo.port}}}
"""
            text = config(folder, admin, [f"127.0.0.1:{port}"], backend.port, "  workers: 2\n")
            write_config(folder, text + udp_server)
            service = Service([str(python), "-m", "lbproxy"], folder, admin, cwd=Path("/"))
            try:
                service.wait_ready()
                workers = json.loads(http("GET", f"{service.url}/api/v1/workers")[1])
                pids = [service.pid, *(w["pid"] for w in workers["workers"])]
                assert len(set(pids)) == 3
                for pid in pids:
                    assert_runs_as_nobody(pid)
                assert ask_name(port) == "a"
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
                    client.settimeout(5)
                    client.sendto(b"hello", ("127.0.0.1", udp))
                    assert client.recv(100) == b"echo:hello"
            finally:
                service.stop()
    finally:
        echo.close()


def test_started_as_root_without_user_warns_once(lbproxy, name_servers):
    servers = name_servers("a")
    port = free_port()
    rs = f"{{name: a, address: 127.0.0.1:{servers[0].port}}}"
    proxy = lbproxy(  # ready: READY=1 once both workers are
        f"""
global:
  admin: {{listen: none}}
  workers: 2
virtual_servers:
  - {{name: web, listen: 127.0.0.1:{port}, real_servers: [{rs}]}}
""",
        wait_ports=[port],
    )
    assert ask_name(port) == "a"
    warnings = [line for line in proxy.log().splitlines() if "running as root" in line]
    assert len(warnings) == 1, proxy.log()
    assert "WARNING" in warnings[0] and "global.user" in warnings[0]


def test_children_never_import_from_the_working_directory(tmp_path, folder):
    """lbproxy started from a folder holding a planted `lbproxy/` package: neither its
    workers nor the new process of an upgrade import it."""
    marker = tmp_path / "planted-ran"
    planted = folder / "lbproxy"
    planted.mkdir()
    (planted / "__init__.py").write_text(
        f"open({str(marker)!r}, 'a').write('ran\\n')\nraise SystemExit(3)\n"
    )
    port, admin = free_port(), free_port()
    with NameServer("a") as backend:
        text = config(folder, admin, [f"127.0.0.1:{port}"], backend.port, "  workers: 2\n")
        write_config(folder, text.replace("  user: nobody\n", ""))
        # The installed command (its folder first on sys.path, not the working one), as
        # an operator runs it: the first process is the operator's choice, the ones it
        # starts are lbproxy's.
        command = [str(Path(sys.executable).with_name("lbproxy"))]
        service = Service(command, folder, admin, cwd=folder)
        try:
            service.wait_ready()
            assert ask_name(port) == "a"
            old = service.pid
            service.upgrade(folder / "admin.token")
            wait_for(lambda: not alive(old), 15, "the old process to exit")
            wait_for(lambda: ready(admin), 20, "the new process's workers")
            assert ask_name(port) == "a"
            assert not marker.exists(), service.log()
        finally:
            service.stop()


def test_without_the_capability_a_reload_onto_a_low_port_fails_and_keeps_serving(python, folder):
    """Started as nobody with no capability at all (as a unit with `User=` and no
    `AmbientCapabilities=`): a reload that needs a port below 1024 fails, says why, and
    the running configuration serves on."""
    account = nobody()
    port, low = free_port(), low_port()
    with NameServer("a") as backend:
        write_config(folder, config(folder, None, [f"127.0.0.1:{port}"], backend.port))
        log_path = folder / "lbproxy.log"
        notifications = Notifications()  # no admin endpoint: READY=1 says it is ready
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [str(python), "-m", "lbproxy", "run", str(folder / "lbproxy.yaml")],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd="/",
                user=account.pw_uid,
                group=account.pw_gid,
                extra_groups=[],
                env={**os.environ, "NOTIFY_SOCKET": notifications.address},
            )
        try:
            wait_for(lambda: notifications.starts() == 1, 30, "the start")
            assert status_ids(process.pid)["CapEff"] == [0]
            listen = [f"127.0.0.1:{port}", f"127.0.0.1:{low}"]
            write_config(folder, config(folder, None, listen, backend.port))
            process.send_signal(signal.SIGHUP)
            wait_for(lambda: notifications.reloads() == 1, 15, "the reload")
            text = log_path.read_text()
            assert "reload failed" in text, text
            assert (
                f"cannot listen on 127.0.0.1:{low}: Permission denied (a port below 1024 "
                "needs root or CAP_NET_BIND_SERVICE" in text
            ), text
            assert ask_name(port) == "a"
            assert process.poll() is None
        finally:
            process.terminate()
            process.wait(15)
            notifications.close()
