"""The admin socket (SPEC §21), against real `lbproxy run` processes: where it is made
and with which mode, who may use it (SO_PEERCRED), a stale file and a live one at its
path, two processes, `lbproxy upgrade` handing it over without a moment where a client
is refused, the supervisor of `workers: N` serving it, and a user other than root
($XDG_RUNTIME_DIR)."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from tests.integration.harness import (
    ROOT,
    admin_socket_path,
    ask_name,
    free_port,
    local_http,
    ready,
    run_cli,
    unix_http,
    vs_config,
    wait_for,
    with_admin,
    worker_servers,
    workers_config,
)

pytestmark = pytest.mark.integration


def config(port: int, servers, admin_port: int, socket_setting: str | None = None) -> str:
    return with_admin(
        vs_config(port, servers, "rr", "health_check: {type: none}"),
        admin_port,
        socket=socket_setting,
    )


def open_folder() -> Path:
    """A folder every user may enter (pytest's tmp_path is root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="lbproxy-admin-socket-"))
    folder.chmod(0o755)
    return folder


@pytest.mark.skipif(os.geteuid() != 0, reason="the default folder of root")
def test_root_default_is_run_lbproxy_admin_port_sock_mode_0600(name_servers, lbproxy):
    servers = name_servers("a")
    port, admin_port = free_port(), free_port()
    proxy = lbproxy(config(port, servers, admin_port))
    path = Path(f"/run/lbproxy/admin-{admin_port}.sock")
    info = path.stat()
    assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == 0
    folder = path.parent.stat()
    assert folder.st_uid == 0 and not folder.st_mode & 0o022
    assert f"admin socket: {path}" in proxy.log()
    status, body = local_http("GET", f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers")
    assert status == 200 and json.loads(body)["virtual_servers"][0]["name"] == "web"
    proxy.stop()
    assert not path.exists()  # removed at a clean stop


def test_runtime_directory_under_systemd_and_the_cli_finds_it_there(
    name_servers, lbproxy, tmp_path, monkeypatch
):
    """$RUNTIME_DIRECTORY (systemd's RuntimeDirectory=) takes the default socket."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(runtime))
    servers = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    lbproxy(config(port, servers, admin_port))
    path = runtime / f"admin-{admin_port}.sock"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not os.path.exists(admin_socket_path(admin_port))
    out = run_cli("drain", "web", "b", "--admin", f"127.0.0.1:{admin_port}")
    assert out.returncode == 0, out.stderr
    assert {ask_name(port) for _ in range(4)} == {"a"}


@pytest.mark.parametrize("workers", [1, 2])
def test_another_user_is_refused_even_when_the_file_mode_lets_it_connect(
    name_servers, lbproxy, workers
):
    """SO_PEERCRED, not the file mode alone: with the socket opened up to everyone
    (chmod 666), `nobody` still gets 403 for a read and for a change; root is served."""
    servers = name_servers("a")
    port, admin_port = free_port(), free_port()
    path = open_folder() / "lb.sock"
    text = config(port, servers, admin_port, str(path))
    if workers == 2:
        text = text.replace("global:\n", "global:\n  workers: 2\n", 1)
    lbproxy(text)
    wait_for(lambda: ready(admin_port), what="/readyz")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o666)
    for method, target in (
        ("GET", "/api/v1/virtual-servers"),
        ("GET", "/healthz"),
        ("PATCH", "/api/v1/virtual-servers/web/real-servers/a"),
    ):
        out = subprocess.run(
            ["runuser", "-u", "nobody", "--", "curl", "-s", "-w", "\n%{http_code}",
             "--unix-socket", str(path), "-X", method, "-d", '{"state": "disabled"}',
             f"http://localhost{target}"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        body, _, status = out.stdout.rpartition("\n")
        assert status == "403", (target, out.stdout, out.stderr)
        assert "serves only the user lbproxy runs as" in json.loads(body)["error"]
    status, body = unix_http(str(path), "GET", "/api/v1/virtual-servers/web/real-servers/a")
    assert status == 200 and json.loads(body)["state"] == "enabled"


def test_a_stale_socket_file_is_replaced_and_anything_else_is_left_alone(
    name_servers, tmp_path, lbproxy
):
    """A socket file nobody answers on (its process died): removed, the new one made.
    One that answers (a live process), or a path that is not a socket: the start fails
    (exit 1, naming the path), and the file is left as it was."""
    servers = name_servers("a")
    folder = open_folder()
    path = folder / "lb.sock"

    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays, nothing listens: what a SIGKILLed process leaves
    port, admin_port = free_port(), free_port()
    text = config(port, servers, admin_port, str(path))
    with lbproxy(text, folder=tmp_path / "stale") as proxy:
        assert "removed the one a stopped process left" in proxy.log()
        assert unix_http(str(path), "GET", "/healthz")[0] == 200

    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(path))
    live.listen()
    try:
        text = config(free_port(), servers, free_port(), str(path))
        out = _run_briefly(tmp_path / "live", text)
        assert out.returncode == 1, out.stdout
        assert f"cannot listen on the admin socket {path}: another process answers" in out.stdout
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(str(path))  # still the live process's
    finally:
        live.close()
        path.unlink()

    path.write_text("not a socket\n")
    out = _run_briefly(tmp_path / "file", config(free_port(), servers, free_port(), str(path)))
    assert out.returncode == 1
    assert "the path exists and is not a socket" in out.stdout
    assert path.read_text() == "not a socket\n"


def _run_briefly(folder: Path, text: str) -> subprocess.CompletedProcess:
    """`lbproxy run` of a configuration expected to fail at start."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "lbproxy.yaml"
    path.write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "lbproxy", "run", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30, cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_two_processes_with_different_admin_ports_each_have_their_own(
    name_servers, tmp_path, lbproxy
):
    one_servers = name_servers("a")
    two_servers = name_servers("b")
    (p1, a1), (p2, a2) = (free_port(), free_port()), (free_port(), free_port())
    with (
        lbproxy(config(p1, one_servers, a1), folder=tmp_path / "1"),
        lbproxy(config(p2, two_servers, a2), folder=tmp_path / "2"),
    ):
        assert admin_socket_path(a1) != admin_socket_path(a2)
        assert all(os.path.exists(admin_socket_path(a)) for a in (a1, a2))
        for admin, name in ((a1, "a"), (a2, "b")):
            out = run_cli("status", "--json", "--admin", f"127.0.0.1:{admin}")
            (vs,) = json.loads(out.stdout)["virtual_servers"]
            assert [rs["name"] for rs in vs["real_servers"]] == [name]
        assert run_cli("drain", "web", "a", "--admin", f"127.0.0.1:{a1}").returncode == 0
        assert run_cli("drain", "web", "a", "--admin", f"127.0.0.1:{a2}").returncode == 1
        assert ask_name(p2) == "b"


@pytest.mark.parametrize("workers", [1, 2])
def test_an_upgrade_hands_the_socket_over_and_no_client_is_refused(name_servers, lbproxy, workers):
    """`lbproxy upgrade` through the admin socket while a client asks through it
    without pause: every request is answered (200), the new process answers on the
    same socket once the old one has exited, and the file is kept by the old one's exit
    and removed by the new one's."""
    servers = name_servers("a")
    port, admin_port = free_port(), free_port()
    text = (
        workers_config(port, servers, admin_port)
        if workers == 2
        else config(port, servers, admin_port)
    )
    proxy = lbproxy(text, may_exit=True)  # the upgrade ends the first process
    path = admin_socket_path(admin_port)
    wait_for(lambda: ready(admin_port), what="/readyz")
    failures: list[str] = []
    answered = [0]
    stop = threading.Event()

    def ask() -> None:
        while not stop.is_set() and answered[0] < 100_000:
            try:
                status, _ = unix_http(path, "GET", "/api/v1/virtual-servers", timeout=10)
                if status != 200:
                    failures.append(f"HTTP {status}")
            except OSError as exc:
                failures.append(repr(exc))
            answered[0] += 1

    asker = threading.Thread(target=ask)
    asker.start()
    new = None
    try:
        out = run_cli("upgrade", "--admin", f"127.0.0.1:{admin_port}", timeout=120)
        assert out.returncode == 0, out.stderr
        new = int(out.stdout.split("pid ")[1].split()[0])
        wait_for(lambda: proxy.proc.poll() is not None, 30, "the old process to exit")
        before = answered[0]
        wait_for(lambda: answered[0] > before + 20, 10, "answers after the hand-over")
    finally:
        stop.set()
        asker.join(30)
    try:
        assert failures == [], failures[:5]
        assert new != proxy.proc.pid
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        drained = run_cli("drain", "web", "a", "--admin", f"127.0.0.1:{admin_port}")
        assert drained.returncode == 0, drained.stderr
        if workers == 2:
            for index in (1, 2):
                assert worker_servers(admin_port, index)["a"]["state"] == "drain"
    finally:
        if new is not None:
            os.kill(new, 15)
            wait_for(lambda: not os.path.exists(f"/proc/{new}"), 30, "the new process to stop")
        proxy.stop()
    assert not os.path.exists(path)


def stop(runuser: subprocess.Popen) -> None:
    """SIGTERM to the lbproxy that `runuser` runs (its child), as a service manager would."""
    children = Path(f"/proc/{runuser.pid}/task/{runuser.pid}/children").read_text().split()
    for child in children:
        os.kill(int(child), signal.SIGTERM)
    runuser.wait(30)


def test_a_user_other_than_root_gets_it_in_xdg_runtime_dir(name_servers, tmp_path):
    """Run as `nobody` (Debian's python3, the checkout and its .venv on PYTHONPATH):
    $XDG_RUNTIME_DIR/lbproxy/ is made 0700, the socket 0600, owned by nobody; nobody's
    CLI drains through it with no token, and so does root's. Without $XDG_RUNTIME_DIR
    there is no socket (the log says so) and TCP is read-only."""
    site = next((ROOT / ".venv" / "lib").glob("python3*/site-packages"), None)
    python = Path("/usr/bin/python3")
    if site is None or not python.exists():
        pytest.skip("needs /usr/bin/python3 and the checkout's .venv")
    nobody = subprocess.run(["id", "-u", "nobody"], capture_output=True, text=True)
    uid = int(nobody.stdout)
    runtime = open_folder()
    os.chown(runtime, uid, -1)
    runtime.chmod(0o700)
    work = open_folder()
    servers = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    (work / "lbproxy.yaml").write_text(config(port, servers, admin_port))
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{ROOT}:{site}",
        "XDG_RUNTIME_DIR": str(runtime),
        "HOME": str(work),
    }

    def as_nobody(*args: str, **options):
        return subprocess.Popen(
            ["runuser", "-u", "nobody", "--", "env", *(f"{k}={v}" for k, v in env.items()),
             str(python), "-m", "lbproxy", *args],
            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **options,
        )  # fmt: skip

    proxy = as_nobody("run", str(work / "lbproxy.yaml"))
    path = runtime / "lbproxy" / f"admin-{admin_port}.sock"
    try:
        wait_for(lambda: path.exists() or proxy.poll() is not None, 20, "the admin socket")
        assert proxy.poll() is None
        folder = path.parent.stat()
        assert folder.st_uid == uid and stat.S_IMODE(folder.st_mode) == 0o700
        info = path.stat()
        assert info.st_uid == uid and stat.S_IMODE(info.st_mode) == 0o600
        drain = as_nobody("drain", "web", "b", "--admin", f"127.0.0.1:{admin_port}")
        output, _ = drain.communicate(timeout=60)
        assert drain.returncode == 0, output
        assert {ask_name(port) for _ in range(4)} == {"a"}
        # root may use it too (its CLI looks in $XDG_RUNTIME_DIR/lbproxy/ as well)
        root = subprocess.run(
            [sys.executable, "-m", "lbproxy", "enable", "web", "b", "--admin",
             f"127.0.0.1:{admin_port}", "--socket", str(path)],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert root.returncode == 0, root.stderr
    finally:
        stop(proxy)
        log, _ = proxy.communicate(timeout=30)
    assert "INFO lbproxy.server: stopped" in log, log
    assert not path.exists()

    del env["XDG_RUNTIME_DIR"]
    port, admin_port = free_port(), free_port()
    (work / "lbproxy.yaml").write_text(config(port, servers, admin_port))
    proxy = as_nobody("run", str(work / "lbproxy.yaml"))
    try:
        wait_for(lambda: ready(admin_port), 20, "/readyz")
        drain = as_nobody("drain", "web", "b", "--admin", f"127.0.0.1:{admin_port}")
        output, _ = drain.communicate(timeout=60)
        assert drain.returncode == 1 and "read-only over TCP" in output, output
    finally:
        stop(proxy)
        log, _ = proxy.communicate(timeout=30)
    assert "no admin socket: no runtime folder" in log, log
