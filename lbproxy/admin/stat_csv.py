"""GET /api/v1/virtual-servers.csv: one row per real server, as HAProxy's `show stat`
(SPEC §24), written from the same document as /api/v1/virtual-servers by the csv
module, so a name with a comma, a quote or a line break stays one field."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from typing import Any

__all__ = ["COLUMNS", "CONTENT_TYPE", "stat_csv"]

CONTENT_TYPE = "text/csv; charset=utf-8"


def _get(*keys: str) -> Callable[[dict[str, Any]], Any]:
    def read(rs: dict[str, Any]) -> Any:
        value: Any = rs
        for key in keys:
            if not isinstance(value, dict):
                return None
            value = value.get(key)
        return value

    return read


# column -> how it is read from a real server's document
COLUMNS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "real_server": _get("name"),
    "address": _get("address"),
    "state": _get("state"),
    "health": _get("health"),
    "since": _get("since"),
    "downtime_s": _get("downtime_s"),
    "weight": _get("weight", "effective"),
    "active_connections": _get("active_connections"),
    "max_connections": _get("max_connections"),
    "connections_total": _get("connections_total"),
    "rate": _get("rate", "current"),
    "rate_max": _get("rate", "max"),
    "bytes_in": _get("bytes_in"),
    "bytes_out": _get("bytes_out"),
    "connect_refused": _get("errors", "connect_refused"),
    "connect_timeout": _get("errors", "connect_timeout"),
    "connect_error": _get("errors", "connect_error"),
    "reset": _get("errors", "reset"),
    "check_result": _get("check", "result"),
    "check_reason": _get("check", "reason"),
}


def stat_csv(document: dict[str, Any]) -> bytes:
    """The CSV of a /api/v1/virtual-servers document: a header row, then one row per
    real server (an empty field: none, e.g. no check yet, no limit)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(["virtual_server", *COLUMNS])
    for vs in document.get("virtual_servers", []):
        for rs in vs.get("real_servers", []):
            writer.writerow([vs.get("name"), *(read(rs) for read in COLUMNS.values())])
    return out.getvalue().encode()
