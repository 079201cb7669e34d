"""The admin endpoint: /metrics, /healthz, /readyz and the /api/v1 JSON API (SPEC §7, §21).

A small ASGI application served by our own HTTP/1.1 server on h11 (http_server.py)
inside the proxy's own trio program, so it reads the live pools directly, on two kinds
of listener (`_authorize` is the rule, written once):

- TCP (`global.admin.listen`): every change (any method but GET) needs
  `Authorization: Bearer <token>` (compared in constant time); without
  `global.admin.token_file` the TCP endpoint is read-only. With `read_token`, /api/v1
  reads need the token too. /healthz, /readyz and /metrics never do. A reload or an
  upgrade over TCP names no file of its own choosing (only the running configuration's
  paths), and its answer quotes nothing of a file outside the running configuration.
- a Unix socket (the admin socket, admin/local_socket.py, and a worker's private one):
  no token; the peer's uid must be this process's or root's, for every request.

Nothing secret is logged.
"""

from __future__ import annotations

import datetime
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lbproxy import __version__
from lbproxy.admin import dashboard, http_server, local_socket
from lbproxy.admin.metrics import VirtualServerView, make_registry
from lbproxy.admin.routes import (
    ANY_HOST_PATHS,
    ROUTES,
    HTTPError,
    Request,
    allow_header,
    allowed,
    match,
)
from lbproxy.admin.stat_csv import CONTENT_TYPE as STAT_CSV_TYPE
from lbproxy.admin.stat_csv import stat_csv
from lbproxy.config.secret_files import SECRETS
from lbproxy.config.values import parse_duration
from lbproxy.core.explain import Admission, explain
from lbproxy.core.locate import Located
from lbproxy.core.per_source import MAX_LISTED, Limits, PerSourceTable, network_named
from lbproxy.core.pool import DRAIN, Pool, state_error, weight_error
from lbproxy.core.rate import Rate
from lbproxy.core.real_server import CheckRecord, ServerCounters
from lbproxy.net import wall_clock
from lbproxy.net.compiled import IMPLEMENTATION
from lbproxy.net.descriptors import clients as process_clients

if TYPE_CHECKING:
    import socket

    from lbproxy.config.model import Config

log = logging.getLogger("lbproxy.admin")

PROCESS_STARTED = time.time()  # close enough to the process's start: imported by it first

MAX_BODY = http_server.MAX_BODY  # larger bodies: 413, from the server before the app
PATCH_KEYS = ("weight", "state", "close_after", "close_rate")
PATCH_EXAMPLE = '{"weight": 3} or {"state": "enabled" | "drain" | "disabled"}'
# A drain's closes: the connections still open `close_after` on, at most `close_rate` a second.
DRAIN_CLOSE_KEYS = ("close_after", "close_rate")
DRAIN_EXAMPLE = '{"state": "drain", "close_after": "30s", "close_rate": 50}'
# The asking client's "HOST PORT", from the supervisor of `workers: N` to a worker over
# its private Unix socket (a locate's affinity); heeded from nowhere else.
CLIENT_HEADER = b"x-lbproxy-client"

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Answer = tuple[int, bytes, str]  # status, body, content type ("json", "text", ...)


class ProxyControl(Protocol):
    """What the admin app reads and changes: a small interface, not the `Server` class.

    `lbproxy.runtime.server.Server` is one (a worker or a single process); the supervisor of
    lbproxy/runtime/workers/ is another. The admin app imports neither.
    """

    ready: bool
    draining: bool
    reloads: dict[str, int]
    config: Config  # the configuration in force (global.admin.allowed_hosts is read per request)
    config_paths: list[str]  # the files and folders it was read from

    @property
    def virtual_servers(self) -> Mapping[str, VirtualServerView]: ...

    def pools(self) -> Iterable[Pool]: ...

    def reload(self, config_paths: Sequence[str] | None = None) -> tuple[bool, list[str]]: ...

    def set_state(
        self,
        vs_name: str,
        rs_name: str,
        state: object,
        close_after: float | None = None,
        close_rate: float | None = None,
    ) -> str | None: ...

    def shutdown_sessions(self, vs_name: str, rs_name: str) -> int | str: ...

    def set_weight(self, vs_name: str, rs_name: str, weight: object) -> str | None: ...

    def add_server(self, vs_name: str, entry: object) -> tuple[int, list[str]]: ...

    def remove_server(self, vs_name: str, rs_name: str) -> tuple[int, str]: ...

    def report_load(
        self, vs_name: str, rs_name: str, load: object, per_connection: object = None
    ) -> str | None: ...


class TokenError(Exception):
    """The token file is missing, empty or readable by everyone."""


def read_token(path: str) -> str:
    """The token in `token_file` (its owner and mode were checked with the configuration,
    lbproxy/config/secret_files.py)."""
    try:
        token = SECRETS.read(path).strip()
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise TokenError(f"admin token_file {path}: {reason}") from None
    if not token:
        raise TokenError(f"admin token_file {path} is empty")
    return token


# -- documents (the same for the API and `lbproxy status --json`) ---------------------


def real_server_document(pool: Pool, name: str) -> dict[str, Any]:
    rs = pool.by_name[name]
    now = trio.current_time()
    pool.advance(now)  # effective weight as the scheduler uses it now
    stats = pool._server_stats(rs)
    return {
        "name": stats.name,
        "address": stats.address,
        "state": stats.state,
        "health": stats.health,
        "backup": stats.backup,
        "weight": {
            "static": _number(stats.weight_static),
            "dynamic": None if not pool.polls_snmp else _number(stats.weight_dynamic),
            "effective": _number(stats.weight_effective),
        },
        "active_connections": stats.active_connections,
        "connections_total": stats.connections_total,
        "bytes_in": stats.bytes_in,
        "bytes_out": stats.bytes_out,
        "snmp": _snmp_document(pool, rs),
        # What the agent check said (SPEC §22), beside the operator's state; None: no agent
        "agent": None if rs.agent is None else rs.agent.document(),
        "load": _load(pool, rs),
        "discovered": rs.config.discovered,  # from DNS (discovery.dns), not from a file
        "check": _check_document(rs.counters.check_last),
        "ejected_until": _wall_time(pool.ejected_until(rs)),  # outlier detection (SPEC §23)
        "since": _wall_time(rs.changed_at),  # the last change of state or health
        "downtime_s": round(pool.downtime(rs, now), 1),
        "rate": _rate_document(rs.rate),
        "errors": _errors_document(rs.counters),
        "max_connections": rs.max_connections or None,  # None: no limit
    }


def _rate_document(rate: Rate) -> dict[str, float | int | None]:
    """New connections a second over the last second, and the highest seen (SPEC §24)."""
    return {"current": _number(round(rate.current, 1)), "max": _number(round(rate.max, 1))}


def _errors_document(counters: ServerCounters) -> dict[str, int]:
    failures = counters.connect_failures
    return {
        "connect_refused": failures["refused"],
        "connect_timeout": failures["timeout"],
        "connect_error": failures["error"],
        "reset": counters.resets,
    }


def _check_document(last: CheckRecord | None) -> dict[str, Any] | None:
    """The last active health check (SPEC §24); None before the first."""
    if last is None:
        return None
    at = datetime.datetime.fromtimestamp(last.at, datetime.UTC)
    return {
        "result": last.result,
        "reason": last.reason,
        "at": at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "duration_ms": round(last.duration * 1000, 1),
    }


def _wall_time(when: float | None) -> str | None:
    """A time of the run's clock (trio's) as ISO 8601 UTC, e.g. 2026-12-05T15:04:23.120Z."""
    if when is None:
        return None
    wall = wall_clock.to_wall(when)
    stamp = datetime.datetime.fromtimestamp(wall, datetime.UTC)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _snmp_document(pool: Pool, rs: Any) -> dict[str, Any] | None:
    """The last SNMP poll of a polled real server: {"value", "result"}; else None."""
    if not pool.polls_snmp or rs.config.snmp is None:
        return None
    result, value = rs.counters.snmp_last or (None, None)
    return {"value": value, "result": result}


def _load(pool: Pool, rs: Any) -> float | None:
    """The scheduler's current load (estimates included) where users read it, else None."""
    if not pool.scheduler.shows_load:
        return None
    return _number(pool.load_of(rs))


def locate_document(located: Located) -> dict[str, Any]:
    """The answer of GET .../locate (SPEC §10)."""
    rs = located.server
    document: dict[str, Any] = {
        "real_server": rs.name,
        "address": str(rs.address),
        "load": _number(located.load),
    }
    if located.replace is not None:
        document["replace"] = located.replace
    return document


def parse_load_report(body: bytes) -> tuple[object, object]:
    """(load, per_connection) of a PUT .../load body; raises a 400 naming the problem.

    The numbers themselves are checked by `Locator.report_load`."""
    example = '{"load": 0.4, "per_connection": 0.1}'
    try:
        request = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError):
        raise HTTPError(400, f"body must be JSON, like {example}") from None
    if not isinstance(request, dict):
        raise HTTPError(400, f"body must be a JSON object like {example}")
    unknown = sorted(set(request) - {"load", "per_connection"})
    if unknown:
        raise HTTPError(400, f"unknown key(s) {', '.join(map(repr, unknown))}; like {example}")
    if "load" not in request:
        raise HTTPError(400, f"body needs 'load', like {example}")
    return request["load"], request.get("per_connection")


def parse_client_header(value: bytes) -> tuple[str, int] | None:
    """(host, port) of a CLIENT_HEADER value "HOST PORT" (port 0 when it is not a
    number), None when empty. Never raises: the host is only ever hashed or a key."""
    if not value:
        return None
    host, _, port = value.decode("latin-1").partition(" ")
    return (host, int(port)) if port.isascii() and port.isdigit() else (host, 0)


MAX_EXPLAIN_QUERY = 256  # bytes of `?client=...&port=...`; an address needs under 64


def _query_fields(
    query: bytes, longest: int, form: str, known: tuple[str, ...]
) -> dict[str, list[str]]:
    """A query string's fields, each a list of its values; HTTPError 400 when it is over
    `longest` bytes, not ASCII and URL-encoded (`form` says what is), or has a field
    other than `known`."""
    if len(query) > longest:
        raise HTTPError(400, f"query too long (over {longest} bytes)")
    try:
        fields = urllib.parse.parse_qs(
            query.decode("ascii"), keep_blank_values=True, strict_parsing=bool(query)
        )
    except (UnicodeDecodeError, ValueError):
        raise HTTPError(400, f"query must be {form} (ASCII, URL-encoded)") from None
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise HTTPError(400, f"unknown query parameter {unknown[0][:40]!r} ({', '.join(known)})")
    return fields


def parse_explain_client(query: bytes) -> tuple[str, int]:
    """`client=IP[&port=N]` of GET .../explain as the `(host, port)` a connection from
    that client has (the host as the socket names it); HTTPError 400 with what is
    wrong. IPv4 or IPv6, without a zone: a zone names a link of this host, which no
    client connection to a virtual server carries."""
    fields = _query_fields(query, MAX_EXPLAIN_QUERY, "client=IP", ("client", "port"))
    if any(len(values) > 1 for values in fields.values()):
        raise HTTPError(400, "client and port may each be given once")
    given = fields.get("client", [""])[0]
    if not given:
        raise HTTPError(400, "client=IP is required (an IPv4 or IPv6 address)")
    if "%" in given:
        raise HTTPError(400, f"client {_shown_text(given)}: an IPv6 zone is not a client address")
    try:
        address = ipaddress.ip_address(given)
    except ValueError:
        raise HTTPError(
            400, f"client {_shown_text(given)} is not an IPv4 or IPv6 address"
        ) from None
    port_text = fields.get("port", ["0"])[0]
    if not (port_text.isascii() and port_text.isdigit() and int(port_text) <= 65535):
        raise HTTPError(400, f"port {_shown_text(port_text)} is not a port (0 to 65535)")
    return str(address), int(port_text)


def _shown_text(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def virtual_server_document(vs: VirtualServerView) -> dict[str, Any]:
    pool = vs.pool
    stats = pool.statistics(trio.current_time())
    return {
        "name": pool.name,
        "listen": [str(address) for address in pool.config.listen],
        "scheduler": pool.config.scheduler,
        "throttle_mode": vs.throttle_mode,
        "active_connections": stats.active_connections,
        "clients": pool.clients,
        "sni": list(pool.config.sni),
        "alpn": list(pool.config.alpn),
        "queued": vs.queue_stats.queued,
        "rejected": stats.rejected,
        "rate": _rate_document(pool.rate),
        "dynamic_weight_fallback": stats.dynamic_weight_fallback,
        "panic": pool.panic,  # panic_threshold (SPEC §23)
        "real_servers": [real_server_document(pool, rs.name) for rs in stats.real_servers],
        "protocol": pool.config.protocol,
        # SPEC §19: the session table's counts (active sessions: `active_connections`).
        "udp": pool.udp.document() if pool.config.protocol == "udp" else None,
        "per_source": per_source_document(vs),
    }


def per_source_document(vs: VirtualServerView) -> dict[str, Any] | None:
    """SPEC §23: the per-source table's size and what it refused (None: no table)."""
    table = vs.per_source
    if table is None:
        return None
    return {
        "tracked": len(table),
        "max_tracked": table.limits.max_tracked,
        "rejected": vs.pool.rejected.get("per_source", 0),
        "untracked": table.untracked,
        "remote_open": table.remote_open(),  # shared: the other instances' open connections
    }


DEFAULT_LISTED = 100  # networks GET .../per-source names without `?limit=`
MAX_LISTING_QUERY = 64  # bytes of `?limit=N`


def parse_listing_limit(query: bytes) -> int:
    """`limit=N` of GET .../per-source: 1 to MAX_LISTED, DEFAULT_LISTED when absent;
    HTTPError 400 with what is wrong."""
    fields = _query_fields(query, MAX_LISTING_QUERY, "limit=N", ("limit",))
    values = fields.get("limit", [str(DEFAULT_LISTED)])
    text = values[0]
    if len(values) > 1 or not (text.isascii() and text.isdigit()):
        raise HTTPError(400, f"limit must be a number from 1 to {MAX_LISTED}, not {text[:20]!r}")
    limit = int(text)
    if not 1 <= limit <= MAX_LISTED:
        raise HTTPError(400, f"limit must be a number from 1 to {MAX_LISTED}, not {limit}")
    return limit


def per_source_table(vs: VirtualServerView | None, name: str) -> PerSourceTable | None:
    """The table of the virtual server `name` under its configuration in force (a
    reload's limits applied, as the next connection would); None while it has none yet.
    A 404 for an unknown name and for one without `per_source:`, as for any route of a
    feature the process does not run."""
    if vs is None:
        raise HTTPError(404, f"no virtual server {name!r}")
    config = vs.pool.config
    if config.per_source is None:
        why = (
            "is UDP: its sessions per source are counted by udp.max_sessions_per_source"
            if config.protocol == "udp"
            else "has no per_source block: no client network is tracked"
        )
        raise HTTPError(404, f"virtual server {name!r} {why}")
    vs.sync_per_source(config.per_source)
    return vs.per_source


def per_source_listing(
    vs: VirtualServerView | None, name: str, limit: int, now: float
) -> dict[str, Any]:
    """GET .../per-source: the `limit` busiest networks of the virtual server `name`'s
    table, its size and its limits (HAProxy's `show table`); 404 as per_source_table."""
    table = per_source_table(vs, name)
    assert vs is not None and vs.pool.config.per_source is not None  # or a 404 above
    config = vs.pool.config.per_source
    limits = table.limits if table is not None else Limits.of(config)
    rows = table.listing(now, limit) if table is not None else []
    return {
        "virtual_server": vs.pool.name,
        "tracked": 0 if table is None else len(table),
        "max_tracked": limits.max_tracked,
        "limits": {
            "max_connections": limits.max_connections or None,
            "rate": limits.rate or None,
            "interval": _number(limits.interval),
            "prefix_v4": limits.prefix_v4,
            "prefix_v6": limits.prefix_v6,
            "shared": config.shared,
        },
        "limit": limit,
        "networks": [
            {
                "network": row.network,
                "open": row.open,
                "arrivals": row.arrivals,
                "at_limit": row.limited_by is not None,
                "limited_by": row.limited_by,
                # the other instances' counts (shared), as this table last had them
                "remote_open": row.remote_open if config.shared else None,
                "remote_arrivals": row.remote_arrivals if config.shared and limits.rate else None,
            }
            for row in rows
        ],
    }


def asked_by(scope: dict[str, Any]) -> str:
    """Who sent a change, for its log line: the TCP peer (which gave the token) or the
    admin socket's peer uid. Nothing secret."""
    client = scope.get("client")
    if client is not None:
        host, port = client[0], client[1]
        return f"{'[' + host + ']' if ':' in host else host}:{port} over TCP with the token"
    uid = (scope.get("extensions") or {}).get(http_server.PEER_UID)
    return f"the admin socket (uid {uid})"


def _number(value: float | None) -> float | int | None:
    if value is None:
        return None
    return int(value) if float(value).is_integer() else round(value, 4)


def _header(headers: dict[bytes, bytes], name: bytes) -> str:
    return headers.get(name, b"").decode("latin-1")


def host_refusal(headers: dict[bytes, bytes], allowed: tuple[str, ...]) -> str | None:
    """Why a request whose `Host` names this endpoint by an unknown name is refused
    (None: accepted).

    DNS rebinding: a page on evil.example rebinds its name to 127.0.0.1 and its requests
    then carry `Host: evil.example`, its own origin, so the cross-origin check passes.
    An IP literal, `localhost`, a `*.localhost` name or a name the operator listed
    cannot be such a page's origin. No `Host` at all (HTTP/1.0) is no browser's request."""
    value = headers.get(b"host")
    if value is None:
        return None
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):  # [v6] or [v6]:port
        host = text[1 : text.find("]")] if "]" in text else text
    elif text.count(":") == 1:
        host = text.partition(":")[0]
    else:  # a name, v4 without a port, or a bare v6 address
        host = text
    host = host.removesuffix(".")
    # *.localhost names always resolve to loopback (RFC 6761 §6.3): no page can rebind them.
    if host == "localhost" or host.endswith(".localhost") or host in allowed:
        return None
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return (
            f"this endpoint does not answer to Host {host!r}: use its IP address, "
            "localhost, or list the name in global.admin.allowed_hosts"
        )
    return None


def _cross_origin(headers: dict[bytes, bytes]) -> bool:
    """True when a browser sent this request from a page of another origin.

    The `Origin` header's host and port must be the `Host` the request was sent to (an
    opaque origin, "null", never is); a request without `Origin` is not from a page of
    another origin (browsers always send it cross-origin on POST, PUT and PATCH)."""
    origin = headers.get(b"origin")
    if origin is None:
        return False
    netloc = urllib.parse.urlsplit(origin.decode("latin-1")).netloc
    return not netloc or netloc.lower() != _header(headers, b"host").lower()


# -- the ASGI application --------------------------------------------------------------


# RFC 6750 §3: how to authenticate (a missing token), and why a given one failed.
_ASK_FOR_TOKEN = ((b"www-authenticate", b'Bearer realm="lbproxy"'),)
_WRONG_TOKEN = ((b"www-authenticate", b'Bearer realm="lbproxy", error="invalid_token"'),)


class _Options(Exception):
    """An OPTIONS request that may be answered: 204 with the route's `Allow` (no CORS
    headers: the API is not for pages of other origins)."""

    def __init__(self, allow: bytes) -> None:
        super().__init__()
        self.allow = allow


class AdminApp:
    def __init__(
        self, server: ProxyControl, token: str | None, socket_path: str | None = None
    ) -> None:
        self.server = server
        self.token = token
        # The admin socket's path (None: there is none), named by a refusal over TCP
        self.socket_path = socket_path
        self.registry = make_registry(server)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            status, body, content_type = await self._route(scope, receive)
            extra: tuple[tuple[bytes, bytes], ...] = ()
        except HTTPError as exc:
            status, body, content_type = exc.status, json_body({"error": exc.message}), "json"
            extra = exc.headers
        except _Options as options:  # 204: no body, so no Content-Type or Content-Length
            headers = [(b"allow", options.allow), (b"cache-control", b"no-store")]
            await send({"type": "http.response.start", "status": 204, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        headers = [
            (b"content-type", _CONTENT_TYPES.get(content_type, content_type).encode()),
            (b"content-length", str(len(body)).encode()),
            (b"cache-control", b"no-store"),
            *extra,
        ]
        if content_type == "html":  # the dashboard: its own scripts only, never framed
            headers += dashboard.headers()
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _check_host(self, scope: dict[str, Any], path: str) -> None:
        if path in ANY_HOST_PATHS or scope.get("client") is None:
            return  # a probe's route, or a worker's private Unix socket (the supervisor checked)
        refusal = host_refusal(
            dict(scope.get("headers", [])), self.server.config.global_.admin.allowed_hosts
        )
        if refusal is not None:
            raise HTTPError(421, refusal)

    async def _route(self, scope: dict[str, Any], receive: Receive) -> tuple[int, bytes, str]:
        """Check a Unix socket's peer, then match the route (routes.py), check the host,
        the method and the authorization, then call the route's handler."""
        local = scope.get("client") is None
        if local:
            _check_peer(scope)
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        self._check_host(scope, path)
        found = match(path)
        handler = None if found is None else getattr(self, "on_" + found[0].name, None)
        if found is None or handler is None:
            raise HTTPError(404, f"no such path: {path}")
        route, params = found
        method = allowed(route, method)
        if not local:
            self._authorize(scope, method, path)
        if method == "OPTIONS":
            raise _Options(allow_header(route))
        return await handler(Request(method, path, params, scope, receive))

    # -- the routes (one handler each) ---------------------------------------------

    async def on_dashboard(self, request: Request) -> Answer:
        return 200, dashboard.page(), "html"  # lbproxy/admin/dashboard.py

    async def on_metrics(self, request: Request) -> Answer:
        return 200, generate_latest(self.registry), "metrics"

    async def on_healthz(self, request: Request) -> Answer:
        return 200, b"ok\n", "text"

    async def on_readyz(self, request: Request) -> Answer:
        server = self.server
        if server.ready and not server.draining:
            return 200, b"ready\n", "text"
        return 503, b"draining\n" if server.draining else b"starting\n", "text"

    async def on_virtual_servers(self, request: Request) -> Answer:
        server = self.server
        running = list(server.virtual_servers.values())
        document: dict[str, Any] = {
            "virtual_servers": [virtual_server_document(vs) for vs in running]
        }
        cluster = getattr(server, "cluster_document", None)  # SPEC §18; None: unclustered
        document["cluster"] = cluster() if cluster is not None else None
        return 200, json_body(document), "json"

    async def on_index(self, request: Request) -> Answer:
        """The routes this app answers (routes.py's table): path and methods."""
        routes = [
            {"path": route.template.replace("{}", "{name}"), "methods": list(route.methods)}
            for route in ROUTES
            if getattr(self, "on_" + route.name, None) is not None
        ]
        return 200, json_body({"routes": routes}), "json"

    async def on_process(self, request: Request) -> Answer:
        """SPEC §24: this process (the supervisor, with workers) and how it runs."""
        uptime = time.time() - PROCESS_STARTED
        started = datetime.datetime.fromtimestamp(PROCESS_STARTED, datetime.UTC)
        document = {
            "version": __version__,
            "pid": os.getpid(),
            "started": started.isoformat(timespec="seconds").replace("+00:00", "Z"),
            "uptime_s": round(uptime, 1),
            "config_files": list(self.server.config_paths),
            "connection_path": IMPLEMENTATION,
            "workers": self.worker_count(),
        }
        return 200, json_body(document), "json"

    def worker_count(self) -> int:
        """How many worker processes answer through this app: none, a single process."""
        return 0

    async def on_virtual_servers_csv(self, request: Request) -> Answer:
        """One row per real server (admin/stat_csv.py), from the same document as
        on_virtual_servers (the supervisor's: the merged one)."""
        _, body, _ = await self.on_virtual_servers(request)
        return 200, stat_csv(json.loads(body)), STAT_CSV_TYPE

    async def on_virtual_server(self, request: Request) -> Answer:
        vs = self.server.virtual_servers.get(request.params[0])
        if vs is None:
            raise HTTPError(404, f"no virtual server {request.params[0]!r}")
        return 200, json_body(virtual_server_document(vs)), "json"

    async def on_real_server(self, request: Request) -> Answer:
        vs_name, rs_name = request.params
        if request.method == "GET":
            pool = self._pool(vs_name)
            self._real_server(pool, rs_name)
            return 200, json_body(real_server_document(pool, rs_name)), "json"
        if request.method == "DELETE":
            await read_body(request.receive)  # nothing is read from it
            status, error = self.server.remove_server(vs_name, rs_name)
            if error:
                raise HTTPError(status, error)
            return status, json_body({"removing": status == 202}), "json"
        return await self._patch(vs_name, rs_name, request.receive)

    async def on_real_servers(self, request: Request) -> Answer:
        """POST .../real-servers: add a real server (its keys as in a file)."""
        vs_name = request.params[0]
        entry = parse_server_entry(await read_body(request.receive))
        status, errors = self.server.add_server(vs_name, entry)
        if errors:
            return status, json_body(problems_document(errors)), "json"
        name = entry["name"]  # type: ignore[index]  # read: an object with a name
        return status, json_body(real_server_document(self._pool(vs_name), name)), "json"

    async def on_reload(self, request: Request) -> Answer:
        paths = await self._config_paths(request)
        ok, messages = self.server.reload(paths)
        if ok:
            return 200, json_body({"result": "ok", "changes": messages}), "json"
        messages = self._shown_errors(request, messages)
        return 400, json_body({"error": "invalid configuration", "errors": messages}), "json"

    async def _config_paths(self, request: Request) -> list[str] | None:
        """The `config` of a reload's or an upgrade's body (None: absent, the running
        paths). Absolute paths; over TCP only the running configuration's own (compared
        after resolving links, SPEC §21): a token must not let a client make lbproxy read
        a file of its choosing, nor hand the listeners to a configuration it wrote."""
        body = await read_body(request.receive)
        try:
            document = json.loads(body) if body.strip() else {}
        except (ValueError, UnicodeDecodeError):
            raise HTTPError(400, "body is not JSON") from None
        if not isinstance(document, dict):
            raise HTTPError(400, 'body must be a JSON object like {"config": ["/abs/path"]}')
        paths = document.get("config")
        if paths is None:
            return None
        if not isinstance(paths, list) or not all(
            isinstance(p, str) and p.startswith("/") and "\0" not in p for p in paths
        ):
            raise HTTPError(400, '"config" must be a list of absolute paths')
        if not paths:
            return None
        if request.scope.get("client") is not None:
            running = {os.path.realpath(p) for p in self.server.config_paths}
            if any(os.path.realpath(p) not in running for p in paths):
                raise HTTPError(
                    403,
                    "over TCP a reload or an upgrade takes only the running configuration's "
                    f"own paths ({', '.join(self.server.config_paths)}); other files only "
                    "through the admin socket",
                )
        return paths

    def _shown_errors(self, request: Request, messages: list[str]) -> list[str]:
        """The errors as a client over TCP may read them: a problem in a file that is
        not one of the running configuration's files is shown as its FILE:LINE only
        (a reader's message quotes the value it refused: `unknown key 'root:*:...'`)."""
        if request.scope.get("client") is None:
            return messages
        return withhold_foreign(messages, self.server.config.files)

    async def on_shutdown_sessions(self, request: Request) -> Answer:
        """POST .../shutdown-sessions: close the real server's connections now."""
        vs_name, rs_name = request.params
        self._real_server(self._pool(vs_name), rs_name)
        await read_body(request.receive)  # nothing is read from it
        closed = self.server.shutdown_sessions(vs_name, rs_name)
        if isinstance(closed, str):
            raise HTTPError(404, closed)
        return 200, json_body({"closed": closed}), "json"

    async def on_upgrade(self, request: Request) -> Answer:
        return await self._upgrade(request)

    async def on_locate(self, request: Request) -> Answer:
        return self._locate(request.params[0], request.scope)

    async def on_load(self, request: Request) -> Answer:
        vs_name, rs_name = request.params
        return await self._report_load(vs_name, rs_name, request.receive)

    async def on_explain(self, request: Request) -> Answer:
        vs_name = request.params[0]
        client = parse_explain_client(request.scope.get("query_string", b""))
        vs = self.server.virtual_servers.get(vs_name)
        if vs is None:
            raise HTTPError(404, f"no virtual server {vs_name!r}")
        pool = vs.pool
        admission = None
        if pool.config.protocol == "tcp":  # a UDP relay decides its sessions apart
            admission = Admission(
                clients_full=process_clients.open >= process_clients.limit,
                throttle=vs.throttle_model,
                per_source=vs.per_source,
            )
        now = trio.current_time()
        answer = explain(pool, client, now, pool.config.queue is not None, admission)
        document = {"virtual_server": vs_name, "client": client[0], **answer.document()}
        document["worker"] = None  # a single process; the supervisor names its worker
        return 200, json_body(document), "json"

    async def on_per_source(self, request: Request) -> Answer:
        """GET .../per-source: the busiest networks; DELETE: clear every network."""
        vs_name = request.params[0]
        if request.method == "GET":
            limit = parse_listing_limit(request.scope.get("query_string", b""))
            vs = self.server.virtual_servers.get(vs_name)
            document = per_source_listing(vs, vs_name, limit, trio.current_time())
            return 200, json_body(document), "json"
        return await self._clear_per_source(request, None)

    async def on_per_source_network(self, request: Request) -> Answer:
        return await self._clear_per_source(request, request.params[1])

    async def on_per_source_prefix(self, request: Request) -> Answer:
        return await self._clear_per_source(request, "/".join(request.params[1:]))

    async def _clear_per_source(self, request: Request, network: str | None) -> Answer:
        """DELETE .../per-source[/NETWORK]: forget the arrivals of one network or of
        all (HAProxy's `clear table`); open connections stay counted (PerSourceTable.
        clear). `{"cleared": N, "kept": K}`: the networks cleared, and of those the
        ones still listed because they hold open connections."""
        await read_body(request.receive)  # nothing is read from it
        vs_name = request.params[0]
        table = per_source_table(self.server.virtual_servers.get(vs_name), vs_name)
        key = None
        if network is not None:
            limits = table.limits if table is not None else None
            prefixes = (limits.prefix_v4, limits.prefix_v6) if limits is not None else (32, 64)
            try:
                key = network_named(network, *prefixes)
            except ValueError as exc:
                raise HTTPError(400, str(exc)) from None
        cleared, kept = (0, 0) if table is None else table.clear(key)
        # A worker is asked by its supervisor, which logs the change and who asked.
        worker = getattr(self.server, "admin_sock", None) is not None
        log.log(
            logging.DEBUG if worker else logging.INFO,
            "%s: per_source %s cleared: %d network(s), %d kept with open connections (by %s)",
            vs_name,
            "every network" if network is None else network,
            cleared,
            kept,
            "the supervisor" if worker else asked_by(request.scope),
        )
        return 200, json_body({"cleared": cleared, "kept": kept}), "json"

    # -- the locator (SPEC §10) ------------------------------------------------------

    def _locate(self, vs_name: str, scope: dict[str, Any]) -> tuple[int, bytes, str]:
        pool = self._pool(vs_name)
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
        current = query.get("current", [None])[-1]
        # The asking address, for maglev and persistence (None over a worker's Unix
        # socket: the supervisor passes it on in a header, see _asking_client).
        located = pool.locator.locate(
            trio.current_time(), current or None, "http", self._asking_client(scope)
        )
        if located is None:
            raise HTTPError(503, "no real server available")
        # Compact: the one hot route (a client pool asks before each connection), and
        # json's C encoder runs only without `indent`.
        return 200, (json.dumps(locate_document(located)) + "\n").encode(), "json"

    def _asking_client(self, scope: dict[str, Any]) -> tuple | None:
        """The address a locate is asked from: the HTTP peer, or, over a worker's
        private endpoint (no peer address; only the supervisor reaches it), the one the
        supervisor read from its own peer and passed on in CLIENT_HEADER."""
        client = scope.get("client")
        if client is not None:
            return tuple(client)
        if getattr(self.server, "admin_sock", None) is None:
            return None
        return parse_client_header(dict(scope.get("headers", [])).get(CLIENT_HEADER, b""))

    async def _report_load(
        self, vs_name: str, rs_name: str, receive: Receive
    ) -> tuple[int, bytes, str]:
        pool = self._pool(vs_name)
        self._real_server(pool, rs_name)
        load, per_connection = parse_load_report(await read_body(receive))
        error = self.server.report_load(vs_name, rs_name, load, per_connection)
        if error:
            raise HTTPError(400, error)
        rs = pool.by_name[rs_name]
        reported, step = pool.locator.reports[rs]
        document = {
            "virtual_server": pool.name,
            "real_server": rs_name,
            "reported": _number(reported),
            "per_connection": _number(step),
            "load": _load(pool, rs),
        }
        return 200, json_body(document), "json"

    async def _patch(self, vs_name: str, rs_name: str, receive: Receive) -> tuple[int, bytes, str]:
        pool = self._pool(vs_name)
        self._real_server(pool, rs_name)
        change = parse_patch(await read_body(receive), f"{vs_name}/{rs_name}")
        # The whole body is valid: both keys apply, or (a 400 above) neither.
        if "weight" in change:
            error = self.server.set_weight(vs_name, rs_name, change["weight"])
            if error:
                raise HTTPError(400, error)
        if "state" in change:
            closes = {key: change[key] for key in DRAIN_CLOSE_KEYS if key in change}
            error = self.server.set_state(vs_name, rs_name, change["state"], **closes)
            if error:
                raise HTTPError(400, error)
        return 200, json_body(real_server_document(pool, rs_name)), "json"

    async def _upgrade(self, request: Request) -> tuple[int, bytes, str]:
        """POST /api/v1/upgrade `{"config": [PATH...]}` (optional; absolute paths, else the
        running ones; over TCP only those): hand over to a new process
        (lbproxy/runtime/upgrade.py), answered once it is ready (200) or has failed (400
        invalid configuration, 500 otherwise), with `exit`, the code `lbproxy upgrade`
        exits with."""
        upgrade = getattr(self.server, "upgrade", None)
        if upgrade is None:
            raise HTTPError(501, "this endpoint cannot upgrade")
        paths = await self._config_paths(request)
        outcome = await upgrade(paths or [])
        status = 200 if outcome.ok else 400 if outcome.exit == 2 else 500
        document = outcome.document()
        if "errors" in document:
            document["errors"] = self._shown_errors(request, document["errors"])
        return status, json_body(document), "json"

    def _pool(self, name: str) -> Pool:
        for pool in self.server.pools():
            if pool.name == name:
                return pool
        raise HTTPError(404, f"no virtual server {name!r}")

    @staticmethod
    def _real_server(pool: Pool, name: str) -> None:
        if name not in pool.by_name:
            raise HTTPError(404, f"no real server {name!r} in virtual server {pool.name!r}")

    def _authorize(self, scope: dict[str, Any], method: str, path: str) -> None:
        """A request over TCP (SPEC §21): a change needs the token, and without a
        token_file there is none to give (read-only); a read needs it only under
        /api/ with `read_token`. A Unix socket's peer was checked before (_check_peer)."""
        headers = dict(scope.get("headers", []))
        if method in ("GET", "OPTIONS"):  # OPTIONS tells no more than GET /api/v1
            admin = self.server.config.global_.admin
            if self.token is not None and admin.read_token and path.startswith("/api/"):
                self._check_token(headers)
            return
        if _cross_origin(headers):
            # Cross-site request forgery: a page open in a browser that holds no token
            # cannot send one, but a "simple" POST needs no CORS pre-check, and a page
            # must learn nothing from trying. Browsers name the page's origin on every
            # cross-origin POST, PUT and PATCH; curl and the CLI send none, and the
            # dashboard's own requests name this endpoint itself.
            raise HTTPError(
                403,
                f"cross-origin change refused: Origin {_header(headers, b'origin')!r} "
                f"is not this endpoint ({_header(headers, b'host')!r})",
            )
        if self.token is None:
            raise HTTPError(403, self._read_only())
        self._check_token(headers)

    def _check_token(self, headers: dict[bytes, bytes]) -> None:
        assert self.token is not None
        header = headers.get(b"authorization", b"")
        scheme, _, given = header.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise HTTPError(401, "missing bearer token", _ASK_FOR_TOKEN)
        if not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            # 403, not RFC 6750's 401, as the API has always said (a client tells a
            # missing token from a wrong one by the status); the header says it too.
            raise HTTPError(403, "wrong token", _WRONG_TOKEN)

    def _read_only(self) -> str:
        """Why a change over TCP is refused without a token_file, and what to use."""
        where = (
            f"through the admin socket {self.socket_path} (`lbproxy drain`, `reload`, ... "
            "use it on this host, as lbproxy's user or root)"
            if self.socket_path is not None
            else "through an admin socket (global.admin.socket; there is none now)"
        )
        return (
            "read-only over TCP: global.admin.token_file is not set, and every change over "
            f"TCP needs its bearer token; change {where}, or set global.admin.token_file"
        )


def _check_peer(scope: dict[str, Any]) -> None:
    """A request over a Unix socket (the admin socket, or a worker's private one): the
    peer must run as this process's user or root, whatever it asks (SPEC §21)."""
    uid = (scope.get("extensions") or {}).get(http_server.PEER_UID)
    if not local_socket.trusted(uid):
        who = "an unknown user" if uid is None else f"uid {uid}"
        raise HTTPError(
            403,
            f"the admin socket serves only the user lbproxy runs as (uid {os.geteuid()}) "
            f"and root, not {who}",
        )


# FILE:LINE: at the start of a message, or after a prefix ("reload: FILE:LINE: ...")
_LOCATED = re.compile(r"(?:^|\s)(?P<file>[^\s:]+):(?P<line>\d+): ")


def withhold_foreign(messages: Iterable[str], running_files: Iterable[str]) -> list[str]:
    """`messages` with every one that names a file outside `running_files` reduced to
    that FILE:LINE and what happened (SPEC §21: an answer over TCP quotes nothing else
    of such a file; lbproxy's log and `lbproxy check` show the whole message)."""
    known = {os.path.realpath(f) for f in running_files}
    shown = []
    for message in messages:
        foreign = next(
            (
                found
                for found in _LOCATED.finditer(message)
                if os.path.isfile(found["file"]) and os.path.realpath(found["file"]) not in known
            ),
            None,
        )
        if foreign is None:
            shown.append(message)
        else:
            shown.append(
                f"{foreign['file']}:{foreign['line']}: invalid (a file the running "
                "configuration does not include: the problem is in lbproxy's log, not "
                "shown over TCP)"
            )
    return shown


_CONTENT_TYPES = {
    "json": "application/json",
    "text": "text/plain; charset=utf-8",
    "metrics": CONTENT_TYPE_LATEST,
    "html": "text/html; charset=utf-8",
}


def json_body(document: Any) -> bytes:
    return (json.dumps(document, indent=2) + "\n").encode()


async def read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if len(body) > MAX_BODY:
            raise HTTPError(413, f"body too large: more than {MAX_BODY} bytes")
        if not message.get("more_body"):
            return body


def parse_server_entry(body: bytes) -> object:
    """A POST .../real-servers body as JSON (checked as a real server by the proxy):
    a 400 when it is not JSON at all (empty, not UTF-8, NaN, a key twice)."""
    example = '{"name": "web3", "address": "10.0.0.13:80", "weight": 2}'
    try:
        return json.loads(
            body.decode("utf-8"), parse_constant=_not_json, object_pairs_hook=_no_repeated_keys
        )
    except UnicodeDecodeError:
        raise HTTPError(400, f"body is not UTF-8 JSON; send {example}") from None
    except _RepeatedKey as exc:
        raise HTTPError(400, f"key {json.dumps(str(exc))} appears twice in the body") from None
    except RecursionError:
        raise HTTPError(400, "body is nested too deeply") from None
    except ValueError as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise HTTPError(400, f"body is not valid JSON ({reason}); send {example}") from None


def problems_document(errors: list[str]) -> dict[str, Any]:
    """An error document with every problem: `error` (the first) and `errors`."""
    return {"error": errors[0] if len(errors) == 1 else "invalid real server", "errors": errors}


def parse_patch(body: bytes, where: str) -> dict[str, Any]:
    """A PATCH body checked whole before anything changes: `{"weight": N, "state": S}`.

    Raises a 400 naming the first problem: not JSON (NaN and Infinity are not JSON
    either), not an object, a key twice, an unknown key, no key at all, or a value that
    `weight_error` / `state_error` refuses. The single-process endpoint and the
    supervisor of `workers: N` (which then reaches no worker) both call it, so a change
    is applied whole or not at all. `where`, the vs/rs names already found, is for the
    log line of a refusal.
    """
    if not body.strip():
        return _refuse(where, f"body is empty; send {PATCH_EXAMPLE}")
    try:
        request = json.loads(
            body.decode("utf-8"),
            parse_constant=_not_json,
            object_pairs_hook=_no_repeated_keys,
        )
    except UnicodeDecodeError:
        return _refuse(where, f"body is not UTF-8 JSON; send {PATCH_EXAMPLE}")
    except _RepeatedKey as exc:
        return _refuse(where, f"key {json.dumps(str(exc))} appears twice in the body")
    except ValueError as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        return _refuse(where, f"body is not valid JSON ({reason}); send {PATCH_EXAMPLE}")
    if not isinstance(request, dict):
        return _refuse(where, f"body must be a JSON object: {PATCH_EXAMPLE}")
    unknown = [key for key in request if key not in PATCH_KEYS]
    if unknown:
        keys = list(map(json.dumps, PATCH_KEYS))
        return _refuse(
            where,
            f"unknown key {json.dumps(unknown[0])} in the body; "
            f"the keys are {', '.join(keys[:-1])} and {keys[-1]}",
        )
    if not request:
        return _refuse(where, f"body changes nothing; send {PATCH_EXAMPLE}")
    if "weight" in request and (error := weight_error(request["weight"])):
        return _refuse(where, error)
    if "state" in request and (error := state_error(request["state"])):
        return _refuse(where, error)
    if any(key in request for key in DRAIN_CLOSE_KEYS):
        return _drain_closes(request, where)
    return request


def _drain_closes(request: dict[str, Any], where: str) -> dict[str, Any]:
    """A drain's `close_after` (a duration, made seconds; 0 when only `close_rate` is
    given) and `close_rate` (a number > 0 a second), checked; they need a drain."""
    if request.get("state") != DRAIN:
        return _refuse(where, f"close_after and close_rate go with a drain: {DRAIN_EXAMPLE}")
    after = request.get("close_after", 0)
    try:
        seconds = parse_duration(after)
    except ValueError:
        return _refuse(
            where,
            f"close_after must be a duration like 30s, 250ms, 2m or seconds, not {after!r}",
        )
    rate = request.get("close_rate")
    if rate is not None and (
        isinstance(rate, bool)
        or not isinstance(rate, int | float)
        or not math.isfinite(rate)
        or rate <= 0
    ):
        return _refuse(
            where, f"close_rate must be a number > 0 (connections a second), not {rate!r}"
        )
    request["close_after"] = seconds
    if rate is not None:
        request["close_rate"] = float(rate)
    return request


class _RepeatedKey(ValueError):
    pass


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise _RepeatedKey(key)
        document[key] = value
    return document


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")


def _refuse(where: str, message: str) -> Any:
    # INFO: a rejected change is rare and an operator wants to see why it did not happen.
    log.info("%s: change refused: %s", where, message)
    raise HTTPError(400, message)


async def serve_admin(
    server: ProxyControl,
    socks: Sequence[socket.socket],
    token: str | None,
    socket_path: str | None = None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin app on already bound, listening sockets (TCP, and the admin
    socket at `socket_path`) until cancelled."""
    await serve_asgi(AdminApp(server, token, socket_path), socks, task_status=task_status)


async def serve_asgi(
    app: Any,
    socks: Sequence[socket.socket],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve an ASGI app (AdminApp or the supervisor's) until cancelled (http_server.py),
    on each socket with limits of its own: clients over TCP never crowd out the admin
    socket's."""
    admin = app.server.config.global_.admin  # the limits are read at start
    async with trio.open_nursery() as nursery:
        for sock in socks:
            await nursery.start(
                partial(
                    http_server.serve,
                    app,
                    sock,
                    max_connections=admin.max_connections,
                    max_per_source=admin.max_connections_per_source,
                )
            )
        task_status.started()
