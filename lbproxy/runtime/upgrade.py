"""`lbproxy upgrade` and SIGUSR2: hand the listening sockets to a new process (SPEC §17).

The running lbproxy (the old process) starts the lbproxy installed on disk now as its
child, `python -m lbproxy run --upgrade-fd FD CONFIG...`, and talks to it over a Unix
socketpair (nginx's binary upgrade on USR2 and HAProxy's `-x` socket transfer are the
models; Envoy's hot restart does the same with a drain time). This module is the old
process's side and the messages; the new process's side is runtime/takeover.py.

    old                                       new
    spawn, stderr into a pipe   ------->      load CONFIG (bad: {"error", "exit": 2} and exit)
    hand-over: JSON + SCM_RIGHTS ------->     every listening socket (named after the
      (listeners, admin, DNS, the old        address it served), its own stderr, the
      stderr, the runtime state, the         runtime state, the secrets it may not
      secret files' contents)                read itself; binds only what is new
                                <-------     {"ready": PID} once every listener serves
    stop accepting (close its copies),        (MAINPID= and READY=1 to systemd first)
    answer `lbproxy upgrade`, drain
    established connections for
    global.drain_timeout, exit 0

The kernel keeps a listening socket while any process holds it, so the accept queue is
never closed: a connection arriving during the hand-over is accepted by one process or
the other, none is refused. A new process that does not become ready (a bad
configuration, an import error, a crash, START_TIMEOUT) leaves the old one serving as
if nothing happened; its last stderr lines are the reason given.

The new process's stderr is a pipe to the old one until it is ready: the old copies each
line to its own log (nothing is lost) and keeps the last lines, which is how an import
error, printed before any lbproxy code runs, still reaches `lbproxy upgrade`. Once
ready, the new process moves its stderr back to the one the old process had (received
with the sockets), and the pipe ends.

Runtime state: lbproxy/runtime/state.py's snapshot of the old process (states and
weights set at run time, the last load reports, the persistence entries, and each
actively checked real server's health and last check) goes with the sockets, taken when
the upgrade starts, and the new process restores it after its configuration and before
its first accept, as it would read `global.state_file` (which holds all but the health).
From the hand-over on, only the new process writes the state file.

After a privilege drop (`global.user`, lbproxy/runtime/privileges.py) the new process runs
as the old one's user, with CAP_NET_BIND_SERVICE from the ambient set: it needs no bind
for the sockets it is given, and the secret files the old process read as root come with
them (lbproxy/config/secret_files.py), used only where it cannot read a file itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from lbproxy.config.secret_files import SECRETS
from lbproxy.net import fd_channel
from lbproxy.net.fd_channel import close_all
from lbproxy.runtime.notify import Notifier
from lbproxy.wire.fd_frames import FrameError, FrameReader, decode_document, encode_document

log = logging.getLogger("lbproxy.upgrade")

START_TIMEOUT = 60.0  # seconds for the new process to become ready
STDERR = "stderr"  # the name of the old process's stderr among the descriptors
TAIL_LINES = 20  # the new process's last stderr lines kept for the reason of a failure


@dataclass
class Outcome:
    """What an upgrade did, for the log, the API answer and `lbproxy upgrade`'s exit."""

    ok: bool
    pid: int | None = None  # the new process
    error: str = ""
    errors: list[str] = field(default_factory=list)  # FILE:LINE: message of a bad config
    exit: int = 0  # for `lbproxy upgrade`: 0, 1 (failed) or 2 (invalid configuration)

    def document(self) -> dict[str, Any]:
        if self.ok:
            return {"result": "ok", "pid": self.pid, "old_pid": os.getpid()}
        return {"error": self.error, "errors": self.errors, "exit": self.exit}


# -- the wire: JSON documents in frames with descriptors (lbproxy/net/fd_channel.py) ----


def send_message(sock: socket.socket, document: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """One document, and `fds` with it, on a blocking socket."""
    fd_channel.send(sock, encode_document(document), fds)


def receive_message(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One document and the descriptors that came with it; (None, []) at end of file.
    FrameError (a ValueError) for anything else, its descriptors closed."""
    received = fd_channel.receive(sock, FrameReader())
    if received is None:
        return None, []
    try:
        return decode_document(received.body), received.fds
    except FrameError:
        close_all(received.fds)
        raise


# -- the old process --------------------------------------------------------------------


def python_command() -> list[str]:
    """How lbproxy starts itself (an upgrade's new process, each worker): this Python,
    `-P -m lbproxy`. `-P` (Python 3.11) keeps the working directory out of sys.path:
    `python -m` would otherwise import from the folder lbproxy was started in before the
    installed package, so a `lbproxy/` planted there would run as the service. `-I` would
    do that too but also ignore PYTHONPATH, which a deployment (and the workers' own
    PYTHONPATH, runtime/workers/supervisor.py) may rely on."""
    return [sys.executable, "-P", "-m", "lbproxy"]


class HandsOver(Protocol):
    """What an upgrade needs of the old process: the Server (`workers: 1`) or the
    Supervisor of lbproxy/runtime/workers/supervisor.py."""

    notifier: Notifier

    def handover_sockets(self) -> list[tuple[str, socket.socket]]:
        """The listening sockets, each named as `Inherited.take` looks it up."""
        ...

    def handover_state(self) -> dict[str, Any]:
        """The runtime state for the new process, JSON (added to the hand-over)."""
        ...


class Upgrade:
    """One upgrade, run by the old process (`Server.upgrade`)."""

    def __init__(self, server: HandsOver, config_paths: Sequence[str], log_level: str) -> None:
        self.server = server
        self.config_paths = list(config_paths)
        self.log_level = log_level
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)

    def _command(self, fd: int) -> list[str]:
        return [
            *python_command(),
            "run",
            "--upgrade-fd",
            str(fd),
            "--log-level",
            self.log_level,
            "--",
            *self.config_paths,
        ]

    async def run(self) -> Outcome:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        read_end, write_end = os.pipe()
        env = dict(os.environ)
        if self.server.notifier.address:  # taken out of the environment at start
            env["NOTIFY_SOCKET"] = self.server.notifier.address
        try:
            process = subprocess.Popen(
                self._command(theirs.fileno()),
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stderr=write_end,
                env=env,
            )
        except OSError as exc:
            os.close(read_end)
            ours.close()
            return Outcome(False, error=f"cannot start {sys.executable}: {exc}", exit=1)
        finally:  # the child's copies
            os.close(write_end)
            theirs.close()
        log.info("upgrade: started the new lbproxy, pid %d", process.pid)
        outcome = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._copy_stderr, read_end)
            with trio.move_on_after(START_TIMEOUT):
                outcome = await self._talk(ours, process)
            if outcome is None:
                process.kill()
                outcome = Outcome(
                    False, error=f"the new lbproxy was not ready within {START_TIMEOUT:g}s", exit=1
                )
            if not outcome.ok:
                # Its stderr ends with it: wait for the last lines, which say why.
                with trio.move_on_after(5):
                    await trio.to_thread.run_sync(process.wait, abandon_on_cancel=True)
            else:
                nursery.cancel_scope.deadline = trio.current_time() + 5
        ours.close()
        if not outcome.ok and not outcome.errors and self.tail:
            outcome.errors = list(self.tail)
        _keep.append(process)  # never waited for on success: it outlives this process
        return outcome

    async def _talk(self, ours: socket.socket, process: subprocess.Popen) -> Outcome:
        named = [(n, sock) for n, sock in self.server.handover_sockets() if sock.fileno() != -1]
        names = [STDERR, *(name for name, _ in named)]
        fds = [2, *(sock.fileno() for _, sock in named)]
        workers = len(getattr(self.server, "workers", ())) or 1  # a Supervisor has them
        document = {
            "sockets": names,
            "pid": os.getpid(),
            "workers": workers,
            # The secret files this process read, for a new process that cannot read
            # them (it runs as global.user; lbproxy/config/secret_files.py). This
            # socketpair is the two processes' alone.
            "secrets": SECRETS.contents(),
            **self.server.handover_state(),
        }
        try:
            await trio.to_thread.run_sync(send_message, ours, document, fds)
            answer, stray = await trio.to_thread.run_sync(
                receive_message, ours, abandon_on_cancel=True
            )
        except (OSError, FrameError) as exc:
            answer, stray = None, []
            log.debug("upgrade channel: %s", exc)
        close_all(stray)
        if answer is not None and answer.get("ready"):
            return Outcome(True, pid=process.pid)
        if answer is not None and answer.get("errors"):
            return Outcome(
                False, error=answer.get("error", "failed"), errors=answer["errors"], exit=2
            )
        code = await trio.to_thread.run_sync(process.wait, abandon_on_cancel=True)
        return Outcome(False, error=f"the new lbproxy {_exited(code)} before it was ready", exit=1)

    async def _copy_stderr(self, fd: int) -> None:
        """The new process's stderr until it is ready: into this process's stderr, and the
        last lines kept."""
        pending = b""
        try:
            while True:
                await trio.lowlevel.wait_readable(fd)
                data = os.read(fd, 1 << 16)
                if not data:
                    break
                with contextlib.suppress(OSError):
                    os.write(2, data)
                lines = (pending + data).split(b"\n")
                pending = lines.pop()
                self.tail.extend(line.decode(errors="replace") for line in lines if line)
        finally:
            if pending:
                self.tail.append(pending.decode(errors="replace"))
            os.close(fd)


_keep: list[subprocess.Popen] = []


def _exited(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"
