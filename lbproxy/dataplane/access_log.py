"""The access log: one INFO line per connection (TCP) or session (UDP) on logger
`lbproxy.access`, written when it ends, only when `access_log: true`.

The line is HAProxy's `option tcplog` in spirit: who, where to, how much, how long, how
it ended. With `log_format: text` it is the message; with `log_format: json` the same
facts are also fields of the record's object (runtime/logs.py merges in what
`record.fields(record.created)` returns), which is what `lbproxy simulate --replay` reads:

    start           when the connection was accepted: ISO 8601, UTC, microseconds
    duration_s      seconds from accept to end (float)
    client          the client's address (the PROXY header's, with accept_proxy)
    client_port     its port (int)
    virtual_server  the virtual server's name
    real_server     the real server's name, null when none was reached
    bytes_in        bytes from the client to the real server
    bytes_out       bytes from the real server to the client
    end             how it ended (closed, client_reset, server_reset, idle_timeout, ...;
                    no_server when none could take it; rejected:REASON when refused
                    before a pick: throttle, per_source, max_connections, acl, ...)
    protocol        tcp or udp

The record's own `time` is when the line was written: the end.
"""

from __future__ import annotations

import logging
import time

access_log = logging.getLogger("lbproxy.access")

_gmtime = time.gmtime
_strftime = time.strftime


def iso_utc(wall: float) -> str:
    """`wall` (seconds since the epoch) as ISO 8601 in UTC with microseconds."""
    seconds = int(wall)
    micros = round((wall - seconds) * 1_000_000)
    if micros == 1_000_000:
        seconds, micros = seconds + 1, 0
    return f"{_strftime('%Y-%m-%dT%H:%M:%S', _gmtime(seconds))}.{micros:06d}Z"


class _Fields:
    """The line's facts as the JSON formatter wants them: called only by it, with the
    record's time (the end), so with `log_format: text` the ISO time and the mapping are
    never made, and a JSON line's `start` plus `duration_s` is its `time` exactly."""

    __slots__ = ("args",)

    def __init__(self, args: tuple) -> None:
        self.args = args

    def __call__(self, written: float) -> dict[str, object]:
        host, port, vs, rs, bytes_in, bytes_out, duration, end, protocol = self.args
        return {
            "start": iso_utc(written - duration),
            "duration_s": round(duration, 6),
            "client": str(host),
            "client_port": port,
            "virtual_server": vs,
            "real_server": rs,
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
            "end": end,
            "protocol": protocol,
        }


def write(
    peer: tuple,
    virtual_server: str,
    real_server: str | None,
    bytes_in: int,
    bytes_out: int,
    duration: float,
    end: str,
    protocol: str = "tcp",
) -> None:
    """Write one access line for a connection that ended just now and lasted `duration`
    seconds (on the run's monotonic clock; its start on the wall clock is the record's
    time minus that). Callers check the virtual server's `access_log` first: when it is off, this
    is never called and costs nothing."""
    host, port = peer[0], peer[1]
    shown = f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    args = (host, port, virtual_server, real_server, bytes_in, bytes_out, duration, end, protocol)
    access_log.info(
        "%s vs=%s rs=%s in=%d out=%d duration=%.3fs end=%s",
        shown,
        virtual_server,
        real_server or "-",
        bytes_in,
        bytes_out,
        duration,
        end,
        extra={"fields": _Fields(args)},
    )
