"""UDP sessions of one virtual server (SPEC §19): a datagram relay per client address.

A datagram from a client address without a session picks a real server through the
pool (its scheduler, persistence, maglev by the client address: `Pool.pick` with the
client), takes a lease (so `max_connections` counts sessions) and opens one connected
socket to that server. Later datagrams from the client go out on it; datagrams coming
back on it go to the client from the virtual server's own socket. A session ends after
`udp.idle_timeout` without a datagram either way, or once `udp.responses` replies per
request came back (counted as nginx's `proxy_responses` does: the replies passed on
never exceed `responses` times the requests sent, and the session ends when they reach
it); `responses: 0` expects none and drops any. Beyond the counted replies nothing is
sent (no amplification), and a reply is the real server's datagram, never more bytes.

Two relays behave alike, as the pump's two implementations do (net/compiled.py picks;
`udp_relay()` makes the one that runs):

* `CompiledUdpRelay`: every datagram is handled in C, in the run's reactor
  (lbproxy/net/_cpump_udp.h's `UdpRelay`: the listening socket and the sessions' sockets in
  the reactor's epoll set, client datagrams read in recvmmsg batches, the session found
  by the client's address in a C hash table, the idle timeout an entry in the reactor's
  deadline heap). Python is called once when a client address opens a session (the
  decision below, `_decide`) and once at its end (the accounts, `_ended`), and for a
  session to a failing server once more, at its first reply (`_answered`); the counts
  per datagram accumulate in C and reach the pool's `UdpCounters` when read (`settle`).
* `PureUdpRelay` (LBPROXY_PURE=1, or no compiled extension): no task per session and
  none per datagram. It has its own level-triggered epoll set holding the listening
  socket and every session's socket, served by one trio task: a wake-up handles every
  socket ready since the last one. The listening socket is read until EAGAIN (at most
  _BATCH datagrams per wake-up, then other tasks run); a session's socket gives one
  datagram per event (level-triggered: one still queued is the next batch's event), so a
  reply costs no failing `recv`. A datagram costs one receive and one send on each side,
  into one preallocated buffer per direction. The idle timeout is an entry in the run's
  deadline heap (net/deadlines.py) per session, armed at the session's start and moved
  on only when it rings early (activity since): no timer work per datagram.

On both, ECONNREFUSED on a session's socket (the real server's ICMP port unreachable,
reported by epoll as an error) is a passive health failure, as a refused TCP connect is.
Without an active check, a session opened while its server was failing (passively down,
so this is its trial; or failures in a row) is watched: its first reply is a passive
success, reported once per session (`_answered`), which brings a down server back as a
TCP trial's connect does. A healthy server's sessions are not watched: the common path
pays one test per reply (a field in C, an attribute in the pure relay), never a call.

The server runs one `UdpListener` (a `UdpRelay` behind the accept-loop interface of
listener.py's `Listener`) per UDP listen address, keyed by `UdpAddress` so that a TCP
and a UDP listener on one address and port are two entries.
"""

from __future__ import annotations

import _socket
import contextlib
import logging
import select
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import trio

from lbproxy.config.model import Address
from lbproxy.core.client_address import SourceFilter, source_key
from lbproxy.core.health import record_health
from lbproxy.core.pool import Lease, Pool, RealServer
from lbproxy.core.udp_stats import UdpCounters
from lbproxy.dataplane.access_log import write as write_access_line
from lbproxy.dataplane.listener import bind_error
from lbproxy.dataplane.virtual_server import VirtualServer
from lbproxy.net.barrier import record
from lbproxy.net.compiled import cpump
from lbproxy.net.deadlines import Deadline, Deadlines, deadlines
from lbproxy.net.pump import run_clock
from lbproxy.net.reactor import implementation, reactor

cpump_sockaddr = cpump.sockaddr if cpump is not None else None

log = logging.getLogger("lbproxy.udp")

# The largest UDP payload over IPv4 (65,535 - 8 - 20), one buffer of it per direction.
MAX_DATAGRAM = 65507
# The listening socket's receive buffer asked for (the kernel caps it at rmem_max).
RECEIVE_BUFFER = 4 << 20
# Client datagrams read per wake-up before other tasks run: fairness under a flood.
_BATCH = 64
# Ready sockets handled per wake-up of the relay's task.
_MAX_EVENTS = 256
# A session's socket: non-blocking from socket(2) on (no fcntl/ioctl after it).
_SESSION_TYPE = socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
# Idle timeouts of at least _DEFER_IDLE seconds are armed by a sweep of the sessions
# opened in the last _SWEEP seconds, not when each opens: most sessions of a DNS-like
# service (`responses: 1`) end within a millisecond and never touch the deadline heap.
_DEFER_IDLE: Final = 1.0
_SWEEP: Final = 0.1


class Session:
    """One client address and its connected socket to a real server; the handle of its
    lease, so the pool reads its live byte counts and `close_leases` can end it."""

    __slots__ = (
        "_idle_timeout",
        "alarm",
        "bytes_in",
        "bytes_out",
        "client",
        "ended",
        "fd",
        "keys",
        "last",
        "lease",
        "own_idle_timeout",
        "relay",
        "replies",
        "requests",
        "server",
        "sock",
        "source",
        "started",
        "watched",
    )

    def __init__(self, relay, client, server, lease, sock, now, idle_timeout, keys, source) -> None:
        self.relay: PureUdpRelay = relay
        self.client: tuple = client
        self.source: object = source  # what it counts under in per_source (source_key)
        self.server: RealServer = server
        self.lease: Lease = lease
        self.sock: _socket.socket = sock  # the C socket: no Python-level wrapper
        self.fd: int = sock.fileno()
        self.keys: tuple[tuple[str, str], tuple[str, str]] = keys  # counters' (rs, in/out)
        self.started = now
        self.last = now  # the last datagram either way
        # The throttle monitor shortens a session's idle timeout in high and digg, and
        # gives it back in low, through `flow.idle_timeout` as for a TCP connection.
        self.own_idle_timeout: float = relay.pool.config.udp.idle_timeout
        self._idle_timeout: float = idle_timeout
        self.alarm: Deadline | None = None  # its idle deadline in the heap, once armed
        self.requests = 0
        self.replies = 0
        self.bytes_in = 0  # client -> real server
        self.bytes_out = 0  # real server -> client
        self.ended = ""
        self.watched = False  # its first reply is its failing server's passive success

    @property
    def flow(self) -> Session:
        return self

    @property
    def idle_timeout(self) -> float:
        return self._idle_timeout

    @idle_timeout.setter
    def idle_timeout(self, value: float) -> None:
        """A new timeout applies at once: a session idle longer than it ends now."""
        self._idle_timeout = value
        relay = self.relay
        if relay.sessions.get(self.client) is not self:
            return  # ended already
        if self.alarm is not None:
            self.alarm.cancel()
        relay.young.pop(self, None)
        self.alarm = relay.deadlines.at(self.last + value, self)

    def ring(self) -> None:
        """Its idle deadline passed (the deadline heap calls it): the session ends if it
        really was idle that long, else the deadline moves to its last datagram's."""
        self.alarm = None
        relay = self.relay
        if relay.sessions.get(self.client) is not self:
            return  # ended already
        due = self.last + self._idle_timeout
        if relay.clock() >= due:
            self.ended = "idle_timeout"
            relay._close(self)
        else:
            self.alarm = relay.deadlines.at(due, self)

    def close(self) -> None:
        """End the session now (`state: disabled`, `on_down: close`)."""
        self.ended = self.ended or "closed"
        self.relay._close(self)


class _Sessions:
    """What both relays share: the decision for a new session (ACL, caps, throttle,
    scheduler, lease), the accounts at a session's end, the stop, the counters."""

    def __init__(
        self,
        pool: Pool,
        sock: socket.socket,
        *,
        access_log: bool = False,
        vs: VirtualServer | None = None,
    ) -> None:
        self.pool = pool
        self.sock = sock
        self.access_log = access_log
        self.vs = vs  # its throttle, when it has one (None: a relay without a server)
        # Sessions per source prefix (udp.source_prefix), for max_sessions_per_source.
        self.per_source: dict[object, int] = {}
        self.stopping = False  # at stop: no new session; serve() ends with the last one
        self._drained = trio.Event()  # stopping, and the last session ended
        self._keys: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {}
        # The ACL (its decision per source address remembered), for the configuration it
        # was made with.
        self._acl = SourceFilter(())
        self._acl_config: object = None
        # Set by serve(): the run's clock (read directly, as the pump does).
        self.clock: Callable[[], float] = trio.current_time

    @property
    def counters(self) -> UdpCounters:
        return self.pool.udp

    @property
    def open_sessions(self) -> int:
        raise NotImplementedError

    def stop(self) -> None:
        """Open no more sessions; the running ones go on to their end (SPEC §6's drain,
        which the server bounds with global.drain_timeout), then serve() returns."""
        self.stopping = True
        if not self.open_sessions:
            self._drained.set()

    def _decide(
        self, client: tuple, now: float, open_now: int
    ) -> tuple[RealServer, Lease, float, object] | None:
        """A new session's real server, lease, idle timeout and source; None (the drop
        counted by reason) when the datagram opens none. `open_now`: the sessions open
        (the caller's count: the property would be a Python frame per session)."""
        pool = self.pool
        config = pool.config
        udp = config.udp
        dropped = pool.udp.dropped  # (not `counters`: the compiled relay's settles first)
        if self.stopping:
            return None  # stopping: as a closed TCP listener, nothing is counted
        host = client[0]
        acl = self._acl if self._acl_config is config else self._acl_for(config)
        if not acl.everyone and not acl.admits(host):  # the default: no call
            dropped["acl"] += 1
            return None
        if open_now >= udp.max_sessions:
            dropped["max_sessions"] += 1
            return None
        prefix = udp.source_prefix
        if prefix.v4 >= 32 and ":" not in host:  # source_key's common case, inline
            source: object = host
        else:
            source = source_key(host, prefix.v4, prefix.v6)
        if self.per_source.get(source, 0) >= udp.max_sessions_per_source:
            dropped["per_source"] += 1
            return None
        throttle = self.vs.throttle if self.vs is not None else None
        idle = udp.idle_timeout
        if throttle is not None:
            # A new session is the throttle's arrival (its rate), counted among the
            # clients it weighs (`pool.clients`: the open sessions) as TCP's accept is.
            pool.clients += 1
            refused = throttle.arrival()
            pool.clients -= 1
            if refused:
                dropped["throttle"] += 1
                return None
            idle = throttle.idle_timeout_for(idle)
        rs = pool.pick(now, (), client)
        if rs is None:
            dropped["no_server"] += 1
            return None
        return rs, pool.take(rs, now, None, client), idle, source

    def _opened(self, session, rs: RealServer, lease: Lease, source: object) -> bool:
        """A session is open: its lease, per source and sessions_total count it.

        Returns whether its first reply must be reported (`_answered`): its server is
        failing (passively down, so this is its trial, or failures in a row) and has no
        active check, whose results alone would count. A healthy server's: one test."""
        rs.counters.connections_total += 1  # Pool.established(lease), inline
        lease.handle = session
        pool = self.pool
        pool.clients += 1
        per_source = self.per_source
        per_source[source] = per_source.get(source, 0) + 1
        pool.udp.sessions_total[rs.name] += 1
        return not rs.health.clean and pool.config.health_check.type == "none"

    def _answered(self, session) -> None:
        """The first reply of a session opened while its server was failing: a passive
        success, as a TCP connect's (once per session, never per datagram). It ends the
        failures in a row, or brings a passively-down server back up (its trial)."""
        record_health(self.pool, session.server, True, self.clock(), "udp reply", passive=True)

    def _session_failed(self, rs: RealServer, lease: Lease, now: float, exc: OSError) -> None:
        self.pool.drop(lease, now)
        self.pool.udp.dropped["send_error"] += 1
        log.warning("udp session to %s: %s", rs.name, exc)

    def _acl_for(self, config) -> SourceFilter:
        """The ACL (allow, then deny) of `config`, a reload's: made anew, and remembered
        with its verdict per source address."""
        self._acl_config = config
        self._acl = SourceFilter(config.allow, config.deny)
        return self._acl

    def _ended(self, session, ended: str, now: float) -> None:
        """The accounts of a session that ended (out of the relay already)."""
        source = session.source
        per_source = self.per_source
        left = per_source[source] - 1
        if left:
            per_source[source] = left
        else:
            del per_source[source]
        pool = self.pool
        rs = session.server
        # The pool's byte counts (lbproxy_bytes_total) take the session's, as a TCP
        # connection's at its end; until then the pool reads them off the lease.
        rs_in, rs_out = session.bytes_in, session.bytes_out
        counters = rs.counters
        counters.bytes_in += rs_in
        counters.bytes_out += rs_out
        pool.drop(session.lease, now)
        pool.clients -= 1
        pool.durations.observe(now - session.started)
        if self.stopping and not self.open_sessions:
            self._drained.set()
        if self.access_log:
            write_access_line(
                session.client,
                pool.name,
                rs.name,
                rs_in,
                rs_out,
                now - session.started,
                ended or "closed",
                "udp",
            )

    def _refused_health(self, session, now: float) -> None:
        """ICMP port unreachable: a passive failure of the session's server."""
        record_health(self.pool, session.server, False, now, "udp port unreachable", passive=True)


class PureUdpRelay(_Sessions):
    """The sessions of one UDP virtual server on one bound, non-blocking socket, every
    datagram handled in Python (LBPROXY_PURE=1, or no compiled extension)."""

    def __init__(
        self,
        pool: Pool,
        sock: socket.socket,
        *,
        access_log: bool = False,
        vs: VirtualServer | None = None,
    ) -> None:
        super().__init__(pool, sock, access_log=access_log, vs=vs)
        self.sessions: dict[tuple, Session] = {}
        self.by_fd: dict[int, Session] = {}  # the sessions' sockets in the epoll set
        self._in = bytearray(MAX_DATAGRAM + 1)  # +1: a datagram that big is not cut short
        self._out = bytearray(MAX_DATAGRAM + 1)
        self._in_view = memoryview(self._in)
        self._out_view = memoryview(self._out)
        # Sessions opened since the last sweep whose idle deadline is not armed yet.
        self.young: dict[Session, None] = {}
        self._sweeping = False  # the sweep's deadline is armed
        self._epoll: select.epoll | None = None  # while serve() runs
        self.deadlines: Deadlines  # no session exists before serve() sets it

    @property
    def open_sessions(self) -> int:
        return len(self.sessions)

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Relay datagrams until cancelled, or, once `stop()` was called, until the last
        session ended."""
        self.clock = trio.lowlevel.current_clock().current_time
        self.deadlines = deadlines()
        self._epoll = epoll = select.epoll()
        try:
            epoll.register(self.sock.fileno(), select.EPOLLIN)
            async with trio.open_nursery() as nursery:
                task_status.started(self.sock.getsockname())
                nursery.start_soon(self._run, epoll)
                await self._drained.wait()
                nursery.cancel_scope.cancel()
        finally:
            self.close()
            self._epoll = None
            trio.lowlevel.notify_closing(epoll.fileno())
            epoll.close()

    def close(self) -> None:
        """Every session ends now (`end=stopped`)."""
        for session in list(self.sessions.values()):
            session.ended = session.ended or "stopped"
            self._close(session)

    async def _run(self, epoll: select.epoll) -> None:
        epfd = epoll.fileno()
        poll = epoll.poll
        listen_fd = self.sock.fileno()
        by_fd = self.by_fd
        clock = self.clock
        wait_readable = trio.lowlevel.wait_readable
        while True:
            await wait_readable(epfd)
            now = clock()
            for fd, _ in poll(0, _MAX_EVENTS):
                if fd == listen_fd:
                    self._from_clients(now)
                    continue
                session = by_fd.get(fd)
                if session is None:  # ended earlier in this batch
                    continue
                try:
                    self._from_server(session, now)
                except Exception as exc:  # a bug: this session ends, the others go on
                    session.ended = "error"
                    record("connection", exc, f"udp session of {_peer(session.client)}", log)
                    self._close(session)

    # -- client -> real server ------------------------------------------------------

    def _from_clients(self, now: float) -> None:
        """Up to _BATCH datagrams from the listening socket, until EAGAIN."""
        receive = self.sock.recvfrom_into
        buffer = self._in
        view = self._in_view
        sessions = self.sessions
        for _ in range(_BATCH):
            try:
                n, client = receive(buffer)
            except BlockingIOError:
                return
            except OSError as exc:  # e.g. a reply to a client that is gone
                log.debug("udp receive: %s", exc)
                continue
            try:
                session = sessions.get(client)
                if session is None:
                    session = self._open(client, now)
                    if session is None:
                        continue
                self._to_server(session, view[:n], now)
            except Exception as exc:  # a bug: this datagram is lost, nothing else
                record("connection", exc, f"udp datagram from {_peer(client)}", log)

    def _to_server(self, session: Session, data: memoryview, now: float) -> None:
        session.requests += 1
        session.last = now
        try:
            session.sock.send(data)
        except BlockingIOError:
            self.counters.dropped["send_error"] += 1
            return
        except ConnectionRefusedError:  # an earlier datagram's ICMP port unreachable
            self._refused(session, now)
            return
        except OSError as exc:
            self.counters.dropped["send_error"] += 1
            log.debug("udp send to %s: %s", session.server.name, exc)
            return
        size = len(data)
        session.bytes_in += size
        counters = self.counters
        key = session.keys[0]
        counters.datagrams[key] += 1
        counters.bytes[key] += size

    def _open(self, client: tuple, now: float) -> Session | None:
        decided = self._decide(client, now, len(self.sessions))
        if decided is None:
            return None
        rs, lease, idle, source = decided
        sock = None
        try:
            family = socket.AF_INET6 if ":" in rs.address.host else socket.AF_INET
            sock = _socket.socket(family, _SESSION_TYPE)
            sock.connect((rs.address.host, rs.address.port))
            assert self._epoll is not None
            self._epoll.register(sock.fileno(), select.EPOLLIN)
        except OSError as exc:
            if sock is not None:
                sock.close()
            self._session_failed(rs, lease, now, exc)
            return None
        keys = self._keys.get(rs.name)
        if keys is None:
            keys = self._keys[rs.name] = ((rs.name, "in"), (rs.name, "out"))
        session = Session(self, client, rs, lease, sock, now, idle, keys, source)
        session.watched = self._opened(session, rs, lease, source)
        self.sessions[client] = session
        self.by_fd[session.fd] = session
        if idle >= _DEFER_IDLE:
            self.young[session] = None
            if not self._sweeping:
                self._sweeping = True
                self.deadlines.at(now + _SWEEP, self)
        else:
            session.alarm = self.deadlines.at(now + idle, session)
        return session

    def ring(self) -> None:
        """The sweep (the deadline heap calls it): arm the young sessions' deadlines,
        from their last datagram as always, so none rings early or late."""
        young, self.young = self.young, {}
        self._sweeping = False
        at = self.deadlines.at
        for session in young:  # all still open: _close takes an ended one out
            session.alarm = at(session.last + session._idle_timeout, session)

    # -- real server -> client ------------------------------------------------------

    def _from_server(self, session: Session, now: float) -> None:
        """One datagram from a session's socket (its epoll event: readable or an error)."""
        try:
            n = session.sock.recv_into(self._out)
        except BlockingIOError:
            return
        except ConnectionRefusedError:
            self._refused(session, now)
            return
        except OSError as exc:
            session.ended = "error"
            log.debug("udp receive from %s: %s", session.server.name, exc)
            self._close(session)
            return
        session.last = now
        if session.watched:  # the server answered: even a reply dropped below counts
            session.watched = False
            self._answered(session)
            if self.sessions.get(session.client) is not session:
                return  # closed by a health change
        responses = self.pool.config.udp.responses
        if responses is not None and session.replies >= session.requests * responses:
            self.counters.dropped["unrequested"] += 1  # no amplification
            return
        self._to_client(session, self._out_view[:n])
        if responses and session.replies >= session.requests * responses:
            session.ended = "responses"
            self._close(session)

    def _to_client(self, session: Session, data: memoryview) -> None:
        try:
            self.sock.sendto(data, session.client)
        except OSError as exc:  # a full buffer or a client gone: the datagram is lost
            self.counters.dropped["reply_error"] += 1
            log.debug("udp reply to %s: %s", session.client, exc)
            return
        size = len(data)
        session.replies += 1
        session.bytes_out += size
        counters = self.counters
        key = session.keys[1]
        counters.datagrams[key] += 1
        counters.bytes[key] += size

    def _refused(self, session: Session, now: float) -> None:
        """ICMP port unreachable: a passive failure; the session ends, the next datagram
        from this client picks again."""
        session.ended = "refused"
        self._refused_health(session, now)
        self._close(session)

    def _close(self, session: Session) -> None:
        if self.sessions.get(session.client) is not session:
            return  # closed already
        del self.sessions[session.client]
        if self.by_fd.get(session.fd) is session:
            del self.by_fd[session.fd]
        if session.alarm is not None:
            session.alarm.cancel()
            session.alarm = None
        else:
            self.young.pop(session, None)
        session.sock.close()  # which takes it out of the epoll set
        self._ended(session, session.ended, self.clock())
        session.bytes_in = session.bytes_out = 0


class CompiledUdpRelay(_Sessions):
    """The same sessions with every datagram handled in C, in the run's reactor (its
    `udp()`: lbproxy/net/_cpump_udp.h): a client datagram costs a recvmmsg batch's share and
    one send, a reply one recv and one sendto, neither a Python call. Python is called
    once when a client address opens a session (`_decide`) and once at its end, and
    once at the first reply of a session opened to a failing server (`_answered`)."""

    def __init__(
        self,
        pool: Pool,
        sock: socket.socket,
        *,
        access_log: bool = False,
        vs: VirtualServer | None = None,
    ) -> None:
        super().__init__(pool, sock, access_log=access_log, vs=vs)
        self._relay: Any = None  # the C relay while serve() runs
        self._open_count = 0
        # Each real server's index in the C relay's counts, by name, and back.
        self._index: dict[str, int] = {}
        self._names: list[str] = []
        self._sockaddrs: dict[tuple[str, int], bytes] = {}
        # What a session to a real server needs, by server (an identity hash in C, where
        # the Address key costs its dataclass __hash__): (the Address it was made for,
        # its struct sockaddr, its index); valid while `rs.address` is that very object.
        # A server named by a host name has none: it is resolved for each session.
        self._targets: dict[RealServer, tuple[Address, bytes, int]] = {}
        self._counted: UdpCounters | None = None  # whose settle() hook this relay is

    @property
    def open_sessions(self) -> int:
        return self._open_count

    @property
    def sessions(self) -> dict[tuple, Any]:
        """The open sessions by client address (a copy)."""
        relay = self._relay
        return {} if relay is None else {s.client: s for s in relay.sessions()}

    @property
    def counters(self) -> UdpCounters:
        self.settle()
        return self.pool.udp

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Relay datagrams until cancelled, or, once `stop()` was called, until the last
        session ended."""
        self.clock = run_clock()
        make = reactor().udp  # type: ignore[attr-defined]  # the C Reactor only
        self._relay = make(self.sock.fileno(), self._on_open, self._on_end)
        self.route()
        try:
            task_status.started(self.sock.getsockname())
            await self._drained.wait()
        finally:
            self.close()

    def route(self) -> None:
        """After a reload: new sessions' `responses` (and the counts) follow the pool."""
        relay = self._relay
        if relay is None:
            return
        relay.responses = self.pool.config.udp.responses
        counters = self.pool.udp
        if self._counted is not counters:
            self.settle()
            if self._counted is not None:
                self._counted.unsettled.discard(self.settle)
            counters.unsettled.add(self.settle)
            self._counted = counters

    def close(self) -> None:
        """Every session ends now (`end=stopped`); the socket leaves the reactor."""
        relay = self._relay
        if relay is None:
            return
        relay.close()
        self.settle()
        if self._counted is not None:
            self._counted.unsettled.discard(self.settle)
            self._counted = None
        self._relay = None

    def settle(self) -> None:
        """Move what the C relay counted since the last call into the pool's counters."""
        relay = self._relay
        if relay is None:
            return
        rows, (unrequested, send_error, reply_error) = relay.take_counts()
        counters = self._counted or self.pool.udp
        names = self._names
        for index, datagrams_in, datagrams_out, bytes_in, bytes_out in rows:
            name = names[index]
            counters.datagrams[name, "in"] += datagrams_in
            counters.datagrams[name, "out"] += datagrams_out
            counters.bytes[name, "in"] += bytes_in
            counters.bytes[name, "out"] += bytes_out
        dropped = counters.dropped
        if unrequested:
            dropped["unrequested"] += unrequested
        if send_error:
            dropped["send_error"] += send_error
        if reply_error:
            dropped["reply_error"] += reply_error

    def _on_open(self, client: tuple) -> Any:
        """The C relay's call for a client address without a session."""
        now = self.clock()
        decided = self._decide(client, now, self._open_count)
        if decided is None:
            return None
        rs, lease, idle, source = decided
        try:
            target = self._targets.get(rs)
            if target is None or target[0] is not rs.address:
                packed, index = self._target(rs)
            else:
                packed, index = target[1], target[2]
            session = self._relay.session(
                packed, idle, index, rs, lease, source, self.pool.config.udp.idle_timeout
            )
        except OSError as exc:
            self._session_failed(rs, lease, now, exc)
            return None
        if self._opened(session, rs, lease, source):
            session.on_reply = self._answered  # the C relay calls it at the first reply
        self._open_count += 1
        return session

    def _on_end(self, session: Any, ended: str) -> None:
        """The C relay's call once a session has ended (out of it, its socket closed)."""
        now = self.clock()
        self._open_count -= 1
        if ended == "refused":
            self._refused_health(session, now)
        self._ended(session, ended, now)

    def _target(self, rs: RealServer) -> tuple[bytes, int]:
        """`rs`'s struct sockaddr and index, remembered in `_targets` when its address
        is numeric."""
        address = rs.address
        packed = self._sockaddr(address)
        index = self._index_of(rs.name)
        if (address.host, address.port) in self._sockaddrs:  # numeric: made once
            targets = self._targets
            if len(targets) > 2 * len(self.pool.servers) + 16:  # removed servers: forget
                targets.clear()
            targets[rs] = (address, packed, index)
        return packed, index

    def _index_of(self, name: str) -> int:
        index = self._index.get(name)
        if index is None:
            index = self._index[name] = len(self._names)
            self._names.append(name)
        return index

    def _sockaddr(self, address: Address) -> bytes:
        """The server's struct sockaddr, made once per numeric address; a name is
        resolved for each session, as the pure relay's connect does."""
        key = (address.host, address.port)  # (a tuple hashes in C; Address in Python)
        packed = self._sockaddrs.get(key)
        if packed is not None:
            return packed
        assert cpump_sockaddr is not None  # the compiled relay runs only with it
        family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
        try:
            packed = self._sockaddrs[key] = cpump_sockaddr(family, key)
        except ValueError:  # not a numeric address
            info = socket.getaddrinfo(address.host, address.port, family, socket.SOCK_DGRAM)
            packed = cpump_sockaddr(family, info[0][4])
        return packed


UdpRelay: TypeAlias = PureUdpRelay | CompiledUdpRelay


def udp_relay(
    pool: Pool,
    sock: socket.socket,
    *,
    access_log: bool = False,
    vs: VirtualServer | None = None,
) -> UdpRelay:
    """The relay of the path that runs (net/compiled.py): compiled, or pure Python."""
    if hasattr(implementation(), "UdpRelay"):
        return CompiledUdpRelay(pool, sock, access_log=access_log, vs=vs)
    return PureUdpRelay(pool, sock, access_log=access_log, vs=vs)


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
        # UDP has no flow control: a datagram arriving while the buffer is full is lost
        # (RcvbufErrors). A larger buffer rides out a burst or a pause of the relay;
        # the kernel caps it at net.core.rmem_max (nginx: `listen ... rcvbuf=`).
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, address.port))
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise bind_error(address, exc) from None
    return sock


class UdpListener:
    """One UDP socket and the one virtual server it feeds, as the server sees listeners.

    The relay runs in the server's handlers nursery (where TCP connections run), not
    beside the accept loops: at stop the accept loop's cancellation only stops new
    sessions (`drain`), and the sessions open go on to their end within
    global.drain_timeout, reading their clients' datagrams on the same socket.
    """

    def __init__(self, address: Address, sock: socket.socket, virtual_servers) -> None:
        self.address = address
        self.sock = sock
        self.cancel_scope = trio.CancelScope()
        self.vs: VirtualServer = virtual_servers[0]
        self.relay: UdpRelay = udp_relay(
            self.vs.pool, sock, access_log=self.vs.access_log, vs=self.vs
        )

    @property
    def virtual_servers(self) -> list[VirtualServer]:
        return [self.vs]

    def route(self, virtual_servers) -> None:
        """After a reload: the sessions stay, new ones use the (reconfigured) pool."""
        self.vs = virtual_servers[0]
        self.relay.pool = self.vs.pool
        self.relay.vs = self.vs
        self.relay.access_log = self.vs.access_log
        if isinstance(self.relay, CompiledUdpRelay):
            self.relay.route()

    async def accept_loop(self, handlers: trio.Nursery) -> None:
        handlers.start_soon(self._relay)
        try:
            await trio.sleep_forever()
        finally:  # the server stops accepting: no new session, the open ones finish
            self.drain()

    async def _relay(self) -> None:
        # Closed by a reload (its socket under the waiter) or cancelled at shutdown.
        try:
            with self.cancel_scope, contextlib.suppress(trio.ClosedResourceError):
                await self.relay.serve()
        finally:
            self.sock.close()  # drained, or cancelled at the drain_timeout

    def drain(self) -> None:
        self.relay.stop()

    def close(self) -> None:
        """Closed by a reload that no longer listens here: its sessions end now."""
        self.relay.close()  # (the C relay leaves the reactor before its socket closes)
        self.cancel_scope.cancel()
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()
