"""A client connection's states and the transitions between them, as data.

The lifecycle itself -- what each state does, and when it waits -- is
dataplane/connection.py's; this is its table.
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
