"""The running proxy: the nursery tree, signals, reload and graceful stop.

The nursery tree (hypercorn's `worker_serve` is the model):

    handlers nursery          every client connection; given a deadline on shutdown
      service nursery         accept loops, signal handling, health checks, admin
                              endpoint; cancelled first on shutdown, so accepting stops
                              at once while connections drain

`serve()` reports `task_status.started(server)` only once every listener is bound.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import socket
from collections.abc import Callable, Sequence
from typing import Any

import trio

from lbproxy.admin.api import TokenError, read_token, serve_admin
from lbproxy.config.model import Address, Config, ConfigError, IPNetwork, VirtualServerConfig
from lbproxy.config.reader import load, read_real_server
from lbproxy.config.secret_files import SECRETS
from lbproxy.control.agent_checks import AgentChecks
from lbproxy.control.checks import HealthChecks, close_leases
from lbproxy.control.cluster import Cluster
from lbproxy.control.conditioning import Conditioners
from lbproxy.control.discovery import Discoveries
from lbproxy.control.drain_close import DrainCloses, shutdown_sessions
from lbproxy.control.snmp import SnmpPollers
from lbproxy.control.throttle_monitor import Throttles
from lbproxy.core.discovery_model import AddressPolicy, address_policy
from lbproxy.core.per_source import PerSourceTable
from lbproxy.core.pool import DISABLED, DRAIN, Pool, RealServer, state_error
from lbproxy.core.topology import RuntimeTopology
from lbproxy.dataplane import queue as waiting
from lbproxy.dataplane.listener import BindError, Listener, failure_lines, listen_socket
from lbproxy.dataplane.udp import UdpAddress, UdpListener, listen_keys, udp_socket
from lbproxy.dataplane.virtual_server import VirtualServer
from lbproxy.locator.dns_server import DnsLocator
from lbproxy.net.descriptors import apply_max_clients
from lbproxy.runtime import logs, privileges, process_title
from lbproxy.runtime import state as runtime_state
from lbproxy.runtime.admin_socket import AdminSocket, handover_name, open_admin_socket
from lbproxy.runtime.inherit import Inherited, Passed
from lbproxy.runtime.notify import STATUS_INTERVAL, Notifier, status_line
from lbproxy.runtime.upgrade import Outcome, Upgrade
from lbproxy.wire.cluster_messages import Change, EntryBatch

RATE_INTERVAL = 1.0  # seconds between readings of the connection rates (SPEC §24)

log = logging.getLogger("lbproxy.server")

# Each one a graceful stop, the same one: stop accepting, drain, exit 0. SIGTERM is what
# service managers send; SIGINT is Ctrl-C; SIGUSR1 is HAProxy's soft stop and SIGQUIT
# nginx's graceful shutdown, so an operator used to either drains instead of killing
# the process at once (their default actions: terminate, and dump core).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGQUIT)

REMOVED_POLL = 0.1  # seconds between looks at a removed server that still has connections


def dns_bind_error(listen: Address, exc: OSError, hint: str = "") -> BindError:
    """Why the DNS locator's address cannot be bound, as every bind failure is named."""
    return BindError(f"cannot listen on {listen} (DNS locator): {exc.strerror}{hint}")


def load_for_reload(paths: Sequence[str]) -> Config | list[str]:
    """Load the files again for a reload: the new Config, or every problem as
    `FILE:LINE: message`, each logged, with the running configuration left alone."""
    try:
        return load(paths)
    except ConfigError as exc:
        messages = [str(problem) for problem in exc.problems]
        for message in messages:
            log.error("reload: %s", message)
        log.error("reload failed; the running configuration is unchanged")
        return messages


class Server:
    def __init__(
        self,
        config: Config,
        config_paths: Sequence[str] = (),
        admin_token: str | None = None,
        *,
        reuse_port: bool = False,
        admin_sock: socket.socket | None = None,
        cluster_name: str | None = None,
        admin_socket: bool = True,
    ) -> None:
        self.config = config
        self.admin_token = admin_token
        # A worker (lbproxy/runtime/workers/worker.py): listeners shared with SO_REUSEPORT, and the
        # admin endpoint on this bound socket instead of global.admin.listen.
        self.reuse_port = reuse_port
        self.admin_sock = admin_sock
        # Serve global.admin.socket (runtime/admin_socket.py); a worker does not: its
        # supervisor does.
        self.serves_admin_socket = admin_socket
        self.admin_socket: AdminSocket | None = None  # once bound; handed over on an upgrade
        # Started by an upgrade: the previous process answers on the admin endpoint and
        # the DNS locator until this one is ready, so this one serves them only then (a
        # client must never meet a process that does not know its virtual servers yet).
        self.takes_over = False
        self.config_paths = list(config_paths)
        self.virtual_servers: dict[str, VirtualServer] = {}
        self.listeners: dict[Address, Listener] = {}
        self.ready = False
        # Once serving, freeze what exists out of the cyclic collector's way (below): a
        # decision for the process, so only a process's own main (run(), a worker's)
        # makes it, not a Server run inside another program (a test).
        self.freeze_heap = False
        self.draining = False
        self.reloads = {"ok": 0, "error": 0}
        self._stop = trio.Event()
        self._finished = trio.Event()
        self._handlers: trio.Nursery | None = None
        self._service: trio.Nursery | None = None
        self.throttles = Throttles()  # one admission-control monitor per throttled VS
        self.checks = HealthChecks()  # one health-check task per real server
        self.agents = AgentChecks()  # one agent-check task per real server with an agent
        self.snmp = SnmpPollers()  # one SNMP poller per real server of dwd/dwr/least-load
        self.discovery = Discoveries(self)  # one DNS discovery task per VS with discovery.dns
        # real servers added and removed through the API, per virtual server (SPEC §24)
        self.topology: dict[str, RuntimeTopology] = {}
        # systemd's notify protocol: a no-op unless run() finds $NOTIFY_SOCKET (never in
        # a worker of `workers: N`, where the supervisor notifies)
        self.notifier = Notifier()
        self.drain_closes = DrainCloses()  # a drain's close_after / close_rate, per server
        self.conditioners = Conditioners()  # one per virtual server with `conditioning:`
        self.dns: DnsLocator | None = None  # global.locator.dns, once bound
        # Listening sockets passed by systemd or by the lbproxy this one replaces
        # (lbproxy/runtime/inherit.py): an address they cover is not bound again.
        self.inherited = Inherited(())
        self.log_level = "info"  # what `lbproxy upgrade` starts the next process with
        self._admin_listener: socket.socket | None = None  # to hand over on an upgrade
        self._dns_socks: tuple[socket.socket, socket.socket] | None = None
        self._endpoints = trio.CancelScope()  # the admin endpoint and the DNS locator
        self._upgrading = False
        # discovery's address policies, per allow_addresses, for the configuration now
        self._discovery_policies: tuple[Config | None, dict[tuple[IPNetwork, ...], AddressPolicy]]
        self._discovery_policies = (None, {})
        # global.cluster (SPEC §18): runtime changes and persistence shared through Redis.
        # Not changed by a reload (like global.locator): it is this process's identity.
        cluster = config.global_.cluster
        self.cluster = Cluster(cluster, self, cluster_name) if cluster.redis is not None else None
        # global.state_file (SPEC §17, lbproxy/runtime/state.py): `initial_state`, when
        # set before serve(), is restored instead of the file (`lbproxy upgrade`).
        self.initial_state: bytes | None = None
        # True: `initial_state` is one old worker's, and the file's parts hold the other
        # workers' persistence entries, which are read after it.
        self.initial_state_is_one_workers = False
        self.state_writer = runtime_state.StateWriter(self)
        # Paths this process creates as root before it drops its privileges (an admin
        # socket) that global.user must own afterwards: chowned just before the drop
        # (lbproxy/runtime/privileges.py).
        self.owned_paths: list[str] = []

    # -- life cycle ---------------------------------------------------------------

    async def serve(
        self,
        *,
        task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
        handle_signals: bool = True,
    ) -> None:
        # Bind before any task starts, so a bad address fails plainly (exit code 1), and
        # try every address even after one failed: all failures are reported together.
        failures: list[BindError] = []
        bound: list[Listener] = []
        try:
            bound, _ = self._bind_virtual_servers(self.config.virtual_servers, trio.current_time())
        except BindError as exc:
            failures.append(exc)
        admin_address = self.config.global_.admin.listen
        admin_sock = self.admin_sock
        if admin_sock is None and admin_address:
            try:
                key = f"admin {admin_address}"
                admin_sock = self.inherited.take(key, admin_address, udp=False, names=["admin"])
                if admin_sock is None:
                    admin_sock = self._listen(admin_address, listen_socket)
            except BindError as exc:
                failures.append(BindError(f"{exc} (the admin endpoint, global.admin.listen)"))
        dns_socks = None
        try:
            if self.serves_admin_socket:
                self.admin_socket = open_admin_socket(self.config.global_, self.inherited)
        except BindError as exc:
            failures.append(exc)
        try:
            dns_socks = self._bind_dns()
        except BindError as exc:
            failures.append(exc)
        if not failures:
            try:
                self.inherited.check_all_used()  # a passed socket nothing took: an error
            except BindError as exc:
                failures.append(exc)
        if failures:
            for sock in [listener.sock for listener in bound] + [admin_sock, *(dns_socks or ())]:
                if sock is not None and sock is not self.admin_sock:
                    sock.close()
            if self.admin_socket is not None:
                self.admin_socket.close(serving=False)
            self.inherited.close()
            raise BindError.together(failures)
        # Clients beyond it are closed at accept, so descriptors stay for the rest.
        apply_max_clients(self.config.global_.max_clients)
        # Every listener bound and every secret read (run()): global.user from here on.
        try:
            owned = list(self.owned_paths)
            if self.admin_socket is not None:
                owned += self.admin_socket.owned_paths()
            privileges.drop(self.config.global_, owned)
        except privileges.PrivilegeError:
            for sock in [listener.sock for listener in bound] + [admin_sock, *(dns_socks or ())]:
                if sock is not None and sock is not self.admin_sock:
                    sock.close()
            raise
        # The admin endpoint outlives the drain (so /readyz can answer 503 meanwhile)
        # and is cancelled once the last connection is done; the DNS locator with it.
        if self.admin_sock is None:
            self._admin_listener = admin_sock
        self._dns_socks = dns_socks
        unix_sock = self.admin_socket.sock if self.admin_socket is not None else None
        admin_socks = [sock for sock in (admin_sock, unix_sock) if sock is not None]
        try:
            async with trio.open_nursery() as admin:
                if not self.takes_over:  # /readyz answers 503 while it starts
                    await admin.start(self._serve_endpoints, admin_socks, dns_socks)
                await admin.start(self._serve, bound, handle_signals)
                if self.takes_over:
                    await admin.start(self._serve_endpoints, admin_socks, dns_socks)
                task_status.started(self)
                if self.notifier.enabled:
                    self.notifier.ready(self.status_line())
                    admin.start_soon(self._report_status)
                admin.start_soon(self._sample_rates)
                await self._finished.wait()
                await self.state_writer.write_if_changed()  # after the drain: the final state
                admin.cancel_scope.cancel()
        finally:
            if self.admin_socket is not None:
                self.admin_socket.close()
        log.info("stopped")

    async def _serve_endpoints(
        self,
        admin_socks: list[socket.socket],
        dns_socks: tuple[socket.socket, socket.socket] | None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The admin endpoint (TCP and the admin socket) and the DNS locator, in a scope
        of their own: an upgrade stops them at once (the new process answers there), the
        drain does not."""
        with self._endpoints:
            async with trio.open_nursery() as nursery:
                if admin_socks:
                    path = self.admin_socket.path if self.admin_socket is not None else None
                    await nursery.start(serve_admin, self, admin_socks, self.admin_token, path)
                if dns_socks is not None and self.dns is not None:
                    await nursery.start(self.dns.serve, *dns_socks)
                task_status.started()

    def endpoint_sockets(self) -> list[tuple[str, socket.socket]]:
        """The admin endpoint's, the admin socket's and the DNS locator's listening
        sockets, named for the hand-over (lbproxy/runtime/inherit.py and
        runtime/admin_socket.py look them up by these names)."""
        named = []
        admin = self.config.global_.admin.listen
        if self._admin_listener is not None and admin is not None:
            named.append((f"admin {admin}", self._admin_listener))
        if self.admin_socket is not None:
            named.append((handover_name(self.admin_socket.path), self.admin_socket.sock))
        dns = self.config.global_.locator.dns
        if self._dns_socks is not None and dns is not None:
            named.append((f"dns {dns.listen}/udp", self._dns_socks[0]))
            named.append((f"dns {dns.listen}", self._dns_socks[1]))
        return named

    def handover_sockets(self) -> list[tuple[str, socket.socket]]:
        """The listening sockets an upgrade hands over: the listeners, the admin
        endpoint, the DNS locator (runtime/upgrade.py's HandsOver)."""
        named = [(str(address), listener.sock) for address, listener in self.listeners.items()]
        named.extend(self.endpoint_sockets())
        return named

    def handover_state(self) -> dict[str, Any]:
        """lbproxy/runtime/state.py's snapshot, as the state file holds it (JSON text),
        with what only a hand-over carries (each server's timeline, and the health of
        those actively checked): the new process starts from it."""
        return {"state": runtime_state.snapshot(self, handover=True).decode()}

    async def upgrade(self, config_paths: Sequence[str] = ()) -> Outcome:
        """`lbproxy upgrade`, SIGUSR2: start the lbproxy on disk now with this process's
        listening sockets and runtime state (lbproxy/runtime/upgrade.py); once it is ready,
        stop accepting and drain. A new process that fails leaves this one serving."""
        if self.draining or self._upgrading:
            busy = "draining" if self.draining else "an upgrade is already running"
            return Outcome(False, error=f"cannot upgrade: {busy}", exit=1)
        self._upgrading = True
        try:
            outcome = await Upgrade(self, config_paths or self.config_paths, self.log_level).run()
        finally:
            self._upgrading = False
        if not outcome.ok:  # the new process's stderr, in this log above, says more
            log.error("upgrade failed, still serving: %s", outcome.error)
            return outcome
        log.info("upgraded: pid %s serves now; this process stops accepting", outcome.pid)
        process_title.set_title(process_title.HANDED_OVER)
        if self.admin_socket is not None:  # its file is the new process's now
            self.admin_socket.handed_over = True
        # The new process is the service's main process now: STOPPING=1 from this one
        # would tell systemd the service stops.
        self.notifier.close()
        self.notifier = Notifier()
        self.state_writer.enabled = False  # the new process owns global.state_file now
        self._endpoints.cancel()
        self.close_udp_listeners()
        self.stop()
        return outcome

    def close_udp_listeners(self) -> None:
        """After a hand-over. A UDP socket is read by whoever asks first (and, with
        workers, the kernel spreads datagrams over the old workers' SO_REUSEPORT sockets
        and the new ones'): a draining relay here would take (and drop) datagrams of
        clients the new process should serve. So this process's UDP sessions end now; a
        client's next datagram opens one there."""
        for address, listener in list(self.listeners.items()):
            if isinstance(listener, UdpListener):
                self.listeners.pop(address).close()

    async def _upgrade_on_signal(self) -> None:
        await self.upgrade()  # logged either way

    def status_line(self) -> str:
        """systemd's STATUS= text: virtual servers and active connections."""
        active = sum(vs.pool.active for vs in self.virtual_servers.values())
        return status_line(len(self.virtual_servers), active, "draining" if self.draining else "")

    async def _sample_rates(self) -> None:
        """Each second, every pool reads its servers' connection counts into their rates
        (SPEC §24): the connection path only increments the count it already keeps."""
        while True:
            await trio.sleep(RATE_INTERVAL)
            now = trio.current_time()
            for vs in self.virtual_servers.values():
                vs.pool.sample_rates(now)

    async def _report_status(self) -> None:
        while True:
            await trio.sleep(STATUS_INTERVAL)
            self.notifier.status(self.status_line())

    def _bind_dns(self) -> tuple[socket.socket, socket.socket] | None:
        """Bind global.locator.dns (UDP and TCP), or None when it is not configured."""
        config = self.config.global_.locator.dns
        if config is None:
            return None
        udp = self.inherited.take(
            f"dns {config.listen}/udp", config.listen, udp=True, names=["dns"]
        )
        tcp = self.inherited.take(f"dns {config.listen}", config.listen, udp=False, names=["dns"])
        if udp is not None and tcp is not None:
            socks = udp, tcp
        else:
            for sock in (udp, tcp):  # both passed, or both bound here
                if sock is not None:
                    sock.close()
            try:
                socks = DnsLocator.bind(config.listen, self.reuse_port)
            except OSError as exc:
                hint = self.inherited.missing(str(config.listen))
                raise dns_bind_error(config.listen, exc, hint) from None
        self.dns = DnsLocator(config, self.virtual_servers)
        return socks

    @property
    def dns_queries(self) -> dict[str, int]:
        """DNS locator answers by rcode, for the metrics."""
        return dict(self.dns.rcodes) if self.dns is not None else {}

    def _add_locator_only(self, configs: Sequence[VirtualServerConfig], now: float) -> list[str]:
        """Virtual servers with `listen: none`: no listener registers them, so do it here."""
        added = []
        for vs_config in configs:
            if not vs_config.listen and vs_config.name not in self.virtual_servers:
                vs = VirtualServer(Pool(vs_config, now))
                vs.access_log = self.config.global_.access_log
                self.virtual_servers[vs_config.name] = vs
                added.append(f"{vs_config.name}: locator only (listen: none)")
        if added:  # back to configuration order, in place (the DNS locator holds the dict)
            order = {vs_config.name: i for i, vs_config in enumerate(configs)}
            running = sorted(self.virtual_servers.items(), key=lambda kv: order.get(kv[0], 0))
            self.virtual_servers.clear()
            self.virtual_servers.update(running)
        return added

    def pools(self) -> list[Pool]:
        """The pools of the configured virtual servers, in configuration order."""
        return [vs.pool for vs in self.virtual_servers.values()]

    def shared_sources(self) -> dict[str, PerSourceTable]:
        """The per-source tables the cluster shares (`per_source.shared`)."""
        shared = {}
        for name, vs in self.virtual_servers.items():
            config = vs.pool.config.per_source
            if config is not None and config.shared:
                vs.sync_per_source(config)  # a reload's limits, before any connection
                if vs.per_source is not None:
                    shared[name] = vs.per_source
        return shared

    async def _serve(
        self,
        bound: list[Listener],
        handle_signals: bool,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            await self._serve_until_drained(bound, handle_signals, task_status)
        finally:
            self._finished.set()

    async def _serve_until_drained(
        self, bound: list[Listener], handle_signals: bool, task_status: trio.TaskStatus[None]
    ) -> None:
        async with trio.open_nursery() as handlers:
            self._handlers = handlers
            async with trio.open_nursery() as service:
                self._service = service
                for listener in bound:
                    self._register(listener)
                self._add_locator_only(self.config.virtual_servers, trio.current_time())
                # The files, then the saved runtime state, then the cluster's changes.
                runtime_state.read_at_start(self)
                service.start_soon(self.state_writer.run)
                if self.cluster is not None:
                    # The file first, then the cluster's changes (as a reload would),
                    # before the first connection is accepted; at once without Redis.
                    self.cluster.share_entries()
                    await service.start(self.cluster.run)
                for listener in bound:
                    self._start_accepting(listener)
                self.conditioners.sync(self.virtual_servers.values(), service)
                self.throttles.sync(self.virtual_servers.values(), service)
                self._sync_queues()
                self.checks.sync(self.virtual_servers.values(), service)
                self.agents.sync(self.virtual_servers.values(), service)
                self.snmp.sync(self.virtual_servers.values(), service)
                self.discovery.sync(self.virtual_servers.values(), service)
                if handle_signals:
                    await service.start(self._signals)
                # What exists now (modules, the configuration, tables read at start)
                # lives as long as the process: out of the cyclic collector's way, so a
                # full collection, which a table growing by thousands of entries sets
                # off, walks only what came later instead of stalling every connection.
                if self.freeze_heap:
                    gc.collect()
                    gc.freeze()
                self.ready = True
                log.info(
                    "listening on %s",
                    ", ".join(str(address) for address in self.listeners)
                    or "nothing (locator only)",
                )
                task_status.started()
                await self._stop.wait()
                service.cancel_scope.cancel()
            for listener in self.listeners.values():
                if not isinstance(listener, UdpListener):  # its sessions drain on it
                    listener.close()
            open_now = sum(vs.pool.clients for vs in self.virtual_servers.values())
            log.info(
                "stopped accepting; draining %d connection(s) for up to %ss",
                open_now,
                self.config.global_.drain_timeout,
            )
            handlers.cancel_scope.deadline = trio.current_time() + self.config.global_.drain_timeout

    def stop(self) -> None:
        """Stop accepting at once; connections get `drain_timeout` to finish."""
        first = not self.draining
        self.draining = True
        if first:
            self.notifier.stopping(self.status_line())
        self._stop.set()

    async def _signals(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
        signals = (signal.SIGHUP, signal.SIGUSR2, *STOP_SIGNALS)
        with trio.open_signal_receiver(*signals) as sigs:
            task_status.started()
            async for signum in sigs:
                if signum == signal.SIGHUP:
                    self.reload()
                elif signum == signal.SIGUSR2:  # as nginx: start the new binary
                    if self._service is not None and self.admin_sock is None:
                        self._service.start_soon(self._upgrade_on_signal)
                else:
                    log.info("received %s; stopping gracefully", signal.Signals(signum).name)
                    self.stop()

    # -- listeners ----------------------------------------------------------------

    def _bind_virtual_servers(
        self, configs: Sequence[VirtualServerConfig], now: float
    ) -> tuple[list[Listener], dict[Address, list[VirtualServer]]]:
        """Bind every listen address not bound yet; all or nothing (raises BindError,
        naming every address that failed with its virtual servers).

        Returns the new listeners and, for every address wanted, the virtual servers
        it is to feed (configuration order; new ones made here, unregistered until
        the caller commits). An address already bound is never bound again: when only
        the set of virtual servers on it changes, its listener is re-routed
        (`Listener.route`), so there is no moment where connections are refused.
        """
        routes: dict[Address, list[VirtualServer]] = {}
        for vs_config in configs:
            vs = self.virtual_servers.get(vs_config.name)
            if vs is None:
                vs = VirtualServer(Pool(vs_config, now))
                vs.access_log = self.config.global_.access_log
            for address in listen_keys(vs_config.protocol, vs_config.listen):
                routes.setdefault(address, []).append(vs)
        bound: list = []
        failures: list[BindError] = []
        for address, virtual_servers in routes.items():
            if address in self.listeners:
                continue
            udp = isinstance(address, UdpAddress)
            # A virtual server with this one address may be named by a passed socket.
            alone = [vs.name for vs in virtual_servers if len(vs.pool.config.listen) == 1]
            try:
                sock = self.inherited.take(str(address), address, udp=udp, names=alone)
                if udp:
                    sock = sock or self._listen(address, udp_socket)
                    bound.append(UdpListener(address, sock, virtual_servers))
                else:
                    sock = sock or self._bind(address)
                    bound.append(Listener(address, sock, virtual_servers))
            except BindError as exc:  # the next addresses are still tried, to name them all
                names = ", ".join(vs.name for vs in virtual_servers)
                failures.append(BindError(f"{exc} (virtual server {names})"))
        if failures:
            for listener in bound:
                listener.sock.close()
            raise BindError.together(failures)
        return bound, routes

    def _bind(self, address: Address) -> socket.socket:
        sock = self._listen(address, listen_socket)
        sock.setblocking(False)
        return sock

    def _listen(
        self, address: Address, bind: Callable[[Address, bool], socket.socket]
    ) -> socket.socket:
        """Bind `address`; a BindError also names the sockets passed, if any were."""
        try:
            return bind(address, self.reuse_port)
        except BindError as exc:
            if not self.inherited:
                raise
            raise BindError(f"{exc}{self.inherited.missing(str(address))}") from None

    def _start_listener(self, listener: Listener) -> None:
        self._register(listener)
        self._start_accepting(listener)

    def _register(self, listener: Listener) -> None:
        self.listeners[listener.address] = listener
        for vs in listener.virtual_servers:
            self.virtual_servers.setdefault(vs.name, vs)

    def _start_accepting(self, listener: Listener) -> None:
        assert self._service is not None and self._handlers is not None
        self._service.start_soon(listener.accept_loop, self._handlers)

    # -- runtime changes (admin API) ----------------------------------------------

    def set_state(
        self,
        vs_name: str,
        rs_name: str,
        state: object,
        close_after: float | None = None,
        close_rate: float | None = None,
    ) -> str | None:
        """Set a real server's state (enabled | drain | disabled); returns an error or None.

        The one path for a runtime state change: `disabled` also closes the server's
        established connections (`drain` lets them finish; a drain with `close_after`
        closes those still open then, at most `close_rate` a second: control/
        drain_close.py). Lasts until the next reload, which applies the file as written.
        """
        found = self._find(vs_name, rs_name)
        if isinstance(found, str):
            return found
        pool, rs = found
        error = state_error(state)
        if error:
            return error
        self.apply_state(pool, rs, state)  # type: ignore[arg-type]  # state_error(): a str
        if state == DRAIN:  # a drain replaces the closes a previous one left pending
            self.drain_closes.cancel(pool, rs)
            if self._service is not None and (close_after is not None or close_rate is not None):
                self.drain_closes.schedule(self._service, pool, rs, close_after or 0.0, close_rate)
        if self.cluster is not None:
            self.cluster.publish("state", pool.name, rs.name, state)
        return None

    def apply_state(self, pool: Pool, rs: RealServer, state: str, via: str = "") -> None:
        """Set a valid state, logged with `via` (where it came from), not published:
        set_state's step, and how the cluster and the state file apply theirs."""
        old = rs.state
        if state != DRAIN:  # enabled again (or disabled): no drain closes pending
            self.drain_closes.cancel(pool, rs)
        closed = close_leases(pool.set_state(rs, state, trio.current_time()))
        if old != state or closed:
            log.info(
                "%s/%s: state %s -> %s%s%s",
                pool.name,
                rs.name,
                old,
                state,
                f"; closed {closed} connection(s)" if closed else "",
                via,
            )

    def shutdown_sessions(self, vs_name: str, rs_name: str) -> int | str:
        """Close a real server's connections now (`reason="shutdown"`); how many, or an
        error (no such server)."""
        found = self._find(vs_name, rs_name)
        if isinstance(found, str):
            return found
        return shutdown_sessions(*found)

    def set_weight(self, vs_name: str, rs_name: str, weight: object) -> str | None:
        """Set a real server's static weight (an integer 0..65535); returns an error or None.

        Lasts until the next reload, which applies the file as written.
        """
        found = self._find(vs_name, rs_name)
        if isinstance(found, str):
            return found
        pool, rs = found
        error = self.apply_weight(pool, rs, weight)
        if error is None and self.cluster is not None:
            self.cluster.publish("weight", pool.name, rs.name, weight)
        return error

    def apply_weight(self, pool: Pool, rs: RealServer, weight: object, via: str = "") -> str | None:
        """Set a static weight, logged with `via`, not published; an error or None (as
        apply_state, for set_weight, the cluster and the state file)."""
        old = rs.static_weight
        error = pool.set_weight(rs, weight, trio.current_time())
        if error is None and old != rs.static_weight:
            log.info("%s/%s: weight %g -> %g%s", pool.name, rs.name, old, rs.static_weight, via)
        return error

    def report_load(
        self, vs_name: str, rs_name: str, load: object, per_connection: object = None
    ) -> str | None:
        """A real server's pushed load report (SPEC §10); returns an error or None."""
        found = self._find(vs_name, rs_name)
        if isinstance(found, str):
            return found
        pool, rs = found
        error = pool.locator.report_load(rs, load, per_connection)
        if error is None:
            log.debug("%s/%s: load report %r", pool.name, rs.name, pool.locator.reports[rs])
            if self.cluster is not None:
                # pool.locator.report_load() checked both are numbers (objects: JSON's)
                step = None if per_connection is None else float(per_connection)  # type: ignore[arg-type]  # see above
                self.cluster.publish("load", pool.name, rs.name, float(load), step)  # type: ignore[arg-type]  # see above
        return error

    # -- real servers added and removed at run time (SPEC §24) ---------------------

    def add_server(self, vs_name: str, entry: object, via: str = "") -> tuple[int, list[str]]:
        """Add a real server from its entry (a JSON object, read as a file's would be):
        (201, []) or (an HTTP status, every problem). With active checks it takes
        connections once its first check passes."""
        vs = self.virtual_servers.get(vs_name)
        vs_config = self._file_config(vs_name)
        if vs is None or vs_config is None:
            return 404, [f"no virtual server {vs_name!r}"]
        if vs_config.discovery is not None:
            return 409, [f"virtual server {vs_name!r} is fed by discovery"]
        read = read_real_server(entry, vs_config)
        if isinstance(read, list):
            return 400, read
        if read.name in vs.pool.by_name:
            return 409, [f"virtual server {vs_name!r} has a real server {read.name!r}"]
        self.topology.setdefault(vs_name, RuntimeTopology()).add(read, entry)  # type: ignore[arg-type]  # read: an object
        self.apply_topology(vs_name)
        rs = vs.pool.by_name.get(read.name)
        if rs is not None:
            vs.pool.await_first_check(rs, trio.current_time())
        log.info("%s/%s: added at %s%s", vs_name, read.name, read.address, via)
        if self.cluster is not None and not via:
            self.cluster.publish("topology", vs_name, read.name, entry)
        return 201, []

    def remove_server(self, vs_name: str, rs_name: str, via: str = "") -> tuple[int, str]:
        """Remove a real server: it takes no new connection and is gone with its last
        one. (200, "") when it went at once, (202, "") while it drains, else an HTTP
        status and why."""
        vs = self.virtual_servers.get(vs_name)
        vs_config = self._file_config(vs_name)
        if vs is None or vs_config is None:
            return 404, f"no virtual server {vs_name!r}"
        if vs_config.discovery is not None:
            return 409, f"virtual server {vs_name!r} is fed by discovery"
        rs = vs.pool.by_name.get(rs_name)
        topology = self.topology.setdefault(vs_name, RuntimeTopology())
        if rs is None:
            return 404, f"no real server {rs_name!r} in virtual server {vs_name!r}"
        if rs_name in topology.leaving:
            return 202, ""  # removed already, still draining
        in_file = next((c for c in vs_config.real_servers if c.name == rs_name), None)
        topology.remove(in_file or rs.config, in_file is not None, rs.active)
        self.apply_topology(vs_name)
        draining = rs_name in topology.leaving
        log.info("%s/%s: removed%s%s", vs_name, rs_name, " (draining)" if draining else "", via)
        if draining and self._service is not None:
            self._service.start_soon(self._drop_when_idle, vs_name, rs_name)
        if self.cluster is not None and not via:
            self.cluster.publish("topology", vs_name, rs_name, None)
        return (202 if draining else 200), ""

    def apply_topology(self, vs_name: str) -> list[str]:
        """Apply `vs_name`'s files with its runtime additions and removals, keeping every
        runtime change (states, weights); start or stop the checks of the servers that
        came or went."""
        vs = self.virtual_servers.get(vs_name)
        vs_config = self._file_config(vs_name)
        if vs is None or vs_config is None:
            return []
        merged = self._with_topology(vs_config)
        changes = self._reconfigure(vs, merged, trio.current_time(), keep_runtime=True)
        if self._service is not None and not self.draining:
            self.checks.sync(self.virtual_servers.values(), self._service)
            self.agents.sync(self.virtual_servers.values(), self._service)
            self.snmp.sync(self.virtual_servers.values(), self._service)
        return changes

    def _with_topology(self, vs_config: VirtualServerConfig) -> VirtualServerConfig:
        topology = self.topology.get(vs_config.name)
        if topology is None:
            return vs_config
        return topology.merged(vs_config, lambda name: self._active(vs_config.name, name))

    def _active(self, vs_name: str, rs_name: str) -> int:
        vs = self.virtual_servers.get(vs_name)
        rs = vs.pool.by_name.get(rs_name) if vs is not None else None
        return rs.active if rs is not None else 0

    def _file_config(self, vs_name: str) -> VirtualServerConfig | None:
        return next((c for c in self.config.virtual_servers if c.name == vs_name), None)

    async def _drop_when_idle(self, vs_name: str, rs_name: str) -> None:
        """Drop a removed server once its last connection has ended (bounded by them)."""
        while True:
            await trio.sleep(REMOVED_POLL)
            topology = self.topology.get(vs_name)
            if topology is None or rs_name not in topology.leaving:
                return
            if self._active(vs_name, rs_name) == 0:
                self.apply_topology(vs_name)
                log.info("%s/%s: gone (its last connection ended)", vs_name, rs_name)
                return

    # -- the cluster's changes (lbproxy/control/cluster.py's ClusterTarget) -------------

    def apply_change(self, change: Change) -> bool:
        """Apply a validated change from another instance, without publishing it again;
        False when this instance has no such virtual or real server."""
        via = f" (cluster: from {change.origin})"
        if change.kind == "topology":
            return self._apply_topology_change(change, via)
        found = self._find(change.virtual_server, change.real_server)
        if isinstance(found, str):
            return False
        pool, rs = found
        if change.kind == "state":
            self.apply_state(pool, rs, change.value, via)
        elif change.kind == "weight":
            self.apply_weight(pool, rs, change.value, via)
        else:
            pool.locator.report_load(rs, change.value, change.per_connection)
        return True

    def _apply_topology_change(self, change: Change, via: str) -> bool:
        """Another instance added (its entry) or removed (None) a real server; False
        when this instance has no such virtual server or cannot apply it."""
        vs_name, rs_name = change.virtual_server, change.real_server
        if vs_name not in self.virtual_servers:
            return False
        if change.value is None:
            status, _ = self.remove_server(vs_name, rs_name, via)
            return status in (200, 202, 404)  # 404: gone here already
        topology = self.topology.get(vs_name)
        if topology is not None and topology.entries.get(rs_name) == change.value:
            return True  # added here already, with the same entry
        if topology is not None and rs_name in topology.added:
            self.remove_server(vs_name, rs_name, via)  # replaced by the newer entry
        status, errors = self.add_server(vs_name, change.value, via)
        if status != 201:
            log.warning("%s/%s: not added%s: %s", vs_name, rs_name, via, "; ".join(errors))
        return status == 201

    def apply_entries(self, batch: EntryBatch, now: float) -> tuple[int, int]:
        """Persistence entries another instance made: into this instance's table."""
        vs = self.virtual_servers.get(batch.virtual_server)
        persistence = vs.pool.persistence if vs is not None else None
        if vs is None or persistence is None:
            return 0, len(batch.entries)
        applied = 0
        for entry in batch.entries:
            rs = vs.pool.by_name.get(entry.real_server)
            if rs is not None:
                persistence.learn(entry.client, rs, entry.ttl_ms / 1000, now)
                applied += 1
        return applied, len(batch.entries) - applied

    def cluster_document(self) -> dict[str, Any] | None:
        return self.cluster.document() if self.cluster is not None else None

    def _find(self, vs_name: str, rs_name: str) -> tuple[Pool, RealServer] | str:
        vs = self.virtual_servers.get(vs_name)
        if vs is None:
            return f"no virtual server {vs_name!r}"
        rs = vs.pool.by_name.get(rs_name)
        if rs is None:
            return f"no real server {rs_name!r} in virtual server {vs_name!r}"
        return vs.pool, rs

    # -- reload -------------------------------------------------------------------

    def reload(self, config_paths: Sequence[str] | None = None) -> tuple[bool, list[str]]:
        """Validate the configuration files again (or `config_paths`, which are then the
        running ones) and apply the difference.

        Returns (ok, messages): the changes applied, or every problem found. On any
        problem the running configuration stays as it was.
        """
        self.notifier.reloading()
        try:
            return self._reload(config_paths or self.config_paths)
        finally:  # READY=1 ends the reload for systemd, whether applied or refused
            self.inherited.close_unused_previous()  # a worker's, sent for it (runtime/workers/)
            self.notifier.ready(self.status_line())

    def _reload(self, config_paths: Sequence[str]) -> tuple[bool, list[str]]:
        new = load_for_reload(config_paths)
        if isinstance(new, list):
            self.reloads["error"] += 1
            return False, new
        try:
            changes = self.apply(new)
        except BindError as exc:
            log.error("reload failed; the running configuration is unchanged: %s", exc)
            self.reloads["error"] += 1
            return False, exc.messages
        self.reloads["ok"] += 1
        self.config_paths = list(config_paths)
        if self.cluster is not None:  # the files first, then the cluster's changes
            self.cluster.share_entries()
            self.cluster.reapply()
        log.info("reloaded: %s", "; ".join(changes) if changes else "no changes")
        return True, changes

    def apply(self, new: Config) -> list[str]:
        now = trio.current_time()
        # may raise BindError
        bound, routes = self._bind_virtual_servers(new.virtual_servers, now)
        changes: list[str] = []
        wanted = {vs.name: vs for vs in new.virtual_servers}
        wanted_addresses = {
            a for vs in new.virtual_servers for a in listen_keys(vs.protocol, vs.listen)
        }
        for name in list(self.virtual_servers):
            if name not in wanted:
                # Its connections keep their pool and finish on their own.
                del self.virtual_servers[name]
                self.topology.pop(name, None)  # its runtime servers went with it
                changes.append(f"removed virtual server {name}")
        for address in list(self.listeners):
            if address not in wanted_addresses:
                dropped = self.listeners.pop(address)
                kept = self.inherited.give_back(dropped.sock)  # systemd's: for a re-add
                dropped.close()
                changes.append(f"closed {address}" + (" (systemd's socket kept)" if kept else ""))
        for vs_config in new.virtual_servers:
            vs = self.virtual_servers.get(vs_config.name)
            if vs is None:
                changes.append(f"added virtual server {vs_config.name}")
            else:
                # The file's servers and those discovered so far (SPEC §14).
                merged = self.discovery.merged(vs_config, self)
                changes.extend(self._reconfigure(vs, self._with_topology(merged), now))
        by_name = {vs.name: vs for feeds in routes.values() for vs in feeds}
        for vs_config in new.virtual_servers:
            if vs_config.name in by_name:  # not a locator-only one: it has no address
                self.virtual_servers.setdefault(vs_config.name, by_name[vs_config.name])
        changes.extend(self._add_locator_only(new.virtual_servers, now))
        for address, feeds in routes.items():
            listener = self.listeners.get(address)
            if listener is None:
                continue
            # A kept address: re-routed after reconfigure(), so new sni names and alpn count.
            before = [vs.name for vs in listener.virtual_servers]
            listener.route(feeds)
            if [vs.name for vs in feeds] != before:
                changes.append(f"{address}: now feeds {', '.join(vs.name for vs in feeds)}")
        for listener in bound:
            self._start_listener(listener)
            names = ", ".join(vs.name for vs in listener.virtual_servers)
            changes.append(f"{names}: listening on {listener.address}")
        if new.global_.locator != self.config.global_.locator:
            log.warning("reload: global.locator changes take effect at the next restart")
        if new.global_.cluster != self.config.global_.cluster:
            log.warning("reload: global.cluster changes take effect at the next restart")
        self.config = new
        apply_max_clients(new.global_.max_clients)
        if self._service is not None and not self.draining:  # start/stop/retune throttles
            changes.extend(self.throttles.sync(self.virtual_servers.values(), self._service))
            self.checks.sync(self.virtual_servers.values(), self._service)
            self.agents.sync(self.virtual_servers.values(), self._service)
            self.snmp.sync(self.virtual_servers.values(), self._service)
            self.discovery.sync(self.virtual_servers.values(), self._service)
            changes.extend(self.conditioners.sync(self.virtual_servers.values(), self._service))
        changes.extend(self._sync_queues())
        for vs in self.virtual_servers.values():
            vs.access_log = new.global_.access_log
        return changes

    def _reconfigure(
        self, vs: VirtualServer, vs_config: VirtualServerConfig, now: float, **options: bool
    ) -> list[str]:
        """Apply one virtual server's new configuration to its pool (reload, discovery)."""
        changes = [
            f"{vs.name}: {change}" for change in vs.pool.reconfigure(vs_config, now, **options)
        ]
        # The one exception to "a reload never closes a connection": the file now says
        # `state: disabled`, which means exactly that (SPEC §6).
        disabled = [rs for rs in vs.pool.servers if rs.state == DISABLED and rs.leases]
        for rs in disabled:
            closed = close_leases(rs.leases)
            changes.append(f"{vs.name}: closed {closed} connection(s) of disabled {rs.name}")
        return changes

    # -- discovery (lbproxy/control/discovery.py) -------------------------------------------

    def apply_discovered(self, vs_name: str) -> list[str]:
        """A discovery round changed `vs_name`'s discovered servers: apply its file
        configuration merged with them, as a reload applies it, keeping every runtime
        change (PATCHed states and weights); then start or stop health checks and SNMP
        pollers for the servers that came or went."""
        vs = self.virtual_servers.get(vs_name)
        vs_config = next((c for c in self.config.virtual_servers if c.name == vs_name), None)
        if vs is None or vs_config is None or self.draining:
            return []
        merged = self.discovery.merged(vs_config, self)
        changes = self._reconfigure(vs, merged, trio.current_time(), keep_runtime=True)
        if self._service is not None:
            self.checks.sync(self.virtual_servers.values(), self._service)
            self.agents.sync(self.virtual_servers.values(), self._service)
            self.snmp.sync(self.virtual_servers.values(), self._service)
        if changes:
            log.info("discovery: %s", "; ".join(changes))
            if self.cluster is not None:  # a server that came may have cluster changes
                self.cluster.reapply()
        return changes

    def discovery_policy(self, allow: tuple[IPNetwork, ...]) -> AddressPolicy:
        """Which addresses discovery may use: none of this process's listeners."""
        config, policies = self._discovery_policies
        if config is not self.config:  # a reload: listeners may have changed
            self._discovery_policies = (self.config, policies := {})
        policy = policies.get(allow)
        if policy is None:
            policy = policies[allow] = address_policy(self.config, allow)
        return policy

    def discovered_active(self, vs_name: str, rs_name: str) -> int:
        """Connections open to a discovered server (0 when it is not in the pool)."""
        vs = self.virtual_servers.get(vs_name)
        rs = vs.pool.by_name.get(rs_name) if vs is not None else None
        return rs.active if rs is not None and rs.config.discovered else 0

    def _sync_queues(self) -> list[str]:
        """Give each virtual server the connection queue its configuration asks for."""
        changes = []
        for vs in self.virtual_servers.values():
            vs.queue, change = waiting.sync(vs.queue, vs.pool, vs.queue_stats)
            if change is not None:
                changes.append(f"{vs.name}: {change}")
        return changes


def raise_descriptor_limit() -> None:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit.

    Every connection holds two descriptors (client and real server) and two more per
    pipe in flight, so the common soft default of 1024 would cap lbproxy near 500
    connections. HAProxy raises its own limit the same way; the hard limit stays the
    administrator's to set (LimitNOFILE=, ulimit -Hn, --ulimit).
    """
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(
    config: Config,
    *,
    config_paths: Sequence[str] = (),
    log_level: str = "info",
    on_started: Callable[[Server], Any] | None = None,
    passed: list[Passed] | None = None,
    main_pid: bool = False,
    initial_state: bytes | None = None,
    initial_state_is_one_workers: bool = False,
) -> int:
    """Run until a stop signal (STOP_SIGNALS); returns the process exit code. `passed`: the sockets
    of the process this one replaces (an upgrade, which also sets `main_pid`: tell
    systemd this is the main process now, and passes its `initial_state`, one of its
    workers' when `initial_state_is_one_workers`); else systemd's, if it passed any."""
    logs.configure(config.global_.log_format, log_level)
    if passed is None:  # an upgrade's new process is named once it serves (takeover.py)
        process_title.name_serving_process()
    privileges.warn_if_root(config.global_)
    SECRETS.read_all(config.secret_files)  # before the drop (privileges.py)
    token = None
    if config.global_.admin.listen and config.global_.admin.token_file:
        try:
            token = read_token(config.global_.admin.token_file)
        except TokenError as exc:
            log.error("%s", exc)
            return 2
    server = Server(config, config_paths, admin_token=token)
    server.log_level = log_level
    server.freeze_heap = True
    server.initial_state = initial_state
    server.initial_state_is_one_workers = initial_state_is_one_workers
    server.notifier = Notifier.from_environment()
    server.notifier.main_pid = main_pid
    server.takes_over = passed is not None
    try:
        server.inherited = Inherited(passed) if passed is not None else Inherited.from_systemd()
    except BindError as exc:
        log.error("%s", exc)
        return 1

    failures: list[str] = []
    try:
        trio.run(_serve_main, server, on_started)
    except* (BindError, privileges.PrivilegeError) as group:
        failures.extend(failure_lines(group))
    for failure in failures:
        log.error("%s", failure)
    return 1 if failures else 0


async def _serve_main(server: Server, on_started: Callable[[Server], Any] | None) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        if on_started is not None:
            on_started(server)
