"""The DNS locator: `global.locator.dns` served over UDP and TCP (SPEC §10).

The answers are lbproxy/locator/dns_answers.py's (pure, dnspython); this module owns the sockets:
two trio tasks beside the admin endpoint, in the proxy's own process, reading the live
pools. With `workers` > 1 every worker binds the same address with SO_REUSEPORT and
answers from its own pools -- Geode's "locators do not share connection information
among themselves": the kernel spreads queries over them as it spreads connections.

Defences, so that no client disturbs another or the proxy:

- UDP: one task; each datagram is answered before the next is read (a query costs one
  pick and ~100 us of dnspython), and the loop lets other tasks run every UDP_BATCH
  datagrams, so a flood shares the CPU with the proxied connections instead of
  starving them. What the
  socket buffer cannot hold the kernel drops, as any DNS server under a flood does.
- TCP (RFC 7766): 2-byte length framing, several queries per connection. A source
  outside `allow` is closed at accept, before a byte is read; at most MAX_TCP_CLIENTS
  at once and `tcp_clients_per_source` from one source prefix (/24, /56: the prefixes
  rate limiting counts), more are closed at once (counted in this module's
  bookkeeping, not in the accept call, so the accept loop itself may move). A client
  has `tcp_idle_timeout` to begin each query (BIND's and Unbound's tcp-idle-timeout,
  Knot's tcp-idle-timeout), TCP_IO_TIMEOUT to finish sending it once begun and to
  take its answer (Knot's tcp-io-timeout: a client that sends half a message and
  stalls is closed, and never blocks another: one task per client), and
  `tcp_lifetime` in all: a busy client cannot keep its place for ever.
- Who may ask, and how often (SPEC §16, dns_rate_limit.py): a UDP query from a
  source outside `allow` is answered REFUSED; UDP answers are rate limited per
  source prefix (BIND's RRL). Both are decided before the query is answered, so a
  refused or rate-limited query makes no pick and counts nothing but its rcode.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping

import trio

from lbproxy.config.model import Address, DnsLocatorConfig
from lbproxy.core.pool import Pool
from lbproxy.locator.dns_answers import UDP_PAYLOAD, QueryHandler
from lbproxy.locator.dns_rate_limit import ANSWER, REFUSE, SLIP, SourcePolicy, source_prefix
from lbproxy.net.accept import AcceptErrors, Spawn, accept_loop
from lbproxy.net.barrier import record

log = logging.getLogger("lbproxy.locator")

TCP_IO_TIMEOUT = 2.0  # seconds to read the rest of a message once begun, and to send one
MAX_TCP_CLIENTS = 64
MAX_TCP_MESSAGE = 65535  # what the 2-byte length allows
UDP_RECEIVE = 65535
UDP_BATCH = 16  # datagrams answered between two checkpoints of the UDP loop
VS_INDEX_MAX_AGE = 1.0  # seconds; a name missed in an older index rebuilds it


class DnsLocator:
    """The DNS face of the locator for one process; `pools` maps names to live pools."""

    def __init__(self, config: DnsLocatorConfig, pools: Mapping[str, object]) -> None:
        self.config = config
        self._pools = pools  # the Server's `virtual_servers` (name -> VirtualServer)
        self.handler = QueryHandler(config.zone, config.ttl, self._find)
        self.policy = SourcePolicy(
            config.allow, config.rate_limit.responses_per_second, config.rate_limit.slip
        )
        self.handler.on_error = _locate_failed
        self.tcp_clients = 0
        self.tcp_per_source: dict[tuple[int, int], int] = {}  # by source prefix
        self._index: dict[str, str] = {}  # lower-case virtual-server name -> its name
        self._index_size = -1
        self._index_built = float("-inf")

    @property
    def rcodes(self) -> dict[str, int]:
        return self.handler.rcodes

    def _find(self, label: str) -> Pool | None:
        vs = self._pools.get(label)
        if vs is None:  # DNS names have no case; ours do: look the lower case up
            vs = self._pools.get(self._lower_name(label.lower()))
        return None if vs is None else vs.pool  # type: ignore[attr-defined]  # a VirtualServer (not imported here)

    def _lower_name(self, lower: str) -> str:
        """The virtual server's name for a lower-case label, through an index of names.

        The pools dict is the Server's, changed in place by reloads and discovery; the
        index is rebuilt when its size changed, or on a miss once it is older than
        VS_INDEX_MAX_AGE -- so a flood of unknown names costs one rebuild a second at
        most, never a scan per query."""
        name = self._index.get(lower)
        if name is not None and name in self._pools and len(self._pools) == self._index_size:
            return name
        now = trio.current_time()
        if len(self._pools) != self._index_size or now - self._index_built >= VS_INDEX_MAX_AGE:
            self._index = {n.lower(): n for n in self._pools}
            self._index_size = len(self._pools)
            self._index_built = now
        return self._index.get(lower, "")

    # -- binding (synchronous, so a bad address fails before anything starts) ----------

    @staticmethod
    def bind(address: Address, reuse_port: bool) -> tuple[socket.socket, socket.socket]:
        """(UDP, TCP) sockets bound on `address`; OSError names the problem."""
        family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
        host = "127.0.0.1" if address.host == "localhost" else address.host
        bound = []
        try:
            for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
                sock = socket.socket(family, kind)
                bound.append(sock)
                if kind == socket.SOCK_STREAM:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if reuse_port:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((host, address.port))
                if kind == socket.SOCK_STREAM:
                    sock.listen(128)
                sock.setblocking(False)
        except OSError:
            for sock in bound:
                sock.close()
            raise
        return bound[0], bound[1]

    # -- serving ---------------------------------------------------------------------

    async def serve(
        self,
        udp: socket.socket,
        tcp: socket.socket,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve both sockets until cancelled; closes them."""
        with udp, tcp:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._udp, udp)
                nursery.start_soon(self._tcp, tcp, nursery)
                log.info(
                    "DNS locator on %s (UDP and TCP), zone %s", self.config.listen, self.config.zone
                )
                task_status.started()

    async def _udp(self, raw: socket.socket) -> None:
        # The plain socket under trio's wrapper, as the accept loop in server.py: trio's
        # recvfrom and sendto cost a scheduler round each. We wait only when nothing is
        # queued, and let other tasks run every UDP_BATCH datagrams, so a flood shares
        # the CPU with the proxied connections.
        fd = raw.fileno()
        handle = self.handler.handle
        batch = 0
        while True:
            try:
                data, peer = raw.recvfrom(UDP_RECEIVE)
            except BlockingIOError:
                batch = 0
                await trio.lowlevel.wait_readable(fd)
                continue
            except OSError as exc:  # e.g. ICMP port unreachable of an earlier answer
                log.debug("DNS UDP receive: %s", exc)
                await trio.lowlevel.checkpoint()
                continue
            now = trio.current_time()
            verdict = self.policy.verdict(peer[0], now)
            if verdict == ANSWER:
                answer = handle(data, now, UDP_PAYLOAD, peer)
            elif verdict == REFUSE:
                answer = self.handler.refuse(data)
            else:  # over the rate limit: no pick; every slip-th gets TC=1
                answer = self.handler.rate_limited(data, verdict == SLIP)
            if answer is not None:
                try:
                    raw.sendto(answer, peer)
                except OSError as exc:  # a full buffer drops it, as UDP may
                    log.debug("DNS UDP answer to %s: %s", peer, exc)
            batch += 1
            if batch >= UDP_BATCH:
                batch = 0
                await trio.lowlevel.checkpoint()

    async def _tcp(self, sock: socket.socket, nursery: trio.Nursery) -> None:
        # The one accept loop (net/accept.py): out of descriptors, back off, never spin.
        errors = AcceptErrors("DNS TCP", log)
        await accept_loop(sock, self, nursery.start_soon, errors)

    def accept_client(self, fd: int, peer: tuple, spawn: Spawn) -> None:
        """Called by the accept loop for each TCP client: admitted, it gets a task."""
        host = peer[0]
        prefix = source_prefix(host)
        if not self.policy.allowed(host) or not self._admit_tcp(prefix):
            socket.socket(fileno=fd).close()  # before a byte is read
            return
        client = trio.socket.from_stdlib_socket(socket.socket(fileno=fd))
        spawn(self._tcp_client, client, peer, prefix)

    def _admit_tcp(self, prefix: tuple[int, int]) -> bool:
        """Count a new TCP client of `prefix` in, or False when a limit is reached."""
        from_prefix = self.tcp_per_source.get(prefix, 0)
        if self.tcp_clients >= MAX_TCP_CLIENTS or from_prefix >= self.config.tcp_clients_per_source:
            return False
        self.tcp_clients += 1
        self.tcp_per_source[prefix] = from_prefix + 1
        return True

    def _release_tcp(self, prefix: tuple[int, int]) -> None:
        self.tcp_clients -= 1
        left = self.tcp_per_source[prefix] - 1
        if left:
            self.tcp_per_source[prefix] = left
        else:
            del self.tcp_per_source[prefix]

    async def _tcp_client(
        self, client: trio.socket.SocketType, peer: tuple, prefix: tuple[int, int]
    ) -> None:
        stream = trio.SocketStream(client)
        try:
            async with stream:
                with trio.move_on_after(self.config.tcp_lifetime):
                    await self._tcp_queries(stream, peer)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.debug("DNS TCP client: %s", exc)
        finally:
            self._release_tcp(prefix)

    async def _tcp_queries(self, stream: trio.SocketStream, peer: tuple) -> None:
        """Answer one TCP client's queries (no rate limit: TCP proves the address) until
        it closes, idles or stalls."""
        while True:
            size = message = None
            with trio.move_on_after(self.config.tcp_idle_timeout):
                size = await _read_exactly(stream, 2)
            if size is None:  # end of file, or idle too long
                return
            with trio.move_on_after(TCP_IO_TIMEOUT):
                message = await _read_exactly(stream, int.from_bytes(size, "big"))
            if message is None:  # end of file, or half a message
                return
            answer = self.handler.handle(message, trio.current_time(), MAX_TCP_MESSAGE, peer)
            if answer is None:
                return
            with trio.move_on_after(TCP_IO_TIMEOUT):  # a client that reads nothing
                await stream.send_all(len(answer).to_bytes(2, "big") + answer)
                continue
            return


async def _read_exactly(stream: trio.SocketStream, n: int) -> bytes | None:
    """`n` bytes, or None at end of file."""
    data = bytearray()
    while len(data) < n:
        chunk = await stream.receive_some(n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _locate_failed(exc: Exception) -> None:
    record("locate", exc, "dns")
