"""The supervisor: one task per worker slot, the TCP listening sockets, reloads,
upgrades and the merged admin answers (the package header,
lbproxy/runtime/workers/__init__.py)."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from zlib import crc32

import trio
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.metrics_core import Metric

import lbproxy.runtime.workers.protocol as protocol
from lbproxy.admin.api import (
    CLIENT_HEADER,
    TokenError,
    json_body,
    parse_patch,
    parse_server_entry,
    problems_document,
    read_token,
    serve_asgi,
)
from lbproxy.admin.client import UnixHTTPConnection
from lbproxy.admin.metric_families import counter as counter_family
from lbproxy.admin.metric_families import gauge as gauge_family
from lbproxy.admin.metrics import RELOAD_RESULTS, build_info
from lbproxy.admin.routes import HTTPError
from lbproxy.config.model import Address, Config, VirtualServerConfig
from lbproxy.config.reader import read_real_server
from lbproxy.config.secret_files import SECRETS
from lbproxy.control.cluster import instance_id
from lbproxy.core.per_source import MAX_LISTED
from lbproxy.core.persistence import client_key
from lbproxy.dataplane.listener import BindError, listen_socket
from lbproxy.dataplane.udp import UdpAddress, udp_socket
from lbproxy.locator.dns_server import DnsLocator
from lbproxy.net.fd_channel import Channel, close_all
from lbproxy.runtime import logs, privileges, process_title
from lbproxy.runtime.admin_socket import AdminSocket, handover_name, open_admin_socket
from lbproxy.runtime.inherit import Inherited, Passed
from lbproxy.runtime.notify import STATUS_INTERVAL, Notifier, status_line
from lbproxy.runtime.server import STOP_SIGNALS, dns_bind_error, load_for_reload
from lbproxy.runtime.upgrade import Outcome, Upgrade, python_command
from lbproxy.runtime.workers.app import SupervisorApp
from lbproxy.runtime.workers.merge import (
    COUNTER_TYPES,
    MetricSums,
    merge_documents,
    merge_per_source,
    merge_real_servers,
    parse_metrics,
)
from lbproxy.runtime.workers.protocol import (
    ERROR,
    LISTENERS,
    STATE,
    TAKEN,
    UPGRADED,
    Init,
    encode_init,
)
from lbproxy.wire.fd_frames import MAX_FDS, FrameError

log = logging.getLogger("lbproxy.workers")

WORKER_TIMEOUT = 10.0  # seconds for one admin request to a worker
STABLE_AFTER = 10.0  # a worker that ran this long before exiting is restarted at once
RESTART_DELAY = 0.5  # then 1, 2, 4 ... seconds while it keeps exiting within STABLE_AFTER
RESTART_DELAY_MAX = 30.0
KILL_GRACE = 5.0  # after drain_timeout, a worker still running gets SIGKILL

# -- HTTP to a worker's Unix socket (http.client in a thread) ---------------------------


def _http(
    socket_path: str,
    method: str,
    path: str,
    body: bytes | None,
    extra: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    connection = UnixHTTPConnection(socket_path, WORKER_TIMEOUT)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if extra:
            headers.update(extra)
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _totals(document: dict[str, Any]) -> tuple[int, int]:
    servers = [rs for vs in document.get("virtual_servers", []) for rs in vs["real_servers"]]
    return (
        sum(rs["active_connections"] for rs in servers),
        sum(rs["connections_total"] for rs in servers),
    )


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


# -- the supervisor --------------------------------------------------------------------


@dataclass
class Worker:
    index: int  # 1..N, stable across restarts
    admin_path: str
    process: trio.Process | None = None
    pid: int | None = None
    ready: bool = False  # this process has bound every listener and caught up
    ever_ready: bool = False  # some process of this slot was ready once
    restarts: int = 0
    counters: list[Metric] = field(default_factory=list)  # last scraped counter families
    error: str | None = None  # why the process could not start, as it said
    # The supervisor's end of the channel (protocol.py), the listener keys this process
    # has (inherited at start or sent since), and the answer to the last sockets sent
    channel: Channel | None = None
    given: set[str] = field(default_factory=set)
    taken: trio.Event | None = None
    # The answer to "state" while one is awaited (Supervisor._worker_state): its text
    # once it has come.
    state_asked: trio.Event | None = None
    state: str | None = None


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class Supervisor:
    def __init__(
        self,
        config: Config,
        config_paths: list[str],
        token: str | None,
        log_level: str,
        listeners: dict[str, socket.socket] | None = None,
    ) -> None:
        self.config = config
        # The TCP listening sockets every worker accepts from (package header), by address.
        self.listeners = listeners if listeners is not None else {}
        # systemd's sockets (a reload that drops one keeps it for a re-add, runtime/inherit.py)
        self.inherited = Inherited(())
        self.config_paths = config_paths
        self.token = token
        self.log_level = log_level
        self.folder = tempfile.mkdtemp(prefix="lbproxy-workers-")  # mode 0700
        self.workers = [
            Worker(i, os.path.join(self.folder, f"worker-{i}.sock"))
            for i in range(1, config.global_.workers + 1)
        ]
        self.generation = 0
        self.overrides: list[tuple[str, bytes]] = []  # PATCHes since the last reload
        # Real servers added and removed at run time, the last request per server (kept
        # across reloads, as the workers keep them): (vs, rs) -> (method, path, body)
        self.topology: dict[tuple[str, str], tuple[str, str, bytes]] = {}
        self.reloads = {"ok": 0, "error": 0}
        self.retired = MetricSums()  # counters of worker processes that have exited
        self.draining = False
        self.exit_code = 0
        self._stop = trio.Event()
        self._changes = trio.Lock()  # one reload, PATCH or catch-up at a time
        self._nursery: trio.Nursery | None = None
        self._announced = False  # "all N workers ready" is logged once
        self.notifier = Notifier()  # systemd's: the supervisor notifies, never a worker
        # The last load report of each real server (path -> body): kept across reloads,
        # as a worker keeps them, and sent to a worker that starts later.
        self.load_reports: dict[str, bytes] = {}
        self._next_locator = 0  # round-robin over the workers for GET .../locate
        # `lbproxy upgrade` (lbproxy/runtime/upgrade.py): the admin socket to hand over,
        # its serving in a scope of its own (stopped at once by an upgrade), and what an
        # upgrade's new process calls once every worker is ready
        self.admin_listener: socket.socket | None = None
        self.admin_socket: AdminSocket | None = None  # global.admin.socket, once bound
        self._endpoints = trio.CancelScope()
        self._upgrading = False
        self.on_ready: Callable[[], Any] | None = None
        # An upgrade's: the state one old worker answered, which each slot's first
        # process here starts from (protocol.Init.state); the one for the next upgrade,
        # asked of a worker of this supervisor's when it starts.
        self.handed_state: str | None = None
        self._state_for_upgrade: str | None = None
        self._admin_socks: list[socket.socket] = []  # the admin endpoint's, to serve

    # -- life cycle -------------------------------------------------------------

    async def main(self, admin_socks: list[socket.socket]) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._admin_socks = admin_socks
            await nursery.start(self._signals)
            # An upgrade's new supervisor serves the admin endpoint once every worker is
            # ready (_ready): until then the old one answers there, with its workers.
            if admin_socks and self.on_ready is None:
                await nursery.start(self._serve_admin, admin_socks)
            if self.notifier.enabled:
                nursery.start_soon(self._report_status)
            async with trio.open_nursery() as slots:
                for worker in self.workers:
                    slots.start_soon(self._supervise, worker)
            nursery.cancel_scope.cancel()  # every worker has exited: admin and signals end
        log.info("stopped")

    async def _serve_admin(
        self,
        socks: list[socket.socket],
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        path = self.admin_socket.path if self.admin_socket is not None else None
        with self._endpoints:
            await serve_asgi(SupervisorApp(self, self.token, path), socks, task_status=task_status)

    # -- upgrade (lbproxy/runtime/upgrade.py) ---------------------------------------------

    def handover_sockets(self) -> list[tuple[str, socket.socket]]:
        named = list(self.listeners.items())
        admin = self.config.global_.admin.listen
        if self.admin_listener is not None and admin is not None:
            named.append((f"admin {admin}", self.admin_listener))
        if self.admin_socket is not None:
            named.append((handover_name(self.admin_socket.path), self.admin_socket.sock))
        return named

    def handover_state(self) -> dict[str, Any]:
        """The runtime changes a new worker catches up with: they go to the new
        supervisor's workers the same way (global.state_file, if set, has the rest)."""
        return {
            "overrides": [(path, body.decode()) for path, body in self.overrides],
            "load_reports": {path: body.decode() for path, body in self.load_reports.items()},
            "topology": [(m, path, body.decode()) for m, path, body in self.topology.values()],
            # The servers' health and timelines, which only the workers know (one's
            # view for all: they check the same servers), with the rest of its state.
            **({"state": self._state_for_upgrade} if self._state_for_upgrade else {}),
        }

    async def _worker_state(self) -> str | None:
        """One ready worker's state for an upgrade's new workers (worker 1's unless it is
        not ready), or None when none answers within WORKER_TIMEOUT: they then start
        from the files, as a restarted worker does."""
        worker = next((w for w in self.workers if w.ready and w.channel is not None), None)
        if worker is None or worker.channel is None:
            return None
        worker.state, worker.state_asked = None, trio.Event()
        with trio.move_on_after(WORKER_TIMEOUT):
            try:
                await protocol.send(worker.channel, STATE)
            except (OSError, trio.ClosedResourceError) as exc:
                log.warning("worker %d: no state for the upgrade: %s", worker.index, exc)
                return None
            await worker.state_asked.wait()
        if worker.state is None:
            log.warning("worker %d: no state for the upgrade in %ss", worker.index, WORKER_TIMEOUT)
        return worker.state

    async def upgrade(self, config_paths: list[str] | tuple[str, ...] = ()) -> Outcome:
        """As Server.upgrade: a new supervisor takes the TCP listening sockets and the
        admin endpoint, starts its workers on them; once all are ready this one stops
        accepting and its workers drain."""
        if self.draining or self._upgrading:
            busy = "draining" if self.draining else "an upgrade is already running"
            return Outcome(False, error=f"cannot upgrade: {busy}", exit=1)
        self._upgrading = True
        try:
            paths = list(config_paths) or self.config_paths
            self._state_for_upgrade = await self._worker_state()
            outcome = await Upgrade(self, paths, self.log_level).run()
        finally:
            self._upgrading = False
            self._state_for_upgrade = None
        if not outcome.ok:
            log.error("upgrade failed, still serving: %s", outcome.error)
            return outcome
        log.info("upgraded: pid %s serves now; these workers stop accepting", outcome.pid)
        process_title.set_title(process_title.HANDED_OVER)
        if self.admin_socket is not None:  # its file is the new supervisor's now
            self.admin_socket.handed_over = True
        self.notifier.close()
        self.notifier = Notifier()  # the new supervisor is systemd's main process now
        self._endpoints.cancel()
        # Each worker ends its UDP sessions now (Server.close_udp_listeners): its socket
        # leaves the SO_REUSEPORT group, so the new workers' sockets get every datagram.
        # Before SIGTERM: until then they serve every datagram they read; answered.
        with trio.move_on_after(WORKER_TIMEOUT):
            async with trio.open_nursery() as nursery:
                for worker in self.workers:
                    nursery.start_soon(self._release_udp, worker)
        self.stop()
        return outcome

    async def _release_udp(self, worker: Worker) -> None:
        if worker.channel is None:
            return
        worker.taken = taken = trio.Event()
        with contextlib.suppress(OSError, trio.ClosedResourceError):
            await protocol.send(worker.channel, UPGRADED)
            await taken.wait()

    def stop(self) -> None:
        """Pass SIGTERM on to every worker (whichever of STOP_SIGNALS the supervisor
        got: a worker drains alike on each); main() returns once all have exited."""
        if self._stop.is_set():
            return
        self.draining = True
        self._stop.set()
        self.notifier.stopping(self._status_line(None))
        for worker in self.workers:
            self._terminate(worker)
        self._close_listeners(set(self.listeners))  # the workers close theirs on SIGTERM
        if self._nursery is not None:
            self._nursery.start_soon(self._kill_stragglers)

    def _fail(self, message: str) -> None:
        log.error("%s; stopping", message)
        self.exit_code = 1
        self.stop()

    def _close_listeners(self, keys: set[str]) -> None:
        """Close the supervisor's copies: once the workers' are closed too, the kernel
        refuses connections to the address instead of queueing them for nobody."""
        for key in keys:
            sock = self.listeners.pop(key, None)
            if sock is not None:
                self.inherited.give_back(sock)  # systemd's: kept (a duplicate) for a re-add
                sock.close()
            for worker in self.workers:  # closed there too: a re-add sends it again
                worker.given.discard(key)

    @staticmethod
    def _terminate(worker: Worker) -> None:
        if worker.process is not None and worker.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGTERM)

    async def _kill_stragglers(self) -> None:
        await trio.sleep(self.config.global_.drain_timeout + KILL_GRACE)
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                log.warning("worker %d (pid %d) is still running; killing it", *_who(worker))
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()

    async def _signals(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
        signals = (signal.SIGHUP, signal.SIGUSR2, *STOP_SIGNALS)
        with trio.open_signal_receiver(*signals) as sigs:
            task_status.started()
            async for signum in sigs:
                if signum == signal.SIGHUP:
                    assert self._nursery is not None
                    self._nursery.start_soon(self.reload)
                elif signum == signal.SIGUSR2:  # as nginx: start the new binary
                    assert self._nursery is not None
                    self._nursery.start_soon(self.upgrade)
                else:
                    log.info(
                        "received %s; stopping %d workers",
                        signal.Signals(signum).name,
                        len(self.workers),
                    )
                    self.stop()

    # -- one worker slot --------------------------------------------------------

    async def _supervise(self, worker: Worker) -> None:
        quick_exits = 0
        while not self._stop.is_set():
            started = trio.current_time()
            code = await self._run_once(worker)
            if self._stop.is_set():
                return
            if not worker.ever_ready:
                reason = f": {worker.error}" if worker.error else ""
                self._fail(
                    f"worker {worker.index} {describe_exit(code)} before it was ready{reason}"
                )
                return
            # The first exit is restarted at once; exits that keep coming within
            # STABLE_AFTER of the start wait 0.5, 1, 2 ... seconds, up to RESTART_DELAY_MAX.
            quick_exits = quick_exits + 1 if trio.current_time() - started < STABLE_AFTER else 0
            delay = 0.0
            if quick_exits > 1:
                delay = min(RESTART_DELAY * 2 ** (quick_exits - 2), RESTART_DELAY_MAX)
            log.error(
                "worker %d (pid %d) %s; restarting it%s",
                worker.index,
                worker.pid,
                describe_exit(code),
                f" in {delay:g}s" if delay else "",
            )
            worker.restarts += 1
            with trio.move_on_after(delay):
                await self._stop.wait()

    async def _run_once(self, worker: Worker) -> int:
        """Start one process for the slot and wait for its exit; returns its exit code."""
        ours, theirs = socket.socketpair()
        listeners = {key: sock.fileno() for key, sock in self.listeners.items()}
        command = [
            *python_command(), "run", "--worker-fd", str(theirs.fileno()),
            "--log-level", self.log_level, "--", *self.config_paths,
        ]  # fmt: skip
        package_root = str(Path(__file__).resolve().parents[3])
        pythonpath = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        try:
            process = await trio.lowlevel.open_process(
                command,
                pass_fds=(theirs.fileno(), *listeners.values()),
                env={**os.environ, "PYTHONPATH": pythonpath},
                process_group=0,  # Ctrl-C reaches the supervisor, which passes SIGTERM on
            )
        except OSError as exc:
            ours.close()
            log.error("worker %d: cannot start %s: %s", worker.index, sys.executable, exc)
            return 1
        finally:
            theirs.close()
        worker.process, worker.pid, worker.error = process, process.pid, None
        worker.given = set(listeners)
        if self._stop.is_set():
            self._terminate(worker)
        log.info("worker %d started (pid %d)", worker.index, process.pid)
        channel = Channel(trio.socket.from_stdlib_socket(ours))
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._talk, worker, channel)
                code = await process.wait()
                # _talk ends on the end of file that follows the exit; it may still have
                # to read the worker's last words ("error")
                nursery.cancel_scope.deadline = trio.current_time() + 1.0
        finally:
            worker.ready = False
            worker.process = None
            worker.channel = None
            channel.close()
            self.retired.add(worker.counters)  # its counts stay in the sums
            worker.counters = []
        return code

    async def _talk(self, worker: Worker, channel: Channel) -> None:
        """Send the configuration, wait for "ready", bring the worker up to date."""
        generation = self.generation
        init = Init(
            config=self.config,
            index=worker.index,
            admin=worker.admin_path,
            # the same descriptor numbers in the worker (pass_fds keeps them)
            listeners={key: sock.fileno() for key, sock in self.listeners.items()},
            # the secret files read before the drop, which the worker may not read
            # now (lbproxy/config/secret_files.py)
            secrets=SECRETS.contents(),
            # an upgrade's state for the slot's first process; a restart reads the file
            state=None if worker.ever_ready else self.handed_state,
        )
        try:
            await channel.send(encode_init(init))
            answer = await protocol.receive(channel)
        except (OSError, trio.ClosedResourceError, FrameError):
            return
        if answer is None:
            return  # it exited; _run_once sees the code
        close_all(answer.fds)  # a worker sends none
        if answer.says(ERROR):  # it cannot start: "error", then exit 1
            worker.error = answer.error.strip()
            return
        worker.channel = channel
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read_channel, worker, channel)
            await self._ready(worker, generation)

    async def _read_channel(self, worker: Worker, channel: Channel) -> None:
        """Our end stays open: closing it stops the worker; the end of file here means
        the worker has exited. "taken" answers sockets sent (_give) and "upgraded"."""
        with contextlib.suppress(OSError, trio.ClosedResourceError, FrameError):
            while (received := await protocol.receive(channel)) is not None:
                close_all(received.fds)
                if received.says(TAKEN) and worker.taken is not None:
                    worker.taken.set()
                elif received.says(STATE) and worker.state_asked is not None:
                    value = received.document[STATE]
                    worker.state = value if isinstance(value, str) else None
                    worker.state_asked.set()

    async def _give(self, worker: Worker, socks: dict[str, socket.socket]) -> None:
        """Send `socks` (TCP listeners a reload adds) to a running worker, and wait until
        it has them: its reload takes them as it takes those inherited at start."""
        socks = {key: sock for key, sock in socks.items() if key not in worker.given}
        channel = worker.channel
        if not socks or channel is None:
            return
        items = list(socks.items())
        for start in range(0, len(items), MAX_FDS):  # one frame holds MAX_FDS at most
            chunk = dict(items[start : start + MAX_FDS])
            worker.taken = trio.Event()
            fds = [sock.fileno() for sock in chunk.values()]
            await protocol.send(channel, LISTENERS, list(chunk), fds)
            with trio.move_on_after(WORKER_TIMEOUT):
                await worker.taken.wait()
            if not worker.taken.is_set():
                raise OSError(f"worker {worker.index} did not take the new listening sockets")
            worker.given |= set(chunk)

    async def _each_give(self, socks: dict[str, socket.socket]) -> None:
        """_give to every ready worker, at once; OSError when one did not take them."""
        failures: list[str] = []

        async def one(worker: Worker) -> None:
            try:
                await self._give(worker, socks)
            except (OSError, trio.ClosedResourceError) as exc:
                failures.append(str(exc) or f"worker {worker.index}: the channel is closed")

        async with trio.open_nursery() as nursery:
            for worker in self.workers:
                if worker.ready:
                    nursery.start_soon(one, worker)
        if failures:
            raise OSError("; ".join(failures))

    async def _ready(self, worker: Worker, generation: int) -> None:
        async with self._changes:
            try:
                await self._catch_up(worker, generation)
            except (OSError, http.client.HTTPException) as exc:
                log.error(
                    "worker %d: catching up with runtime changes failed: %s", worker.index, exc
                )
            worker.ready = worker.ever_ready = True
        if all(w.ever_ready for w in self.workers):
            self.handed_state = None  # each slot's first process has started from it
        log.info("worker %d (pid %d) ready", *_who(worker))
        if not self._announced and all(w.ready for w in self.workers):
            self._announced = True
            addresses = list(
                dict.fromkeys(str(a) for vs in self.config.virtual_servers for a in vs.listen)
            )
            log.info(
                "all %d workers ready; listening on %s", len(self.workers), ", ".join(addresses)
            )
            self.notifier.ready(self._status_line(None))  # connections: in the next STATUS=
            if self.on_ready is not None:  # an upgrade's new supervisor: tell the old one
                if self._admin_socks and self._nursery is not None:
                    await self._nursery.start(self._serve_admin, self._admin_socks)
                self.on_ready()

    async def _catch_up(self, worker: Worker, generation: int) -> None:
        """A reload or PATCH that happened while the worker started: apply it now."""
        if generation != self.generation:
            await self._give(worker, self.listeners)  # added since it started
            status, body = await self._ask(
                worker, "POST", "/api/v1/reload", _reload_body(self.config_paths)
            )
            if status != 200:
                log.error(
                    "worker %d: catching up with the last reload failed: %s", worker.index, body
                )
        for method, path, body in self.topology.values():
            await self._ask(worker, method, path, body)
        for path, body in self.overrides:
            await self._ask(worker, "PATCH", path, body)
        for path, body in self.load_reports.items():
            await self._ask(worker, "PUT", path, body)

    # -- talking to the workers -------------------------------------------------

    async def _ask(
        self,
        worker: Worker,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        return await trio.to_thread.run_sync(
            partial(_http, worker.admin_path, method, path, body, headers),
            abandon_on_cancel=True,
        )

    async def _each(
        self, method: str, path: str, body: bytes | None = None
    ) -> list[tuple[Worker, int, bytes]]:
        """The same request to every ready worker, at once; the ones that answered."""
        answers: dict[int, tuple[int, bytes]] = {}

        async def one(worker: Worker) -> None:
            try:
                answers[worker.index] = await self._ask(worker, method, path, body)
            except (OSError, http.client.HTTPException) as exc:
                if worker.ready:
                    log.warning("worker %d: %s %s: %s", worker.index, method, path, exc)

        targets = [worker for worker in self.workers if worker.ready]
        async with trio.open_nursery() as nursery:
            for worker in targets:
                nursery.start_soon(one, worker)
        return [(w, *answers[w.index]) for w in targets if w.index in answers]

    async def documents(self) -> list[tuple[Worker, dict[str, Any]]]:
        return [
            (worker, json.loads(body))
            for worker, status, body in await self._each("GET", "/api/v1/virtual-servers")
            if status == 200
        ]

    async def merged_document(self) -> dict[str, Any]:
        documents = [document for _, document in await self.documents()]
        if not documents:
            raise HTTPError(503, "no worker is ready")
        return merge_documents(documents)

    async def workers_document(self) -> dict[str, Any]:
        documents = {worker.index: document for worker, document in await self.documents()}
        entries = []
        for worker in self.workers:
            document = documents.get(worker.index)
            active, total = _totals(document) if document else (None, None)
            entries.append(
                {
                    "index": worker.index,
                    "pid": worker.pid,
                    "ready": worker.ready,
                    "restarts": worker.restarts,
                    "active_connections": active,
                    "connections_total": total,
                }
            )
        return {"workers": entries}

    async def worker_document(self, index: int) -> dict[str, Any]:
        for worker, document in await self.documents():
            if worker.index == index:
                return document
        raise HTTPError(404, f"no ready worker {index}")

    async def metrics(self) -> bytes:
        sums = MetricSums()
        for worker, status, body in await self._each("GET", "/metrics"):
            if status != 200:
                continue
            families = parse_metrics(body.decode())
            worker.counters = [f for f in families if f.type in COUNTER_TYPES]
            sums.add(families)
        for family in self.retired.metrics():
            sums.add([family], existing_only=True)
        reloads = counter_family("lbproxy_config_reloads")
        for result in RELOAD_RESULTS:
            reloads.add_metric([result], self.reloads[result])
        ready = gauge_family("lbproxy_workers_ready")
        ready.add_metric([], sum(worker.ready for worker in self.workers))
        restarts = counter_family("lbproxy_worker_restarts")
        restarts.add_metric([], sum(worker.restarts for worker in self.workers))
        registry = CollectorRegistry(auto_describe=False)
        own = [reloads, ready, restarts, build_info()]
        registry.register(_Families([*sums.metrics(), *own]))
        ProcessCollector(registry=registry)  # the supervisor's own process_*
        return generate_latest(registry)

    # -- runtime changes: every worker ------------------------------------------

    async def patch(self, vs_name: str, rs_name: str, body: bytes) -> tuple[int, bytes]:
        """One PATCH to every worker, checked here first (names, then the whole body).

        A bad request is a 404 or 400 that reaches no worker, and every worker gets the
        same valid change, so none is applied on some workers and refused on others.
        """
        async with self._changes:  # a reload in progress may add or remove the names
            vs = next((v for v in self.config.virtual_servers if v.name == vs_name), None)
            if vs is None:
                raise HTTPError(404, f"no virtual server {vs_name!r}")
            if not await self._has_server(vs, rs_name):
                raise HTTPError(404, f"no real server {rs_name!r} in virtual server {vs_name!r}")
            change = parse_patch(body, f"{vs_name}/{rs_name}")
            path = "/api/v1/virtual-servers/{}/real-servers/{}".format(
                *(urllib.parse.quote(name, safe="") for name in (vs_name, rs_name))
            )
            rate = change.get("close_rate")
            if rate is not None:  # each worker closes its own share: the sum keeps the rate
                change["close_rate"] = rate / max(1, sum(w.ready for w in self.workers))
            body = json.dumps(change).encode()
            answers = await self._each("PATCH", path, body)
            if not answers:
                raise HTTPError(503, "no worker is ready")
            for _, status, answer in answers:
                if status != 200:
                    return status, answer  # the worker's own error document
            self.overrides.append((path, body))  # for a worker that starts later
            return 200, json_body(merge_real_servers([json.loads(a) for _, _, a in answers]))

    async def _has_server(self, vs: VirtualServerConfig, rs_name: str) -> bool:
        """A file names it, or it was added at run time and not removed since (here,
        or before a restart: then the workers, which restored it, know it)."""
        change = self.topology.get((vs.name, rs_name))
        if change is not None:
            return change[0] == "POST"
        if any(rs.name == rs_name for rs in vs.real_servers):
            return True
        answers = await self._each("GET", self._server_path(vs.name, rs_name))
        return any(status == 200 for _, status, _ in answers)

    @staticmethod
    def _server_path(vs_name: str, rs_name: str) -> str:
        return "/api/v1/virtual-servers/{}/real-servers/{}".format(
            *(urllib.parse.quote(name, safe="") for name in (vs_name, rs_name))
        )

    async def add_server(self, vs_name: str, body: bytes) -> tuple[int, bytes]:
        """POST .../real-servers to every worker, checked here first as the workers
        check it (a bad body reaches none); kept for a worker that starts later."""
        async with self._changes:
            vs = next((v for v in self.config.virtual_servers if v.name == vs_name), None)
            if vs is None:
                raise HTTPError(404, f"no virtual server {vs_name!r}")
            entry = parse_server_entry(body)
            read = read_real_server(entry, vs)
            if isinstance(read, list):
                return 400, json_body(problems_document(read))
            path = "/api/v1/virtual-servers/{}/real-servers".format(
                urllib.parse.quote(vs_name, safe="")
            )
            body = json.dumps(entry).encode()
            answers = await self._each("POST", path, body)
            if not answers:
                raise HTTPError(503, "no worker is ready")
            for _, status, answer in answers:
                if status != 201:
                    return status, answer
            self.topology[(vs_name, read.name)] = ("POST", path, body)
            return 201, json_body(merge_real_servers([json.loads(a) for _, _, a in answers]))

    async def remove_server(self, vs_name: str, rs_name: str) -> tuple[int, bytes]:
        """DELETE .../real-servers/RS on every worker: 202 while any still drains it."""
        async with self._changes:
            path = "/api/v1/virtual-servers/{}/real-servers/{}".format(
                *(urllib.parse.quote(name, safe="") for name in (vs_name, rs_name))
            )
            answers = await self._each("DELETE", path, b"")
            if not answers:
                raise HTTPError(503, "no worker is ready")
            for _, status, answer in answers:
                if status not in (200, 202):
                    return status, answer
            self.topology[(vs_name, rs_name)] = ("DELETE", path, b"")
            removing = any(status == 202 for _, status, _ in answers)
            return (202 if removing else 200), json_body({"removing": removing})

    async def shutdown_sessions(self, vs_name: str, rs_name: str) -> tuple[int, bytes]:
        """Every worker closes the server's connections; the closes add up."""
        async with self._changes:
            vs = next((v for v in self.config.virtual_servers if v.name == vs_name), None)
            if vs is None:
                raise HTTPError(404, f"no virtual server {vs_name!r}")
            if not await self._has_server(vs, rs_name):
                raise HTTPError(404, f"no real server {rs_name!r} in virtual server {vs_name!r}")
            path = "/api/v1/virtual-servers/{}/real-servers/{}/shutdown-sessions".format(
                *(urllib.parse.quote(name, safe="") for name in (vs_name, rs_name))
            )
            answers = await self._each("POST", path, b"{}")
            if not answers:
                raise HTTPError(503, "no worker is ready")
            closed = 0
            for _, status, answer in answers:
                if status != 200:
                    return status, answer
                closed += json.loads(answer)["closed"]
            return 200, json_body({"closed": closed})

    async def per_source(self, vs_name: str, limit: int) -> tuple[int, bytes]:
        """GET .../per-source: every worker's busiest networks, merged (merge.py). Each
        worker is asked for MAX_LISTED networks so that a network's counts add up
        exactly unless a worker tracks more networks than that."""
        path = "/api/v1/virtual-servers/{}/per-source?limit={}".format(
            urllib.parse.quote(vs_name, safe=""), MAX_LISTED
        )
        answers = await self._each("GET", path)
        if not answers:
            raise HTTPError(503, "no worker is ready")
        for _, status, answer in answers:
            if status != 200:
                return status, answer  # a 404 or 400: the same from every worker
        documents = [json.loads(answer) for _, _, answer in answers]
        return 200, json_body(merge_per_source(documents, limit))

    async def clear_per_source(
        self, vs_name: str, network: str | None, who: str
    ) -> tuple[int, bytes]:
        """DELETE .../per-source[/NETWORK] on every worker; the clears add up. Logged
        here, once, with who asked (the workers log it at debug)."""
        async with self._changes:
            path = "/api/v1/virtual-servers/{}/per-source".format(
                urllib.parse.quote(vs_name, safe="")
            )
            if network is not None:
                path += "/" + urllib.parse.quote(network, safe="/")
            answers = await self._each("DELETE", path, b"")
            if not answers:
                raise HTTPError(503, "no worker is ready")
            cleared = kept = 0
            for _, status, answer in answers:
                if status != 200:
                    return status, answer
                document = json.loads(answer)
                cleared += document["cleared"]
                kept += document["kept"]
            log.info(
                "%s: per_source %s cleared: %d network(s), %d kept with open connections "
                "(by %s; %d workers)",
                vs_name,
                "every network" if network is None else network,
                cleared,
                kept,
                who,
                len(answers),
            )
            return 200, json_body({"cleared": cleared, "kept": kept})

    def _status_line(self, active: int | None) -> str:
        """systemd's STATUS= text: virtual servers, active connections, workers."""
        ready = sum(worker.ready for worker in self.workers)
        extra = f"{ready}/{len(self.workers)} workers ready"
        if self.draining:
            extra += ", draining"
        return status_line(len(self.config.virtual_servers), active, extra)

    async def _report_status(self) -> None:
        while True:
            await trio.sleep(STATUS_INTERVAL)
            documents = [document for _, document in await self.documents()]
            active = sum(_totals(document)[0] for document in documents) if documents else None
            self.notifier.status(self._status_line(active))

    async def report_load(self, path: str, body: bytes) -> tuple[int, bytes]:
        """A load report goes to every worker, as a PATCH does (each is a locator)."""
        async with self._changes:
            answers = await self._each("PUT", path, body)
            if not answers:
                raise HTTPError(503, "no worker is ready")
            for _, status, answer in answers:
                if status != 200:
                    return status, answer
            self.load_reports[path] = body
            return 200, answers[0][2]

    async def explain(self, path: str) -> tuple[int, bytes]:
        """GET .../explain: asked of the first ready worker, named in the answer
        (`"worker": N`). Each worker has its own scheduler state (rr's turn, connection
        counts, persistence table) and the kernel spreads new connections over the
        workers, so the answer is that worker's next pick, not necessarily the pick of
        the worker a client's next connection lands on."""
        ready = [worker for worker in self.workers if worker.ready]
        if not ready:
            raise HTTPError(503, "no worker is ready")
        worker = ready[0]
        try:
            status, body = await self._ask(worker, "GET", path)
        except (OSError, http.client.HTTPException) as exc:
            raise HTTPError(503, f"worker {worker.index} did not answer: {exc}") from None
        if status != 200:
            return status, body
        document = json.loads(body)
        document["worker"] = worker.index
        return status, json_body(document)

    async def locate(
        self, path: str, vs_name: str = "", client: tuple | None = None
    ) -> tuple[int, bytes]:
        """GET .../locate: asked of one ready worker, the next one each time.

        Every worker keeps its own pools, so each is a locator of its own; Geode's
        locators "do not share connection information among themselves" either. Round
        robin spreads the answers' estimates evenly over the workers' views. The
        asking `client` is passed on (CLIENT_HEADER) for maglev and persistence; with
        `persistence`, whose table is per worker, a client is always asked of the same
        worker (by a hash of its address, while the set of ready workers stays).
        """
        ready = [worker for worker in self.workers if worker.ready]
        if not ready:
            raise HTTPError(503, "no worker is ready")
        headers = None
        if client is not None:
            headers = {CLIENT_HEADER.decode(): f"{client[0]} {client[1]}"}
        vs = next((v for v in self.config.virtual_servers if v.name == vs_name), None)
        if client is not None and vs is not None and vs.persistence is not None:
            worker = ready[crc32(client_key(client).encode()) % len(ready)]
        else:
            self._next_locator = (self._next_locator + 1) % len(ready)
            worker = ready[self._next_locator]
        try:
            return await self._ask(worker, "GET", path, headers=headers)
        except (OSError, http.client.HTTPException) as exc:
            raise HTTPError(503, f"worker {worker.index} did not answer: {exc}") from None

    async def reload(self, config_paths: list[str] | None = None) -> tuple[bool, list[str]]:
        """Validate the files (or `config_paths`, which are then the running ones), then
        reload every worker; (ok, changes or errors)."""
        self.notifier.reloading()
        try:
            return await self._reload(config_paths or self.config_paths)
        finally:  # READY=1 ends the reload for systemd, whether applied or refused
            if self._announced:  # (before every worker is ready, READY=1 comes then)
                self.notifier.ready(self._status_line(None))

    async def _reload(self, config_paths: list[str]) -> tuple[bool, list[str]]:
        async with self._changes:
            new = load_for_reload(config_paths)
            if isinstance(new, list):
                self.reloads["error"] += 1
                return False, new
            if new.global_.workers != len(self.workers):
                log.warning(
                    "reload: workers %d -> %d takes a restart; still running %d",
                    len(self.workers),
                    new.global_.workers,
                    len(self.workers),
                )
            errors: list[str] = []
            changes: list[str] | None = None
            # A TCP address the reload adds: bound here, sent to every worker (package header).
            added: dict[str, socket.socket] = {}
            try:
                for key, address in tcp_listen(new).items():
                    if key not in self.listeners:
                        alone = _alone(new, key)
                        sock = self.inherited.take(key, address, udp=False, names=alone)
                        added[key] = sock or _bind(self.inherited, address)
            except BindError as exc:
                for sock in added.values():
                    self.inherited.give_back(sock)
                    sock.close()
                log.error("reload failed; the running configuration is unchanged: %s", exc)
                self.reloads["error"] += 1
                return False, [str(exc)]
            self.listeners.update(added)
            if added:
                try:
                    await self._each_give(added)
                except OSError as exc:
                    errors.append(str(exc))
            body = _reload_body(config_paths)
            answers = await self._each("POST", "/api/v1/reload", body) if not errors else []
            for worker, status, body in answers:
                try:
                    document = json.loads(body)
                except ValueError:
                    document = {"errors": [f"worker {worker.index}: HTTP {status}"]}
                if status == 200:
                    if changes is None:
                        changes = document.get("changes", [])
                else:
                    theirs = document.get("errors") or [
                        f"worker {worker.index}: HTTP {status}: {document.get('error')}"
                    ]
                    errors += [e for e in theirs if e not in errors]
            if errors:
                for message in errors:
                    log.error("reload: %s", message)
                log.error("reload failed; the running configuration is unchanged")
                self._close_listeners(set(added))  # the workers close their copies
                self.reloads["error"] += 1
                return False, errors
            # Workers still starting (none answered) reload once they are ready (_catch_up).
            self._close_listeners(set(self.listeners) - tcp_addresses(new))
            self.config = new
            self.config_paths = list(config_paths)
            self.generation += 1
            self.overrides.clear()
            self.reloads["ok"] += 1
            changes = changes or []
            log.info(
                "reloaded %d workers: %s",
                len(answers),
                "; ".join(changes) if changes else "no changes",
            )
            return True, changes


def _reload_body(config_paths: list[str]) -> bytes:
    """A worker's reload: the supervisor's files (absolute, as the API takes them; a
    worker runs in the supervisor's folder, so they name the same files)."""
    return json.dumps({"config": [os.path.abspath(p) for p in config_paths]}).encode()


def _who(worker: Worker) -> tuple[int, int]:
    return worker.index, worker.pid or 0


def run(
    config: Config,
    *,
    config_paths: list[str],
    log_level: str = "info",
    passed: list[Passed] | None = None,
    on_ready: Callable[[], Any] | None = None,
    handed: dict[str, Any] | None = None,
    on_bound: Callable[[], Any] | None = None,
) -> int:
    """The supervisor: run until a stop signal (STOP_SIGNALS); returns the process exit code.

    `passed`, `on_ready`, `handed`: started by `lbproxy upgrade` (runtime/upgrade.py), the
    old process's sockets, what to call once every worker is ready, and the hand-over
    (the old supervisor's runtime changes); `on_bound` is called once every socket is
    bound, before a worker starts. Else systemd's sockets, if it passed any."""
    logs.configure(config.global_.log_format, log_level)
    if passed is None:  # an upgrade's new process is named once it serves (takeover.py)
        process_title.name_serving_process()
    privileges.warn_if_root(config.global_)
    SECRETS.read_all(config.secret_files)  # before the drop (privileges.py)
    if config.global_.cluster.redis is not None:
        instance_id()  # the workers and an upgrade's new supervisor inherit it
    token = None
    admin = config.global_.admin
    if admin.listen and admin.token_file:
        try:
            token = read_token(admin.token_file)
        except TokenError as exc:
            log.error("%s", exc)
            return 2
    listeners: dict[str, socket.socket] = {}
    admin_sock = None
    admin_socket = None
    # Sockets from an upgrade or systemd (TCP and the admin endpoint: a worker binds
    # its UDP and DNS sockets itself), else bound here (lbproxy/runtime/inherit.py).
    # Every address is tried even after one failed, so all failures are reported at once.
    failures: list[BindError] = []
    failed: set[str] = set()  # each address tried once, named once
    try:
        inherited = Inherited(passed) if passed is not None else Inherited.from_systemd()
    except BindError as exc:
        log.error("%s", exc)
        return 1
    if admin.listen:
        try:
            key = f"admin {admin.listen}"
            admin_sock = inherited.take(key, admin.listen, udp=False, names=["admin"])
            admin_sock = admin_sock or _bind(inherited, admin.listen)
        except BindError as exc:
            failures.append(BindError(f"{exc} (the admin endpoint, global.admin.listen)"))
    try:
        admin_socket = open_admin_socket(config.global_, inherited)
    except BindError as exc:
        failures.append(exc)
    for vs in config.virtual_servers:  # the workers' TCP sockets (package header)
        if vs.protocol == "tcp":
            for address in vs.listen:
                key = str(address)
                if key not in listeners and key not in failed:
                    alone = [vs.name] if len(vs.listen) == 1 else []
                    try:
                        sock = inherited.take(key, address, udp=False, names=alone)
                        listeners[key] = sock or _bind(inherited, address)
                    except BindError as exc:
                        names = ", ".join(
                            other.name
                            for other in config.virtual_servers
                            if other.protocol == "tcp" and address in other.listen
                        )
                        failures.append(BindError(f"{exc} (virtual server {names})"))
                        failed.add(key)
    if passed is None:  # an upgrade's old workers hold them, perhaps as global.user
        failures += _try_worker_binds(config, inherited)
    if not failures:
        try:
            inherited.check_all_used()
        except BindError as exc:
            failures.append(exc)
    if failures:
        for line in BindError.together(failures).messages:
            log.error("%s", line)
        for sock in [*listeners.values(), admin_sock]:
            if sock is not None:
                sock.close()
        if admin_socket is not None:
            admin_socket.close(serving=False)
        return 1
    if on_bound is not None:
        on_bound()
    supervisor = Supervisor(config, config_paths, token, log_level, listeners)
    try:  # every socket bound, every secret read: the workers start as global.user
        owned = [supervisor.folder]
        if admin_socket is not None:
            owned += admin_socket.owned_paths()
        privileges.drop(config.global_, owned=owned)
    except privileges.PrivilegeError as exc:
        log.error("%s", exc)
        shutil.rmtree(supervisor.folder, ignore_errors=True)
        if admin_socket is not None:
            admin_socket.close(serving=False)
        return 1
    supervisor.inherited = inherited
    supervisor.admin_listener = admin_sock
    supervisor.admin_socket = admin_socket
    supervisor.on_ready = on_ready
    if handed is not None:  # the old supervisor's PATCHes and load reports, replayed
        supervisor.overrides = [(p, b.encode()) for p, b in handed.get("overrides", ())]
        supervisor.load_reports = {p: b.encode() for p, b in handed.get("load_reports", {}).items()}
        for method, path, body in handed.get("topology", ()):
            vs_name, _, rs_name = path.removeprefix("/api/v1/virtual-servers/").partition("/")
            supervisor.topology[(vs_name, rs_name)] = (method, path, body.encode())
        state = handed.get("state")
        supervisor.handed_state = state if isinstance(state, str) else None
    # Taken out of the environment before any worker starts: workers never notify.
    supervisor.notifier = Notifier.from_environment()
    supervisor.notifier.main_pid = passed is not None  # an upgrade: MAINPID= with READY=1
    log.info("starting %d workers", len(supervisor.workers))
    admin_socks = [admin_sock] if admin_sock is not None else []
    if admin_socket is not None:
        admin_socks.append(admin_socket.sock)
    try:
        trio.run(supervisor.main, admin_socks)
    finally:
        shutil.rmtree(supervisor.folder, ignore_errors=True)
        if admin_socket is not None:
            admin_socket.close()
    return supervisor.exit_code


def _bind(inherited: Inherited, address: Address) -> socket.socket:
    """listen_socket(), its BindError naming the sockets passed, if any were."""
    try:
        return listen_socket(address)
    except BindError as exc:
        if not inherited:
            raise
        raise BindError(f"{exc}{inherited.missing(str(address))}") from None


def _try_worker_binds(config: Config, inherited: Inherited) -> list[BindError]:
    """Each worker binds the UDP listen addresses and the DNS locator itself, with
    SO_REUSEPORT (package header), once it runs. A trial bind of each here, with the
    workers' options, before any of them starts, reports an address in use once and
    beside the TCP ones, as `lbproxy run` without workers does, instead of once per
    worker after they started. An address a passed socket holds is not tried."""
    failures = []
    for vs in config.virtual_servers:
        if vs.protocol == "udp":
            for address in vs.listen:
                if any(p.udp and p.bound_to(address) for p in inherited.passed):
                    continue
                try:
                    udp_socket(UdpAddress(address.host, address.port), reuse_port=True).close()
                except BindError as exc:
                    failures.append(BindError(f"{exc} (virtual server {vs.name})"))
    dns = config.global_.locator.dns
    if dns is not None:
        try:
            for sock in DnsLocator.bind(dns.listen, reuse_port=True):
                sock.close()
        except OSError as exc:
            failures.append(dns_bind_error(dns.listen, exc))
    return failures


def tcp_listen(config: Config) -> dict[str, Address]:
    """The TCP listen addresses of `config`, by the key the supervisor's listeners have."""
    return {
        str(address): address
        for vs in config.virtual_servers
        if vs.protocol == "tcp"
        for address in vs.listen
    }


def _alone(config: Config, key: str) -> list[str]:
    """The TCP virtual servers with the one listen address `key` (a passed socket's name
    may stand for it, runtime/inherit.py)."""
    return [
        vs.name
        for vs in config.virtual_servers
        if vs.protocol == "tcp" and len(vs.listen) == 1 and str(vs.listen[0]) == key
    ]


def tcp_addresses(config: Config) -> set[str]:
    """The TCP listen addresses of `config`, as the supervisor's listeners are keyed."""
    return {
        str(address)
        for vs in config.virtual_servers
        if vs.protocol == "tcp"
        for address in vs.listen
    }
