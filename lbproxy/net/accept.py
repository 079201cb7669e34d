"""Accepting connections: the errnos that mean "out of capacity", and the back-off.

One table and one back-off for every accept loop (the proxy's listeners, the admin
endpoint, the DNS locator's TCP side) and for the connects that can run out the same
way (health checks, connects to real servers). trio's serve_listeners is the model
(ACCEPT_CAPACITY_ERRNOS in _highlevel_serve_listeners.py): out of descriptors or memory,
an accept back off and retries -- never crash, never spin. The pending connection stays
in the kernel's backlog and is served once a slot frees up.
"""

from __future__ import annotations

import errno
import logging

import trio

__all__ = ["ACCEPT_BACKOFF", "ACCEPT_BATCH", "CAPACITY_ERRNOS", "AcceptErrors"]

# Out of descriptors (this process's or the system's) or of kernel memory.
CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
# The listening socket was closed (a reload, a stop): the loop ends.
CLOSED_ERRNOS = frozenset({errno.EBADF, errno.EINVAL})
ACCEPT_BACKOFF = 0.1  # seconds between two accepts while out of capacity
# Connections accepted per wake-up, at most, before the accept loop lets other tasks run:
# it accepts until the backlog is empty (EAGAIN) or this many, so a burst of arrivals
# costs one trio wait and one scheduler round instead of one each (each round is an
# epoll_wait), and a flood still cannot starve established connections.
ACCEPT_BATCH = 16
# A burst of capacity errors ends (and "accepting again" is logged, once) only when an
# accept succeeds this long after the last error: at the limit, every freed descriptor
# lets one accept through between errors, which is still the same burst.
ACCEPT_BURST_QUIET = 1.0


class AcceptErrors:
    """What one accept loop does when accept() fails, and when it works again.

    The loop calls `failed(exc)` on an OSError (False: the socket is closed, stop) and,
    after a success, `recovered()` only while `burst` is non-zero (an attribute test on
    the per-connection path, nothing more).
    """

    __slots__ = ("burst", "last_error", "log", "name")

    def __init__(self, name: str, logger: logging.Logger) -> None:
        self.name = name
        self.log = logger
        self.burst = 0  # capacity errors in the current burst; 0: no burst
        self.last_error = 0.0

    async def failed(self, exc: OSError) -> bool:
        if exc.errno in CAPACITY_ERRNOS:
            if not self.burst:
                self.log.error(
                    "%s: accept failed (%s); retrying every %ss",
                    self.name,
                    exc.strerror,
                    ACCEPT_BACKOFF,
                )
            self.burst += 1
            self.last_error = trio.current_time()
            await trio.sleep(ACCEPT_BACKOFF)
            return True
        if exc.errno in CLOSED_ERRNOS:
            return False
        self.log.warning("%s: accept failed: %s", self.name, exc)
        await trio.lowlevel.checkpoint()
        return True

    def recovered(self) -> None:
        if trio.current_time() - self.last_error >= ACCEPT_BURST_QUIET:
            self.log.info(
                "%s: accepting again (%d accept failure(s) in that burst)", self.name, self.burst
            )
            self.burst = 0
