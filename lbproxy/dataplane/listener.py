"""Listening addresses: bind, the accept loop (net/accept.py's), and the SNI route.

A `Listener` is one bound socket and the virtual servers it feeds. Its accept loop hands
every accepted client to its handler, which serves it at once and, only for what has to
wait, in a task in the server's handlers nursery (trio's `serve_listeners` is the model:
the accept loop and the handlers live in separate nurseries, so stopping accepting does
not cancel connections; connection.py says how connections without a task are drained).

An address fed by one virtual server without `sni` nor `alpn` passes each client straight
to that virtual server's handler. An address shared by several (or one with `sni` or
`alpn`) routes TLS passthrough (SPEC §13): it pre-reads the PROXY header (if
`accept_proxy`) and the ClientHello (client_hello.py, pure), picks the virtual server by
the server name and the ALPN protocols offered (`Routes`), and hands the client over
with the bytes read, which the handler forwards to the real server unchanged. A reload
that only changes which virtual servers an address feeds re-routes its listener in
place: the socket stays bound.

Data flows one way: client -> listener -> connection handler (connection.py) -> pump. This
module imports the handler and the runtime virtual server; neither imports it.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Sequence

import trio

from lbproxy.config.model import Address
from lbproxy.core.client_address import SourceFilter
from lbproxy.dataplane.connection import Handler, Spawn
from lbproxy.dataplane.proxy_header_io import read_proxy_header
from lbproxy.dataplane.virtual_server import VirtualServer
from lbproxy.net.accept import AcceptErrors, ReactorAcceptor
from lbproxy.net.barrier import record
from lbproxy.net.descriptors import clients, note_refused
from lbproxy.wire.client_hello import LIMIT, ClientHelloReader, Hello
from lbproxy.wire.proxy_protocol import ProxyProtocolError

log = logging.getLogger("lbproxy.listener")

LISTEN_BACKLOG = 4096

# A ClientHello is one read in practice (~300-600 bytes; more with post-quantum keys);
# never more than the 16 KiB the reader looks at.
HELLO_READ = LIMIT


class BindError(Exception):
    """A listen address could not be bound (in use, no permission): exit code 1."""

    @property
    def messages(self) -> list[str]:
        """One line per address that could not be bound."""
        return [str(self)]

    @staticmethod
    def together(errors: Sequence[BindError]) -> BindError:
        """Every failure of one start or reload as one exception, so an operator sees
        them all at once instead of fixing one address to meet the next."""
        if len(errors) == 1:
            return errors[0]
        return BindErrors(errors)


class BindErrors(BindError):
    """Several addresses could not be bound; `messages` has one line each."""

    def __init__(self, errors: Sequence[BindError]) -> None:
        self.errors = [line for error in errors for line in error.messages]
        super().__init__("; ".join(self.errors))

    @property
    def messages(self) -> list[str]:
        return list(self.errors)


def failure_lines(group: BaseExceptionGroup[Exception]) -> list[str]:
    """One line per failure of a (nested) exception group, in order: each address a
    BindError names, else the exception's text."""
    lines: list[str] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            lines.extend(failure_lines(exc))
        elif isinstance(exc, BindError):
            lines.extend(exc.messages)
        else:
            lines.append(str(exc))
    return lines


class _Tier:
    """The virtual servers of one `sni` entry (a name, a wildcard, or none): by ALPN
    protocol, and the one without `alpn`."""

    __slots__ = ("by_protocol", "plain")

    def __init__(self) -> None:
        self.by_protocol: dict[bytes, VirtualServer] = {}
        self.plain: VirtualServer | None = None

    def add(self, vs: VirtualServer) -> None:
        protocols = vs.pool.config.alpn
        if not protocols:
            if self.plain is None:
                self.plain = vs
            return
        for protocol in protocols:
            self.by_protocol.setdefault(protocol.encode("ascii"), vs)

    def pick(self, alpn: tuple[bytes, ...]) -> VirtualServer | None:
        """The virtual server of the client's most preferred protocol that has one,
        else the one without `alpn`, else None."""
        by_protocol = self.by_protocol
        if by_protocol:
            for protocol in alpn:
                vs = by_protocol.get(protocol)
                if vs is not None:
                    return vs
        return self.plain


class Routes:
    """Which virtual server a TLS ClientHello goes to, on one listen address.

    The tiers, in order: the exact server name, the wildcard for the name's parent
    (`*.example.com` stands for one label, so for `a.example.com` only `*.example.com`
    can match: the "longest matching wildcard" of SPEC §13 is that one), then the
    virtual servers without `sni`. In each tier, the virtual server whose `alpn` lists
    the client's most preferred offered protocol, else the tier's one without `alpn`;
    a tier with neither passes to the next. None: no route.

    Per connection: at most three dictionary lookups for the name, plus one per
    offered protocol in a tier that has `alpn` routes (none without them).
    """

    __slots__ = ("default", "exact", "wildcard")

    def __init__(self, virtual_servers: Sequence[VirtualServer]) -> None:
        self.exact: dict[str, _Tier] = {}
        self.wildcard: dict[str, _Tier] = {}  # "example.com" for *.example.com
        self.default = _Tier()  # the virtual servers without `sni`
        for vs in virtual_servers:
            names = vs.pool.config.sni
            if not names:
                self.default.add(vs)
            for name in names:
                if name.startswith("*."):
                    self.wildcard.setdefault(name[2:], _Tier()).add(vs)
                else:
                    self.exact.setdefault(name, _Tier()).add(vs)

    def match(self, server_name: str | None, alpn: tuple[bytes, ...] = ()) -> VirtualServer | None:
        if server_name is not None:
            tier = self.exact.get(server_name)
            if tier is not None:
                vs = tier.pick(alpn)
                if vs is not None:
                    return vs
            _, dot, parent = server_name.partition(".")
            if dot:
                tier = self.wildcard.get(parent)
                if tier is not None:
                    vs = tier.pick(alpn)
                    if vs is not None:
                        return vs
        return self.default.pick(alpn)


class Listener:
    """One bound listening socket, the virtual servers it feeds, and its accept loop.

    One virtual server without `sni` nor `alpn` (the usual case): every client goes
    straight to its handler, which checks it and reads the PROXY header itself; nothing
    here costs a thing per connection. Otherwise (SNI/ALPN routing) each client is
    screened at accept (`_screen`: a PROXY sender outside `accept_proxy_from`, or a
    client every virtual server's ACL refuses, is closed before a byte is read), then
    pre-read (`_route`):
    the PROXY header if `accept_proxy`, then the TLS ClientHello, within the first
    virtual server's `connect_timeout`; the bytes read go to the chosen virtual
    server's handler, to be forwarded unchanged, and its own ACL.

    Clients beyond `global.max_clients` never get here: the accept batch closes them
    and calls `refuse_client` (net/descriptors.py).
    """

    def __init__(
        self, address: Address, sock: socket.socket, virtual_servers: Sequence[VirtualServer]
    ):
        self.address = address
        # A plain non-blocking socket: the accept loop waits on its descriptor itself
        # (see accept_loop), so trio's socket wrapper would only add cost.
        self.sock = sock
        self.cancel_scope = trio.CancelScope()
        self._acceptor: ReactorAcceptor | None = None  # while accepting
        self._handlers: dict[VirtualServer, Handler] = {}
        self.route(virtual_servers)

    def route(self, virtual_servers: Sequence[VirtualServer]) -> None:
        """Feed these virtual servers (configuration order) from now on.

        Called when the listener is made and after every reload: the set of virtual
        servers on an address, or their `sni` names and `alpn` protocols, may change
        while the socket stays bound. Connections already handed to a handler keep it.
        """
        old = self._handlers
        self._handlers = {vs: old.get(vs) or Handler(vs) for vs in virtual_servers}
        for vs, handler in old.items():
            if vs not in self._handlers:  # its connections go on; no new one comes
                handler.retire()
        self.vs = virtual_servers[0]  # the address's first: it counts no_route
        self.handler = self._handlers[self.vs]
        self.routes = Routes(virtual_servers)
        # The screen at accept of a shared (SNI) address: the PROXY senders trusted
        # (the virtual servers of an address agree on them), else the ACLs of all its
        # virtual servers, of which one must admit the client (None: all admit all).
        first = self.vs.pool.config
        self._proxy_peers = SourceFilter(first.accept_proxy_from) if first.accept_proxy else None
        acls = [SourceFilter(vs.pool.config.allow, vs.pool.config.deny) for vs in virtual_servers]
        self._acls = None if any(acl.everyone for acl in acls) else acls
        alone = len(virtual_servers) == 1
        if alone and not (self.vs.pool.config.sni or self.vs.pool.config.alpn):
            # Served at once by the handler, with a task only if it has to wait.
            self.accept_client = self.handler.accept
        else:
            self.accept_client = self._spawn_route

    @property
    def virtual_servers(self) -> list[VirtualServer]:
        return list(self._handlers)

    def close(self) -> None:
        """Stop accepting and close the socket (the drain, a reload that drops the
        address); connections already accepted go on."""
        if self._acceptor is not None:  # out of the reactor's set first (ReactorAcceptor)
            self._acceptor.stop()
        self.cancel_scope.cancel()
        trio.lowlevel.notify_closing(self.sock)  # wakes a waiter with ClosedResourceError
        self.sock.close()
        for handler in self._handlers.values():
            handler.retire()

    def refuse_client(self, peer: tuple) -> None:
        """The accept batch closed a client beyond `global.max_clients`: counted on the
        address's first virtual server (the one it would have been routed by)."""
        self.handler.reject("max_clients", peer)
        note_refused()

    def _spawn_route(self, client: int, peer: tuple, spawn: Spawn) -> None:
        if self._proxy_peers is not None or self._acls is not None:  # else: no call
            refused = self._screen(peer[0])
            if refused is not None:
                os.close(client)
                self.handler.reject(refused, peer)
                return
        clients.open += 1  # while pre-read here; the handler's connection counts it then
        try:
            spawn(self._route, client, peer)
        except BaseException:
            clients.open -= 1
            os.close(client)
            raise

    def _screen(self, host: str) -> str | None:
        """Why a client of a shared address is closed before a byte is read (the
        rejection's reason), or None: it may be pre-read."""
        proxy_peers = self._proxy_peers
        if proxy_peers is not None:
            # With accept_proxy the ACLs apply to the header's source, read later.
            return None if proxy_peers.admits(host) else "proxy_untrusted"
        acls = self._acls
        if acls is None:
            return None
        for acl in acls:
            if acl.admits(host):
                return None
        return "acl"

    async def _route(self, fd: int, peer: tuple) -> None:
        """Pre-read a client of a shared (SNI) address and hand it to its handler.

        Every way this can go wrong ends here, with the client closed (and counted as
        `no_route` when there is no default): nothing escapes to the nursery.
        """
        # A socket object for the reads (the descriptor is non-blocking already); the
        # handler gets the descriptor back.
        client = socket.socket(-1, socket.SOCK_STREAM, 0, fd)
        # As they are now: a reload re-routing the listener meanwhile changes nothing
        # for this client.
        routes, handlers, first = self.routes, self._handlers, self.handler
        config = first.pool.config
        source = peer
        reader = ClientHelloReader()
        received = bytearray()  # outside the deadline's scope: kept when it expires
        handler = None
        header_read = not config.accept_proxy
        try:
            with trio.move_on_after(config.connect_timeout):
                if config.accept_proxy:
                    header = await _read_proxy_header(client, first.name)
                    if header is None:
                        return  # a bad PROXY header: dropped, as the handler would
                    source = header[0]
                    received += header[1]
                    header_read = True
                await _read_client_hello(client, reader, received)
            if not header_read:
                log.debug("%s: no PROXY header within %ss", first.name, config.connect_timeout)
                return
            result = reader.eof()  # incomplete at the deadline or EOF: not a hello
            if isinstance(result, Hello):
                server_name, alpn = result.server_name, result.alpn
            else:
                server_name, alpn = None, ()
            vs = routes.match(server_name, alpn)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "%s: sni %s alpn %s -> %s", self.address, server_name, alpn, vs and vs.name
                )
            if vs is None:
                first.reject("no_route", source)
                return
            handler = handlers[vs]
        except OSError as exc:  # reset while we read: nobody to route
            log.debug("%s: client gone before it was routed: %s", self.address, exc)
            return
        except Exception as exc:  # a bug in routing must end only this connection
            record("route", exc, str(self.address))
            return
        finally:
            clients.open -= 1  # the handler's connection counts it from here on
            if handler is None:
                client.close()
        # This frame waits as long as the connection lives: let go of the reader and
        # its copy of the hello now (an idle connection should keep only what it needs).
        serve = handler.handle(client.detach(), source, bytes(received))
        del reader, received, routes, handlers, handler
        await serve

    async def accept_loop(self, handlers: trio.Nursery) -> None:
        """Accept clients until closed, each served at once or by a task in `handlers`."""
        # The accept loop that shares the pump reactor's wait (net/accept.py), which
        # reads `accept_client` for every client: a reload re-routing this listener
        # takes effect at the next one.
        errors = AcceptErrors(str(self.address), log)  # the back-off
        with self.cancel_scope:
            acceptor = self._acceptor = ReactorAcceptor(
                self.sock, self, handlers.start_soon, errors, clients
            )
            try:
                await acceptor.serve()
            finally:
                self._acceptor = None


def listen_socket(address: Address, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    host = "127.0.0.1" if address.host == "localhost" else address.host
    # A stdlib socket bound synchronously (the host is a literal: no DNS), then handed
    # to trio: a reload can bind all its addresses before changing anything.
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            # workers > 1: every worker binds its own socket on the address and the
            # kernel spreads new connections across them (lbproxy/runtime/workers/)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            # one socket per family, as trio's open_tcp_listeners: [::]:80 and
            # 0.0.0.0:80 can then both be configured
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted
        sock.bind((host, address.port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise bind_error(address, exc) from None
    return sock


def bind_error(address: Address, exc: OSError) -> BindError:
    """`cannot listen on ADDRESS: REASON`, saying what a port below 1024 needs."""
    hint = ""
    if exc.errno in (errno.EACCES, errno.EPERM) and address.port < 1024:
        hint = (
            " (a port below 1024 needs root or CAP_NET_BIND_SERVICE, which lbproxy keeps "
            "when it drops root for global.user)"
        )
    return BindError(f"cannot listen on {address}: {exc.strerror}{hint}")


# -- the pre-read of a shared (SNI) address ------------------------------------------


async def _read_proxy_header(client: socket.socket, name: str) -> tuple[tuple, bytes] | None:
    """The source a PROXY header names and the bytes after it; None: a bad header."""
    sock = trio.socket.from_stdlib_socket(client)
    try:
        source, leftover = await read_proxy_header(sock)
        return (source or client.getpeername()[:2]), leftover
    except (OSError, ProxyProtocolError) as exc:
        log.debug("%s: bad PROXY header: %s", name, exc)
        return None


async def _read_client_hello(
    client: socket.socket, reader: ClientHelloReader, received: bytearray
) -> None:
    """Read into `received` until `reader` has a result; returns early on EOF (the
    caller's deadline cancels it; a socket error is raised). Bytes already in
    `received` (after a PROXY header) are fed first."""
    if received and reader.feed(bytes(received)) is not None:
        return
    fd = client.fileno()
    while True:
        try:
            chunk = client.recv(HELLO_READ)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(fd)
            continue
        if not chunk:
            return
        received += chunk
        if reader.feed(chunk) is not None:
            return
