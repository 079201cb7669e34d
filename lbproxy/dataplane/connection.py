"""One client connection: admit -> pick -> connect (retry elsewhere) -> pump both ways.

Everything a connection needs from its virtual server is read from the pool at the
moment it starts (`pool.config`), so a reload that changes timeouts or the scheduler
applies to new connections while established ones keep going undisturbed.

Errors a connection can expect (refused, timeouts, resets, bad PROXY headers) are
handled here and end only that connection; nothing escapes to the accept loop.

Two paths, one behaviour (issue 15, docs/benchmarks.md). The fast path
(`Handler.accept`, called by the accept loop) has no task: whatever can be done at once
is done there -- admission, pick and take, a connect a near server completes before
connect() returns, the start of the pump -- and the reactor reports the end to
`_pumped`. The task path (`handle`, `_serve`) is for what has to wait: a PROXY header or
a queue from the start, and, handed over as it stands, a name to resolve, a connect in
progress or failed, retries. Both share the steps (`_admitted`, `_connection`,
`_attempt_failed`, `_connected`, `_ended`). A task costs more user time than all of
HAProxy's work for a connection; a task-less connection is drained through one guardian
task per handler (`_guard`).

A connection is carried as plain descriptors, the client's from accept to close and the
real server's from its connect on: the pump splices descriptors, and a socket object per
connection costs Python frames and, for an accepted one, a getsockname call (CPython's
check that a descriptor is a socket). Socket objects are built only where something
needs one: a PROXY header to read, SO_ERROR after a connect that had to wait.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
from collections.abc import Callable

import trio

from lbproxy.config.model import Address, VirtualServerConfig
from lbproxy.control.checks import LOCAL_CAPACITY_ERRNOS, LocalCapacityError, record_health
from lbproxy.core.pool import Lease, Pool, RealServer
from lbproxy.dataplane.proxy_header_io import read_proxy_header
from lbproxy.dataplane.virtual_server import VirtualServer
from lbproxy.net.barrier import record
from lbproxy.net.pump import Flow, Pump
from lbproxy.wire import proxy_protocol

log = logging.getLogger("lbproxy.proxy")
access_log = logging.getLogger("lbproxy.access")


_ALLOW_ALL = VirtualServerConfig.__dataclass_fields__["allow"].default
# socket.socket() without a Python __init__: the C type, for the connect to a real server
# (the pump needs only its descriptor, taken with detach() once connected).
_new_socket = socket.SocketType
_CONNECT_TYPE = socket.SOCK_STREAM | socket.SOCK_NONBLOCK


class Connection:
    """A pool lease's handle for a flow made elsewhere: live byte counts, and a way to
    close it. The handler's own connections are `ClientConnection`s, which are their
    own flow; this is the same interface for any other caller (tools, tests)."""

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
        self.flow.close()
        if self.connecting is not None:
            self.connecting.cancel()


class ClientConnection(Flow):
    """One client connection: the flow the pump moves (byte counts, idle timeout, close)
    and the handle its pool lease carries (`Connection`'s interface), with what its end
    needs (the lease, its source, when it started) -- one object per connection, not
    two, and no property between the counters and their readers.
    """

    __slots__ = ("connecting", "lease", "own_idle_timeout", "source", "started")

    def __init__(self, idle_timeout: float, source: tuple, started: float) -> None:
        # Flow.__init__'s lines, here: one frame less and no property setter (the
        # configuration's idle_timeout is a number of seconds or math.inf already).
        self.bytes_in = 0
        self.bytes_out = 0
        self.error: OSError | None = None
        self.last_activity = 0.0
        self.closing = False
        self._pump: Pump | None = None
        self._idle_timeout = idle_timeout
        # The scope of a connect that is waiting for the real server's answer, if any.
        self.connecting: trio.CancelScope | None = None
        # The virtual server's idle_timeout when the connection started: the throttle
        # imposes min(own, imposed) under load and gives this back in low mode.
        self.own_idle_timeout = idle_timeout
        self.source = source  # the client's address (the PROXY header's, if any)
        self.started = started
        self.lease: Lease | None = None  # once a server is taken

    @property
    def flow(self) -> Flow:
        """The connection's flow: itself (for the control plane's readers)."""
        return self

    def close(self) -> None:
        # No cancel scope of its own (a scope costs ~0.7 kB for the connection's whole
        # life): while connecting, the connect wait's scope is cancelled and the retry
        # loop stops; from then on the pump ends ("cancelled").
        Flow.close(self)
        if self.connecting is not None:
            self.connecting.cancel()


# What the accept loop hands connections to: its handlers nursery's start_soon.
Spawn = Callable[..., object]
# A connect attempt begun by the fast path, for the task to go on with: the server, its
# lease, when it was picked, and the connecting socket (None: not begun, the address is
# still to be resolved).
Pending = tuple[RealServer, Lease, float, "socket.SocketType | None"]


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
        # Connections served with no task (accept): the pumps, and the guardian task
        # standing for them in the handlers nursery while there are any.
        self._live: set[Pump] = set()
        self._guarded = False
        self._empty: trio.Event | None = None
        self._spawn: Spawn | None = None
        # Made once: the reactor's callback for every task-less connection's end.
        self._on_end: Callable[[Pump], None] = self._pumped
        # The run's clock, read directly (trio.current_time() is three Python frames).
        self._clock: Callable[[], float] = trio.lowlevel.current_clock().current_time

    @property
    def name(self) -> str:
        return self.pool.name

    # -- the fast path: no task -------------------------------------------------------

    def accept(self, client: int, peer: tuple, spawn: Spawn) -> None:
        """Serve a client the accept loop just accepted (its non-blocking descriptor);
        closes it in the end.

        Whatever can be done at once is done here, in the accept loop, with no task:
        admission, the pick, a non-blocking connect that a near server completes before
        connect() returns, and the start of the pump, whose end the reactor reports to
        `_pumped`. The first thing that has to wait -- a PROXY header to read, a name
        to resolve, a connect in progress or failed (retries) -- hands the connection,
        as it stands, to a task in `spawn`'s nursery (`_serve`, today's path), so every
        wait keeps its trio code. Measured (docs/benchmarks.md): a task per connection
        costs more user time than all of HAProxy's work for it.
        """
        pool = self.pool
        config = pool.config
        vs = self.vs
        queue = vs.queue
        if config.accept_proxy or (queue is not None and queue.must_wait()):
            # A header to read, or a queue to wait in: a task from the start. An idle
            # queue (no one waiting, a server free) keeps the fast path.
            try:
                spawn(self.handle, client, peer)
            except BaseException:
                os.close(client)
                raise
            return
        pool.clients += 1
        handed = False
        connection: ClientConnection | None = None
        try:
            throttle = vs.throttle
            if throttle is not None and throttle.arrival():  # digg: close at once
                self._reject("throttle", peer)
                return
            if not self._admitted(config, peer):
                return
            started = self._clock()
            connection = self._connection(config, peer, started)
            rs = pool.pick(started, (), peer)
            if rs is None:  # no server: the task path counts and logs it
                spawn(self._serve, client, b"", connection, config, [], None)
                handed = True
                return
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s", explain_pick(pool, rs, []))
            lease = connection.lease = pool.take(rs, started, connection, peer)
            cached = self._resolved.get(rs.address)
            if cached is None:  # resolve, then connect, in the task
                spawn(
                    self._serve, client, b"", connection, config, [rs], (rs, lease, started, None)
                )
                handed = True
                return
            try:
                sock, err = self._start_connect(*cached)
            except (LocalCapacityError, ConnectError) as exc:
                if not self._attempt_failed(rs, lease, exc):  # no retry
                    pool.rejected["connect_failed"] += 1
                    if vs.access_log:
                        self._log_access(peer, None, connection, started, "no_server")
                    return
                # retry another server in the task
                spawn(self._serve, client, b"", connection, config, [rs], None)
                handed = True
                return
            if err:  # in progress: the task waits for it
                spawn(
                    self._serve, client, b"", connection, config, [rs], (rs, lease, started, sock)
                )
                handed = True
                return
            self._connected(rs, lease, started)
            if queue is not None and queue.waiting:
                queue.kick()  # the slot is taken: the next waiter, if room is left
            self._spawn = spawn
            handed = True  # the pump owns both descriptors now, whatever happens
            self._pump_now(client, sock.detach(), connection, config)
        except Exception as exc:  # the barrier: a bug ends this connection only
            if handed:  # not expected: _pump_now and the spawned task own their ends
                record("connection", exc, pool.name)
            else:
                self._internal_error(connection, exc)
        finally:
            if not handed:
                pool.clients -= 1
                os.close(client)

    def _pump_now(
        self, client: int, server: int, connection: ClientConnection, config: VirtualServerConfig
    ) -> None:
        """Start the pump with no task: it owns (and closes) both descriptors, and the
        reactor reports its end to `_pumped`."""
        header = b""
        try:
            if config.send_proxy != "none":
                header = proxy_protocol.encode(
                    config.send_proxy, connection.source, _local_address(client)
                )
        except Exception as exc:  # OSError, as in _serve: the client reset before getsockname()
            os.close(server)
            os.close(client)
            self._pump_failed(connection, exc)
            return
        try:
            # close_sockets: it owns both descriptors from here on, even if this raises
            p = Pump(client, server, connection, preamble=header, close_sockets=True)
        except Exception as exc:  # OSError: as in _serve
            self._pump_failed(connection, exc)
            return
        p.on_end = self._on_end
        self._live.add(p)
        if not self._guarded:
            self._guarded = True
            assert self._spawn is not None
            self._spawn(self._guard)
        try:
            p.start()
        except OSError as exc:  # as in _serve: only this connection ends
            log.debug("%s: %s", self.pool.name, exc)
            connection.error = exc
            if p.outcome is None:
                p.outcome = "error"
        except Exception as exc:  # the barrier: a bug ends this connection only
            record("connection", exc, self.pool.name)
            if p.outcome is None:
                p.outcome = "error"
        if p.outcome is not None and p.on_end is not None:  # ended before it began
            p.close()
            end = p.on_end
            p.on_end = None
            end(p)

    def _pump_failed(self, connection: ClientConnection, exc: Exception) -> None:
        if isinstance(exc, OSError):
            log.debug("%s: %s", self.pool.name, exc)
            connection.error = exc
        else:
            record("connection", exc, self.pool.name)
        self._finished(connection, "error")

    def _internal_error(
        self, connection: ClientConnection | None, exc: BaseException, where: str = "connection"
    ) -> None:
        """The barrier's clean-up: count and log the bug, and give back the lease the
        connection still holds (its descriptors are closed by the caller). Never raises."""
        record(where, exc, self.pool.name)
        lease = None if connection is None else connection.lease
        if lease is not None and lease in lease.server.leases:
            try:
                self.pool.drop(lease, self._clock())
            except Exception as again:
                record(where, again, f"{self.pool.name}: dropping the lease")

    def _pumped(self, p: Pump) -> None:
        """The reactor's report that a task-less connection is over (both descriptors
        are closed by then). Called from the reactor, a deadline or Flow.close(): it
        must not raise."""
        self._live.discard(p)
        connection: ClientConnection = p.flow  # type: ignore[assignment]
        try:  # _finished(), inline: once per connection
            assert connection.lease is not None
            self._ended(
                connection.lease,
                connection,
                connection.started,
                connection.source,
                p.outcome or "error",
            )
        except Exception as exc:
            self._internal_error(connection, exc, "connection_end")
        finally:
            self.pool.clients -= 1
        if not self._live and self._empty is not None:
            self._empty.set()

    def _finished(self, connection: ClientConnection, end: str) -> None:
        """A task-less connection is over: its end, counted (must not raise)."""
        try:
            assert connection.lease is not None
            self._ended(connection.lease, connection, connection.started, connection.source, end)
        except Exception as exc:
            self._internal_error(connection, exc, "connection_end")
        finally:
            self.pool.clients -= 1

    async def _guard(self) -> None:
        """Stands, in the handlers nursery, for the connections that have no task, so
        the drain waits for them, and closes them when its deadline cancels it."""
        try:
            while self._live:
                self._empty = trio.Event()
                await self._empty.wait()
        except BaseException:
            for p in list(self._live):
                p.flow.close()  # outcome "cancelled", reported through _pumped
            raise
        finally:
            self._guarded = False
            self._empty = None

    # -- the task path ----------------------------------------------------------------

    async def handle(self, client: int, peer: tuple, preread: bytes | None = None) -> None:
        """Serve one accepted client (its descriptor) in a task until both sides are
        done; closes it. For what may wait from the start (a PROXY header to read, a
        queue) and for the clients a shared (SNI) address routes here.

        `preread`: the listener has already read the PROXY header (if any; `peer` is
        then the source it names) and these bytes (a TLS ClientHello, for the route),
        which go to the real server first, unchanged.
        """
        pool = self.pool
        config = pool.config
        pool.clients += 1
        try:
            admitted = await self._admit(client, peer, config, preread)
        except Exception as exc:  # the barrier: a bug ends this connection only
            record("connection", exc, pool.name)
            admitted = None
        except BaseException:
            pool.clients -= 1
            os.close(client)
            raise
        if admitted is None:
            pool.clients -= 1
            os.close(client)
            return
        source, leftover = admitted
        connection = self._connection(config, source, trio.current_time())
        await self._serve(client, leftover, connection, config, [], None)

    async def _serve(
        self,
        client: int,
        leftover: bytes,
        connection: ClientConnection,
        config: VirtualServerConfig,
        tried: list[RealServer],
        pending: Pending | None,
    ) -> None:
        """The rest of a connection's life, in a task: connect (the attempt `pending`
        first, then retries), pump, end. Counted in pool.clients already; closes the
        client's descriptor.

        One coroutine from here to the end: its frame and trio's wait are what an idle
        connection keeps alive, so the steps before the pump are helpers that return,
        not frames that stay on the stack, and the pump is driven by the reactor while
        this task waits in ``finished()``.
        """
        pool = self.pool
        source, started = connection.source, connection.started
        client_open = True  # until the pump owns it
        try:
            queue = self.vs.queue
            # A connection the fast path hands over has picked already (`tried`): it
            # holds a lease, and must not wait behind the slot it holds itself.
            if queue is not None and not tried and queue.must_wait():
                reason = await queue.wait()
                if reason is not None:  # queue_full | queue_timeout
                    self._reject(reason, source)
                    return
            connected = await self._connect(connection, config, source, tried, pending)
            if queue is not None and queue.waiting:
                queue.kick()  # the slot is taken: the next waiter, if room is left
            if connected is None:
                if self.vs.access_log:
                    end = "cancelled" if connection.closing else "no_server"
                    self._log_access(source, None, connection, started, end)
                return
            server, lease = connected
            outcome = "cancelled"  # the drain deadline cancelled us
            p: Pump | None = None
            try:
                header = b""
                if config.send_proxy != "none":
                    try:
                        destination = _local_address(client)
                        header = proxy_protocol.encode(config.send_proxy, source, destination)
                    except BaseException:
                        os.close(server)
                        raise
                # close_sockets: the pump closes both the moment it ends (or fails to
                # start), which saves two epoll_ctl and usually a shutdown per connection.
                client_open = False
                p = Pump(
                    client,
                    server,
                    connection,
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
                connection.error = exc
                outcome = "error"
            except Exception as exc:  # the barrier: a bug ends this connection only
                if p is None or exc is not p.error:  # else the reactor counted it
                    record("connection", exc, pool.name)
                outcome = "error"
            finally:
                try:
                    self._ended(lease, connection, started, source, outcome)
                except Exception as exc:
                    self._internal_error(connection, exc, "connection_end")
        except Exception as exc:  # the barrier: a bug ends this connection only
            self._internal_error(connection, exc)
        finally:
            if client_open:
                os.close(client)
            pool.clients -= 1

    # -- shared by both paths ------------------------------------------------------------

    def _connection(
        self, config: VirtualServerConfig, source: tuple, started: float
    ) -> ClientConnection:
        connection = ClientConnection(config.idle_timeout, source, started)
        if self.vs.throttle is not None:  # start with the imposed idle timeout, if any
            connection.idle_timeout = self.vs.throttle.idle_timeout_for(config.idle_timeout)
        return connection

    def _ended(self, lease: Lease, flow: Flow, started: float, source: tuple, end: str) -> None:
        pool = self.pool
        rs = lease.server
        rs.bytes_in += flow.bytes_in
        rs.bytes_out += flow.bytes_out
        now = self._clock()
        pool.drop(lease, now)
        pool.durations.observe(now - started)
        if self.vs.access_log:
            self._log_access(source, rs.name, flow, started, end)

    async def _admit(
        self,
        client: int,
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
            # A trio socket over the descriptor for the read; detached after, not closed.
            sock = trio.socket.from_stdlib_socket(socket.socket(-1, socket.SOCK_STREAM, 0, client))
            try:
                header = await self._read_proxy_header(sock, config.connect_timeout)
            finally:
                sock.detach()
            if header is None:
                return None
            source, leftover = header
        if not self._admitted(config, source):
            return None
        return source, leftover

    def _admitted(self, config: VirtualServerConfig, source: tuple) -> bool:
        """The ACL and max_connections (counted and logged when they refuse)."""
        if not self._allowed(config, source[0]):
            self._reject("acl", source)
            return False
        if config.max_connections and self.pool.clients > config.max_connections:
            self._reject("max_connections", source)
            return False
        return True

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
        self,
        handle: ClientConnection,
        config: VirtualServerConfig,
        source: tuple,
        tried: list[RealServer],
        pending: Pending | None = None,
    ) -> tuple[int, Lease] | None:
        """Connect to a picked real server, retrying others (never the same one twice):
        (its connected descriptor, the lease), or None.

        `source` is the client's address (the PROXY header's with accept_proxy), for
        persistence and maglev; the pool ignores it when neither is configured.
        `tried` holds the servers already tried (by the fast path), and `pending` the
        attempt it began: (server, lease, when, socket connecting or None: not begun).
        """
        pool = self.pool
        while True:
            if pending is not None:
                rs, lease, now, started_sock = pending
                pending = None
            else:
                if len(tried) > config.retries:
                    break
                if handle.closing:  # closed while an earlier attempt was waiting
                    return None
                now = trio.current_time()
                rs = pool.pick(now, tried, source)
                if rs is None:
                    break
                tried.append(rs)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("%s", explain_pick(pool, rs, tried[:-1]))
                # Taken before the connect completes, as IPVS counts a connection from
                # its SYN: concurrent arrivals then see this one and spread out.
                lease = handle.lease = pool.take(rs, now, handle, source)
                started_sock = None
            try:
                sock = await self._open(rs.address, config.connect_timeout, handle, started_sock)
            except (LocalCapacityError, ConnectError) as exc:
                if isinstance(exc, ConnectError) and exc.reason == "cancelled":
                    pool.drop(lease, trio.current_time())
                    return None
                if self._attempt_failed(rs, lease, exc):
                    continue
                break
            except BaseException:  # the drain deadline: give the lease back all the same
                pool.drop(lease, trio.current_time())
                raise
            self._connected(rs, lease, now)
            return sock.detach(), lease
        pool.rejected["connect_failed" if tried else "no_server"] += 1
        return None

    def _attempt_failed(
        self, rs: RealServer, lease: Lease, exc: LocalCapacityError | ConnectError
    ) -> bool:
        """A connect attempt failed: give the lease back; True: try another server."""
        pool = self.pool
        pool.drop(lease, trio.current_time())
        if isinstance(exc, LocalCapacityError):
            # Out of descriptors here: not the real server's fault, and no other
            # would do better; the client is closed (the accept loop backs off).
            return False
        rs.connect_failures[exc.reason] += 1
        record_health(pool, rs, False, trio.current_time(), f"connect {exc.reason}")
        return True

    def _connected(self, rs: RealServer, lease: Lease, now: float) -> None:
        self.pool.established(lease)
        if not rs.health.clean:
            # a good connect ends a failure streak (or is a down server's trial)
            record_health(self.pool, rs, True, now, "connect succeeded")

    def _start_connect(self, family: int, sockaddr: tuple) -> tuple[socket.SocketType, int]:
        """socket() and a non-blocking connect: (socket, 0) connected already, or
        (socket, EINPROGRESS). Raises LocalCapacityError or ConnectError (closed)."""
        try:
            # A plain non-blocking socket: trio's wrapper costs a checkpoint, an address
            # re-resolution and an ioctl per connect, and socket.socket's Python layer
            # frames of its own; the pump needs only the descriptor.
            sock = _new_socket(family, _CONNECT_TYPE)
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
            if err and err != errno.EINPROGRESS:
                raise OSError(err, os.strerror(err))
        except OSError as exc:
            sock.close()
            raise _connect_error(exc) from None
        except BaseException:
            sock.close()
            raise
        return sock, err

    async def _open(
        self,
        address: Address,
        timeout: float,
        handle: ClientConnection,
        sock: socket.SocketType | None = None,
    ) -> socket.SocketType:
        """A connected socket to `address`; `sock`: a connect already in progress."""
        if sock is None:
            cached = self._resolved.get(address)  # no coroutine on the usual cache hit
            family, sockaddr = cached if cached is not None else await self._resolve(address)
            sock, err = self._start_connect(family, sockaddr)
            if not err:
                return sock
        try:
            with trio.move_on_after(timeout) as deadline:
                handle.connecting = deadline  # ClientConnection.close() cancels it
                try:
                    await trio.lowlevel.wait_writable(sock.fileno())
                finally:
                    handle.connecting = None
            if handle.closing:
                raise ConnectError("cancelled")
            if deadline.cancelled_caught:
                raise ConnectError("timeout")
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err))
        except OSError as exc:
            sock.close()
            raise _connect_error(exc) from None
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


def _local_address(fd: int) -> tuple:
    """The local address of a connected descriptor (send_proxy's destination)."""
    sock = socket.socket(-1, socket.SOCK_STREAM, 0, fd)
    try:
        return sock.getsockname()
    finally:
        sock.detach()


def _connect_error(exc: OSError) -> ConnectError:
    """A failed connect attempt, by the reason its metrics count: refused or error."""
    return ConnectError("refused" if exc.errno == errno.ECONNREFUSED else "error")
