"""Listening addresses: bind, the accept loop, and its back-off when out of descriptors.

A `Listener` is one bound socket and the virtual server it feeds. Its accept loop hands
every accepted client to a task in the server's handlers nursery (trio's
`serve_listeners` is the model: the accept loop and the handlers live in separate
nurseries, so stopping accepting does not cancel connections).

Data flows one way: client -> listener -> connection handler (proxy.py) -> pump. This
module imports the handler and the runtime virtual server; neither imports it.
"""

from __future__ import annotations

import errno
import logging
import socket

import trio

from lbproxy.config import Address
from lbproxy.proxy import Handler
from lbproxy.virtual_server import VirtualServer

log = logging.getLogger("lbproxy.listener")

LISTEN_BACKLOG = 4096

# Accept errors that mean "out of descriptors or memory": back off and retry, never
# crash or spin (trio's ACCEPT_CAPACITY_ERRNOS in _highlevel_serve_listeners.py). The
# pending connection stays in the kernel's backlog and is served once a slot frees up.
ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
ACCEPT_BACKOFF = 0.1
ACCEPT_BATCH = 1  # connections accepted between two checkpoints of the accept loop
# A burst of capacity errors ends (and "accepting again" is logged, once) only when an
# accept succeeds this long after the last error: at the limit, every freed descriptor
# lets one accept through between errors, which is still the same burst.
ACCEPT_BURST_QUIET = 1.0


class BindError(Exception):
    """A listen address could not be bound (in use, no permission): exit code 1."""


class Listener:
    """One bound listening socket, the virtual server it feeds, and its accept loop."""

    def __init__(self, address: Address, sock: socket.socket, vs: VirtualServer):
        self.address = address
        # A plain non-blocking socket: the accept loop waits on its descriptor itself
        # (see accept_loop), so trio's socket wrapper would only add cost.
        self.sock = sock
        self.vs = vs
        self.handler = Handler(vs)
        self.cancel_scope = trio.CancelScope()

    def close(self) -> None:
        self.cancel_scope.cancel()
        trio.lowlevel.notify_closing(self.sock)  # wakes a waiter with ClosedResourceError
        self.sock.close()

    async def accept_loop(self, handlers: trio.Nursery) -> None:
        """Accept clients until closed, each served by a task in `handlers`."""
        spawn = handlers.start_soon
        listener = self
        # Accept on the plain socket under trio's wrapper: trio's accept() costs two
        # checkpoints (a scheduler round each) and a wrapper object per connection. We
        # wait only when the backlog is empty, and let other tasks run every
        # ACCEPT_BATCH connections so a flood cannot starve established ones.
        sock = listener.sock
        fd = sock.fileno()
        batch = 0
        burst_errors = 0  # capacity errors in the current burst; 0: no burst
        last_error = 0.0
        with listener.cancel_scope:
            while True:
                try:
                    client, peer = sock.accept()
                    client.setblocking(False)
                except BlockingIOError:
                    batch = 0
                    try:
                        await trio.lowlevel.wait_readable(fd)
                    except trio.ClosedResourceError:  # closed by a reload
                        return
                    continue
                except OSError as exc:
                    if exc.errno in ACCEPT_CAPACITY_ERRNOS:
                        if not burst_errors:
                            log.error(
                                "%s: accept failed (%s); retrying every %ss",
                                listener.address,
                                exc.strerror,
                                ACCEPT_BACKOFF,
                            )
                        burst_errors += 1
                        last_error = trio.current_time()
                        await trio.sleep(ACCEPT_BACKOFF)
                        continue
                    if exc.errno in (errno.EBADF, errno.EINVAL):  # closed by a reload
                        return
                    log.warning("%s: accept failed: %s", listener.address, exc)
                    continue
                if burst_errors and trio.current_time() - last_error >= ACCEPT_BURST_QUIET:
                    log.info(
                        "%s: accepting again (%d accept failure(s) in that burst)",
                        listener.address,
                        burst_errors,
                    )
                    burst_errors = 0
                spawn(listener.handler.handle, client, peer)
                batch += 1
                if batch >= ACCEPT_BATCH:
                    batch = 0
                    await trio.lowlevel.checkpoint()


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
            # kernel spreads new connections across them (lbproxy/workers.py)
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
        raise BindError(f"cannot listen on {address}: {exc.strerror}") from None
    return sock
