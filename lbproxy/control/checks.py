"""Active health checks: one trio task per real server, beside the listeners.

What this module owns:

- `probe(address, check)`: one check of one real server -> ("ok" | "fail" | "timeout",
  reason), bounded by `health_check.timeout` as a whole:
    tcp          the connect succeeds
    send_expect  after the connect, `send` or `send_hex` (if any) is sent and the answer
                 is read until the regular expression `expect` (or the bytes
                 `expect_hex`) is found in it, the peer closes, 4 KiB
                 have arrived, or the timeout: found = ok (the regular expression is
                 *searched*, so `^` anchors at the start of the answer). A wrong answer
                 is a `fail`, whichever of close, 4 KiB or timeout ends the read;
                 `timeout` means the server said nothing at all within `timeout` (or
                 the connect did not complete): "it answered wrongly" and "it did not
                 answer" are different faults, and an operator needs to tell them apart.
                 The reason names what was received (escaped, at most 60 characters).
    http         `method path` (GET) with Host (`host`, else the address) and
                 `Connection: close`; the answer is parsed by h11 (strictly, as any
                 HTTP/1.1 client does): its status code must be one of `expect_status`
                 and `expect_body` (if any) found in the body's first 4 KiB. With
                 `tls: true` over TLS (check_tls.py).
    tls          a TLS handshake (check_tls.py: `sni`, `alpn`, `verify`), then
                 `send`/`expect` over TLS as send_expect when given
    pgsql, mysql, redis, smtp
                 (SPEC §22) the server's own protocol: each a sans-io exchange in
                 lbproxy/wire/health, driven by `converse`, the one runner, which owns
                 the stream, the 16 KiB bound on what is read and the timeout
  send_expect, redis and smtp run over TLS with `tls: true` (a server that speaks
  implicit TLS: the handshake first, as HAProxy's `check-ssl`); pgsql and mysql start
  TLS inside their protocol, which the checks do not do (the configuration refuses it).
    udp, dns     (UDP virtual servers, SPEC §19) a datagram (`send`) whose reply must
                 contain `expect`, or a DNS query (`query`, `query_type`) whose answer
                 must be NOERROR; ICMP port unreachable fails at once (a reply is read
                 up to 16 KiB)
  `address` is where the checks go: `check_address` gives it from the real server's own
  `health_check: {port, address}`, the virtual server's, and the server's address.
  A TCP check's connection may begin with a PROXY header (`check_proxy_header`: as the
  virtual server's `send_proxy` when the check goes to the server's own address and
  port, else as `health_check.send_proxy` says), sent before anything else, a TLS
  handshake too: a server that requires the header on its traffic port refuses any
  connection without it, and would be marked down although it serves.
- `HealthChecks`: one task per real server of every virtual server whose check type is
  not `none`, kept in step with the configuration by the one reconciler (reconcile.py,
  `sync()` after start-up and after each reload, as every control-plane subsystem). A
  task starts after a random offset within its first interval, so the checks of many
  servers spread out, then checks every `interval` (measured from the start of one check
  to the next).
- Each result goes to `record_health()` (core/health.py, below this module because the
  connection handler's passive health feeds it too): the pure hysteresis and, when the
  server goes down and the virtual server says `on_down: close`, the close of its
  established connections.

Up/down transitions are logged once at INFO by the pool, with the reason of the last
result; individual check failures are logged at DEBUG only.

A check that cannot even create its socket because *this* process is out of
descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) says nothing about the real
server: it is not counted, so a proxy at its descriptor limit does not mark every real
server down (which would turn a busy moment into an outage).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import re
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import dns.message
import dns.rcode
import h11
import trio

from lbproxy.config.model import (
    PGSQL_DEFAULT_USER,
    PROTOCOL_CHECKS,
    Address,
    HealthCheckConfig,
    RealServerCheckConfig,
)
from lbproxy.config.secret_files import SECRETS
from lbproxy.config.tls_check_keys import speaks_tls
from lbproxy.control.check_tls import TlsFailed, TlsLayer
from lbproxy.control.reconcile import Configured, Reconciler
from lbproxy.core.health import close_leases, record_health
from lbproxy.core.pool import Pool, RealServer
from lbproxy.core.real_server import CheckRecord
from lbproxy.net.accept import CAPACITY_ERRNOS, LocalCapacityError
from lbproxy.net.barrier import record
from lbproxy.wire import proxy_protocol
from lbproxy.wire.health.exchange import (
    ANSWER_LIMIT,
    EXCERPT_LIMIT,
    NEED_MORE,
    Exchange,
    excerpt,
)
from lbproxy.wire.health.mysql import MysqlExchange
from lbproxy.wire.health.pgsql import PgsqlExchange
from lbproxy.wire.health.redis import RedisExchange
from lbproxy.wire.health.smtp import SmtpExchange

log = logging.getLogger("lbproxy.checks")

READ_LIMIT = 4096  # send_expect: the answer searched is at most this long
BODY_LIMIT = 4096  # http: the part of the body `expect_body` is searched in
LOCAL_CAPACITY_ERRNOS = CAPACITY_ERRNOS  # one table (net/accept.py)
# Where they live now (the data plane feeds passive health without importing control):
__all__ = [
    "ANSWER_LIMIT",
    "EXCERPT_LIMIT",
    "HealthChecks",
    "LocalCapacityError",
    "check_address",
    "check_proxy_header",
    "close_leases",
    "converse",
    "probe",
    "record_health",
]
USER_AGENT = "lbproxy-health-check"

OK, FAIL, TIMEOUT = "ok", "fail", "timeout"  # lbproxy_health_checks_total{result}


class _Failed(Exception):
    """The check failed for a reason worth a log line."""


# -- one check ----------------------------------------------------------------------


def decode_send(text: str) -> bytes:
    r"""The bytes of `send`: YAML's double quotes already turn "\r\n" into CR LF; in a
    plain or single-quoted string the escapes \r \n \t \0 \\ and \xHH are decoded here,
    so `send: PING\r\n` means what it looks like. Other characters are sent as UTF-8."""
    out = bytearray()
    i = 0
    while i < len(text):
        char = text[i]
        if char == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            simple = {"r": b"\r", "n": b"\n", "t": b"\t", "0": b"\0", "\\": b"\\"}
            if nxt in simple:
                out += simple[nxt]
                i += 2
                continue
            if nxt == "x" and re.fullmatch(r"[0-9A-Fa-f]{2}", text[i + 2 : i + 4]):
                out.append(int(text[i + 2 : i + 4], 16))
                i += 4
                continue
        out += char.encode()
        i += 1
    return bytes(out)


def host_header(address: Address) -> str:
    host = f"[{address.host}]" if ":" in address.host else address.host
    return host if address.port == 80 else f"{host}:{address.port}"


# What a server sent, for a log line (wire/health/exchange.py).
describe_received = excerpt


async def probe(address: Address, check: HealthCheckConfig, proxy: str = "none") -> tuple[str, str]:
    """Run one check of the real server at `address` (where its checks go: see
    `check_address`): (result, reason for the log). `proxy` ("none", "v1", "v2", see
    `check_proxy_header`): the PROXY header the connection begins with, before anything
    else the check sends (a TLS handshake too).

    Raises LocalCapacityError when this process is out of descriptors or memory.
    """
    if check.type in DATAGRAM_CHECKS:
        return await _datagram_probe(address, check)
    if check.type in PROTOCOL_CHECKS:
        return await _protocol_probe(address, check, proxy)
    connected = False
    answer = bytearray()  # send_expect: what the server has sent so far
    tls = TlsLayer(address, check) if speaks_tls(check) else None
    expects = check.type == "send_expect" or (check.type == "tls" and check.expect is not None)
    try:
        with trio.fail_after(check.timeout):
            stream: trio.abc.Stream = await _connect(address, proxy)
            connected = True
            if tls is not None:
                stream = await tls.wrap(stream)
            async with stream:
                if expects or (check.type == "tls" and check.send):
                    await _send_expect(stream, check, answer)
                elif check.type == "http":
                    await _http(stream, address, check, answer)
        return OK, ""
    except trio.TooSlowError:
        within = f"within {check.timeout:g}s"
        if not connected:
            return TIMEOUT, f"{check.type} check: connect did not complete {within}"
        handshake = tls.timeout_reason(check.timeout) if tls is not None else None
        if handshake is not None:
            return (FAIL if handshake.startswith("tls: not") else TIMEOUT), handshake
        if check.type == "http" and answer:  # half an answer is a wrong one
            received = describe_received(bytes(answer))
            asked = f"{check.method} {check.path}"
            return FAIL, f"http check: {asked}: the answer did not end {within} ({received})"
        if not expects:
            return TIMEOUT, f"{check.type} check: no answer {within}"
        if not answer:
            return TIMEOUT, f"{check.type} check: nothing received {within}"
        received = describe_received(bytes(answer))
        return FAIL, f"{check.type} check: {_expected(check)} not found in {received} {within}"
    except TlsFailed as exc:
        return FAIL, str(exc)
    except _Failed as exc:
        return FAIL, f"{check.type} check: {exc}"
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        return FAIL, f"{check.type} check: {_describe(exc)}"


def check_address(
    address: Address, check: HealthCheckConfig, own: RealServerCheckConfig | None
) -> Address:
    """Where the checks of a real server served at `address` go: its own
    `health_check: {port, address}`, else the virtual server's `health_check` `port`
    and `address`, else the address it is served at (HAProxy's `port` and `addr`)."""
    host = (own.address if own else None) or check.address or address.host
    port = (own.port if own else None) or check.port or address.port
    return Address(host, port)


def check_proxy_header(
    served_at: Address,
    check: HealthCheckConfig,
    own: RealServerCheckConfig | None,
    traffic: str,
) -> str:
    """The PROXY header ("none", "v1", "v2") the checks of a real server served at
    `served_at` begin with, when the virtual server sends `traffic` ("none", "v1", "v2",
    its `send_proxy`) on client connections. HAProxy's rule: by default as the traffic
    when the checks go to the server's own address and port (a server that requires the
    header there would refuse a check without it), none when they go elsewhere (a
    management port does not expect it); `send_proxy: true` or `false` (the server's
    own, else the virtual server's) decides instead, as `check-send-proxy`, with the
    traffic's version or else v1 (HAProxy's default line)."""
    if check.type in DATAGRAM_CHECKS:
        return "none"
    forced = own.send_proxy if own is not None and own.send_proxy is not None else None
    if forced is None:
        forced = check.send_proxy
    if forced is None:
        return traffic if check_address(served_at, check, own) == served_at else "none"
    if not forced:
        return "none"
    return traffic if traffic != "none" else "v1"


# -- protocol checks: one runner for every exchange (lbproxy/wire/health) --------------


def exchange_for(check: HealthCheckConfig) -> Exchange:
    """The sans-io exchange of a protocol check (PROTOCOL_CHECKS). Reads the Redis
    password file now, so a rotated password is picked up (config/secret_files.py)."""
    if check.type == "pgsql":
        user = check.user or PGSQL_DEFAULT_USER
        return PgsqlExchange(user, check.database or user)
    if check.type == "mysql":
        return MysqlExchange(check.user)
    if check.type == "redis":
        password = None
        if check.password_file:
            password = SECRETS.read(check.password_file).rstrip("\r\n")
        return RedisExchange(password, check.role)
    if check.type == "smtp":
        return SmtpExchange(check.helo or socket.gethostname())
    raise ValueError(f"not a protocol check: {check.type}")


async def _protocol_probe(
    address: Address, check: HealthCheckConfig, proxy: str
) -> tuple[str, str]:
    name = check.type
    try:
        exchange = exchange_for(check)
    except (OSError, ValueError) as exc:  # the password file is gone or not text
        return FAIL, f"{name}: cannot read password_file {check.password_file}: {_describe(exc)}"
    deadline = trio.current_time() + check.timeout
    tls = TlsLayer(address, check) if speaks_tls(check) else None  # redis, smtp over TLS
    stream: trio.abc.Stream | None = None
    try:
        with trio.fail_at(deadline):
            stream = await _connect(address, proxy)
            if tls is not None:
                stream = await tls.wrap(stream)
    except trio.TooSlowError:
        handshake = tls.timeout_reason(check.timeout) if tls is not None and stream else None
        if handshake is not None:
            return (FAIL if handshake.startswith("tls: not") else TIMEOUT), f"{name}: {handshake}"
        return TIMEOUT, f"{name}: connect did not complete within {check.timeout:g}s"
    except TlsFailed as exc:
        return FAIL, f"{name}: {exc}"
    except _Failed as exc:
        return FAIL, f"{name}: {exc}"
    except _STREAM_ERRORS as exc:
        return FAIL, f"{name}: {_describe(exc)}"
    async with stream:
        return await converse(stream, exchange, deadline=deadline, timeout=check.timeout)


async def converse(
    stream: trio.abc.Stream, exchange: Exchange, *, deadline: float, timeout: float
) -> tuple[str, str]:
    """Drive `exchange` over a connected stream: (result, reason).

    The one runner of every protocol check, and the only code that touches the stream
    (any trio stream: a TCP connection, or one wrapped in TLS after the connect). It
    sends the exchange's opening, feeds it what arrives and sends what it answers,
    until its verdict or the server's close. Bounded twice:

    - in size: at most ANSWER_LIMIT bytes are read in all (so the exchange never holds
      more); a server that sends more fails the check (`answer longer than ...`);
    - in time: everything happens before `deadline` (trio's clock), `timeout` being
      only what the reason says. A server that says nothing by then is a `timeout`;
      one that started an answer and did not finish it, a `fail`.

    After the verdict, what it says to send (a Terminate, a QUIT) is sent once, best
    effort, before the deadline. The caller closes the stream.
    """
    name = exchange.name
    received = 0
    farewell = b""  # sent after the verdict
    try:
        with trio.fail_at(deadline):
            opening = exchange.opening()
            if opening:
                await stream.send_all(opening)
            while True:
                chunk = await stream.receive_some(ANSWER_LIMIT + 1 - received)
                if not chunk:
                    verdict = exchange.closed()
                    break
                received += len(chunk)
                # One byte over the bound at most (what was asked for): the bytes within
                # it are judged first, so a verdict does not depend on how they arrived.
                over = received > ANSWER_LIMIT
                judged = chunk[:-1] if over else chunk
                step = exchange.received(bytes(judged)) if judged else NEED_MORE
                if over and step.verdict is None:
                    return FAIL, f"{name}: answer longer than {ANSWER_LIMIT} bytes"
                if step.verdict is not None:
                    verdict, farewell = step.verdict, step.send
                    break
                if step.send:
                    await stream.send_all(step.send)
    except trio.TooSlowError:
        within = f"within {timeout:g}s"
        if not received:
            return TIMEOUT, f"{name}: no answer {within}"
        return FAIL, f"{name}: answer incomplete after {received} bytes {within}"
    except _STREAM_ERRORS as exc:
        return FAIL, f"{name}: {_describe(exc)}"
    if farewell:  # the verdict stands whatever becomes of it
        with trio.move_on_at(deadline), contextlib.suppress(*_STREAM_ERRORS):
            await stream.send_all(farewell)
    return (OK, "") if verdict.ok else (FAIL, verdict.reason)


_STREAM_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)


async def _socket_for(address: Address, kind: int) -> tuple[trio.socket.SocketType, Any]:
    """A new socket of `kind` for `address` and the address to connect it to; raises
    _Failed when the name does not resolve, LocalCapacityError when this process is out
    of descriptors (lbproxy's problem, not the server's)."""
    try:
        infos = await trio.socket.getaddrinfo(address.host, address.port, type=kind)
    except socket.gaierror as exc:  # the resolver's own words (its codes are not errnos)
        raise _Failed(f"cannot resolve {address.host}: {exc.strerror or exc}") from None
    except OSError as exc:
        raise _Failed(f"cannot resolve {address.host}: {_describe(exc)}") from None
    family, _, _, _, sockaddr = infos[0]
    try:
        return trio.socket.socket(family, kind), sockaddr
    except OSError as exc:
        if exc.errno in LOCAL_CAPACITY_ERRNOS:
            raise LocalCapacityError(_describe(exc)) from None
        raise


async def _connect(address: Address, proxy: str = "none") -> trio.SocketStream:
    """A connected stream to `address`; with `proxy` ("v1", "v2") the PROXY header of a
    health check (wire/proxy_protocol.py) is sent on it first."""
    sock, sockaddr = await _socket_for(address, socket.SOCK_STREAM)
    try:
        await sock.connect(sockaddr)
        stream = trio.SocketStream(sock)
        if proxy != "none":
            local, peer = sock.getsockname(), sock.getpeername()
            await stream.send_all(proxy_protocol.health_check_header(proxy, local, peer))
    except BaseException:
        sock.close()
        raise
    return stream


async def _send_expect(
    stream: trio.abc.Stream, check: HealthCheckConfig, answer: bytearray
) -> None:
    """Send, then read into `answer` (the caller's, so that a timeout can tell a wrong
    answer from none) until `expect` is found; raises _Failed on close or at 4 KiB."""
    if check.send_hex:
        await stream.send_all(check.send_hex)
    elif check.send:
        await stream.send_all(decode_send(check.send))
    pattern = re.compile(check.expect or "")
    while True:
        if check.expect_hex is not None:
            if check.expect_hex in answer:
                return
        # Decoded as a whole each time: a character split between reads still matches.
        elif pattern.search(answer.decode("utf-8", errors="replace")):
            return
        if len(answer) >= READ_LIMIT:
            raise _Failed(
                f"{_expected(check)} not found in the first {READ_LIMIT} bytes"
                f" ({describe_received(bytes(answer))})"
            )
        chunk = await stream.receive_some(READ_LIMIT - len(answer))
        if not chunk:
            if not answer:
                raise _Failed("closed without an answer")
            received = describe_received(bytes(answer))
            raise _Failed(f"{_expected(check)} not found in {received} before the server closed")
        answer += chunk


def _expected(check: HealthCheckConfig) -> str:
    """What send_expect looks for, as its reasons name it."""
    if check.expect_hex is not None:
        return f"hex {check.expect_hex.hex()}"
    return repr(check.expect)


async def _http(
    stream: trio.abc.Stream, address: Address, check: HealthCheckConfig, answer: bytearray
) -> None:
    """The request, then the status line and headers (h11, bounded by its 16 KiB limit on
    a head), and with `expect_body` at most BODY_LIMIT bytes of the body. The first
    READ_LIMIT bytes received go to `answer` (the caller's: a timeout names them)."""
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method=check.method,
        target=check.path,
        headers=[
            ("Host", check.host or host_header(address)),
            ("User-Agent", USER_AGENT),
            ("Accept", "*/*"),
            ("Connection", "close"),
        ],
    )
    await stream.send_all(conn.send(request) + (conn.send(h11.EndOfMessage()) or b""))
    asked = f"{check.method} {check.path}"
    body = bytearray()
    responded = False  # the status line and headers have arrived
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = bytes(await stream.receive_some(READ_LIMIT))
                answer += data[: READ_LIMIT - len(answer)]
                conn.receive_data(data)
            elif isinstance(event, h11.Response):
                if event.status_code not in check.expect_status:
                    raise _Failed(f"{asked} answered {event.status_code}")
                if check.expect_body is None:
                    return
                responded = True
            elif isinstance(event, h11.Data):
                body += event.data[: BODY_LIMIT - len(body)]
                if len(body) >= BODY_LIMIT:
                    break
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):  # (after a Response: EndOfMessage)
                raise _Failed(f"{asked}: closed before a status line")
            # InformationalResponse (1xx): the final status follows
    except h11.RemoteProtocolError as exc:
        # h11 quotes the offending line, which may be 16 KiB long: cut for the log
        problem = str(exc) if len(str(exc)) <= EXCERPT_LIMIT else str(exc)[:EXCERPT_LIMIT] + "..."
        if responded:  # the body was cut short, or its chunks were garbled
            raise _Failed(f"{asked}: the body ended early ({problem})") from None
        raise _Failed(f"{asked}: not an HTTP answer ({problem})") from None
    if not body_matches(check.expect_body or "", bytes(body)):
        received = describe_received(bytes(body))
        raise _Failed(f"{asked}: body did not match {check.expect_body!r} ({received})")


def body_matches(pattern: str, body: bytes) -> bool:
    """`expect_body` searched in the body's first BODY_LIMIT bytes, read as UTF-8 (an
    invalid byte stands for U+FFFD)."""
    return re.search(pattern, body[:BODY_LIMIT].decode("utf-8", errors="replace")) is not None


# -- UDP checks (SPEC §19) ----------------------------------------------------------

DATAGRAM_CHECKS = ("udp", "dns")
DATAGRAM_LIMIT = ANSWER_LIMIT  # of a reply, at most: the rest of a larger datagram is dropped


async def _datagram_probe(address: Address, check: HealthCheckConfig) -> tuple[str, str]:
    """`udp`: send `send` (an empty datagram without it) and wait for a reply in which
    `expect` is found (any reply without `expect`); `dns`: a query for `query` and
    `query_type` (dnspython) answered NOERROR. Both within `timeout`; the first reply
    decides, except a DNS reply with another id (not ours: read on). ICMP port
    unreachable is a `fail` at once, as a refused TCP connect is."""
    query = None
    if check.type == "dns":
        query = dns.message.make_query(check.query or ".", check.query_type)
        payload = query.to_wire()
    else:
        payload = decode_send(check.send or "")
    try:
        sock, sockaddr = await _socket_for(address, socket.SOCK_DGRAM)
    except _Failed as exc:
        return FAIL, f"{check.type} check: {exc}"
    received = b""
    try:
        with sock, trio.fail_after(check.timeout):
            await sock.connect(sockaddr)  # connected: ICMP errors come back on it
            await sock.send(payload)
            while True:
                received = await sock.recv(DATAGRAM_LIMIT)
                if query is None:
                    return _udp_result(check, received)
                result = _dns_result(query, received)
                if result is not None:
                    return result
    except trio.TooSlowError:
        if received:  # a DNS reply that was not ours
            return FAIL, f"dns check: no answer to our query within {check.timeout:g}s"
        return TIMEOUT, f"{check.type} check: no reply within {check.timeout:g}s"
    except ConnectionRefusedError:
        return FAIL, f"{check.type} check: port unreachable (ICMP)"
    except OSError as exc:
        return FAIL, f"{check.type} check: {_describe(exc)}"


def _udp_result(check: HealthCheckConfig, reply: bytes) -> tuple[str, str]:
    if check.expect is None or re.search(check.expect, reply.decode("utf-8", errors="replace")):
        return OK, ""
    return FAIL, f"udp check: {check.expect!r} not found in {describe_received(reply)}"


def _dns_result(query: dns.message.Message, reply: bytes) -> tuple[str, str] | None:
    """OK on NOERROR, FAIL on another rcode or garbage; None: a reply to another query."""
    try:
        answer = dns.message.from_wire(reply)
    except Exception:  # dnspython raises many kinds on garbage: all mean "not DNS"
        return FAIL, f"dns check: not a DNS answer ({describe_received(reply)})"
    if answer.id != query.id or not query.is_response(answer):
        return None
    rcode = answer.rcode()
    if rcode != dns.rcode.NOERROR:
        return FAIL, f"dns check: answered {dns.rcode.to_text(rcode)}"
    return OK, ""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno).lower()  # trio's strerror also names the address
    return str(exc) or type(exc).__name__


# -- the tasks ----------------------------------------------------------------------


# What a check task runs: the check, where it goes, its PROXY header, the pool.
_Spec = tuple[HealthCheckConfig, Address, str, Pool]


class HealthChecks(Reconciler[RealServer, _Spec]):
    """One check task per real server, in step with the configuration (reconcile.py).

    A real server that is gone (removed, or its virtual server removed, or checks turned
    off with `type: none`) has its task cancelled; one whose check settings or address
    changed gets a new task (and a new random offset).
    """

    def wanted(self, virtual_servers: Iterable[Configured]) -> dict[RealServer, _Spec]:
        wanted = {}
        for vs in virtual_servers:
            pool = vs.pool
            check = pool.config.health_check
            if check.type == "none":
                continue
            traffic = pool.config.send_proxy
            for rs in pool.servers:
                own = rs.config.health_check
                target = check_address(rs.address, check, own)
                proxy = check_proxy_header(rs.address, check, own, traffic)
                wanted[rs] = (check, target, proxy, pool)  # a real server's pool never changes
        return wanted

    def start(self, key: RealServer, spec: _Spec) -> Callable[[], Awaitable[None]]:
        check, target, proxy, pool = spec
        return functools.partial(self._run, pool, key, check, target, proxy)

    @staticmethod
    async def _run(
        pool: Pool, rs: RealServer, check: HealthCheckConfig, address: Address, proxy: str
    ) -> None:
        out_of_capacity = False
        await trio.sleep(random.uniform(0, check.interval))
        next_at = trio.current_time()
        while True:
            result: str | None = None  # None: no result (out of descriptors here)
            started = trio.current_time()
            try:
                result, reason = await probe(address, check, proxy)
            except LocalCapacityError as exc:
                if not out_of_capacity:  # once per burst
                    log.warning("%s/%s: health check skipped: %s", pool.name, rs.name, exc)
                    out_of_capacity = True
            except Exception as exc:  # a bug here must not stop the proxy
                record("check", exc, f"{pool.name}/{rs.name}")
                result, reason = FAIL, f"{check.type} check: {type(exc).__name__}"
            if result is not None:
                out_of_capacity = False
                rs.counters.health_checks[result] += 1
                duration = trio.current_time() - started
                rs.counters.check_last = CheckRecord(result, reason, time.time(), duration)
                if result != OK:
                    log.debug("%s/%s: %s", pool.name, rs.name, reason)
                record_health(pool, rs, result == OK, trio.current_time(), reason)
            next_at = max(next_at + check.interval, trio.current_time())
            await trio.sleep_until(next_at)
