"""The admin API client behind `lbproxy status`, `set-weight`, `drain`, ... (stdlib HTTP).

How it reaches the endpoint (SPEC §21), chosen once by `connect`:

- `--socket PATH`: that Unix socket, no token.
- else, when `--admin` names this host (a loopback address, a name resolving to one, or
  an address of this host): the admin socket of the lbproxy with that TCP admin port
  (lbproxy/admin/local_socket.py `client_paths`) when one answers, no token; so
  `lbproxy drain web a` works on the host as lbproxy's user or root, with no token.
- else TCP with the token (`--token-file`, else $LBPROXY_TOKEN), which is never sent in
  clear text (http://) to an address that is not loopback unless `--insecure` says so.

http.client, one connection per request: no redirect is ever followed (a 3xx is an
error and the token is not sent again), and the same code speaks HTTP over the Unix
socket. Errors come back as `AdminError` with a message a user can act on: the endpoint
is down, the token is missing or wrong, the server or real server does not exist.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import socket
import ssl
import urllib.parse
from typing import Any

from lbproxy.admin import local_socket

DEFAULT_ADMIN = "http://127.0.0.1:9100"


class AdminError(Exception):
    """A message a user can act on; `status` and `document`: the API's answer, if any."""

    def __init__(
        self, message: str, status: int | None = None, document: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.document = document or {}


class UsageError(AdminError):
    """A request the CLI will not make as given (exit 2): a token in clear text to a
    host that is not loopback, a token file it cannot read, an address it cannot use."""


def admin_url(given: str | None) -> str:
    url = given or os.environ.get("LBPROXY_ADMIN") or DEFAULT_ADMIN
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


def load_token(token_file: str | None) -> str | None:
    """The token from --token-file, else $LBPROXY_TOKEN (which holds the token itself)."""
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as exc:
            raise UsageError(f"cannot read token file {token_file}: {exc.strerror}") from None
    return os.environ.get("LBPROXY_TOKEN") or None


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix socket; "localhost" only fills the Host header."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _addresses(host: str) -> list[str]:
    """The IP addresses `host` (a literal or a name) stands for; [] when it resolves to none."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    return [str(info[4][0]).split("%", 1)[0] for info in infos]


def is_loopback(host: str) -> bool:
    """`host` is a loopback address, or a name every address of which is loopback."""
    addresses = _addresses(host)
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def _is_this_host(host: str) -> bool:
    """`host` stands for this machine: loopback, unspecified, or an address of one of
    its interfaces (an address this process can bind)."""
    addresses = _addresses(host)
    if not addresses:
        return False
    for address in addresses:
        ip = ipaddress.ip_address(address)
        if ip.is_loopback or ip.is_unspecified:
            continue
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((address, 0))
            except OSError:
                return False
    return True


class AdminClient:
    """One admin endpoint, over TCP (`url`, with `token`) or its Unix socket (`socket_path`)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = 10.0,
        *,
        socket_path: str | None = None,
    ) -> None:
        self.url = url
        self.token = None if socket_path else token  # the socket needs none
        self.timeout = timeout
        self.socket_path = socket_path
        self._parts = urllib.parse.urlsplit(url)

    def describe(self) -> str:
        """Which endpoint this client uses, for `status --verbose`."""
        if self.socket_path:
            return f"admin socket {self.socket_path} (no token)"
        token = "with the token" if self.token else "no token"
        return f"admin endpoint {self.url} over TCP ({token})"

    @property
    def where(self) -> str:
        return f"the lbproxy admin socket {self.socket_path}" if self.socket_path else self.url

    def _connection(self) -> http.client.HTTPConnection:
        if self.socket_path:
            return UnixHTTPConnection(self.socket_path, self.timeout)
        parts = self._parts
        if parts.scheme == "https":
            return http.client.HTTPSConnection(
                parts.netloc, timeout=self.timeout, context=ssl.create_default_context()
            )
        if parts.scheme != "http":
            raise UsageError(f"{self.url}: the admin endpoint is http:// or https://")
        return http.client.HTTPConnection(parts.netloc, timeout=self.timeout)

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        target = (self._parts.path.rstrip("/") if not self.socket_path else "") + path
        connection = self._connection()
        try:
            connection.request(method, target, body=data, headers=headers)
            response = connection.getresponse()
            status, raw = response.status, response.read()
            location = response.getheader("Location", "")
        except (OSError, http.client.HTTPException) as exc:
            raise AdminError(self._unreachable(exc)) from None
        finally:
            connection.close()
        if 300 <= status < 400:
            raise AdminError(
                f"HTTP {status}: {self.url} answered with a redirect"
                + (f" to {location}" if location else "")
                + "; lbproxy follows none (give the endpoint's own address with --admin)",
                status,
            )
        if status >= 400:
            document = _document(raw)
            raise AdminError(self._explain(status, document), status, document)
        try:
            return json.loads(raw or b"null")
        except ValueError:
            raise AdminError(f"{self.where} answered HTTP {status} with no JSON") from None

    def _unreachable(self, exc: BaseException) -> str:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        if self.socket_path:
            return (
                f"cannot reach the lbproxy admin socket {self.socket_path}: {reason} "
                "(is lbproxy running? does --socket name its global.admin.socket?)"
            )
        return (
            f"cannot reach the lbproxy admin endpoint at {self.url}: {reason} "
            "(is lbproxy running? set --admin or $LBPROXY_ADMIN)"
        )

    def _explain(self, status: int, document: dict[str, Any]) -> str:
        message = document.get("error", http.client.responses.get(status, "error"))
        # `error` is the one problem of a list of one, or what the list is about
        errors = [error for error in document.get("errors") or [] if error != message]
        if self.socket_path:
            hints = {403: " (run as the user lbproxy runs as, or root)"}
        else:
            hints = {
                401: " (give --token-file or set $LBPROXY_TOKEN)",
                403: " (over TCP: check the token; on the proxy's host the CLI uses the "
                "admin socket by itself, as lbproxy's user or root)",
            }
        return "\n".join([f"HTTP {status}: {message}{hints.get(status, '')}", *errors])

    def status(self) -> dict[str, Any]:
        return self.request("GET", "/api/v1/virtual-servers")

    def patch(self, vs: str, rs: str, change: dict[str, Any]) -> dict[str, Any]:
        path = (
            f"/api/v1/virtual-servers/{urllib.parse.quote(vs, safe='')}"
            f"/real-servers/{urllib.parse.quote(rs, safe='')}"
        )
        return self.request("PATCH", path, change)

    def shutdown_sessions(self, vs: str, rs: str) -> dict[str, Any]:
        """POST .../shutdown-sessions: `{"closed": N}`."""
        path = (
            f"/api/v1/virtual-servers/{urllib.parse.quote(vs, safe='')}"
            f"/real-servers/{urllib.parse.quote(rs, safe='')}/shutdown-sessions"
        )
        return self.request("POST", path, {})

    def explain(self, vs: str, client: str, port: int = 0) -> dict[str, Any]:
        """GET .../explain: where a new connection from `client` would go now."""
        query = urllib.parse.urlencode({"client": client, **({"port": port} if port else {})})
        path = f"/api/v1/virtual-servers/{urllib.parse.quote(vs, safe='')}/explain?{query}"
        return self.request("GET", path)

    def per_source(self, vs: str, limit: int | None = None) -> dict[str, Any]:
        """GET .../per-source: the busiest client networks of `per_source:`'s table."""
        query = f"?limit={limit}" if limit is not None else ""
        return self.request(
            "GET", f"/api/v1/virtual-servers/{urllib.parse.quote(vs, safe='')}/per-source{query}"
        )

    def clear_per_source(self, vs: str, network: str | None = None) -> dict[str, Any]:
        """DELETE .../per-source[/NETWORK]: `{"cleared": N, "kept": K}`. NETWORK is an
        address or ADDRESS/PREFIX, its "/" a path separator (the API takes both)."""
        path = f"/api/v1/virtual-servers/{urllib.parse.quote(vs, safe='')}/per-source"
        if network is not None:
            path += "/" + urllib.parse.quote(network, safe="/:")
        return self.request("DELETE", path)

    def add_server(self, vs: str, entry: dict[str, Any]) -> dict[str, Any]:
        """POST .../real-servers: the new real server's document."""
        path = f"/api/v1/virtual-servers/{urllib.parse.quote(vs, safe='')}/real-servers"
        return self.request("POST", path, entry)

    def remove_server(self, vs: str, rs: str) -> dict[str, Any]:
        """DELETE .../real-servers/RS: `{"removing": true}` while it drains."""
        path = (
            f"/api/v1/virtual-servers/{urllib.parse.quote(vs, safe='')}"
            f"/real-servers/{urllib.parse.quote(rs, safe='')}"
        )
        return self.request("DELETE", path)

    def reload(self, config: list[str] | None = None) -> dict[str, Any]:
        return self.request("POST", "/api/v1/reload", {"config": config} if config else {})

    def upgrade(self, config: list[str]) -> dict[str, Any]:
        """POST /api/v1/upgrade: answered once the new process is ready or has failed."""
        return self.request("POST", "/api/v1/upgrade", {"config": config} if config else {})


def _document(raw: bytes) -> dict[str, Any]:
    try:
        document = json.loads(raw)
    except ValueError:
        return {}
    return document if isinstance(document, dict) else {}


def connect(
    admin: str | None,
    token_file: str | None = None,
    *,
    socket_path: str | None = None,
    insecure: bool = False,
) -> AdminClient:
    """The client a runtime command uses (the module header says how it is chosen).
    UsageError when the token would go in clear text to a host that is not loopback."""
    url = admin_url(admin)
    if socket_path:
        return AdminClient(url, socket_path=socket_path)
    parts = urllib.parse.urlsplit(url)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        raise UsageError(f"{url}: not an address (--admin takes http://HOST:PORT)") from None
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    if host and _is_this_host(host):
        for path in local_socket.client_paths(port):
            if local_socket.connects(path):
                return AdminClient(url, socket_path=path)
    token = load_token(token_file)
    if token and parts.scheme == "http" and not insecure and not is_loopback(host or ""):
        raise UsageError(
            f"not sending the admin token in clear text to {url}, which is not a loopback "
            "address: use https://, an SSH tunnel (ssh -L 9100:127.0.0.1:9100 HOST), or "
            "--insecure"
        )
    return AdminClient(url, token)
