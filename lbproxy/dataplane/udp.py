"""UDP sessions of one virtual server (SPEC §19): a datagram relay per client address.

A datagram from a client address without a session picks a real server through the
pool (its scheduler, persistence, maglev by the client address: `Pool.pick` with the
client), takes a lease (so `max_connections` counts sessions) and opens one connected
socket to that server. Later datagrams from the client go out on it; datagrams coming
back on it go to the client from the virtual server's own socket. A session ends after
`udp.idle_timeout` without a datagram either way, or once `udp.responses` replies per
request came back; `responses: 0` expects none and drops any. Beyond the counted replies
nothing is sent (no amplification), and a reply is the real server's datagram, never
more bytes.

Cost per datagram: one receive and one send on each side, into one preallocated buffer
per direction; one task per listening socket and one per session (waiting on its
socket), never one per datagram. ECONNREFUSED on a session's socket (the real server's
ICMP port unreachable) is a passive health failure, as a refused TCP connect is.

The server runs one `UdpListener` (a `UdpRelay` behind the accept-loop interface of
listener.py's `Listener`) per UDP listen address, keyed by `UdpAddress` so that a TCP
and a UDP listener on one address and port are two entries.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
from collections import Counter
from dataclasses import dataclass, field

import trio

from lbproxy.config.model import Address
from lbproxy.control.checks import record_health
from lbproxy.core.pool import Lease, Pool, RealServer
from lbproxy.dataplane.listener import BindError
from lbproxy.dataplane.virtual_server import VirtualServer

log = logging.getLogger("lbproxy.udp")
access_log = logging.getLogger("lbproxy.access")

# The largest UDP payload over IPv4 (65,535 - 8 - 20), one buffer of it per direction.
MAX_DATAGRAM = 65507
# Datagrams read per wake-up before other tasks run: fairness under a flood.
_BATCH = 64


@dataclass(eq=False)
class Session:
    """One client address and its connected socket to a real server."""

    client: tuple
    server: RealServer
    lease: Lease
    sock: socket.socket
    started: float
    last: float  # the last datagram either way
    requests: int = 0
    replies: int = 0
    bytes_in: int = 0  # client -> real server
    bytes_out: int = 0  # real server -> client
    ended: str = ""


@dataclass
class UdpCounters:
    datagrams: Counter = field(default_factory=Counter)  # (real server, "in"/"out")
    bytes: Counter = field(default_factory=Counter)
    sessions_total: Counter = field(default_factory=Counter)  # by real server
    dropped: Counter = field(default_factory=Counter)  # by reason


class UdpRelay:
    """The sessions of one UDP virtual server on one bound, non-blocking socket."""

    def __init__(self, pool: Pool, sock: socket.socket, *, access_log: bool = False) -> None:
        self.pool = pool
        self.sock = sock
        self.access_log = access_log
        self.sessions: dict[tuple, Session] = {}
        self.per_source: Counter = Counter()
        self.counters = UdpCounters()
        self._in = bytearray(MAX_DATAGRAM + 1)  # +1: a datagram that big is not cut short
        self._out = bytearray(MAX_DATAGRAM + 1)
        self._nursery: trio.Nursery | None = None

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Read client datagrams until cancelled; session tasks live in the same nursery."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started(self.sock.getsockname())
                await self._receive()
        finally:
            for session in list(self.sessions.values()):
                session.ended = session.ended or "stopped"
                self._close(session)

    async def _receive(self) -> None:
        view = memoryview(self._in)
        sock = self.sock
        while True:
            await trio.lowlevel.wait_readable(sock)
            for _ in range(_BATCH):
                try:
                    n, client = sock.recvfrom_into(self._in)
                except BlockingIOError:
                    break
                except OSError as exc:  # e.g. a reply to a client that is gone
                    log.debug("udp receive: %s", exc)
                    continue
                self._from_client(view[:n], client)

    # -- client -> real server ------------------------------------------------------

    def _from_client(self, data: memoryview, client: tuple) -> None:
        session = self.sessions.get(client)
        now = trio.current_time()
        if session is None:
            session = self._open(client, now)
            if session is None:
                return
        session.requests += 1
        session.last = now
        try:
            session.sock.send(data)
        except BlockingIOError:
            self.counters.dropped["send_full"] += 1
            return
        except ConnectionRefusedError:  # an earlier datagram's ICMP port unreachable
            self._refused(session, now)
            return
        except OSError as exc:
            self.counters.dropped["send_error"] += 1
            log.debug("udp send to %s: %s", session.server.name, exc)
            return
        rs = session.server
        size = len(data)
        session.bytes_in += size
        self.counters.datagrams[rs.name, "in"] += 1
        self.counters.bytes[rs.name, "in"] += size

    def _open(self, client: tuple, now: float) -> Session | None:
        config = self.pool.config
        udp = config.udp
        if not _allowed(config.allow, config.deny, client[0]):
            self.counters.dropped["acl"] += 1
            return None
        if len(self.sessions) >= udp.max_sessions:
            self.counters.dropped["max_sessions"] += 1
            return None
        if self.per_source[client[0]] >= udp.max_sessions_per_source:
            self.counters.dropped["per_source"] += 1
            return None
        rs = self.pool.pick(now, (), client)
        if rs is None:
            self.counters.dropped["no_server"] += 1
            return None
        lease = self.pool.take(rs, now, None, client)
        try:
            family = socket.AF_INET6 if ":" in rs.address.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_DGRAM)
            sock.setblocking(False)
            sock.connect((rs.address.host, rs.address.port))
        except OSError as exc:
            self.pool.drop(lease, now)
            self.counters.dropped["no_socket"] += 1
            log.warning("udp session to %s: %s", rs.name, exc)
            return None
        self.pool.established(lease)
        session = Session(client, rs, lease, sock, now, now)
        self.sessions[client] = session
        self.per_source[client[0]] += 1
        self.counters.sessions_total[rs.name] += 1
        assert self._nursery is not None
        self._nursery.start_soon(self._replies, session)
        return session

    # -- real server -> client ------------------------------------------------------

    async def _replies(self, session: Session) -> None:
        idle = self.pool.config.udp.idle_timeout
        responses = self.pool.config.udp.responses
        view = memoryview(self._out)
        sock = session.sock
        try:
            while not session.ended:
                try:
                    with trio.move_on_at(session.last + idle):
                        await trio.lowlevel.wait_readable(sock)
                except trio.ClosedResourceError:  # closed by `_refused` from the other side
                    break
                now = trio.current_time()
                if now >= session.last + idle:
                    session.ended = "idle_timeout"
                    break
                for _ in range(_BATCH):
                    try:
                        n = sock.recv_into(self._out)
                    except BlockingIOError:
                        break
                    except ConnectionRefusedError:
                        self._refused(session, now)
                        break
                    except OSError as exc:
                        session.ended = "error"
                        log.debug("udp receive from %s: %s", session.server.name, exc)
                        break
                    session.last = now
                    if responses is not None and session.replies >= session.requests * responses:
                        self.counters.dropped["unrequested"] += 1  # no amplification
                        continue
                    self._to_client(session, view[:n])
                    if responses and session.replies >= session.requests * responses:
                        session.ended = "responses"
                        break
        finally:
            self._close(session)

    def _to_client(self, session: Session, data: memoryview) -> None:
        try:
            self.sock.sendto(data, session.client)
        except OSError as exc:  # a full buffer or a client gone: the datagram is lost
            self.counters.dropped["reply_send"] += 1
            log.debug("udp reply to %s: %s", session.client, exc)
            return
        size = len(data)
        session.replies += 1
        session.bytes_out += size
        rs = session.server.name
        self.counters.datagrams[rs, "out"] += 1
        self.counters.bytes[rs, "out"] += size

    def _refused(self, session: Session, now: float) -> None:
        """ICMP port unreachable: a passive failure; the session ends, the next datagram
        from this client picks again."""
        session.ended = "refused"
        record_health(self.pool, session.server, False, now, "udp port unreachable")
        # Its task wakes (the socket is closed under it) and finishes the clean-up.
        self._close(session)

    def _close(self, session: Session) -> None:
        if self.sessions.get(session.client) is not session:
            return  # closed already
        del self.sessions[session.client]
        source = session.client[0]
        self.per_source[source] -= 1
        if not self.per_source[source]:
            del self.per_source[source]
        now = trio.current_time()
        self.pool.drop(session.lease, now)
        # A socket still waited on is closed through trio, which wakes the waiter.
        trio.lowlevel.notify_closing(session.sock)
        session.sock.close()
        if self.access_log:
            access_log.info(
                "%s vs=%s rs=%s in=%d out=%d duration=%.3fs end=%s",
                _peer(session.client),
                self.pool.name,
                session.server.name,
                session.bytes_in,
                session.bytes_out,
                now - session.started,
                session.ended or "closed",
            )


def _allowed(allow, deny, host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if any(ip in net for net in deny if net.version == ip.version):
        return False
    return any(ip in net for net in allow if net.version == ip.version)


def _peer(client: tuple) -> str:
    host, port = client[0], client[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class UdpAddress(Address):
    """A UDP listen address: never equal to the TCP `Address` of the same host and port."""

    def __str__(self) -> str:
        return Address.__str__(self) + "/udp"


def listen_keys(protocol: str, addresses: tuple[Address, ...]) -> tuple[Address, ...]:
    """The keys of a virtual server's listeners in the server's table."""
    if protocol != "udp":
        return addresses
    return tuple(UdpAddress(a.host, a.port) for a in addresses)


def udp_socket(address: Address, reuse_port: bool = False) -> socket.socket:
    """A bound, non-blocking UDP socket on `address` (BindError when it cannot be)."""
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    host = "127.0.0.1" if address.host == "localhost" else address.host
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, address.port))
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot listen on {address}: {exc.strerror}") from None
    return sock


class UdpListener:
    """One UDP socket and the one virtual server it feeds, as the server sees listeners."""

    def __init__(self, address: Address, sock: socket.socket, virtual_servers) -> None:
        self.address = address
        self.sock = sock
        self.cancel_scope = trio.CancelScope()
        self.vs: VirtualServer = virtual_servers[0]
        self.relay = UdpRelay(self.vs.pool, sock, access_log=self.vs.access_log)

    @property
    def virtual_servers(self) -> list[VirtualServer]:
        return [self.vs]

    def route(self, virtual_servers) -> None:
        """After a reload: the sessions stay, new ones use the (reconfigured) pool."""
        self.vs = virtual_servers[0]
        self.relay.pool = self.vs.pool
        self.relay.access_log = self.vs.access_log

    async def accept_loop(self, handlers: trio.Nursery) -> None:
        # Closed by a reload (its socket under the waiter) or cancelled at shutdown.
        with self.cancel_scope, contextlib.suppress(trio.ClosedResourceError):
            await self.relay.serve()

    def close(self) -> None:
        self.cancel_scope.cancel()
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()
