"""The admin endpoint's HTTP/1.1 server: an ASGI app served over h11 on a trio socket.

h11 does all the parsing and serialising (and the protocol's rules: framing, keep-alive,
`Expect: 100-continue`, chunked bodies, HEAD); this module owns only the connection
loop. It replaces hypercorn, whose per-request machinery (a task and a memory channel per
request, its idle-timer task restarted after every answer, a lock and a shielded scope
per write, three writes per answer) cost more than the admin app's hottest route, the
locator's `GET .../locate` (figures in docs/benchmarks.md, "HTTP locate").

The shape is chosen for cost:

- One task per connection; the app is awaited inline (HTTP/1.1 answers in order on a
  connection, so a request has nothing to run beside): no task per request.
- One cancel scope per connection whose deadline is moved, never restarted: the idle
  timeout between requests, the request timeout once a request has begun, none while the
  app runs.
- A complete answer (the app's `http.response.start` plus a last `http.response.body`)
  leaves in ONE send: h11's Response, Data and EndOfMessage bytes joined. No lock: only
  the connection's own task ever writes.
- Plain non-blocking sockets, not trio's socket wrapper (reads of 64 KiB); the task waits on
  the descriptor only when a call would block. Nothing is logged per request.

The request body is read whole (at most MAX_BODY) before the app is called, so
`receive()` gives one `http.request` with the body and `more_body: False`, then
`http.disconnect`. The server's own refusals are JSON `{"error": ...}` as the admin API's:
400 a request h11 cannot parse, 413 a body over MAX_BODY, 431 a head over MAX_HEAD (414
when the request line alone is), 501 a Transfer-Encoding other than chunked, 505 an HTTP
version other than 1.0 and 1.1, 500 when the app raises (logged once, with its
traceback); each then closes the connection.
HTTP/1.0 is closed after its answer unless it asked for `Connection: keep-alive`.

Slow clients (SPEC §21) cannot hold the endpoint: a new connection must send its whole
first request within REQUEST_TIMEOUT (a keep-alive one, its next request within
REQUEST_TIMEOUT of that request's first byte, after at most IDLE_TIMEOUT of silence);
one client address holds at most `max_per_source` connections, and a newcomer over it
closes that address's oldest connection still reading a request (or idle), else it is
refused; at `max_connections` the oldest one still reading (or idle) anywhere is closed
for a newcomer. A connection being answered is never closed for another. So a probe
from another address is answered at once, and one from the same address as a thousand
slow clients within REQUEST_TIMEOUT.

Over a Unix socket the peer's uid (SO_PEERCRED) is read once per connection and given
to the app in the scope's `extensions` as PEER_UID; a TCP client's address is
`client`, as ASGI says.
"""

from __future__ import annotations

import email.utils
import http
import itertools
import json
import logging
import math
import socket
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import trio

from lbproxy.admin.local_socket import peer_uid
from lbproxy.net.accept import AcceptErrors, Spawn, accept_loop
from lbproxy.net.barrier import record

log = logging.getLogger("lbproxy.http_server")

MAX_BODY = 64 * 1024  # a request body, Content-Length or chunked (nginx: 413)
MAX_HEAD = 16 * 1024  # the request line and headers (h11's max_incomplete_event_size): 431
READ_SIZE = 64 * 1024
IDLE_TIMEOUT = 5.0  # a keep-alive connection with no request for this long is closed
# A new connection's first request, and a keep-alive connection's next one once its
# first bytes are in, must be complete (head and body) within this (slowloris: a client
# sending a byte a second is closed after REQUEST_TIMEOUT).
REQUEST_TIMEOUT = 3.0
SEND_TIMEOUT = 10.0  # a client that has not read the whole answer by then is closed
MAX_CONNECTIONS = 256  # global.admin.max_connections' default
MAX_PER_SOURCE = 32  # global.admin.max_connections_per_source's default
PEER_UID = "lbproxy.peer_uid"  # in the scope's extensions: a Unix socket peer's uid
GRACE = 1.0  # on stop, an answer in progress has this long; idle connections close at once
# After a refusal (400, 413, 431, 500) the connection is closed "lingering", as nginx
# does: our side shut, what the client still sends read and dropped for up to this long,
# so closing with unread bytes (an RST) does not destroy the answer before it is read.
LINGER = 1.0
LINGER_BYTES = 1024 * 1024
# Requests answered on one connection without waiting for the socket (a pipelining
# client) before it lets other tasks run.
FAIR_BATCH = 16

BODY_TOO_LARGE = f"body too large: more than {MAX_BODY} bytes"
HEAD_TOO_LARGE = f"request head too large (over {MAX_HEAD // 1024} KiB)"
URI_TOO_LONG = f"request line too long (over {MAX_HEAD // 1024} KiB)"
# The status line's reason phrase ("HTTP/1.1 404 Not Found"): clients ignore it, but
# people reading curl -v or a capture do not.
REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}
# Answers that have no body and so no Content-Length (RFC 9110 §8.6)
NO_BODY_STATUSES = frozenset({204, 304})
ASGI = {"version": "3.0", "spec_version": "2.3"}
DISCONNECT = {"type": "http.disconnect"}

App = Callable[..., Awaitable[None]]


async def serve(
    app: App,
    sock: socket.socket,
    *,
    max_connections: int = MAX_CONNECTIONS,
    max_per_source: int = MAX_PER_SOURCE,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve an ASGI app on a bound, listening socket (TCP or Unix) until cancelled.

    The app's lifespan startup runs before the first accept; on cancel, accepting stops,
    idle connections close, an answer in progress gets GRACE seconds, and the lifespan
    shutdown runs. The limits (module header): at `max_connections`, or at
    `max_per_source` from one address, the oldest connection still reading its request
    (or idle) is closed to admit a new one (its descriptors are the data plane's)."""
    await Server(app, max_connections, max_per_source).serve(sock, task_status=task_status)


class Server:
    def __init__(
        self, app: App, max_connections: int = MAX_CONNECTIONS, max_per_source: int = MAX_PER_SOURCE
    ) -> None:
        self.app = app
        self.max_connections = max_connections
        self.max_per_source = max_per_source
        self.connections: set[_Connection] = set()
        # A TCP client address -> its open connections (the per-source limit)
        self.by_source: dict[str, set[_Connection]] = {}
        self._handlers: trio.Nursery | None = None
        self._listening: socket.socket  # set when serving starts
        self._stopped = trio.Event()

    async def serve(
        self, sock: socket.socket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        lifespan = _Lifespan(self.app)
        async with trio.open_nursery() as nursery:
            await nursery.start(lifespan.run)
            await lifespan.startup()
            await nursery.start(self._run_handlers)
            try:
                task_status.started()
                await self._accept(sock)
            finally:
                self._stop()
                await lifespan.shutdown()

    async def _run_handlers(self, task_status: trio.TaskStatus[None]) -> None:
        # The connections live in a nursery of their own, shielded: cancelling `serve`
        # stops the accept loop, and `_stop` then ends each connection its own way.
        with trio.CancelScope(shield=True) as scope:
            async with trio.open_nursery() as handlers:
                self._handlers = handlers
                task_status.started()
                await self._stopped.wait()
                scope.deadline = trio.current_time() + GRACE + 0.5  # a backstop

    def _stop(self) -> None:
        self._stopped.set()
        deadline = trio.current_time() + GRACE
        for connection in self.connections:
            connection.stop(deadline)

    async def _accept(self, sock: socket.socket) -> None:
        # The one accept loop (net/accept.py): the plain socket, a wait only when the
        # backlog is empty, a checkpoint every ACCEPT_BATCH, back-off on capacity errors.
        assert self._handlers is not None
        self._listening = sock
        errors = AcceptErrors("admin", log)
        await accept_loop(sock, self, self._handlers.start_soon, errors)

    def accept_client(self, fd: int, peer: Any, spawn: Spawn) -> None:
        """Called by the accept loop for each client, in the order they came: admitted
        (the limits, `_admit`) here, so "oldest" is the order of arrival; its connection
        then runs in a task."""
        listening = self._listening
        client = socket.socket(listening.family, listening.type, listening.proto, fd)
        client.setblocking(False)  # the descriptor is; this sets the socket object's mode
        connection = self._admit(client, None if listening.family == socket.AF_UNIX else peer)
        if connection is not None:
            spawn(self._connection, connection)

    def _admit(self, sock: socket.socket, peer: tuple | None) -> _Connection | None:
        """A connection for the newcomer, counted, once the limits leave room (the oldest
        half-read or idle connection closed to make it); None: closed (every connection
        in its way is being answered)."""
        try:
            local = None if peer is None else sock.getsockname()[:2]
        except OSError:  # reset before we looked
            sock.close()
            return None
        connection = _Connection(self.app, sock, None if peer is None else peer[:2], local)
        if connection.peer is None:  # a Unix socket: who is asking, for all its requests
            connection.extensions = {PEER_UID: peer_uid(sock)}
            same: set[_Connection] = set()
        else:
            same = self.by_source.get(connection.peer[0], set())
        # Its address's oldest reading connection, then the oldest of all, makes room; a
        # newcomer that finds every one in its way being answered waits its turn elsewhere.
        if (len(same) >= self.max_per_source and not self._evict_oldest(same)) or (
            len(self.connections) >= self.max_connections
            and not self._evict_oldest(self.connections)
        ):
            sock.close()
            return None
        self.connections.add(connection)
        if connection.peer is not None:
            self.by_source.setdefault(connection.peer[0], set()).add(connection)
        return connection

    async def _connection(self, connection: _Connection) -> None:
        try:
            await connection.run()
        except Exception as exc:  # a bug here must end only this connection, never the endpoint
            who = connection.peer or "a local client"
            record("request", exc, f"admin: connection from {who}", log)
        finally:
            self._discard(connection)
            connection.sock.close()

    def _discard(self, connection: _Connection) -> None:
        self.connections.discard(connection)
        if connection.peer is not None:
            same = self.by_source.get(connection.peer[0])
            if same is not None:
                same.discard(connection)
                self._forget_source(connection.peer[0])

    def _forget_source(self, host: str) -> None:
        if not self.by_source.get(host, True):
            del self.by_source[host]

    def _evict_oldest(self, candidates: set[_Connection]) -> bool:
        """Close the connection of `candidates` that has been reading its request (or
        waiting for it, idle) the longest; one being answered is never touched. False
        when every one is being answered. A scan, but only at a limit, of at most
        max_connections: the admin endpoint, never the data plane."""
        reading = [c for c in candidates if not (c.busy or c.evicted)]
        if not reading:
            return False
        oldest = min(reading, key=lambda c: (c.idle_since, c.number))
        oldest.evicted = True
        oldest.scope.cancel()
        self._discard(oldest)
        return True


_arrivals = itertools.count()


class _Gone(Exception):
    """The client went away (reset, broken pipe, or it stopped reading)."""


class _Connection:
    """One client connection: its h11 state, its one cancel scope, the request in hand."""

    def __init__(self, app: App, sock: socket.socket, peer: tuple | None, local: tuple | None):
        self.app = app
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.local = local
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.scope = trio.CancelScope()
        self.busy = False  # a request is being answered: a stop lets it finish (GRACE)
        self.idle_since = trio.current_time()  # when its last answer ended (or it came)
        self.number = next(_arrivals)  # the order of arrival, for connections of one instant
        self.evicted = False  # closed to admit another at a limit
        self.extensions: dict[str, Any] = {}  # the ASGI scope's (PEER_UID over a Unix socket)
        self.send_deadline = math.inf  # the whole answer must be read by then (SEND_TIMEOUT)
        self.closing = False
        self.began = False  # bytes of the next request have arrived
        self.timed = False  # ... and its REQUEST_TIMEOUT is set
        self.eof = False
        self.keep_alive_10 = False  # an HTTP/1.0 request asked for keep-alive
        self.unwaited = 0  # answers since this connection last waited for its socket
        # The request in hand (reset per request)
        self.method = b""
        self.body = b""
        self.delivered = False
        self.head: dict[str, Any] | None = None
        self.started = False  # the answer's head is written
        self.finished = False
        self.answered_by = self.h11  # the h11 connection that serialises the answer
        self.asgi_receive = self._asgi_receive  # bound once, not per request
        self.asgi_send = self._asgi_send

    def stop(self, deadline: float) -> None:
        if self.busy:
            self.closing = True
            self.scope.deadline = min(self.scope.deadline, deadline)
        else:
            self.scope.cancel()

    async def run(self) -> None:
        with self.scope:
            # The first request, head and body, within REQUEST_TIMEOUT of the connect.
            self.scope.deadline = trio.current_time() + REQUEST_TIMEOUT
            self.timed = True
            fresh = True
            try:
                while await self._serve_one(fresh):
                    fresh = False
                    self.idle_since = trio.current_time()
                    self.scope.deadline = self.idle_since + IDLE_TIMEOUT
                    self.began = self.timed = False
                    self.unwaited += 1
                    if self.unwaited >= FAIR_BATCH:
                        self.unwaited = 0
                        await trio.lowlevel.checkpoint()
            except h11.RemoteProtocolError as exc:
                if not self.eof:  # a client that closed mid-request is not answered
                    status = exc.error_status_hint
                    if status == 431 and b"\n" not in self.h11.trailing_data[0]:
                        # Over MAX_HEAD and the request line not ended yet: the URI
                        # is what is too long (RFC 9110 §15.5.15), not the headers.
                        status, message = 414, URI_TOO_LONG
                    elif status == 431:
                        message = HEAD_TOO_LARGE
                    else:  # 400, or h11's 501 for a Transfer-Encoding it does not know
                        message = f"bad request: {exc}" if status == 400 else str(exc)
                    await self._refuse(status, message)
            except _Gone as exc:
                log.debug("admin client %s gone: %s", self.peer, exc)

    async def _serve_one(self, fresh: bool = False) -> bool:
        """Read one request, answer it; True: the connection goes on. On a `fresh`
        connection the request is read at once (a client sends it with the connect):
        answered before any newer connection could see this one as the oldest."""
        self.method = b""  # until a request's head is in (a refusal's framing reads it)
        request = await self._next_event(wait_first=not fresh)
        if type(request) is not h11.Request:
            return False  # ConnectionClosed (or PAUSED: nothing we would go on with)
        self.busy = True
        self.method = request.method
        headers = list(request.headers)
        body = await self._read_request(request, headers)
        if body is None:
            return False  # refused
        self.scope.deadline = math.inf  # the app is never cut by a timeout of ours
        self.body = body
        self.delivered = self.started = self.finished = False
        self.send_deadline = math.inf  # set by the answer's first write
        self.head = None
        self.answered_by = self.h11
        try:
            await self.app(self._scope(request.target, headers), self.asgi_receive, self.asgi_send)
            if not self.finished:
                raise RuntimeError("the app returned without a complete answer")
        except _Gone:
            raise
        except Exception as exc:
            what = f"admin: {request.method.decode()} {request.target.decode()}"
            record("request", exc, what, log)
            if not self.started:
                await self._refuse(500, "internal error")
            return False  # or half an answer: only closing can end it
        self.busy = False
        if self.closing:
            return False
        conn = self.h11
        if self.answered_by is not conn:  # an HTTP/1.0 keep-alive answer (_asgi_send)
            self.h11 = _fresh(conn)
            return True
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            return True
        return False

    async def _read_request(
        self, request: h11.Request, headers: list[tuple[bytes, bytes]]
    ) -> bytes | None:
        """The checks of a request's head, then its whole body; None: refused."""
        if request.http_version not in (b"1.1", b"1.0"):  # h11 parses any "HTTP/d.d"
            await self._refuse(505, f"HTTP/{request.http_version.decode()} is not supported")
            return None
        self.keep_alive_10 = False
        # h11 bounds only a head still incomplete after a read; one that came whole in a
        # read of up to READ_SIZE is measured here (the request line and the headers).
        size = len(request.method) + len(request.target) + 12  # "M T HTTP/1.1\r\n"
        if size > MAX_HEAD:
            await self._refuse(414, URI_TOO_LONG)
            return None
        for name, value in headers:
            size += len(name) + len(value) + 4
            if name == b"content-length" and int(value) > MAX_BODY:
                await self._refuse(413, BODY_TOO_LARGE)  # before any 100 Continue
                return None
            if name == b"connection" and request.http_version == b"1.0":
                tokens = [token.strip() for token in value.lower().split(b",")]
                self.keep_alive_10 = b"keep-alive" in tokens and request.method != b"CONNECT"
        if size > MAX_HEAD:
            await self._refuse(431, HEAD_TOO_LARGE)
            return None
        body = b""
        while True:
            event = await self._next_event()
            if type(event) is h11.Data:
                body += event.data
                if len(body) > MAX_BODY:  # chunked
                    await self._refuse(413, BODY_TOO_LARGE)
                    return None
            elif type(event) is h11.EndOfMessage:
                return body
            else:  # nothing else can come before EndOfMessage
                return None

    def _scope(self, target: bytes, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
        raw_path, _, query = target.partition(b"?")
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = urllib.parse.unquote(path)
        return {
            "type": "http",
            "asgi": ASGI,
            "http_version": self.h11.their_http_version.decode(),  # type: ignore[union-attr]  # set once a request line was read
            "method": self.method.decode("ascii"),
            "scheme": "http",
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": self.peer,
            "server": self.local,
            "extensions": self.extensions,
        }

    async def _next_event(self, wait_first: bool = False) -> Any:
        conn = self.h11
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            if self.began and not self.timed:  # a request has begun: it has a deadline now
                self.timed = True
                self.scope.deadline = trio.current_time() + REQUEST_TIMEOUT
            if conn.they_are_waiting_for_100_continue:
                await self._write(
                    conn.send(
                        h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
                    )
                )
            await self._read(wait_first)
            wait_first = False

    async def _read(self, wait_first: bool) -> None:
        sock = self.sock
        if wait_first:  # after an answer the next request is rarely there yet
            self.unwaited = 0
            await trio.lowlevel.wait_readable(self.fd)
        while True:
            try:
                data = sock.recv(READ_SIZE)
            except BlockingIOError:
                self.unwaited = 0
                await trio.lowlevel.wait_readable(self.fd)
                continue
            except OSError:  # reset: as an end of stream
                data = b""
            break
        if data:
            self.began = True
        else:
            self.eof = True
        self.h11.receive_data(data)

    async def _write(self, data: bytes) -> None:
        sock = self.sock
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise _Gone(exc) from None
        if self.send_deadline == math.inf:  # the answer's first write: its one deadline
            self.send_deadline = trio.current_time() + SEND_TIMEOUT
        if sent == len(data):
            return
        view = memoryview(data)[sent:]
        while view:
            # One deadline for the whole answer, not one per wait: a reader taking a
            # byte now and then must not hold the connection for ever.
            with trio.move_on_at(self.send_deadline) as waited:
                await trio.lowlevel.wait_writable(self.fd)
            if waited.cancelled_caught:
                raise _Gone(f"it did not read the answer within {SEND_TIMEOUT}s")
            try:
                view = view[sock.send(view) :]
            except BlockingIOError:
                continue
            except OSError as exc:
                raise _Gone(exc) from None

    # -- the ASGI side -------------------------------------------------------------

    async def _asgi_receive(self) -> dict[str, Any]:
        if self.delivered:
            return DISCONNECT
        self.delivered = True
        return {"type": "http.request", "body": self.body, "more_body": False}

    async def _asgi_send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.head is not None:
                raise RuntimeError("http.response.start sent twice")
            self.head = message
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if self.head is None or self.finished:
            raise RuntimeError("http.response.body without http.response.start, or after the end")
        conn = self.answered_by
        body = message.get("body", b"")
        more = message.get("more_body", False)
        parts = []
        if not self.started:
            self.started = True
            status = self.head["status"]
            headers = list(self.head.get("headers", ()))
            if (
                not more
                and status not in NO_BODY_STATUSES
                and not any(name.lower() == b"content-length" for name, _ in headers)
            ):
                headers.append((b"content-length", b"%d" % len(body)))
            headers.append((b"date", _date()))
            if self.closing:
                headers.append((b"connection", b"close"))
            elif self.keep_alive_10 and not more:  # a whole answer: Content-Length framed
                conn = self.answered_by = _http_1_0_keep_alive_writer(self.method)
                headers.append((b"connection", b"keep-alive"))
            reason = REASONS.get(status, b"")
            parts.append(
                conn.send(h11.Response(status_code=status, headers=headers, reason=reason))
            )
        if body and self.method != b"HEAD":  # h11 frames HEAD answers with no body
            parts.append(conn.send(h11.Data(data=body)))
        if not more:
            self.finished = True
            parts.append(conn.send(h11.EndOfMessage()))
        await self._write(b"".join(parts))

    # -- refusals --------------------------------------------------------------------

    async def _refuse(self, status: int, message: str) -> None:
        """Answer an error (when an answer can still start) and close lingering."""
        conn = self.h11
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = (json.dumps({"error": message}) + "\n").encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
                (b"date", _date()),
                (b"connection", b"close"),
            ]
            try:
                reason = REASONS.get(status, b"")
                data = conn.send(h11.Response(status_code=status, headers=headers, reason=reason))
                if self.method != b"HEAD":  # h11 frames an answer to HEAD without a body
                    data += conn.send(h11.Data(data=body))
                await self._write(data + conn.send(h11.EndOfMessage()))
            except _Gone:
                return
        await self._linger()

    async def _linger(self) -> None:
        sock = self.sock
        with trio.move_on_after(LINGER):
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                return
            dropped = 0
            while dropped < LINGER_BYTES:
                try:
                    data = sock.recv(READ_SIZE)
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(self.fd)
                    continue
                except OSError:
                    return
                if not data:
                    return
                dropped += len(data)


def _http_1_0_keep_alive_writer(method: bytes) -> h11.Connection:
    """An h11 connection to serialise the answer to an HTTP/1.0 request that asked for
    `Connection: keep-alive` (ApacheBench's `ab -k`, old client libraries). h11 closes
    every HTTP/1.0 connection, so this one is told the same request came as HTTP/1.1:
    it frames the whole answer by Content-Length and adds no `Connection: close`; the
    status line says HTTP/1.1, as a server's own version may."""
    writer = h11.Connection(h11.SERVER)
    writer.receive_data(b"%s / HTTP/1.1\r\nhost: -\r\n\r\n" % method)
    writer.next_event()  # the Request
    writer.next_event()  # its EndOfMessage
    return writer


def _fresh(conn: h11.Connection) -> h11.Connection:
    """A new h11 connection for the next request after an HTTP/1.0 keep-alive answer,
    given whatever the client has sent after the last request."""
    fresh = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    data, closed = conn.trailing_data
    if data:
        fresh.receive_data(data)
    if closed:
        fresh.receive_data(b"")
    return fresh


_date_cache = [0, b""]


def _date() -> bytes:
    """The `Date` header's value, formatted once a second."""
    now = int(time.time())
    if now != _date_cache[0]:
        _date_cache[0] = now
        _date_cache[1] = email.utils.formatdate(now, usegmt=True).encode()
    return _date_cache[1]  # type: ignore[return-value]  # [int, bytes]


class _Lifespan:
    """The ASGI lifespan protocol: startup before the first accept, shutdown after the
    last connection. The apps here only acknowledge; an app without lifespan support
    (it raises on the scope) is served all the same."""

    def __init__(self, app: App) -> None:
        self.app = app
        self._send, self._receive = trio.open_memory_channel[dict[str, Any]](2)
        self._started = trio.Event()
        self._stopped = trio.Event()
        self._failure: str | None = None
        self._scope: trio.CancelScope | None = None

    async def run(self, task_status: trio.TaskStatus[None]) -> None:
        # Shielded: it must outlive the cancel that stops the server, to hear shutdown.
        with trio.CancelScope(shield=True) as self._scope:
            task_status.started()
            scope = {"type": "lifespan", "asgi": ASGI, "state": {}}
            try:
                await self.app(scope, self._receive.receive, self._asgi_send)
            except Exception as exc:
                log.debug("admin: the app does not do lifespan: %r", exc)
            finally:
                self._started.set()
                self._stopped.set()

    async def _asgi_send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "lifespan.startup.complete":
            self._started.set()
        elif kind == "lifespan.shutdown.complete":
            self._stopped.set()
        elif kind in ("lifespan.startup.failed", "lifespan.shutdown.failed"):
            self._failure = message.get("message", "")
            self._started.set()
            self._stopped.set()

    async def startup(self) -> None:
        await self._send.send({"type": "lifespan.startup"})
        await self._started.wait()
        if self._failure is not None:
            raise RuntimeError(f"admin app startup failed: {self._failure}")

    async def shutdown(self) -> None:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(GRACE):
                if not self._stopped.is_set():
                    await self._send.send({"type": "lifespan.shutdown"})
                    await self._stopped.wait()
            if self._scope is not None:
                self._scope.cancel()
