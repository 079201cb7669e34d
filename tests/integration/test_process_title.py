"""The help's `kill -HUP $(pidof -s lbproxy)` and `kill -USR2 $(pidof -s lbproxy)`, run as
written against a real `lbproxy run` (lbproxy/runtime/process_title.py).

Every lbproxy this suite starts is named `lbproxy`, and tests run in parallel: so that
`pidof` sees this test's processes alone, the proxy and the shell line run in a PID
namespace of their own (`unshare --pid`, as root; `nsenter` enters it). Loopback and
the files are the host's, so the test talks to the proxy as any other does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import tools
from tests.integration.harness import (
    Lbproxy,
    NameServer,
    ask_name,
    free_port,
    listening,
    ready,
    reloads_done,
    tracebacks,
    wait_for,
)

pytestmark = [
    pytest.mark.integration,
    tools.requires("unshare", "nsenter", package="util-linux"),
    tools.requires("pidof", package="sysvinit-utils"),
]

LBPROXY = Path(sys.executable).with_name("lbproxy")  # the installed command, as a user runs it


def help_example(command: str, starts: str) -> str:
    """The example line of `lbproxy COMMAND --help` that starts with `starts`, as written
    (its `# comment` too: the shell ignores it)."""
    result = subprocess.run(
        [str(LBPROXY), command, "--help"], capture_output=True, text=True, timeout=60
    )
    examples = result.stdout.split("Examples:\n", 1)[-1]
    lines = [line.strip() for line in examples.splitlines() if line.strip().startswith(starts)]
    assert len(lines) == 1, result.stdout
    return lines[0]


class PidNamespace:
    """A PID namespace whose first process is a bounded `sleep`; everything in it dies
    with it (unshare's --kill-child)."""

    def __init__(self) -> None:
        if os.geteuid() != 0:
            pytest.skip("a PID namespace (unshare --pid) needs root")
        self.unshare = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "sleep", "600"]
        )
        children = Path(f"/proc/{self.unshare.pid}/task/{self.unshare.pid}/children")
        self.leader = int(wait_for(lambda: children.read_text().split(), 10, "unshare's child")[0])

    def command(self, *args: str) -> list[str]:
        return ["nsenter", "--target", str(self.leader), "--pid", "--mount", "--", *args]

    def shell(self, line: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command("sh", "-c", line), capture_output=True, text=True, timeout=60
        )

    def pidof(self, name: str) -> list[int]:
        return [int(pid) for pid in self.shell(f"pidof {name}").stdout.split()]

    def titles(self) -> list[str]:
        """The command line of every process in the namespace but its first, as `ps -f`."""
        listing = self.shell("for d in /proc/[0-9]*; do tr '\\0' ' ' < $d/cmdline; echo; done")
        return sorted(
            line.strip() for line in listing.stdout.splitlines() if line.startswith("lbproxy")
        )

    def close(self) -> None:
        # unshare ignores SIGTERM while it waits; a namespace's first process takes
        # SIGKILL from outside, and every process in the namespace goes with it
        os.kill(self.leader, signal.SIGKILL)
        self.unshare.wait(30)


@pytest.fixture
def namespace():
    space = PidNamespace()
    yield space
    space.close()


def config(port: int, admin: int, server: NameServer, workers: int) -> str:
    return textwrap.dedent(
        f"""\
        global:
          workers: {workers}
          admin: {{listen: 127.0.0.1:{admin}}}
        virtual_servers:
          - name: web
            listen: 127.0.0.1:{port}
            scheduler: rr
            real_servers:
              - {{name: {server.name}, address: 127.0.0.1:{server.port}}}
        """
    )


class Started:
    """`lbproxy run FILE` in the namespace, with its log."""

    def __init__(self, space: PidNamespace, tmp_path: Path, text: str) -> None:
        self.config = tmp_path / "lbproxy.yaml"
        self.config.write_text(text)
        self.log_path = tmp_path / "lbproxy.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                space.command(str(LBPROXY), "run", str(self.config)),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM to the process nsenter started (the host's PID of it), and its status."""
        if self.proc.poll() is None:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
            for pid in children.read_text().split():
                os.kill(int(pid), signal.SIGTERM)
        return self.proc.wait(60)

    def wait_ready(self, admin: int) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, f"lbproxy exited {self.proc.returncode}\n{self.log()}"
            return ready(admin)

        wait_for(up, 60, "lbproxy to be ready", details=self.log)


def reload_took_effect(space, started, admin, port, line, new_config) -> None:
    before = reloads_done(admin)
    started.config.write_text(new_config)
    result = space.shell(line)
    assert result.returncode == 0, f"{line!r}: {result.stderr}"
    wait_for(lambda: reloads_done(admin) > before, 30, "the reload", details=started.log)
    # every worker serves the new configuration
    assert {ask_name(port) for _ in range(6)} == {"b"}, started.log()


@pytest.mark.parametrize("workers", [1, 2])
def test_the_run_help_reload_line_reloads_the_running_proxy(namespace, tmp_path, workers):
    line = help_example("run", "kill -HUP")
    port, admin = free_port(), free_port()
    with NameServer("a") as a, NameServer("b") as b:
        started = Started(namespace, tmp_path, config(port, admin, a, workers))
        try:
            started.wait_ready(admin)
            assert ask_name(port) == "a"
            (supervisor,) = namespace.pidof("lbproxy")  # one: not a worker
            assert namespace.titles() == [
                "lbproxy",
                *(f"lbproxy: worker {n}" for n in range(1, workers + 1) if workers > 1),
            ]
            reload_took_effect(
                namespace, started, admin, port, line, config(port, admin, b, workers)
            )
            assert namespace.pidof("lbproxy") == [supervisor]
        finally:
            code = started.stop()
    assert code == 0, started.log()
    assert tracebacks(started.log()) == []


@pytest.mark.parametrize("workers", [1, 2])
def test_the_upgrade_help_line_upgrades_and_the_reload_line_finds_the_new_process(
    namespace, tmp_path, workers
):
    upgrade_line = help_example("upgrade", "kill -USR2")
    reload_line = help_example("run", "kill -HUP")
    port, admin = free_port(), free_port()
    with NameServer("a") as a, NameServer("b") as b:
        started = Started(namespace, tmp_path, config(port, admin, a, workers))
        try:
            started.wait_ready(admin)
            (old,) = namespace.pidof("lbproxy")
            result = namespace.shell(upgrade_line)
            assert result.returncode == 0, result.stderr
            # the new process serves, and is the only `lbproxy`; the old one, draining
            # no connection, has ended (the test's child: exit status 0)
            assert started.proc.wait(60) == 0, started.log()
            new = wait_for(
                lambda: [pid for pid in namespace.pidof("lbproxy") if pid != old],
                60,
                "the new process",
                details=started.log,
            )
            assert len(new) == 1 and namespace.pidof("lbproxy") == new, started.log()
            assert ask_name(port) == "a"
            reload_took_effect(
                namespace, started, admin, port, reload_line, config(port, admin, b, workers)
            )
        finally:
            serving = namespace.pidof("lbproxy")
            for pid in serving:
                namespace.shell(f"kill -TERM {pid}")
            started.stop()
            if serving:  # else the namespace's end kills what is left
                wait_for(lambda: not listening(port), 60, "the proxy to stop", details=started.log)
                wait_for(lambda: namespace.titles() == [], 60, "every lbproxy process to end")
    assert tracebacks(started.log()) == []
    assert re.search(r"upgraded: pid \d+ serves now", started.log())


def test_without_setproctitle_lbproxy_runs_and_says_how_to_reload(tmp_path, monkeypatch):
    """An installation without the library (its import fails) serves the same."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "setproctitle.py").write_text('raise ImportError("not installed, for the test")\n')
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(blocked), os.environ.get("PYTHONPATH")]))
    )
    port, admin = free_port(), free_port()
    with NameServer("a") as a, NameServer("b") as b:
        proxy = Lbproxy(tmp_path, config(port, admin, a, workers=2))
        with proxy:
            assert ask_name(port) == "a"
            proxy.reload(config(port, admin, b, workers=2))
            assert {ask_name(port) for _ in range(6)} == {"b"}
            assert proxy.proc is not None
            pid = proxy.proc.pid
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            assert argv0 == sys.executable.encode()  # Python's name, as before
        assert (
            "setproctitle is not installed: this process keeps Python's name and `pidof "
            f"lbproxy` does not find it; reload with `lbproxy reload` or `kill -HUP {pid}`"
        ) in proxy.log()
