"""Socket activation (SPEC §17) with a real `systemd-socket-activate`.

systemd-socket-activate binds the sockets, waits for the first connection and execs the
command with LISTEN_FDS/LISTEN_PID/LISTEN_FDNAMES set, exactly as systemd does for a
`.socket` unit. For a restart the command is a bash loop that starts lbproxy again and
again on the same inherited descriptors (LISTEN_PID set to each lbproxy's PID): bash holds
the sockets between two lbproxy processes as PID 1 does for `systemctl restart`, so a
connection that arrives meanwhile waits in the kernel's queue instead of being refused.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import tools
from tests.integration.client_loop import ClientLoop
from tests.integration.harness import ROOT, NameServer, Notifications, free_port, wait_for

pytestmark = [
    pytest.mark.integration,
    tools.requires("systemd-socket-activate", package="systemd"),
]


def config(port: int, backend: int, name: str = "web", extra_vs: str = "") -> str:
    return textwrap.dedent(
        f"""\
        global:
          admin: {{listen: none}}
          drain_timeout: 5s
        virtual_servers:
          - name: {name}
            listen: 127.0.0.1:{port}
            scheduler: rr
            real_servers:
              - {{name: echo, address: 127.0.0.1:{backend}}}
        """
    ) + textwrap.indent(textwrap.dedent(extra_vs), "  ")


class Activated:
    """`systemd-socket-activate -l ... -- bash -c 'restart loop'` around `lbproxy run`."""

    def __init__(self, tmp_path: Path, yaml: str, listen: list[str], fdnames: str = "", runs=1):
        self.tmp = tmp_path
        (tmp_path / "lbproxy.yaml").write_text(yaml)
        self.pidfile = tmp_path / "pid"
        self.log_path = tmp_path / "lbproxy.log"
        # Each run: a subshell that writes its PID, claims the sockets (LISTEN_PID) and
        # becomes lbproxy; bash keeps the descriptors open between two runs.
        script = (
            f"for i in $(seq {runs}); do"
            " ( echo $BASHPID > pid; export LISTEN_PID=$BASHPID;"
            f' exec {sys.executable} -m lbproxy run lbproxy.yaml ); echo "exit $?";'
            " done"
        )
        # no admin endpoint: each lbproxy's READY=1 says it is ready, RELOADING=1 and
        # READY=1 that a reload is over (systemd-socket-activate passes on only the
        # environment -E names)
        self.notifications = Notifications()
        command = [
            tools.need("systemd-socket-activate", "systemd"),
            f"-ENOTIFY_SOCKET={self.notifications.address}",
        ]
        for address in listen:
            command += ["-l", address]
        if fdnames:
            command.append(f"--fdname={fdnames}")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*command, "--", "bash", "-c", script],
            cwd=tmp_path,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pid(self) -> int:
        text = self.pidfile.read_text().strip() if self.pidfile.exists() else ""
        return int(text) if text else 0

    def wait_started(self, count: int, timeout: float = 20.0) -> None:
        """Until the count-th lbproxy is ready (READY=1; every worker, with workers)."""
        wait_for(
            lambda: self.notifications.starts() >= count or self.proc.poll() is not None,
            timeout,
            f"lbproxy run #{count}",
        )
        assert self.proc.poll() is None, self.log()

    def stop(self) -> None:
        if self.proc.poll() is None:
            pid = self.pid()
            if pid:
                os.kill(pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.notifications.close()


def first_connection(port: int) -> None:
    """systemd-socket-activate starts its command on the first connection (as systemd
    does without a service already running)."""

    def connected() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except ConnectionRefusedError:  # systemd-socket-activate has not bound it yet
            return False
        return True

    wait_for(connected, 5, "systemd-socket-activate's socket")


def test_restarts_under_a_connection_loop_refuse_none(tmp_path):
    port = free_port()
    restarts = 3
    with NameServer("echo", greeting=False) as backend:
        run = Activated(
            tmp_path, config(port, backend.port), [f"127.0.0.1:{port}"], "web", runs=restarts + 1
        )
        try:
            first_connection(port)
            run.wait_started(1)
            assert "socket activation: web 127.0.0.1:" in run.log()
            with ClientLoop(port, clients=10, limit=60) as loop:
                loop.wait_for(50)
                for n in range(restarts):
                    old = run.pid()
                    os.kill(old, signal.SIGTERM)
                    # The next lbproxy is up only when the loop got through it, too.
                    wait_for(lambda old=old: run.pid() != old, 10, "the next lbproxy")
                    run.wait_started(n + 2)
                    loop.wait_for(50)
            counts = loop.counts
        finally:
            run.stop()
    log = run.log()
    assert log.count("exit 0") == restarts + 1, log  # each stop was a clean drain
    assert "cannot listen" not in log
    assert counts["ok"] > 200, counts
    assert counts["refused"] == counts["reset"] == counts["error"] == 0, (counts, loop.errors)
    assert counts["mismatch"] == 0, (counts, loop.errors)


def test_an_unnamed_socket_is_matched_by_its_address(tmp_path):
    """No --fdname: systemd names the socket "unknown"; its address says which virtual
    server it is for, and the other virtual server binds its own."""
    port, other = free_port(), free_port()
    extra = f"""\
      - name: api
        listen: 127.0.0.1:{other}
        scheduler: rr
        real_servers:
          - {{name: echo, address: 127.0.0.1:1}}
    """
    with NameServer("echo") as backend:
        run = Activated(tmp_path, config(port, backend.port, extra_vs=extra), [f"127.0.0.1:{port}"])
        try:
            first_connection(port)
            run.wait_started(1)
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                assert s.recv(100) == b"echo\n"
            socket.create_connection(("127.0.0.1", other), timeout=5).close()  # bound itself
        finally:
            run.stop()
    assert "socket activation: unknown 127.0.0.1:" in run.log()


def test_a_passed_socket_that_matches_no_virtual_server_is_an_error(tmp_path):
    port, stray = free_port(), free_port()
    run = Activated(
        tmp_path,
        config(port, 1),
        [f"127.0.0.1:{port}", f"127.0.0.1:{stray}"],
        "web:metrics",
    )
    try:
        first_connection(port)
        wait_for(lambda: "exit 1" in run.log(), 15, "lbproxy to exit 1")
    finally:
        run.stop()
    log = run.log()
    assert f"systemd's socket 'metrics' (TCP 127.0.0.1:{stray}) matches no virtual server" in log
    assert "Traceback" not in log


def test_an_address_needed_but_not_passed_says_which_were(tmp_path):
    """api's address is neither passed nor free: the error names it and what was passed."""
    port, taken = free_port(), free_port()
    extra = f"""\
      - name: api
        listen: 127.0.0.1:{taken}
        real_servers:
          - {{name: echo, address: 127.0.0.1:1}}
    """
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        run = Activated(tmp_path, config(port, 1, extra_vs=extra), [f"127.0.0.1:{port}"], "web")
        try:
            first_connection(port)
            wait_for(lambda: "exit 1" in run.log(), 15, "lbproxy to exit 1")
        finally:
            run.stop()
    log = run.log()
    assert (
        f"cannot listen on 127.0.0.1:{taken}: Address already in use (not among the sockets"
        f" passed: web 127.0.0.1:{port}; add it to lbproxy.socket)"
    ) in log, log


def test_with_workers_the_supervisor_takes_the_passed_socket(tmp_path):
    """workers: 2: the supervisor takes systemd's socket and both workers accept on it."""
    port = free_port()
    with NameServer("echo") as backend:
        yaml = config(port, backend.port).replace(
            "  drain_timeout: 5s\n", "  drain_timeout: 5s\n  workers: 2\n"
        )
        run = Activated(tmp_path, yaml, [f"127.0.0.1:{port}"], "web")
        try:
            first_connection(port)
            run.wait_started(1)
            for _ in range(10):
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    assert s.recv(100) == b"echo\n"
        finally:
            run.stop()
    log = run.log()
    assert "socket activation: web 127.0.0.1:" in log and "cannot listen" not in log
    assert "exit 0" in log, log


@pytest.mark.parametrize("workers", [1, 2])
def test_a_reload_that_adds_back_a_passed_address_takes_the_socket_again(tmp_path, workers):
    """A virtual server on systemd's socket removed by a reload and added back by the next:
    the passed socket is kept meanwhile (systemd holds it open anyway, so binding the
    address again would fail with "address in use") and serves again; with workers the
    supervisor keeps it and sends it to the workers again."""
    port, other = free_port(), free_port()
    with NameServer("echo") as backend, NameServer("api") as api:
        extra = f"""\
          - name: api
            listen: 127.0.0.1:{other}
            scheduler: rr
            real_servers:
              - {{name: api, address: 127.0.0.1:{api.port}}}
        """
        full = config(port, backend.port, extra_vs=extra)
        without_web = textwrap.dedent(
            """\
            global:
              admin: {listen: none}
              drain_timeout: 5s
            virtual_servers:
            """
        ) + textwrap.indent(textwrap.dedent(extra), "  ")
        if workers > 1:
            full, without_web = (
                text.replace(
                    "  drain_timeout: 5s\n", f"  drain_timeout: 5s\n  workers: {workers}\n"
                )
                for text in (full, without_web)
            )
        run = Activated(tmp_path, full, [f"127.0.0.1:{port}"], "web")
        try:
            first_connection(port)
            run.wait_started(1)  # with workers, once every worker is ready

            def reload(text: str, wanted: str) -> None:
                (tmp_path / "lbproxy.yaml").write_text(text)
                before = run.notifications.reloads()
                os.kill(run.pid(), signal.SIGHUP)
                wait_for(lambda: run.notifications.reloads() > before, 10, "the reload")
                assert "reload failed" not in run.log(), run.log()
                assert wanted in run.log(), run.log()

            reload(without_web, "removed virtual server web")
            reload(full, "web: listening on 127.0.0.1:")
            for _ in range(5):
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    assert s.recv(100) == b"echo\n"
            with socket.create_connection(("127.0.0.1", other), timeout=5) as s:
                assert s.recv(100) == b"api\n"
        finally:
            run.stop()
    log = run.log()
    assert "in use" not in log and "reload failed" not in log, log
    assert "exit 0" in log, log
