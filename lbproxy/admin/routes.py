"""The admin endpoint's routes: one table for both apps that answer them.

A single process answers them from its live pools (api.py's `AdminApp`); the supervisor
of `workers: N` answers the same routes from its workers (runtime/workers/app.py's
`SupervisorApp`, a subclass). Each app has one handler per route it answers, named
`on_<route>`; the matching, the method check and the authorization rule are written
once, here and in `AdminApp._route`:

- A path matches one route or none (404 "no such path"); a route an app has no handler
  for is a 404 too (the workers' routes on a single process).
- A route lists its methods; any other is a 405 whose `Allow` names them all. HEAD is
  answered as GET on a read-only route (GET alone), except where a GET is counted
  (`head_as_get=False`: locate, whose answer is a pick that steers the next ones; a
  HEAD from a monitor or a link checker must not).
- Every method but GET (and OPTIONS) changes something and needs a credential (api.py
  `_authorize`): a request through the admin socket, or the token over TCP. Checked
  before the body is read.

docs/reference/admin-api.md describes the same routes for a user.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ANY_HOST_PATHS",
    "ROUTES",
    "HTTPError",
    "Request",
    "Route",
    "allow_header",
    "allowed",
    "match",
]

# Routes a request naming any Host may use: probes and scrapers often name the host, and
# these change nothing and reveal nothing a rebound page could use (SPEC §16).
ANY_HOST_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class HTTPError(Exception):
    """An answer other than 200, raised anywhere in a handler: status and message, and
    the headers the status calls for (a 405's `Allow`, a 401's `WWW-Authenticate`)."""

    def __init__(
        self, status: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


@dataclass(frozen=True)
class Route:
    name: str  # the handler: on_<name>
    template: str  # the path; {} stands for one name (no "/")
    methods: tuple[str, ...]
    head_as_get: bool = True  # HEAD answered as GET when GET is the only method
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        regex = "^" + re.escape(self.template).replace(r"\{\}", "([^/]+)") + "$"
        object.__setattr__(self, "pattern", re.compile(regex))


ROUTES = (
    Route("dashboard", "/", ("GET",)),
    Route("metrics", "/metrics", ("GET",)),
    Route("healthz", "/healthz", ("GET",)),
    Route("readyz", "/readyz", ("GET",)),
    Route("workers", "/api/v1/workers", ("GET",)),  # the supervisor's only
    Route("worker", "/api/v1/workers/{}/virtual-servers", ("GET",)),  # the supervisor's only
    Route("index", "/api/v1", ("GET",)),  # this table, as JSON
    Route("process", "/api/v1/process", ("GET",)),
    Route("virtual_servers", "/api/v1/virtual-servers", ("GET",)),
    Route("virtual_servers_csv", "/api/v1/virtual-servers.csv", ("GET",)),
    Route("virtual_server", "/api/v1/virtual-servers/{}", ("GET",)),
    Route("real_servers", "/api/v1/virtual-servers/{}/real-servers", ("POST",)),
    Route("real_server", "/api/v1/virtual-servers/{}/real-servers/{}", ("GET", "DELETE", "PATCH")),
    Route("reload", "/api/v1/reload", ("POST",)),
    Route("upgrade", "/api/v1/upgrade", ("POST",)),
    Route("locate", "/api/v1/virtual-servers/{}/locate", ("GET",), head_as_get=False),
    Route("load", "/api/v1/virtual-servers/{}/real-servers/{}/load", ("PUT",)),
    Route("explain", "/api/v1/virtual-servers/{}/explain", ("GET",)),
    # per_source's table (HAProxy's `show table` and `clear table`): a network is an
    # address or ADDRESS/PREFIX, whose "/" (or %2F) makes it two path segments.
    Route("per_source", "/api/v1/virtual-servers/{}/per-source", ("GET", "DELETE")),
    Route("per_source_network", "/api/v1/virtual-servers/{}/per-source/{}", ("DELETE",)),
    Route("per_source_prefix", "/api/v1/virtual-servers/{}/per-source/{}/{}", ("DELETE",)),
    Route(
        "shutdown_sessions",
        "/api/v1/virtual-servers/{}/real-servers/{}/shutdown-sessions",
        ("POST",),
    ),
)
_FIXED = {route.template: route for route in ROUTES if "{}" not in route.template}
_PATTERNS = [route for route in ROUTES if "{}" in route.template]


@dataclass(frozen=True, slots=True)
class Request:
    """One request as a handler sees it: the method it is answered as (HEAD: GET), the
    path (no trailing slash), the path's names in order, and the ASGI scope and receive."""

    method: str
    path: str
    params: tuple[str, ...]
    scope: dict[str, Any]
    receive: Any


def match(path: str) -> tuple[Route, tuple[str, ...]] | None:
    """The route `path` names and the names in it, or None."""
    route = _FIXED.get(path)
    if route is not None:
        return route, ()
    for route in _PATTERNS:
        found = route.pattern.match(path)
        if found is not None:
            return route, found.groups()
    return None


def allowed(route: Route, method: str) -> str:
    """The method `method` is answered as on `route` (OPTIONS: the caller answers 204
    with `allow_header`); a 405 with `Allow` when it has none."""
    if method in route.methods or method == "OPTIONS":
        return method
    if method == "HEAD" and _head_as_get(route):
        return "GET"
    allow = allow_header(route)
    raise HTTPError(405, f"method {method} not allowed; use {allow.decode()}", ((b"allow", allow),))


def allow_header(route: Route) -> bytes:
    """`route`'s methods as an `Allow` header says them (RFC 9110 §10.2.1): its own,
    HEAD where `allowed` answers it as GET, and OPTIONS."""
    methods = list(route.methods)
    if "HEAD" not in methods and _head_as_get(route):
        methods.append("HEAD")
    methods.append("OPTIONS")
    return ", ".join(methods).encode()


def _head_as_get(route: Route) -> bool:
    return route.methods == ("GET",) and route.head_as_get
