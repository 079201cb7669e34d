"""Accepting connections: the one accept loop, the errnos that mean "out of capacity",
and the back-off.

One loop (`accept_loop`), one table and one back-off for every listening socket (the
proxy's listeners, the admin endpoint, the DNS locator's TCP side); the table also serves
the connects that can run out the same way (health checks, connects to real servers).
trio's serve_listeners is the model (ACCEPT_CAPACITY_ERRNOS in
_highlevel_serve_listeners.py): out of descriptors or memory, an accept backs off and
retries -- never crash, never spin. The pending connection stays
in the kernel's backlog and is served once a slot frees up.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
from collections.abc import Callable
from typing import Any, Protocol

import trio

from lbproxy.net.barrier import record
from lbproxy.net.compiled import cpump
from lbproxy.net.descriptors import ClientCount
from lbproxy.net.reactor import reactor

__all__ = [
    "ACCEPT_BACKOFF",
    "ACCEPT_BATCH",
    "CAPACITY_ERRNOS",
    "AcceptErrors",
    "Acceptor",
    "LocalCapacityError",
    "ReactorAcceptor",
    "accept_loop",
]

# Out of descriptors (this process's or the system's) or of kernel memory.
CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
# The listening socket was closed (a reload, a stop): the loop ends.
CLOSED_ERRNOS = frozenset({errno.EBADF, errno.EINVAL})


class LocalCapacityError(Exception):
    """This process could not create a socket (CAPACITY_ERRNOS): no result for the real
    server it was for (a health check, a connect); raised by those connects."""


ACCEPT_BACKOFF = 0.1  # seconds between two accepts while out of capacity
# Connections accepted per wake-up, at most, before the accept loop lets other tasks run:
# it accepts until the backlog is empty (EAGAIN) or this many, so a burst of arrivals
# costs one trio wait and one scheduler round instead of one each (each round is an
# epoll_wait), and a flood still cannot starve established connections.
ACCEPT_BATCH = 16
# A burst of capacity errors ends (and "accepting again" is logged, once) only when an
# accept succeeds this long after the last error: at the limit, every freed descriptor
# lets one accept through between errors, which is still the same burst.
ACCEPT_BURST_QUIET = 1.0


class AcceptErrors:
    """What one accept loop does when accept() fails, and when it works again.

    The loop calls `failed(exc)` on an OSError (False: the socket is closed, stop) and,
    after a success, `recovered()` only while `burst` is non-zero (an attribute test on
    the per-connection path, nothing more).
    """

    __slots__ = ("burst", "last_error", "log", "name")

    def __init__(self, name: str, logger: logging.Logger) -> None:
        self.name = name
        self.log = logger
        self.burst = 0  # capacity errors in the current burst; 0: no burst
        self.last_error = 0.0

    async def failed(self, exc: OSError) -> bool:
        if exc.errno in CAPACITY_ERRNOS:
            if not self.burst:
                self.log.error(
                    "%s: accept failed (%s); retrying every %ss",
                    self.name,
                    exc.strerror,
                    ACCEPT_BACKOFF,
                )
            self.burst += 1
            self.last_error = trio.current_time()
            await trio.sleep(ACCEPT_BACKOFF)
            return True
        if exc.errno in CLOSED_ERRNOS:
            return False
        self.log.warning("%s: accept failed: %s", self.name, exc)
        await trio.lowlevel.checkpoint()
        return True

    def owner_failed(self, exc: Exception) -> None:
        """The barrier: an owner's accept_client raised (it closed what it owned)."""
        record("accept", exc, self.name)

    def recovered(self) -> None:
        if trio.current_time() - self.last_error >= ACCEPT_BURST_QUIET:
            self.log.info(
                "%s: accepting again (%d accept failure(s) in that burst)", self.name, self.burst
            )
            self.burst = 0


Spawn = Callable[..., object]  # a nursery's start_soon
F_SETFL, O_NONBLOCK = fcntl.F_SETFL, os.O_NONBLOCK


class Acceptor(Protocol):
    """What an accept loop hands each client to.

    `accept_client(fd, peer, spawn)` is called in the loop, once per accepted client,
    with a non-blocking descriptor the callee now owns and the peer address as accept()
    returns it; it serves the client at once or `spawn`s a task for it, and must not
    block. It is read from the owner for every client, so an owner may replace it (a
    listener re-routed by a reload) while the loop runs.
    """

    @property  # read-only here: a method or an attribute of the owner both do
    def accept_client(self) -> Callable[[int, Any, Spawn], object]: ...


# accept_batch(fd, owner, spawn, most, failed, clients) -> how many were accepted (see
# _cpump.accept_batch): both accept loops' inner part.
_AcceptBatch = Callable[
    [int, Acceptor, Spawn, int, Callable[[Exception], None], "ClientCount | None"], int
]


def _accept_batch_for(sock: socket.socket, errors: AcceptErrors) -> _AcceptBatch:
    """The accept batch for `sock`: up to `most` clients accepted and each handed to
    ``owner.accept_client`` (read afresh: a reload may re-route the owner), an
    exception in it given to `failed` (the barrier); the first accept's OSError is
    raised (BlockingIOError: the backlog is empty), a later one ends the batch. With
    `clients` (the data plane's, net/descriptors.py), a client accepted while
    ``clients.open >= clients.limit`` is closed at once and handed to
    ``owner.refuse_client(peer)`` to be counted: one integer compare per client.

    Compiled: ``_cpump.accept_batch``, accept4 with SOCK_NONBLOCK, one C call
    per batch. Pure: `_accept` is socket.accept() without the socket object (Python
    frames, and a getsockname call CPython makes to check the descriptor): the data
    plane works on descriptors, and an owner that wants a socket object makes one.
    O_NONBLOCK with one fcntl, as HAProxy does (accept4's SOCK_NONBLOCK is not reachable
    from the standard library)."""
    if cpump is not None:
        return cpump.accept_batch
    accept = sock._accept  # type: ignore[attr-defined]  # CPython's accept4 wrapper
    set_flags = fcntl.fcntl

    def accept_batch(
        fd: int,
        owner: Acceptor,
        spawn: Spawn,
        most: int,
        failed: Callable[[Exception], None],
        clients: ClientCount | None = None,
    ) -> int:
        n = 0
        while n < most:
            try:
                client, peer = accept()
            except OSError:
                if n == 0:
                    raise
                break  # the next batch meets it again, or the backlog is empty
            n += 1
            if clients is not None and clients.open >= clients.limit:
                os.close(client)  # max_clients: closed before a byte is read
                try:
                    owner.refuse_client(peer)  # type: ignore[attr-defined]  # see above
                except Exception as exc:
                    failed(exc)
                continue
            try:
                set_flags(client, F_SETFL, O_NONBLOCK)
            except OSError as exc:  # not expected from a fresh socket: drop it
                errors.log.warning("%s: accepted socket: %s", errors.name, exc)
                os.close(client)
                continue
            try:
                owner.accept_client(client, peer, spawn)
            except Exception as exc:
                failed(exc)
        return n

    return accept_batch


async def accept_loop(
    sock: socket.socket, owner: Acceptor, spawn: Spawn, errors: AcceptErrors
) -> None:
    """Accept clients on the listening `sock` until it is closed, handing each to
    `owner.accept_client` with `spawn` (the handlers' nursery's start_soon: the loop and
    the handlers live in separate nurseries, as in trio's serve_listeners, so stopping
    the loop cancels no connection). Returns when the socket is closed; cancel it to
    stop it otherwise."""
    # Accept on the plain socket, not trio's wrapper: trio's accept() costs two
    # checkpoints (a scheduler round each) and a wrapper object per connection. A batch
    # at a time (_accept_batch_for); we wait only when the backlog is empty, and let
    # other tasks run after a full batch so a flood cannot starve established ones.
    sock.setblocking(False)
    fd = sock.fileno()
    batch = _accept_batch_for(sock, errors)
    failed = errors.owner_failed
    while True:
        try:
            n = batch(fd, owner, spawn, ACCEPT_BATCH, failed, None)
        except BlockingIOError:
            n = 0
        except OSError as exc:
            if await errors.failed(exc):
                continue
            return  # the socket was closed
        else:
            if errors.burst:
                errors.recovered()
        if n >= ACCEPT_BATCH:  # maybe more waiting: let other tasks run first
            await trio.lowlevel.checkpoint()
            continue
        try:
            await trio.lowlevel.wait_readable(fd)
        except trio.ClosedResourceError:  # closed meanwhile (a reload)
            return


class ReactorAcceptor:
    """An accept loop whose accepts run in the pump reactor's batches: the
    data plane's listeners.

    The listening descriptor sits in the reactor's epoll set beside the pumps' sockets
    (`Reactor.listen`, with `on_event` as its callback), so a wake-up that finds clients
    waiting and bytes to move costs one trio round, not one per task: under
    new-connection load the accept task's own wake-ups were most of trio's rounds
    (strace -c: 0.44 of the 2.44 epoll_ctl per connection were trio re-arming the two
    waits). Each readiness report accepts a
    batch (``ACCEPT_BATCH`` at most; a backlog left over is reported again, the set is
    level-triggered), each client handed to ``owner.accept_client`` as accept_loop does.
    The back-off stays in a task: an accept that fails for want of capacity takes the
    descriptor out of the set and wakes `serve`, which waits (AcceptErrors.failed) and
    puts it back. `stop()` takes it out at once; the owner calls it before closing the
    socket (a descriptor whose file is still open elsewhere -- a worker's, shared with
    the supervisor -- would otherwise stay in the set after close).
    """

    __slots__ = (
        "batch",
        "clients",
        "errors",
        "failure",
        "fd",
        "owner",
        "reactor",
        "spawn",
        "wake",
    )

    def __init__(
        self,
        sock: socket.socket,
        owner: Acceptor,
        spawn: Spawn,
        errors: AcceptErrors,
        clients: ClientCount | None = None,
    ) -> None:
        sock.setblocking(False)
        # The count `max_clients` bounds (net/descriptors.py); None: no bound. The owner
        # then has a refuse_client(peer) method for a client closed at accept.
        self.clients = clients
        self.fd = sock.fileno()
        self.batch = _accept_batch_for(sock, errors)
        self.owner = owner
        self.spawn = spawn
        self.errors = errors
        self.reactor = reactor()
        self.failure: OSError | None = None  # why the reactor stopped accepting, if it did
        self.wake = trio.Event()

    async def serve(self) -> None:
        """Accept (in the reactor) until stopped, the socket is closed, or this task is
        cancelled; the back-off runs here."""
        try:
            while True:
                self.failure = None
                self.wake = trio.Event()
                try:
                    self.reactor.listen(self.fd, self.on_event)
                except OSError:  # closed meanwhile (during a back-off), not by stop()
                    return
                await self.wake.wait()
                failure = self.failure
                if failure is None:  # stop()
                    return
                if not await self.errors.failed(failure):
                    return  # the socket was closed
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop accepting now (idempotent): out of the reactor's set, `serve` returns."""
        self.reactor.unlisten(self.fd, self.on_event)
        self.wake.set()

    def on_event(self, fd: int, events: int) -> None:
        """The reactor's report that clients are waiting: accept a batch."""
        try:
            self.batch(
                fd, self.owner, self.spawn, ACCEPT_BATCH, self.errors.owner_failed, self.clients
            )
        except BlockingIOError:  # another process's accept took them (workers)
            return
        except OSError as exc:  # out of capacity, or closed: serve() decides
            self.reactor.unlisten(self.fd, self.on_event)
            self.failure = exc
            self.wake.set()
            return
        except Exception as exc:  # the barrier: a bug in this batch, not in the reactor
            record("accept", exc, self.errors.name)
            return
        if self.errors.burst:
            self.errors.recovered()
