"""The admin API client behind `lbproxy status`, `set-weight`, `drain`, ... (stdlib HTTP).

Errors come back as `AdminError` with a message a user can act on: the endpoint is down,
the token is missing or wrong, the server or real server does not exist.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

DEFAULT_ADMIN = "http://127.0.0.1:9100"


class AdminError(Exception):
    """A message a user can act on; `status` and `document`: the API's answer, if any."""

    def __init__(
        self, message: str, status: int | None = None, document: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.document = document or {}


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
            raise AdminError(f"cannot read token file {token_file}: {exc.strerror}") from None
    return os.environ.get("LBPROXY_TOKEN") or None


class AdminClient:
    def __init__(self, url: str, token: str | None = None, timeout: float = 10.0) -> None:
        self.url = url
        self.token = token
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            document = self._document(exc)
            raise AdminError(self._explain(exc, document), exc.code, document) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AdminError(
                f"cannot reach the lbproxy admin endpoint at {self.url}: {reason} "
                "(is lbproxy running? set --admin or $LBPROXY_ADMIN)"
            ) from None

    @staticmethod
    def _document(exc: urllib.error.HTTPError) -> dict[str, Any]:
        try:
            document = json.loads(exc.read())
        except ValueError:
            return {}
        return document if isinstance(document, dict) else {}

    @staticmethod
    def _explain(exc: urllib.error.HTTPError, document: dict[str, Any]) -> str:
        message = document.get("error", exc.reason)
        errors = document.get("errors") or []
        hint = {
            401: " (give --token-file or set $LBPROXY_TOKEN)",
            403: " (check the token, or run from the proxy's host)",
        }.get(exc.code, "")
        return "\n".join([f"HTTP {exc.code}: {message}{hint}", *errors])

    def status(self) -> dict[str, Any]:
        return self.request("GET", "/api/v1/virtual-servers")

    def patch(self, vs: str, rs: str, change: dict[str, Any]) -> dict[str, Any]:
        path = (
            f"/api/v1/virtual-servers/{urllib.parse.quote(vs, safe='')}"
            f"/real-servers/{urllib.parse.quote(rs, safe='')}"
        )
        return self.request("PATCH", path, change)

    def reload(self) -> dict[str, Any]:
        return self.request("POST", "/api/v1/reload", {})

    def upgrade(self, config: list[str]) -> dict[str, Any]:
        """POST /api/v1/upgrade: answered once the new process is ready or has failed."""
        return self.request("POST", "/api/v1/upgrade", {"config": config} if config else {})
