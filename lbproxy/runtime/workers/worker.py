"""A worker: the ordinary Server, configured by the supervisor over the inherited
channel (the package header, lbproxy/runtime/workers/__init__.py)."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import sys

import trio

import lbproxy.runtime.workers.protocol as protocol
from lbproxy.config.secret_files import SECRETS
from lbproxy.control.cluster import member_name
from lbproxy.dataplane.listener import BindError, failure_lines
from lbproxy.net import fd_channel
from lbproxy.net.fd_channel import Channel, close_all
from lbproxy.runtime import logs, privileges, process_title
from lbproxy.runtime import state as runtime_state
from lbproxy.runtime.inherit import PREVIOUS, Inherited, Passed
from lbproxy.runtime.server import Server
from lbproxy.runtime.workers.protocol import (
    ERROR,
    READY,
    STATE,
    TAKEN,
    UPGRADED,
    decode_init,
    message,
)
from lbproxy.wire.fd_frames import FrameError, FrameReader

log = logging.getLogger("lbproxy.workers")


class _WorkerTag(logging.Filter):
    """Tags a worker's log lines: `lbproxy.server[w2]: listening on ...`."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.tag = f"[w{index}]"

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.endswith(self.tag):
            record.name += self.tag
        return True


def run_worker(fd: int, config_paths: list[str], log_level: str) -> int:
    """A worker: its configuration comes from the supervisor over the inherited socket."""
    channel = socket.socket(fileno=fd)
    reader = FrameReader()  # what came after the Init stays in it, for _worker_main
    try:
        received = fd_channel.receive(channel, reader)
        if received is None:
            raise EOFError("the supervisor closed the connection")
        init = decode_init(received.body)
    except (OSError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        print(f"lbproxy worker: no configuration from the supervisor: {exc}", file=sys.stderr)
        return 1
    process_title.set_title(process_title.worker(init.index))
    config = init.config
    SECRETS.remember(init.secrets)
    logs.configure(config.global_.log_format, log_level)
    for handler in logging.getLogger("lbproxy").handlers:
        handler.addFilter(_WorkerTag(init.index))
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(init.admin)  # left by the process this one replaces
        admin_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        admin_sock.bind(init.admin)
        admin_sock.listen(64)
    except OSError as exc:
        log.error("cannot listen on %s: %s", init.admin, exc.strerror)
        return 1
    redis = config.global_.cluster.redis
    # Each worker has its own tables, so each is a member of the cluster of its own.
    cluster_name = f"{member_name(redis)[:58]}-w{init.index}" if redis is not None else None
    server = Server(
        config,
        config_paths,
        reuse_port=True,
        admin_sock=admin_sock,
        cluster_name=cluster_name,
        admin_socket=False,  # the supervisor serves global.admin.socket
    )
    server.freeze_heap = True
    # global.state_file: worker 1 writes it, worker k > 1 its part STATE_FILE.wK (its own
    # persistence entries); every worker reads the file and all the parts at start
    # (lbproxy/runtime/state.py).
    index = init.index
    server.state_writer.suffix = "" if index == 1 else f".w{index}"
    server.state_writer.merges_parts = False
    if init.state is not None:  # an upgrade's: one old worker's, instead of the file
        server.initial_state = init.state.encode()
        server.initial_state_is_one_workers = True
    # The supervisor's TCP sockets, matched by address as an upgrade's are; one that the
    # configuration no longer names is closed (check_all_used).
    passed = []
    for key, fd in init.listeners.items():
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        passed.append(Passed(sock, key, PREVIOUS))
    server.inherited = Inherited(passed)
    failures: list[str] = []
    orphaned = False
    try:
        orphaned = trio.run(_worker_main, server, channel, reader)
    except* (BindError, privileges.PrivilegeError) as group:
        failures.extend(failure_lines(group))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(init.admin)
    if orphaned:  # the supervisor could not remove its folder: the last worker out does
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(init.admin))
    for failure in failures:
        log.error("%s", failure)
    if failures:
        with contextlib.suppress(OSError):  # the supervisor repeats it when it stops
            fd_channel.send(channel, message(ERROR, "; ".join(failures)))
    return 1 if failures else 0


async def _worker_main(server: Server, sock: socket.socket, reader: FrameReader) -> bool:
    """Serve until stopped; True when stopped because the supervisor is gone."""
    channel = Channel(trio.socket.from_stdlib_socket(sock), reader)
    async with trio.open_nursery() as nursery:

        async def serve(
            task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
        ) -> None:
            try:
                await server.serve(task_status=task_status)
            finally:
                nursery.cancel_scope.cancel()  # drained: stop watching the supervisor

        orphaned = False
        await nursery.start(serve)
        try:
            await protocol.send(channel, READY)
            await _receive_messages(server, channel)
        except (OSError, trio.ClosedResourceError, FrameError):
            pass
        log.warning("the supervisor is gone; stopping")
        server.stop()
        orphaned = True
    return orphaned


async def _receive_messages(server: Server, channel: Channel) -> None:
    """Until the supervisor's end of file: the TCP listening sockets a reload adds
    (Supervisor._give), kept for the reload that follows, which takes them as those
    inherited at start; "upgraded" (Supervisor.upgrade): a new supervisor serves;
    "state" (Supervisor.upgrade, before the new supervisor starts): what its workers
    start from."""
    while (received := await protocol.receive(channel)) is not None:
        if received.says(STATE):  # an upgrade's new workers start from it
            close_all(received.fds)
            snapshot = runtime_state.snapshot(server, handover=True).decode()
            await protocol.send(channel, STATE, snapshot)
            continue
        if received.says(UPGRADED):
            server.close_udp_listeners()
        keys = received.listener_keys
        for key, fd in zip(keys, received.fds, strict=False):
            sock = socket.socket(fileno=fd)
            sock.setblocking(False)
            server.inherited.passed.append(Passed(sock, key, PREVIOUS))
        close_all(received.fds[len(keys) :])
        await protocol.send(channel, TAKEN)  # the sockets are kept, or UDP released
