"""One client connection, one lifecycle: a state machine from accept to close.

    admitted -> preread -> queued -> picked -> connecting -> established -> closing -> ended

HAProxy's stream interface is the model (`enum si_state`: INI, REQ, QUE, TAR/ASS, CON,
EST, DIS, CLO): waiting is a state, not a second implementation. Each state is a step
that returns at once (`Handler._begin`, `_admit`, `_pick`, `_connect`, `_establish`);
a step that has to wait returns the wait instead (`_preread`: a PROXY header;
`_queued`: the queue; `_resolving`: a name; `_connecting`: a connect in progress), and
only then is a task spawned (`_waiting`), which awaits it and goes on with the steps. A
connection that waits for nothing -- no PROXY header, no queue, a cached address and a
near server that completes the connect before connect() returns -- runs the same steps
from admitted to established in the accept loop's call, with no task at all: a task
costs more user time than all of HAProxy's work for a connection (docs/benchmarks.md).
Every state change is `c.state = INTO[new][c.state]`, a lookup in the table
(dataplane/lifecycle.py) that raises for a transition the table lacks. Once
established, the pump (the reactor, net/pump.py) moves the bytes and reports the end;
the task-less connections of a handler are drained through one guardian task
(`Handler._guard`), which stands from its first such connection until the handler is
retired (`Handler.retire`: its listener closed, or a reload dropped its virtual server)
and its last connection has ended -- not one task per idle-to-busy transition, which on
a proxy serving one connection at a time would cost a task and two trio rounds, with
their wake-ups, per connection.

`ClientConnection.end()` is the one way out of every state: idempotent, it counts the
connection, writes the access log, gives the lease back, adds the byte counts and
uncounts `pool.clients` exactly once, and closes whatever descriptor the connection
still owns, so the counts stay right on every path and under cancellation. One
exception barrier covers every state: a bug in a step (`accept`, `_waiting`) or in the end
is counted in `lbproxy_internal_errors_total{where}` and ends that connection only.

Everything a connection needs from its virtual server is read from the pool when it is
accepted (`pool.config`), so a reload that changes timeouts or the scheduler applies to
new connections while established ones keep going undisturbed.

A connection is carried as plain descriptors, the client's from accept to close and the
real server's from its connect on: the pump splices descriptors, and a socket object per
connection costs Python frames and, for an accepted one, a getsockname call (CPython's
check that a descriptor is a socket). Socket objects are built only where something
needs one: a PROXY header to read, SO_ERROR after a connect that had to wait.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
from collections.abc import Awaitable, Callable

import trio

from lbproxy.config.model import Address, VirtualServerConfig
from lbproxy.core.client_address import SourceFilter
from lbproxy.core.closing import MAX_DURATION, lifetime
from lbproxy.core.health import record_health
from lbproxy.core.per_source import SourceEntry
from lbproxy.core.pool import Lease, Pool, RealServer
from lbproxy.dataplane.access_log import write as write_access_line
from lbproxy.dataplane.lifecycle import (
    ADMITTED,
    CLOSING,
    CONNECTING,
    ENDED,
    ESTABLISHED,
    INTO,
    PICKED,
    PREREAD,
    QUEUED,
    STATES,
)
from lbproxy.dataplane.proxy_header_io import read_proxy_header
from lbproxy.dataplane.virtual_server import VirtualServer
from lbproxy.net.accept import CAPACITY_ERRNOS as LOCAL_CAPACITY_ERRNOS
from lbproxy.net.accept import LocalCapacityError
from lbproxy.net.barrier import record
from lbproxy.net.compiled import cpump
from lbproxy.net.deadlines import deadlines
from lbproxy.net.descriptors import clients as _clients
from lbproxy.net.pump import SERVER_RESET, Flow, Pump, Reactor, reactor, run_clock
from lbproxy.wire import proxy_protocol

log = logging.getLogger("lbproxy.proxy")


# socket.socket() without a Python __init__: the C type, for the connect to a real server
# (the pump needs only its descriptor, taken with detach() once connected).
_new_socket = socket.SocketType
_CONNECT_TYPE = socket.SOCK_STREAM | socket.SOCK_NONBLOCK
# On the compiled path the connect is one C call: socket, TCP_NODELAY, connect
# and the getpeername that sees a completed handshake (_cpump.connect), to the struct
# sockaddr made once per address (_cpump.sockaddr).
_c_connect = cpump.connect if cpump is not None else None


class ClientConnection(Flow):
    """One client connection from accept to close: its state, what it owns (the
    client's descriptor until the pump has it, a connecting socket, the lease), the
    flow the pump moves (byte counts, idle timeout, close) and the handle its pool lease
    carries (the byte counts, `flow`, `own_idle_timeout` and `close()`, read by the
    control plane) -- one object per connection, not two.
    """

    __slots__ = (
        "config",
        "connecting",
        "fd",
        "handler",
        "lease",
        "leftover",
        "own_idle_timeout",
        "sock",
        "source",
        "started",
        "state",
        "tracked",
        "tried",
    )

    def __init__(
        self, handler: Handler, fd: int, source: tuple, config: VirtualServerConfig, now: float
    ) -> None:
        # Flow.__init__'s fields, set here: its call and its idle_timeout property setter
        # would be a measurable share of a connection's user CPU (docs/benchmarks.md);
        # tests/unit/dataplane/test_connection.py checks that every Flow field is
        # set, so the two cannot drift apart. The configuration's idle_timeout is a
        # number of seconds or math.inf already (the setter's check).
        self.pump: Pump | None = None
        self.closing = False
        self._idle_timeout = config.idle_timeout
        self.handler = handler
        self.state = ADMITTED
        handler.pool.clients += 1  # uncounted by end(), the one place
        _clients.open += 1  # the process's count (max_clients), likewise
        self.fd = fd  # the client's descriptor while the connection owns it, else -1
        self.source = source  # the client's address (the PROXY header's, if any)
        self.config = config  # as it was at accept: a reload changes the next ones
        self.started = now
        # Bytes read before the pick (behind a PROXY header, the SNI pre-read), for the
        # real server first; None: nothing pre-read (and a PROXY header still to read).
        self.leftover: bytes | None = None
        self.lease: Lease | None = None  # while a server is taken
        self.tried: list[RealServer] | None = None  # servers whose connect failed
        # Its client network's entry in the per-source table while counted there.
        self.tracked: SourceEntry | None = None
        self.sock: socket.SocketType | None = None  # a connect in progress
        # The scope of a connect that is waiting for the real server's answer, if any.
        self.connecting: trio.CancelScope | None = None
        # The virtual server's idle_timeout when the connection started: the throttle
        # imposes min(own, imposed) under load and gives this back in low mode.
        self.own_idle_timeout = config.idle_timeout

    @property
    def flow(self) -> Flow:
        """The connection's flow: itself (for the control plane's readers)."""
        return self

    @property
    def state_name(self) -> str:
        return STATES[self.state]

    def close(self) -> None:
        # No cancel scope of its own (a scope costs memory for the connection's whole
        # life): while connecting, the connect wait's scope is cancelled and the
        # connection ends ("cancelled"); once established the pump ends ("cancelled").
        Flow.close(self)
        if self.connecting is not None:
            self.connecting.cancel()

    def reject(self, reason: str) -> None:
        """End a connection refused before a server was picked (counted by reason)."""
        self.end("rejected:" + reason, reason)

    def end(self, how: str | None = None, rejected: str | None = None) -> None:
        """The end, from any state: count the connection (its bytes, duration and
        `rejected` reason, if any), write the access log (`how` is its `end=`; None:
        no line, as for a bad PROXY header or the drain's cancellation), give the lease
        back, uncount it from pool.clients and close what it still owns. Idempotent;
        never raises (a bug in the counting is the barrier's `connection_end`; every
        live state may close, and closing end, in TRANSITIONS)."""
        was = self.state
        if was >= CLOSING:
            return
        self.state = INTO[CLOSING][was]
        handler = self.handler
        try:
            # The counting, here rather than in a method of the handler's (a Python
            # frame per connection): the reason it was refused, an established
            # connection's bytes and duration, the lease, the access log.
            pool = handler.pool
            if rejected is not None:
                pool.rejected[rejected] += 1
            elif how == MAX_DURATION:
                pool.closed[MAX_DURATION] += 1
            lease = self.lease
            rs = None
            now = handler._clock()
            if lease is not None:
                if was == ESTABLISHED:
                    rs = lease.server
                    counters = rs.counters
                    pump = self.pump  # None: the pump never started (its open() raised)
                    if pump is not None:  # its counts read directly: no Flow property frames
                        counters.bytes_in += pump.bytes_in
                        answered = pump.bytes_out
                        counters.bytes_out += answered
                        # Outlier detection: a reset before the server's first byte is a
                        # failed connect; any other end, a success (only a server that
                        # failed lately has a record: a healthy one costs this test).
                        if how == SERVER_RESET:
                            counters.resets += 1
                        if how == SERVER_RESET and not answered:
                            handler._outlier_failure(rs, now)
                        elif rs.outlier is not None:
                            pool.answered(lease)
                    pool.drop(lease, now)
                    pool.durations.observe(now - self.started)
                else:
                    pool.drop(lease, now)
                self.lease = None
            if how is not None and handler.vs.access_log:
                if how.startswith("rejected:"):  # refused before anything moved
                    handler._log_access(self.source, None, 0, 0, 0.0, how)
                else:
                    handler._log_access(
                        self.source,
                        None if rs is None else rs.name,
                        self.bytes_in,
                        self.bytes_out,
                        now - self.started,
                        how,
                    )
        except Exception as exc:  # the barrier: the lease goes back all the same
            handler._end_failed(self, exc)
        finally:
            self.lease = None
            handler.pool.clients -= 1
            _clients.open -= 1
            tracked = self.tracked
            if tracked is not None:  # counted in its network's entry: uncounted
                self.tracked = None
                sources = handler.vs.per_source
                if sources is not None:  # (else the block is gone: nothing to count)
                    sources.release(tracked)
            self.state = INTO[ENDED][self.state]
            if self.fd >= 0 or self.sock is not None:  # not once established: the pump's
                self._release()

    def _release(self) -> None:
        """Close the descriptors the connection still owns (not the pump's)."""
        sock, self.sock = self.sock, None
        fd, self.fd = self.fd, -1
        try:
            if sock is not None:
                sock.close()
            if fd >= 0:
                os.close(fd)
        except OSError:  # cannot happen to a descriptor we own; end() never raises
            pass


# What the accept loop hands connections to: its handlers nursery's start_soon.
Spawn = Callable[..., object]
# What a step returns when the next state has to wait: the wait, to be awaited in a
# task, which returns what the step after it returns (None: established or ended).
Wait = Callable[[ClientConnection], Awaitable["Wait | None"]]


class ConnectError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        # refused | timeout | error (the metric's label), or cancelled: closed on purpose
        self.reason = reason


class Handler:
    """The connection handler of one virtual server: runs the lifecycle of the clients
    routed to it.

    Made by the listener for each virtual server it feeds; everything that outlives a
    connection (pool, throttle, queue, access-log flag) is read from the `VirtualServer`.
    """

    def __init__(self, vs: VirtualServer) -> None:
        self.vs = vs
        self.pool = vs.pool
        # Address -> (family, sockaddr, the C struct sockaddr or None: see _resolve)
        self._resolved: dict[Address, tuple[int, tuple, bytes | None]] = {}
        # The connect's view of that cache: RealServer -> (the Address it was for,
        # family, sockaddr, C struct sockaddr or None). Keyed by the server (an identity
        # hash in C): the Address key costs its dataclass __hash__, a Python frame per
        # connection; valid while `rs.address` is that very object (a reload that moves
        # a server gives it another).
        self._targets: dict[RealServer, tuple[Address, int, tuple, bytes | None]] = {}
        # The configuration last seen (_see): its ACL and its trusted PROXY senders.
        self._seen: VirtualServerConfig | None = None
        self._acl: SourceFilter
        self._proxy_peers: SourceFilter
        self._see(self.pool.config)
        # The run's pump reactor (reactor() is a RunVar's get, three Python frames, per
        # connection otherwise); a handler lives in one run, as its _clock.
        self._reactor: Reactor | None = None
        # Connections established with no task, by their client's descriptor (theirs
        # until the pump has ended), and the guardian task standing for them in the
        # handlers nursery: from the first until the handler is retired and the last
        # has ended (_guard).
        self._live: dict[int, ClientConnection] = {}
        self._guarded = False
        self._retired = False
        self._empty: trio.Event | None = None
        self._spawn: Spawn | None = None
        # Made once: the pumps' on_end, for every connection's end.
        self._on_end: Callable[[Pump], None] = self._pumped
        # The run's clock, read directly (trio.current_time() is three Python frames);
        # compiled, with no Python frame at all (two per connection, at the accept and
        # at the end).
        self._clock: Callable[[], float] = run_clock()

    @property
    def name(self) -> str:
        return self.pool.name

    # -- entry points ------------------------------------------------------------------

    def accept(self, client: int, peer: tuple, spawn: Spawn) -> None:
        """Serve a client the accept loop just accepted (its non-blocking descriptor):
        its lifecycle runs here, with no task, as far as it goes without waiting; a wait
        (PROXY header, queue, a name, a connect in progress) goes on in a task in
        `spawn`'s nursery. The connection closes the descriptor in the end."""
        self._spawn = spawn
        try:
            c = ClientConnection(self, client, peer, self.pool.config, self._clock())
        except BaseException:
            os.close(client)
            raise
        try:
            wait = self._begin(c)
            if wait is not None:
                spawn(self._waiting, c, wait)
        except Exception as exc:  # the barrier: a bug ends this connection only
            record("connection", exc, self.pool.name)
            c.end()

    def _see(self, config: VirtualServerConfig) -> None:
        """Remember a configuration's (the first, or a reload's) ACL and trusted PROXY
        senders, each of which remembers its verdict per address."""
        self._seen = config
        self.vs.sync_per_source(config.per_source)
        self._acl = SourceFilter(config.allow, config.deny)
        self._proxy_peers = SourceFilter(config.accept_proxy_from)

    def _filters(self, config: VirtualServerConfig) -> tuple[SourceFilter, SourceFilter]:
        """The ACL and the trusted PROXY senders of `config` (a connection's, as it was
        at its accept): the remembered ones, unless a reload came in between."""
        if config is not self._seen:
            if config is not self.pool.config:  # older than the pool's: made for it alone
                return SourceFilter(config.allow, config.deny), SourceFilter(
                    config.accept_proxy_from
                )
            self._see(config)
        return self._acl, self._proxy_peers

    def _target(self, rs: RealServer) -> tuple[Address, int, tuple, bytes | None] | None:
        """`rs`'s entry in `_targets`, made from the resolved addresses (None: not
        resolved yet)."""
        address = rs.address
        cached = self._resolved.get(address)
        if cached is None:
            return None
        targets = self._targets
        if len(targets) > 2 * len(self.pool.servers) + 16:  # removed servers: forget them
            targets.clear()
        target = targets[rs] = (address, cached[0], cached[1], cached[2])
        return target

    async def handle(self, client: int, peer: tuple, preread: bytes | None = None) -> None:
        """Serve a client in the calling task (a shared address's route): the same
        lifecycle, waiting here; returns once established (the pump has it) or ended.

        `preread`: the listener has already read the PROXY header (if any; `peer` is
        then the source it names) and these bytes (a TLS ClientHello, for the route),
        which go to the real server first, unchanged.
        """
        if self._spawn is None:  # the guardian's nursery: the one this task runs in
            nursery = trio.lowlevel.current_task().parent_nursery
            assert nursery is not None
            self._spawn = nursery.start_soon
        try:
            c = ClientConnection(self, client, peer, self.pool.config, self._clock())
        except BaseException:
            os.close(client)
            raise
        c.leftover = preread
        await self._waiting(c, None)

    def reject(self, reason: str, source: tuple) -> None:
        """Count (and access-log) a client closed before it reached this handler: the
        listener's `no_route`."""
        self.pool.rejected[reason] += 1
        if self.vs.access_log:
            self._log_access(source, None, 0, 0, 0.0, "rejected:" + reason)

    # -- the barrier: every step runs under accept()'s or this one ---------------------

    async def _waiting(self, c: ClientConnection, wait: Wait | None) -> None:
        """The task of a connection that has to wait: each wait, then the steps after
        it, until established or ended. The barrier: a bug ends this connection only;
        a cancellation (the drain deadline) ends it unlogged and goes on up."""
        try:
            if wait is None:
                wait = self._begin(c)
            while wait is not None:
                wait = await wait(c)
        except Exception as exc:
            record("connection", exc, self.pool.name)
            c.end()
        except BaseException:
            c.end()
            raise

    # -- the steps: each returns at once, with the next wait or None -------------------

    def _begin(self, c: ClientConnection) -> Wait | None:
        """admitted: a PROXY sender's trust, the throttle; a PROXY header to read
        (-> preread), or admission."""
        proxied = c.leftover is None and c.config.accept_proxy
        if proxied and not self._filters(c.config)[1].admits(c.source[0]):
            c.reject("proxy_untrusted")  # nothing read: not a header from just anyone
            return None
        throttle = self.vs.throttle
        if throttle is not None and throttle.arrival():  # digg: close at once
            c.reject("throttle")
            return None
        if proxied:
            c.state = INTO[PREREAD][c.state]
            return self._preread
        return self._admit(c)

    def _admit(self, c: ClientConnection) -> Wait | None:
        """The client's source is known: the ACL and max_connections, the throttle's
        idle timeout, then the queue (-> queued) or a pick."""
        config = c.config
        acl = self._acl if config is self._seen else self._filters(config)[0]
        if not acl.everyone and not acl.admits(c.source[0]):  # the default: no call
            c.reject("acl")
            return None
        if config.max_connections and self.pool.clients > config.max_connections:
            c.reject("max_connections")
            return None
        if config.per_source is not None:
            sources = self.vs.per_source
            if sources is not None:
                entry = sources.admit(c.source[0], c.started)
                if entry is None:
                    c.reject("per_source")
                    return None
                if entry is not True:
                    c.tracked = entry  # type: ignore[assignment]  # True: untracked
        throttle = self.vs.throttle
        if throttle is not None:  # start with the imposed idle timeout, if any
            c.idle_timeout = throttle.idle_timeout_for(config.idle_timeout)
        queue = self.vs.queue
        if queue is not None and queue.must_wait():
            # A busy queue (someone waiting, or no server free): wait in it. An idle one
            # costs nothing.
            c.state = INTO[QUEUED][c.state]
            return self._queued
        return self._pick(c, c.started)  # nothing has waited since: the admission's time

    def _pick(self, c: ClientConnection, now: float) -> Wait | None:
        """-> picked: a server picked (at `now`, the caller's time) and taken, never one
        whose connect failed."""
        pool = self.pool
        tried = c.tried
        if tried is not None:  # a retry
            if len(tried) > c.config.retries:
                self._no_server(c, "connect_failed")
                return None
            if c.closing:  # closed while the failed attempt was waiting
                c.end("cancelled")
                return None
        rs = pool.pick(now, tried or (), c.source)
        if rs is None:
            self._no_server(c, "connect_failed" if tried else "no_server")
            return None
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", explain_pick(pool, rs, tried or []))
        # Taken before the connect completes, as IPVS counts a connection from its SYN:
        # concurrent arrivals then see this one and spread out. `source` (the PROXY
        # header's with accept_proxy) is for persistence and maglev.
        c.lease = pool.take(rs, now, c, c.source)
        c.state = INTO[PICKED][c.state]
        return self._connect(c, rs)

    def _connect(self, c: ClientConnection, rs: RealServer) -> Wait | None:
        """-> connecting: a non-blocking connect to `rs`, the server picked; established
        at once if it completes before connect() returns, else a wait (a name to
        resolve, the connect in progress); a failure gives the lease back and picks
        again. `_resolving` comes back here once the name is resolved: in the connecting
        state already, which is no change of state."""
        if c.state != CONNECTING:
            c.state = INTO[CONNECTING][c.state]
        target = self._targets.get(rs)
        if target is None or target[0] is not rs.address:
            target = self._target(rs)
            if target is None:
                return self._resolving
        packed = target[3]
        if packed is not None:  # compiled: one C call (see _c_connect)
            fd, err = _c_connect(packed)  # type: ignore[misc]  # packed: compiled
            if fd < 0:
                return self._attempt_failed(c, _c_connect_error(fd, err))
        else:
            try:
                fd, err = self._start_connect(target[1], target[2])
            except (LocalCapacityError, ConnectError) as exc:
                return self._attempt_failed(c, exc)
        if err:  # in progress: a socket object for the wait and SO_ERROR (no system call)
            c.sock = _new_socket(target[1], _CONNECT_TYPE, 0, fd)
            return self._connecting
        self._establish(c, fd)
        return None

    def _attempt_failed(
        self, c: ClientConnection, exc: LocalCapacityError | ConnectError
    ) -> Wait | None:
        """A connect attempt failed: give the lease back, then try another server
        (-> picked), unless it was for want of descriptors here: not the real server's
        fault, and no other would do better; the client is closed (the accept loop
        backs off)."""
        pool = self.pool
        lease = c.lease
        assert lease is not None
        rs = lease.server
        now = self._clock()
        pool.drop(lease, now)
        c.lease = None
        if c.tried is None:
            c.tried = [rs]
        else:
            c.tried.append(rs)
        if isinstance(exc, LocalCapacityError):
            self._no_server(c, "connect_failed")
            return None
        rs.counters.connect_failures[exc.reason] += 1
        record_health(pool, rs, False, now, f"connect {exc.reason}", passive=True)
        self._outlier_failure(rs, now)
        return self._pick(c, now)

    def _outlier_failure(self, rs: RealServer, now: float) -> None:
        """A connect to `rs` failed, or its server reset an established connection
        before its first byte (to the client the same thing): outlier detection counts
        it. Apart from health, whose passive results stay the connects' alone."""
        pool = self.pool
        ejected_until = pool.connect_failed(rs, now)
        if ejected_until is not None:  # back on time, even with no pick to run the pool's timer
            deadlines().at(ejected_until, _Advance(pool))

    def _no_server(self, c: ClientConnection, rejected: str) -> None:
        """No server to connect to (none available, or every attempt failed)."""
        queue = self.vs.queue
        if queue is not None and queue.waiting:
            queue.kick()
        c.end("no_server", rejected)

    def _establish(self, c: ClientConnection, server: int) -> None:
        """-> established: the connect succeeded; the pump (no task) owns and closes
        both descriptors from here on, and the reactor reports the end to `_pumped`."""
        lease = c.lease
        assert lease is not None
        rs = lease.server
        # Pool.established(lease), inline: one of rs's connections_total (a Python frame
        # per connection saved)
        rs.counters.connections_total += 1
        if not rs.health.clean:
            # without an active check, a good connect ends a failure streak (or is a down
            # server's trial); with one it changes nothing (a call, only while failing)
            record_health(self.pool, rs, True, self._clock(), "connect succeeded", passive=True)
        queue = self.vs.queue
        if queue is not None and queue.waiting:
            queue.kick()  # the slot is taken: the next waiter, if room is left
        client = c.fd
        c.fd = -1
        config = c.config
        header = b""
        try:
            c.state = INTO[ESTABLISHED][c.state]  # a bug raises: both closed below
            send_proxy = config.send_proxy  # none | v1 | v2 (the configuration checked)
            if send_proxy != "none":
                encode = (
                    proxy_protocol.encode_v1 if send_proxy == "v1" else proxy_protocol.encode_v2
                )
                header = encode(c.source, _local_address(client))
        except Exception as exc:  # OSError: the client reset before getsockname(); a bug
            os.close(server)
            os.close(client)
            self._start_failed(c, exc)
            return None
        # The pump owns both descriptors from here on and closes them when it ends (or if
        # open() raises); its end is reported to _pumped, which finds the connection here.
        live = self._live
        live[client] = c
        if not self._guarded:
            self._guarded = True
            assert self._spawn is not None
            self._spawn(self._guard)
        pumps = self._reactor
        if pumps is None:
            pumps = self._reactor = reactor()
        leftover = c.leftover
        max_duration = config.max_connection_duration
        try:
            if max_duration is None:
                p = pumps.open(
                    client,
                    server,
                    header + leftover if leftover else header,
                    c._idle_timeout,
                    self._on_end,
                    len(header),
                )
            else:  # its lifetime: the pump's deadline beside the idle one, O(log n) once
                p = pumps.open(
                    client,
                    server,
                    header + leftover if leftover else header,
                    c._idle_timeout,
                    self._on_end,
                    len(header),
                    max_duration=lifetime(max_duration, config.max_connection_duration_jitter),
                )
        except Exception as exc:  # OSError: epoll_ctl refused (ENOMEM, ENOSPC)
            del live[client]
            self._start_failed(c, exc)
            return None
        c.pump = p
        if c.closing:  # closed while it was connecting: ends "cancelled"
            p.close()
        return None

    def _start_failed(self, c: ClientConnection, exc: Exception) -> None:
        """The pump could not start (its descriptors are closed): the end, as an error."""
        if isinstance(exc, OSError):
            # The epoll set refused the descriptors, or the client reset before
            # getsockname(). The accept loop backs off by itself when descriptors run out.
            log.debug("%s: %s", self.pool.name, exc)
        else:
            record("connection", exc, self.pool.name)
        c.end("error")

    # -- the waits: each awaits, then returns what the next step returns ---------------

    async def _preread(self, c: ClientConnection) -> Wait | None:
        """preread: the PROXY header, within connect_timeout; a bad or late one closes
        the connection (uncounted, unlogged)."""
        # A trio socket over the descriptor for the read; detached after, not closed.
        sock = trio.socket.from_stdlib_socket(socket.socket(-1, socket.SOCK_STREAM, 0, c.fd))
        try:
            header = await self._read_proxy_header(sock, c.config.connect_timeout)
        finally:
            sock.detach()
        if header is None:
            c.end()
            return None
        c.source, c.leftover = header
        c.started = self._clock()
        return self._admit(c)

    async def _queued(self, c: ClientConnection) -> Wait | None:
        """queued: until a server is free (then picked before the next checkpoint, as
        the queue asks), or refused (queue_full, queue_timeout, queue_abandoned: the
        client reset its connection meanwhile, or closed it with abort_on_close)."""
        queue = self.vs.queue
        assert queue is not None

        def gone() -> bool:  # asked at the client's turn, with the queue's config then
            return client_gone(c.fd, closed_too=queue.config.abort_on_close)

        reason = await queue.wait(gone)
        if reason is not None:
            c.reject(reason)
            return None
        return self._pick(c, self._clock())

    async def _resolving(self, c: ClientConnection) -> Wait | None:
        """connecting: the server's address, resolved once per handler."""
        lease = c.lease
        assert lease is not None
        try:
            await self._resolve(lease.server.address)
        except ConnectError as exc:
            return self._attempt_failed(c, exc)
        return self._connect(c, lease.server)

    async def _connecting(self, c: ClientConnection) -> Wait | None:
        """connecting: the connect in progress, within connect_timeout; close() cancels
        the wait (the connection ends, "cancelled")."""
        sock = c.sock
        assert sock is not None
        with trio.move_on_after(c.config.connect_timeout) as deadline:
            c.connecting = deadline  # ClientConnection.close() cancels it
            try:
                await trio.lowlevel.wait_writable(sock.fileno())
            finally:
                c.connecting = None
        if c.closing:
            c.end("cancelled")  # closes the socket, gives the lease back
            return None
        failure = None
        if deadline.cancelled_caught:
            failure = ConnectError("timeout")
        else:
            try:
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, os.strerror(err))
            except OSError as exc:
                failure = _connect_error(exc)
        c.sock = None
        if failure is not None:
            sock.close()
            return self._attempt_failed(c, failure)
        self._establish(c, sock.detach())
        return None

    # -- the end -------------------------------------------------------------------------

    def _pumped(self, p: Pump) -> None:
        """The pump's on_end: an established connection is over (both descriptors are
        closed by then). Called from the reactor, its idle timer, or whoever closed the
        pump or changed its idle timeout -- or from within open(), before `c.pump` is
        set, if the pump ended at once: it must not raise (end() does not)."""
        live = self._live
        c = live.pop(p.client_fd)
        c.pump = p
        c.end(p.outcome or "error")
        if not live and self._retired and self._empty is not None:
            self._empty.set()

    def _end_failed(self, c: ClientConnection, exc: Exception) -> None:
        """end()'s barrier: a bug in the counting is counted; the lease goes back."""
        pool = self.pool
        record("connection_end", exc, pool.name)
        lease = c.lease
        if lease is not None and lease in lease.server.leases:
            try:
                pool.drop(lease, self._clock())
            except Exception as again:
                record("connection_end", again, f"{pool.name}: dropping the lease")

    def retire(self) -> None:
        """No client comes to this handler any more (its listener is closed, or a
        reload dropped its virtual server): the guardian ends once the connections it
        stands for have, so that the drain does not wait for it. Idempotent."""
        self._retired = True
        if not self._live and self._empty is not None:
            self._empty.set()

    async def _guard(self) -> None:
        """Stands, in the handlers nursery, for the connections that have no task, so
        the drain waits for them, and closes them when its deadline cancels it. It
        stays while the handler serves (an empty moment between two connections is
        not its end) and ends when the handler is retired and no connection is left."""
        try:
            while self._live or not self._retired:
                self._empty = trio.Event()
                await self._empty.wait()
        except BaseException:
            for c in list(self._live.values()):
                c.close()  # outcome "cancelled", reported through _pumped
            raise
        finally:
            self._guarded = False
            self._empty = None

    # -- helpers ---------------------------------------------------------------------------

    def _log_access(
        self,
        source: tuple,
        rs: str | None,
        bytes_in: int,
        bytes_out: int,
        duration: float,
        end: str,
    ) -> None:
        write_access_line(source, self.pool.name, rs, bytes_in, bytes_out, duration, end)

    def _start_connect(self, family: int, sockaddr: tuple) -> tuple[int, int]:
        """socket() and a non-blocking connect, in Python (the compiled path makes it
        one C call, `_c_connect`): (descriptor, 0) connected already, or (descriptor,
        EINPROGRESS). Raises LocalCapacityError or ConnectError (closed)."""
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
        return sock.detach(), err

    async def _resolve(self, address: Address) -> tuple[int, tuple, bytes | None]:
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
        packed = None
        if cpump is not None:
            # not AF_INET/AF_INET6 (ValueError): the Python connect serves it
            with contextlib.suppress(ValueError):
                packed = cpump.sockaddr(family, sockaddr)
        resolved = self._resolved[address] = (family, sockaddr, packed)
        return resolved

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


class _Advance:
    """A deadline's target: bring a pool's time-driven state (the end of an outlier
    ejection) up to the run's clock, which makes the server available again and wakes
    the queue's oldest waiter, if any."""

    __slots__ = ("pool",)

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def ring(self) -> None:
        self.pool.advance(trio.current_time())


def explain_pick(pool: Pool, chosen: RealServer, tried: list[RealServer]) -> str:
    """The decision explain line: every candidate and its score (debug logs only)."""
    scores = ", ".join(f"{name}={score}" for name, score in pool.scores(tried).items())
    return f"{pool.name}: {pool.config.scheduler} picked {chosen.name} [{scores}]"


def _local_address(fd: int) -> tuple:
    """The local address of a connected descriptor (send_proxy's destination)."""
    sock = socket.socket(-1, socket.SOCK_STREAM, 0, fd)
    try:
        return sock.getsockname()
    finally:
        sock.detach()


_TCP_CLOSE = 7  # tcp_info's tcpi_state once a reset came (linux/tcp_states.h)
_TCP_CLOSE_WAIT = 8  # ... once the peer's FIN came (and no reset)


def client_gone(fd: int, closed_too: bool = False) -> bool:
    """Did the client reset its connection (or is its descriptor unusable)? With
    `closed_too`, did it also close its side (a FIN)?

    Read from the kernel's TCP state, which a reset puts in TCP_CLOSE even with unread
    bytes in the receive queue (a peek would return those first). A FIN only leaves
    CLOSE_WAIT: it may be a half-close, so it is not a reset unless the configuration
    says to drop such clients (`queue.abort_on_close`). One getsockopt.
    """
    sock = socket.socket(-1, socket.SOCK_STREAM, 0, fd)
    try:
        state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    except OSError:
        return True
    finally:
        sock.detach()
    return state == _TCP_CLOSE or (closed_too and state == _TCP_CLOSE_WAIT)


def _c_connect_error(fd: int, err: int) -> LocalCapacityError | ConnectError:
    """_cpump.connect's failure (`fd` < 0) as the exception the connect raises: out of
    descriptors here (socket() failed: fd -1), or the attempt's reason."""
    if fd == -1 and err in LOCAL_CAPACITY_ERRNOS:  # socket() failed
        return LocalCapacityError(os.strerror(err))
    return ConnectError("refused" if err == errno.ECONNREFUSED else "error")


def _connect_error(exc: OSError) -> ConnectError:
    """A failed connect attempt, by the reason its metrics count: refused or error."""
    return ConnectError("refused" if exc.errno == errno.ECONNREFUSED else "error")
