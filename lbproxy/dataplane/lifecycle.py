"""A client connection's states, the transitions between them as data, and `INTO`, the
one way a connection changes state.

    admitted -> preread -> queued -> picked -> connecting -> established -> closing -> ended

h11's `_state.py` is the model: the table says which transitions exist, and a state
change that is not in it raises instead of going unnoticed. Every state change is

    c.state = INTO[new][c.state]

`INTO[new]` maps each state TRANSITIONS lets into `new` to `new`, so a transition the
table lacks raises KeyError (the state the connection was in) on the line that names the
state it was to enter. In production that is a bug in the lifecycle's code: the
connection's exception barrier (dataplane/connection.py) counts it in
`lbproxy_internal_errors_total{where="connection"}` and ends that connection only. What
each state does, and when it waits, is dataplane/connection.py's; the states are
`Handler`'s steps there.

Why a lookup and not a function: a connection changes state five times from admitted to
ended, on the path every connection takes, and in CPython a call to a Python function
costs several times this lookup before its body has even run; measured, the calls alone
were most of what the lifecycle may cost a connection (the figures are in the commit
that made this change). A lookup in a plain dict is specialized by the interpreter and
allocates nothing.
"""

from __future__ import annotations

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

# INTO[new][old] is `new` for every transition old -> new in TRANSITIONS; any other old
# is missing (KeyError).
INTO: tuple[dict[int, int], ...] = tuple(
    {old: new for old in range(len(STATES)) if new in TRANSITIONS[old]}
    for new in range(len(STATES))
)
