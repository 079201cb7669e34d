"""The process's descriptor budget: how many clients it serves at once (`global.max_clients`).

Clients are what can run a process out of descriptors: outsiders open them, as many as
they like. Everything else that needs a descriptor -- the admin endpoint, health checks,
SNMP polls, the DNS locator, Redis, a reload's new listening socket -- is few and ours.
So the data plane counts its clients and, beyond `max_clients`, closes a new one at
accept (`lbproxy_rejected_connections_total{reason="max_clients"}`), which keeps a
reserve of descriptors free for the rest; clients are served again as soon as some
leave. HAProxy's `maxconn` (derived from `ulimit -n` the same way when unset) and
nginx's `worker_connections` are the same idea.

A client counts from its accept (`clients.open`, raised when its connection is made and
lowered by its end, or while an SNI address pre-reads it) to its end. The accept batch
(accept.py, compiled and pure) compares `open` with `limit` before it hands a client
over: an integer compare per accepted client, nothing per chunk.

The default (`auto`) is derived from RLIMIT_NOFILE, which `lbproxy run` has raised to its
hard limit by then, so that with every client holding all the descriptors it can hold a
reserve of 10 % of the limit, at least `MIN_RESERVE`, stays free. A client holds at most:
its socket, the real server's, and while a spliced chunk waits for a slow reader one
pipe (two descriptors) per direction -- six; a pipe goes back to the pool once its chunk
is written (pump.py), and the pool itself keeps at most `MAX_IDLE_PIPES` pipes. Each
process has its own descriptor table and its own limit: with `workers: N` each worker
derives (or takes) its own `max_clients`.
"""

from __future__ import annotations

import logging
import sys
import time

from lbproxy.net.compiled import cpump
from lbproxy.net.pump import MAX_IDLE_PIPES, splice_available

__all__ = [
    "MIN_RESERVE",
    "ClientCount",
    "apply_max_clients",
    "clients",
    "default_max_clients",
    "descriptors_per_client",
    "note_refused",
]

log = logging.getLogger("lbproxy.descriptors")

# Descriptors kept free for everything that is not a client: 10 % of the limit, at least
# this many.
MIN_RESERVE = 64
RESERVE_SHARE = 0.10
# A client's own socket and the real server's.
SOCKETS_PER_CLIENT = 2
# While the limit refuses clients, a warning at most this often (seconds).
WARN_EVERY = 60.0
# `auto` below this many clients: the open-file limit is worth a warning.
FEW_CLIENTS = 100
# No limit: more than any descriptor table holds (and what ClientCount starts with).
UNLIMITED = sys.maxsize


class ClientCount:
    """The pure path's client count (the compiled path's is ``_cpump.ClientCount``, the
    same two integers read by the C accept batch): `open` clients, at most `limit`."""

    __slots__ = ("limit", "open")

    def __init__(self) -> None:
        self.open = 0
        self.limit = UNLIMITED


# The process's one count, shared by every listener and every connection.
clients: ClientCount = cpump.ClientCount() if cpump is not None else ClientCount()


def descriptors_per_client(splice: bool) -> int:
    """The most descriptors one client holds: two sockets, and with splice a pipe (two
    descriptors) per direction while a chunk waits."""
    return SOCKETS_PER_CLIENT + (4 if splice else 0)


def default_max_clients(nofile: int, splice: bool) -> int:
    """`max_clients: auto` for an open-file limit of `nofile`: every client at its most
    (`descriptors_per_client`), the pipe pool full, and the reserve still free. At least
    1 (a limit too low for the reserve is warned about, not refused)."""
    reserve = max(MIN_RESERVE, int(nofile * RESERVE_SHARE))
    pooled = 2 * MAX_IDLE_PIPES if splice else 0
    return max(1, (nofile - reserve - pooled) // descriptors_per_client(splice))


def _nofile() -> int | None:
    """This process's soft RLIMIT_NOFILE, None when unlimited or unknown."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def apply_max_clients(configured: int | None) -> int:
    """Set the process's limit from `global.max_clients` (None: `auto`); at start and at
    every reload (logged when it changes). Returns the limit set (`UNLIMITED` when the
    open-file limit is)."""
    nofile = _nofile()
    splice = splice_available()
    if configured is None:
        limit = UNLIMITED if nofile is None else default_max_clients(nofile, splice)
        if limit == clients.limit:
            return limit
        if nofile is not None:
            log.info(
                "max_clients %d (open-file limit %d, up to %d descriptors a client)",
                limit,
                nofile,
                descriptors_per_client(splice),
            )
            if limit < FEW_CLIENTS:
                log.warning(
                    "the open-file limit (%d) is low: %d clients at most; raise it "
                    "(LimitNOFILE=, ulimit -n) to serve more",
                    nofile,
                    limit,
                )
    else:
        limit = configured
        if limit == clients.limit:
            return limit
        log.info("max_clients %d", limit)
        if nofile is not None and configured > default_max_clients(nofile, splice):
            log.warning(
                "max_clients %d: with up to %d descriptors a client, the open-file limit "
                "(%d) may run out before it; health checks and the admin endpoint then "
                "fail too (auto would be %d)",
                configured,
                descriptors_per_client(splice),
                nofile,
                default_max_clients(nofile, splice),
            )
    clients.limit = limit
    return limit


_last_warning = -WARN_EVERY
_refused_since = 0


def note_refused() -> None:
    """A client was closed at accept for `max_clients`: logged at most every
    `WARN_EVERY` seconds, with how many since the last line."""
    global _last_warning, _refused_since
    _refused_since += 1
    now = time.monotonic()
    if now - _last_warning >= WARN_EVERY:
        log.warning(
            "max_clients (%d) reached: %d new client(s) closed at accept since the last such line",
            clients.limit,
            _refused_since,
        )
        _last_warning = now
        _refused_since = 0
