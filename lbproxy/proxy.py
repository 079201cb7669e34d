"""One client connection: admit -> pick -> connect (retry elsewhere) -> pump both ways.

Everything a connection needs from its virtual server is read from the pool at the
moment it starts (`pool.config`), so a reload that changes timeouts or the scheduler
applies to new connections while established ones keep going undisturbed.

Errors a connection can expect (refused, timeouts, resets, bad PROXY headers) are
handled here and end only that connection; nothing escapes to the accept loop.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket

import trio

from lbproxy import proxy_protocol
from lbproxy.checks import LOCAL_CAPACITY_ERRNOS, LocalCapacityError, record_health
from lbproxy.config import Address, VirtualServerConfig
from lbproxy.pool import Lease, Pool, RealServer
from lbproxy.proxy_header_io import read_proxy_header
from lbproxy.pump import Flow, Pump
from lbproxy.virtual_server import VirtualServer

log = logging.getLogger("lbproxy.proxy")
access_log = logging.getLogger("lbproxy.access")


_ALLOW_ALL = VirtualServerConfig.__dataclass_fields__["allow"].default


class Connection:
    """The handle a pool lease carries: live byte counts, and a way to close it."""

    __slots__ = ("connecting", "flow", "own_idle_timeout")

    def __init__(self, flow: Flow) -> None:
        self.flow = flow
        # The scope of a connect that is waiting for the real server's answer, if any.
        self.connecting: trio.CancelScope | None = None
        # The virtual server's idle_timeout when the connection started: the throttle
        # imposes min(own, imposed) under load and gives this back in low mode.
        self.own_idle_timeout = flow.idle_timeout

    @property
    def bytes_in(self) -> int:
        return self.flow.bytes_in

    @property
    def bytes_out(self) -> int:
        return self.flow.bytes_out

    def close(self) -> None:
        # No cancel scope of its own (a scope costs ~0.7 kB for the connection's whole
        # life): while connecting, the connect wait's scope is cancelled and the retry
        # loop stops; from then on the pump ends ("cancelled").
        self.flow.close()
        if self.connecting is not None:
            self.connecting.cancel()


class ConnectError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        # refused | timeout | error (the metric's label), or cancelled: closed on purpose
        self.reason = reason


class Handler:
    """The connection handler of one virtual server: serves the clients routed to it.

    Made by the listener for each virtual server it feeds; everything that outlives a
    connection (pool, throttle, access-log flag) is read from the `VirtualServer`.
    """

    def __init__(self, vs: VirtualServer) -> None:
        self.vs = vs
        self.pool = vs.pool
        self._resolved: dict[Address, tuple[int, tuple]] = {}

    @property
    def name(self) -> str:
        return self.pool.name

    async def handle(
        self, client: socket.socket, peer: tuple, preread: bytes | None = None
    ) -> None:
        """Serve one accepted client socket until both sides are done; closes it.

        `preread`: the listener has already read the PROXY header (if any; `peer` is
        then the source it names) and these bytes (a TLS ClientHello, for the route),
        which go to the real server first, unchanged.

        One coroutine from admission to the end: its frame and trio's wait are what an
        idle connection keeps alive, so the steps before the pump are helpers that
        return, not frames that stay on the stack, and the pump is driven by the
        reactor while this task waits in ``finished()``.
        """
        pool = self.pool
        config = pool.config
        pool.clients += 1
        try:
            with client:
                admitted = await self._admit(client, peer, config, preread)
                if admitted is None:
                    return
                source, leftover = admitted
                started = trio.current_time()
                flow = Flow(config.idle_timeout)
                connection = Connection(flow)
                if self.vs.throttle is not None:  # start with the imposed idle timeout, if any
                    flow.idle_timeout = self.vs.throttle.idle_timeout_for(config.idle_timeout)
                queue = self.vs.queue
                if queue is not None and queue.must_wait():
                    reason = await queue.wait()
                    if reason is not None:  # queue_full | queue_timeout
                        self._reject(reason, source)
                        return
                connected = await self._connect(connection, config, source)
                if queue is not None and queue.waiting:
                    queue.kick()  # the slot is taken: the next waiter, if room is left
                if connected is None:
                    if self.vs.access_log:
                        end = "cancelled" if flow.closing else "no_server"
                        self._log_access(source, None, flow, started, end)
                    return
                server, lease = connected
                outcome = "cancelled"  # the drain deadline cancelled us
                try:
                    with server:
                        header = b""
                        if config.send_proxy != "none":
                            destination = client.getsockname()
                            header = proxy_protocol.encode(config.send_proxy, source, destination)
                        # close_sockets: the pump closes both the moment it ends (the
                        # `with` blocks then do nothing), which saves two epoll_ctl and
                        # usually a shutdown per connection.
                        p = Pump(
                            client,
                            server,
                            flow,
                            preamble=header,
                            initial_client_bytes=leftover,
                            close_sockets=True,
                        )
                        try:  # pump()'s body, here: one coroutine frame less per connection
                            p.start()
                            await p.finished()
                        finally:
                            p.close()
                        outcome = p.outcome
                except OSError as exc:
                    # Out of descriptors for a pipe (EMFILE), or the client reset before
                    # getsockname(). Only this connection ends; the accept loop backs off
                    # by itself when descriptors run out.
                    log.debug("%s: %s", pool.name, exc)
                    flow.error = exc
                    outcome = "error"
                finally:
                    rs = lease.server
                    rs.bytes_in += flow.bytes_in
                    rs.bytes_out += flow.bytes_out
                    now = trio.current_time()
                    pool.drop(lease, now)
                    pool.durations.observe(now - started)
                    if self.vs.access_log:
                        self._log_access(source, rs.name, flow, started, outcome)
        finally:
            pool.clients -= 1

    async def _admit(
        self,
        client: socket.socket,
        peer: tuple,
        config: VirtualServerConfig,
        preread: bytes | None = None,
    ) -> tuple[tuple, bytes] | None:
        """(source address, bytes read behind a PROXY header), or None: rejected."""
        source, leftover = peer, b""
        throttle = self.vs.throttle
        if throttle is not None and throttle.arrival():  # digg: close at once
            self._reject("throttle", source)
            return None
        if preread is not None:
            leftover = preread
        elif config.accept_proxy:
            header = await self._read_proxy_header(
                trio.socket.from_stdlib_socket(client), config.connect_timeout
            )
            if header is None:
                return None
            source, leftover = header
        if not self._allowed(config, source[0]):
            self._reject("acl", source)
            return None
        if config.max_connections and self.pool.clients > config.max_connections:
            self._reject("max_connections", source)
            return None
        return source, leftover

    def reject(self, reason: str, source: tuple) -> None:
        """Count (and access-log) a client closed before it reached this handler: the
        listener's `no_route`."""
        self._reject(reason, source)

    def _reject(self, reason: str, source: tuple) -> None:
        self.pool.rejected[reason] += 1
        if self.vs.access_log:
            access_log.info(
                "%s vs=%s rs=- in=0 out=0 duration=0.000s end=rejected:%s",
                _format_peer(source),
                self.pool.name,
                reason,
            )

    def _log_access(
        self, source: tuple, rs: str | None, flow: Flow, started: float, end: str
    ) -> None:
        # HAProxy `option tcplog` in spirit: who, where to, how much, how long, how it ended.
        access_log.info(
            "%s vs=%s rs=%s in=%d out=%d duration=%.3fs end=%s",
            _format_peer(source),
            self.pool.name,
            rs or "-",
            flow.bytes_in,
            flow.bytes_out,
            trio.current_time() - started,
            end,
        )

    async def _connect(
        self, handle: Connection, config: VirtualServerConfig, source: tuple
    ) -> tuple[socket.socket, Lease] | None:
        """Connect to a picked real server, retrying others (never the same one twice).

        `source` is the client's address (the PROXY header's with accept_proxy), for
        persistence and maglev; the pool ignores it when neither is configured.
        """
        pool = self.pool
        tried: list[RealServer] = []
        for _ in range(config.retries + 1):
            if handle.flow.closing:  # closed while an earlier attempt was waiting
                return None
            now = trio.current_time()
            rs = pool.pick(now, tried, source)
            if rs is None:
                break
            tried.append(rs)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s", explain_pick(pool, rs, tried[:-1]))
            # Taken before the connect completes, as IPVS counts a connection from its
            # SYN: concurrent arrivals then see this one and spread out.
            lease = pool.take(rs, now, handle, source)
            try:
                sock = await self._open(rs.address, config.connect_timeout, handle)
            except LocalCapacityError:
                # Out of descriptors here: not the real server's fault, and no other
                # would do better; the client is closed (the accept loop backs off).
                pool.drop(lease, trio.current_time())
                break
            except ConnectError as exc:
                pool.drop(lease, trio.current_time())
                if exc.reason == "cancelled":
                    return None
                rs.connect_failures[exc.reason] += 1
                record_health(pool, rs, False, trio.current_time(), f"connect {exc.reason}")
                continue
            except BaseException:  # the drain deadline: give the lease back all the same
                pool.drop(lease, trio.current_time())
                raise
            pool.established(lease)
            if not rs.health.clean:
                # a good connect ends a failure streak (or is a down server's trial)
                record_health(pool, rs, True, now, "connect succeeded")
            return sock, lease
        pool.rejected["connect_failed" if tried else "no_server"] += 1
        return None

    async def _open(self, address: Address, timeout: float, handle: Connection) -> socket.socket:
        cached = self._resolved.get(address)  # no coroutine on the usual cache hit
        family, sockaddr = cached if cached is not None else await self._resolve(address)
        try:
            # A plain non-blocking socket: trio's wrapper costs a checkpoint, an address
            # re-resolution and an ioctl per connect; the pump needs only the descriptor.
            sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        except OSError as exc:
            if exc.errno in LOCAL_CAPACITY_ERRNOS:
                raise LocalCapacityError(exc.strerror) from None
            raise ConnectError("error") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            err = sock.connect_ex(sockaddr)
            if err == errno.EINPROGRESS:
                # A near server (loopback, same host) has often completed the handshake
                # before connect() returns: check once before paying for an epoll wait.
                # One system call: a peer name means connected; ENOTCONN means still
                # connecting or failed, and SO_ERROR after the wait tells which.
                try:
                    sock.getpeername()
                    err = 0
                except OSError:
                    pass
            if err == errno.EINPROGRESS:
                with trio.move_on_after(timeout) as deadline:
                    handle.connecting = deadline  # Connection.close() cancels it
                    try:
                        await trio.lowlevel.wait_writable(sock.fileno())
                    finally:
                        handle.connecting = None
                if handle.flow.closing:
                    raise ConnectError("cancelled")
                if deadline.cancelled_caught:
                    raise ConnectError("timeout")
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err))
        except OSError as exc:
            sock.close()
            reason = "refused" if exc.errno == errno.ECONNREFUSED else "error"
            raise ConnectError(reason) from None
        except BaseException:
            sock.close()
            raise
        return sock

    async def _resolve(self, address: Address) -> tuple[int, tuple]:
        cached = self._resolved.get(address)
        if cached is not None:
            return cached
        try:
            infos = await trio.socket.getaddrinfo(
                address.host, address.port, type=socket.SOCK_STREAM
            )
        except OSError as exc:
            raise ConnectError("error") from exc
        family, _, _, _, sockaddr = infos[0]
        self._resolved[address] = (family, sockaddr)
        return family, sockaddr

    def _allowed(self, config: VirtualServerConfig, host: str) -> bool:
        # deny wins over allow
        if not config.deny and config.allow == _ALLOW_ALL:
            return True  # the default: no address to parse
        try:
            ip = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return False
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if any(ip in net for net in config.deny if net.version == ip.version):
            return False
        return any(ip in net for net in config.allow if net.version == ip.version)

    async def _read_proxy_header(
        self, client: trio.socket.SocketType, timeout: float
    ) -> tuple[tuple, bytes] | None:
        """Read an incoming PROXY v1/v2 header; None drops the connection."""
        try:
            with trio.fail_after(timeout):
                source, leftover = await read_proxy_header(client)
            return (source or client.getpeername()[:2]), leftover
        except trio.TooSlowError:
            log.debug("%s: no PROXY header within %ss", self.name, timeout)
        except (OSError, proxy_protocol.ProxyProtocolError) as exc:
            log.debug("%s: bad PROXY header: %s", self.name, exc)
        return None


def explain_pick(pool: Pool, chosen: RealServer, tried: list[RealServer]) -> str:
    """The decision explain line: every candidate and its score (debug logs only)."""
    scores = ", ".join(f"{name}={score}" for name, score in pool.scores(tried).items())
    return f"{pool.name}: {pool.config.scheduler} picked {chosen.name} [{scores}]"


def _format_peer(peer: tuple) -> str:
    host, port = peer[0], peer[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
