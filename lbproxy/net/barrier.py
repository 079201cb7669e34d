"""The exception barrier: a bug in one unit of work ends that unit only.

A unit is one connection, one health check, one SNMP poll, one locate, one admin
request, one deadline or reactor callback. Whatever the unit's own error handling does
not expect (anything but the OSErrors and timeouts it handles) is caught at the unit's
edge by the code that owns it, which closes what the unit held and calls `record()`:
the failure is counted in `lbproxy_internal_errors_total{where}` and logged with its
traceback at most once a minute per `where` (a bug hit by every connection must not
turn the log into the bottleneck); the accept loop and every other unit go on. Erlang's
"let it crash" with the supervisor in the same frame, or HAProxy's per-stream error
handling: one stream's fault is never the process's.

The counts belong to the trio run (each in-process Server, each worker process, has its
own), read by the metrics collector at scrape time. A `try` around code that already
runs costs nothing in CPython 3.11 while nothing raises (zero-cost exceptions), so the
barrier adds nothing to the hot path.
"""

from __future__ import annotations

import contextlib
import logging
import time

import trio

__all__ = ["WHERE", "InternalErrors", "internal_errors", "record"]

log = logging.getLogger("lbproxy.internal")

# The `where` label's values, each a kind of unit (all exported, zero until it happens).
WHERE = (
    "accept",  # the accept loop, between accept() and the handler
    "connection",  # a client connection, before its end (pick, take, connect, PROXY, pump start)
    "connection_end",  # a connection's end: counting, access log, the lease
    "pump",  # the reactor moving a connection's bytes
    "deadline",  # a deadline's callback (idle timeouts, UDP's sweep, the pumps' idle timer)
    "route",  # the SNI pre-read of a shared address
    "check",  # one health check
    "poll",  # one SNMP poll (the poller restarts)
    "locate",  # one locator answer (HTTP or DNS)
    "request",  # one admin HTTP request or connection
)
LOG_INTERVAL = 60.0  # seconds between two tracebacks for one `where`


class InternalErrors:
    """The counts and the log limiter of one run."""

    __slots__ = ("_logged", "counts")

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(WHERE, 0)
        self._logged: dict[str, float] = {}

    def record(
        self, where: str, exc: BaseException, what: str = "", logger: logging.Logger | None = None
    ) -> None:
        self.counts[where] = self.counts.get(where, 0) + 1
        now = time.monotonic()
        last = self._logged.get(where)
        if last is not None and now - last < LOG_INTERVAL:
            return
        self._logged[where] = now
        (logger or log).error(
            "%s failed: an internal error in one %s, which ended it only (logged at most "
            "once a minute, counted in lbproxy_internal_errors_total{where=%r})",
            what or where,
            where,
            where,
            exc_info=(type(exc), exc, exc.__traceback__),
        )


_current: trio.lowlevel.RunVar[InternalErrors] = trio.lowlevel.RunVar("lbproxy_internal_errors")
_outside_trio = InternalErrors()  # a caller with no trio run (tools, threads)


def internal_errors() -> InternalErrors:
    """The current run's counts (created on first use)."""
    try:
        return _current.get()
    except LookupError:
        errors = InternalErrors()
        _current.set(errors)
        return errors
    except RuntimeError:  # not in a trio run
        return _outside_trio


def record(
    where: str, exc: BaseException, what: str = "", logger: logging.Logger | None = None
) -> None:
    """Count and (rate-limited) log a failure that ended one unit. Never raises."""
    with contextlib.suppress(Exception):  # the logging machinery itself failed
        internal_errors().record(where, exc, what, logger)
