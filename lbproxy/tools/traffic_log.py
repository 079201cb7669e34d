"""Traffic logs for `lbproxy simulate --replay`: one logged connection per line, read
into when it started, how long it lasted, the virtual server it came to and its client.

PURE (no clock, no sockets). Two formats:

- `lbproxy`: lbproxy's own JSON access log (`log_format: json`, `access_log: true`;
  lbproxy/dataplane/access_log.py writes it). Records of other loggers in the same
  stream are skipped, not malformed.
- `haproxy`: HAProxy's `option tcplog` line, as HAProxy writes it with `log stdout
  format raw` or through syslog (any prefix before the client address is ignored):

      127.0.0.1:45544 [05/Dec/2026:17:22:52.799] fe web/a 1/-1/3005 0 SC 2/2/1/0/3 0/0

  client:port [accept date] frontend backend/server Tw/Tc/Tt bytes_read termination ...
  The backend's name is the virtual server's (`BACKEND-FRONTEND` when the configuration
  has one by that name: `lbproxy import` names so the copy of a backend one frontend
  uses alone, when frontends sharing it take clients differently); the accept date is
  the start and Tt (ms, `+Tt` with `option logasap`) the duration. HAProxy writes the
  accept date in its local time without a zone: it is read as UTC, which changes no
  interval between two lines unless the log spans a daylight-saving change.

A parser returns a `Logged`, None for a line that is not a connection (blank, another
logger's record), or a `Malformed` saying what is wrong with it. It never raises.
"""

from __future__ import annotations

import calendar
import json
import math
import re
from datetime import datetime
from typing import Any, NamedTuple

FORMATS = ("lbproxy", "haproxy")
MAX_LINE = 65536  # longer lines are malformed without being looked at
_SHOWN = 80  # a malformed line's text is quoted up to this many characters
_decode = json.JSONDecoder().decode  # json.loads without its per-call checks


class Logged(NamedTuple):
    start: float  # seconds since the epoch
    duration: float  # seconds, >= 0
    virtual_server: str
    client: str  # the source address
    client_port: int  # 0: not logged
    frontend: str = ""  # HAProxy's frontend ("" in lbproxy's own log)


class Malformed(NamedTuple):
    reason: str


Parsed = Logged | Malformed | None


# A JSON string without escapes or control characters, and one with any valid escapes
_PLAIN = r'"([^"\\\x00-\x1f]*)"'
_ANY_STRING = r'"[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*"'
_NUMBER = r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?"
# The whole of an access line exactly as lbproxy writes it (runtime/logs.py and
# dataplane/access_log.py: its keys in that order, json.dumps' separators). Such a line
# is valid JSON by construction, so its fields are read without decoding the rest: the
# decoding is most of the parsing's cost. Any other line (reordered by a log pipeline,
# an escaped name, another logger) takes json's decoder.
_ACCESS_LINE = re.compile(
    r'\{"time": ' + _ANY_STRING
    + r', "level": "info", "logger": "lbproxy\.access", "message": ' + _ANY_STRING
    + r', "start": "(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})\.(\d{6})Z"'
    + r', "duration_s": (' + _NUMBER + r")"
    + r', "client": ' + _PLAIN.replace("*", "+")
    + r', "client_port": (0|[1-9]\d{0,4})'
    + r', "virtual_server": ' + _PLAIN.replace("*", "+")
    + r', "real_server": (?:null|' + _ANY_STRING + r")"
    + r', "bytes_in": \d+, "bytes_out": \d+, "end": ' + _ANY_STRING
    + r', "protocol": ' + _ANY_STRING + r"\}"
)  # fmt: skip


def parse_lbproxy(line: str) -> Parsed:
    """One line of lbproxy's JSON log."""
    text = line.strip()
    if not text:
        return None
    if len(text) > MAX_LINE:
        return Malformed(f"longer than {MAX_LINE} characters")
    match = _ACCESS_LINE.fullmatch(text)
    if match is not None:
        second, micros, duration, client, port, vs = match.groups()
        base = _utc_second(second)
        seconds = float(duration)
        if base is not None and 0 <= seconds < math.inf and int(port) <= 65535:
            return Logged(base + int(micros) / 1e6, seconds, vs, client, int(port))
    return parse_lbproxy_decoding(text)


def parse_lbproxy_decoding(text: str) -> Parsed:
    """One line of lbproxy's JSON log (stripped, not too long), decoded as JSON: any
    JSON object with the fields, in any order."""
    try:
        record = _decode(text)
    except (ValueError, RecursionError):
        return Malformed(f"not a JSON object: {_quoted(text)}")
    if not isinstance(record, dict):
        return Malformed(f"not a JSON object: {_quoted(text)}")
    logger = record.get("logger")
    if logger is not None and logger != "lbproxy.access":
        return None  # lbproxy's other lines, in the same stream
    start = record.get("start")
    if not isinstance(start, str):
        return Malformed(_missing("start", record, "an ISO 8601 time"))
    started = _iso_seconds(start)
    if started is None:
        return Malformed(f"start is not an ISO 8601 time: {_quoted(start)}")
    duration = _seconds(record.get("duration_s"))
    if duration is None:
        return Malformed(_missing("duration_s", record, "a number of seconds >= 0"))
    vs = record.get("virtual_server")
    if not isinstance(vs, str) or not vs:
        return Malformed(_missing("virtual_server", record, "a name"))
    client = record.get("client")
    if not isinstance(client, str) or not client:
        return Malformed(_missing("client", record, "an address"))
    port = record.get("client_port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        return Malformed(f"client_port is not a port: {_quoted(repr(port))}")
    return Logged(started, duration, vs, client, port)


_TCPLOG = re.compile(
    r"(?P<client>[^\s\[\]]+):(?P<port>\d{1,5}) "
    r"\[(?P<date>\d{2}/[A-Z][a-z]{2}/\d{4}:\d{2}:\d{2}:\d{2})\.(?P<ms>\d{3})\] "
    r"(?P<frontend>[^\s~]+)~? (?P<backend>[^\s/]+)/\S+ "
    r"-?\d+/-?\d+/\+?(?P<tt>-?\d+) \+?\d+ \S\S"
    r"(?: |$)"
)
_MONTHS = {
    name: number
    for number, name in enumerate(
        ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), 1
    )
}


def parse_haproxy(line: str) -> Parsed:
    """One line of HAProxy's `option tcplog` output (with or without a syslog header)."""
    text = line.strip()
    if not text:
        return None
    if len(text) > MAX_LINE:
        return Malformed(f"longer than {MAX_LINE} characters")
    match = _TCPLOG.search(text)
    if match is None:
        return Malformed(f"not an HAProxy tcplog line: {_quoted(text)}")
    second = _haproxy_second(match["date"])
    if second is None:
        return Malformed(f"no such date: {match['date']}")
    total_ms = int(match["tt"])
    if total_ms < 0:
        return Malformed(f"no total time (Tt {total_ms}): {_quoted(text)}")
    port = int(match["port"])
    if port > 65535:
        return Malformed(f"client port {port} out of range")
    start = second + int(match["ms"]) / 1000
    return Logged(
        start, total_ms / 1000, match["backend"], match["client"], port, match["frontend"]
    )


PARSERS = {"lbproxy": parse_lbproxy, "haproxy": parse_haproxy}

_seconds_cache: dict[str, float | None] = {}
_utc_cache: dict[str, float | None] = {}


def _utc_second(text: str) -> float | None:
    """`2026-12-05T17:22:52` (UTC) as seconds since the epoch, None if no such time;
    cached, as _haproxy_second."""
    cached = _utc_cache.get(text, -1.0)
    if cached != -1.0:
        return cached
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        value = None
    else:
        value = float(calendar.timegm(moment.timetuple()))
    if len(_utc_cache) > 100_000:
        _utc_cache.clear()
    _utc_cache[text] = value
    return value


def _haproxy_second(date: str) -> float | None:
    """`05/Dec/2026:17:22:52` as seconds since the epoch (read as UTC), None if no such
    date. A log has few distinct seconds per line: cached."""
    cached = _seconds_cache.get(date, -1.0)
    if cached != -1.0:
        return cached
    day, month_name, rest = date.split("/")
    year, hour, minute, sec = rest.split(":")
    month = _MONTHS.get(month_name)
    value: float | None = None
    if month is not None:
        try:
            moment = datetime(int(year), month, int(day), int(hour), int(minute), int(sec))
        except ValueError:
            pass
        else:
            value = float(calendar.timegm(moment.timetuple()))
    if len(_seconds_cache) > 100_000:
        _seconds_cache.clear()
    _seconds_cache[date] = value
    return value


def _iso_seconds(text: str) -> float | None:
    """An ISO 8601 time as seconds since the epoch; without a zone, UTC."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        return calendar.timegm(moment.timetuple()) + moment.microsecond / 1e6
    try:
        return moment.timestamp()
    except (OverflowError, OSError, ValueError):
        return None


def _seconds(value: Any) -> float | None:
    """A JSON number of seconds >= 0 as a float; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        seconds = float(value)
    except OverflowError:  # an integer too large for a float
        return None
    return seconds if 0 <= seconds < math.inf else None


def _missing(key: str, record: dict[str, Any], what: str) -> str:
    if key not in record:
        return f"no {key}"
    return f"{key} is not {what}: {_quoted(repr(record[key]))}"


def _quoted(text: str) -> str:
    shown = text if len(text) <= _SHOWN else text[:_SHOWN] + "..."
    return shown.encode("unicode_escape").decode("ascii")
