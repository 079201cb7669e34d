"""GET /api/v1/virtual-servers.csv: one row per real server, as HAProxy's `show stat`
(SPEC §24), written from the same document as /api/v1/virtual-servers by the csv
module, so a name with a comma, a quote or a line break stays one field."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from typing import Any

__all__ = ["AGENT_COLUMNS", "COLUMNS", "CONTENT_TYPE", "VIRTUAL_SERVER_COLUMNS", "stat_csv"]

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
    # Appended, not inserted, so that the columns above keep their places.
    "ejected_until": _get("ejected_until"),  # outlier detection: not picked until then
}
# Of the virtual server, repeated on each of its rows (as `virtual_server`): 1 while in
# panic (too few servers up: every enabled one is offered as if up), else 0.
VIRTUAL_SERVER_COLUMNS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "panic": lambda vs: int(bool(vs.get("panic"))),
}
# What the agent check last said (HAProxy's agent_status and agent_desc); empty: no agent.
AGENT_COLUMNS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "agent_state": _get("agent", "state"),
    "agent_weight_percent": _get("agent", "weight_percent"),
    "agent_reason": _get("agent", "reason"),
}


def stat_csv(document: dict[str, Any]) -> bytes:
    """The CSV of a /api/v1/virtual-servers document: a header row, then one row per
    real server (an empty field: none, e.g. no check yet, no limit)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(["virtual_server", *COLUMNS, *VIRTUAL_SERVER_COLUMNS, *AGENT_COLUMNS])
    for vs in document.get("virtual_servers", []):
        of_vs = [read(vs) for read in VIRTUAL_SERVER_COLUMNS.values()]
        for rs in vs.get("real_servers", []):
            writer.writerow(
                [
                    vs.get("name"),
                    *(read(rs) for read in COLUMNS.values()),
                    *of_vs,
                    *(read(rs) for read in AGENT_COLUMNS.values()),
                ]
            )
    return out.getvalue().encode()
