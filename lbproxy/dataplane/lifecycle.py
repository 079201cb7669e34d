"""A client connection's states, the transitions between them as data, and `enter`,
the one way a connection changes state.

    admitted -> preread -> queued -> picked -> connecting -> established -> closing -> ended

h11's `_state.py` is the model: the table says which transitions exist, and a state
change that is not in it raises (`IllegalTransition`) instead of going unnoticed. In
production that exception is a bug in the lifecycle's code: the connection's exception
barrier (dataplane/connection.py) counts it in `lbproxy_internal_errors_total{where=
"connection"}` and ends that connection only. What each state does, and when it waits,
is dataplane/connection.py's; the states are `Handler`'s steps there.

`enter` runs five times per connection on the way from admitted to ended, so its check
is two tuple indexes into a matrix of booleans made from the table once: no allocation,
and cheaper than a frozenset membership test.
"""

from __future__ import annotations

from typing import Protocol

# -- the states ----------------------------------------------------------------------
#
# Small ints (a state is stored and compared on every connection: no enum lookups).
ADMITTED = 0  # accepted and counted in pool.clients; the throttle asked
PREREAD = 1  # waiting for the PROXY header (accept_proxy); then the ACL, max_connections
QUEUED = 2  # waiting in the virtual server's queue for a free server
PICKED = 3  # a real server picked and its lease taken
CONNECTING = 4  # resolving its address or connecting; a failure goes back to a pick
ESTABLISHED = 5  # connected: the pump moves the bytes (no task) until it ends
CLOSING = 6  # end() is running: counting, the access log, the lease, the descriptors
ENDED = 7  # counted once; nothing left

STATES = (
    "admitted",
    "preread",
    "queued",
    "picked",
    "connecting",
    "established",
    "closing",
    "ended",
)

# Every transition a connection may make, as data (h11's `_state.py` is the model); the
# unit tests drive each one and check every step a connection takes against this table.
# Any live state may end (-> closing): a rejection, no server, a drain, a bug.
TRANSITIONS: dict[int, frozenset[int]] = {
    ADMITTED: frozenset({PREREAD, QUEUED, PICKED, CLOSING}),
    PREREAD: frozenset({QUEUED, PICKED, CLOSING}),
    QUEUED: frozenset({PICKED, CLOSING}),
    PICKED: frozenset({CONNECTING, CLOSING}),
    CONNECTING: frozenset({PICKED, ESTABLISHED, CLOSING}),  # -> picked: a retry
    ESTABLISHED: frozenset({CLOSING}),
    CLOSING: frozenset({ENDED}),
    ENDED: frozenset(),
}

# The states that may wait, each in the connection's task (a connection that waits for
# nothing has no task): the PROXY header, a free server, a name or a connect in progress.
WAITING = frozenset({PREREAD, QUEUED, CONNECTING})

# TRANSITIONS as a matrix, _ALLOWED[old][new]: what `enter` reads.
_ALLOWED: tuple[tuple[bool, ...], ...] = tuple(
    tuple(new in TRANSITIONS[old] for new in range(len(STATES))) for old in range(len(STATES))
)


class Stateful(Protocol):
    state: int


class IllegalTransition(RuntimeError):
    """A state change TRANSITIONS does not allow: a bug in the lifecycle's code."""

    def __init__(self, old: int, new: int) -> None:
        super().__init__(f"{STATES[old]} -> {STATES[new]} is not in TRANSITIONS")
        self.old = old
        self.new = new


def enter(c: Stateful, new: int) -> None:
    """Move `c` to state `new`, if TRANSITIONS allows it from the state it is in; else
    raise IllegalTransition and leave `c` as it was. The caller's exception barrier
    counts that as a bug."""
    if _ALLOWED[c.state][new]:
        c.state = new
    else:
        raise IllegalTransition(c.state, new)
