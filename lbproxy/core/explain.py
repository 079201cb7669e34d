"""Where a new connection from one client would go now, and why (SPEC §24 explain).

PURE: no trio, no clock (time is passed in as `now`).

The answer is read off the pool's live state without taking a connection and without
moving anything a pick moves: persistence is looked up without dropping, sweeping or
counting (`Persistence.peek`), and the scheduler is asked through `Scheduler.peek`, its
side-effect-free twin of `pick_for` (the heap schedulers read their minimum without
popping stale entries; maglev reads its table, or computes one it does not keep). In
this code base a pick itself moves no rotation — rr's turn, wrr's deadlines and sap's
accumulated load advance in `on_take`, once a connection is sent — so a peek is the pick
the next connection gets, as long as nothing changes in between.

The one thing done for real is `Pool.advance(now)`: the time-driven steps (slow start,
ejections ending, passive-health trials, load samples) that the next pick would run
first, as every reader of the pool does (`Pool.statistics`).

Costs O(number of servers) per call (a score for each), and nothing on the connection path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lbproxy.core.persistence import client_key
from lbproxy.core.schedulers import format_score

if TYPE_CHECKING:
    from lbproxy.core.pool import Pool, RealServer

# How the pick was made (`Explanation.by`); a keyed scheduler (one that hashes the
# client, maglev) is named itself: its pick follows the client, not the servers' state.
PERSISTENCE, SCHEDULER, BACKUP, QUEUE, REJECT = (
    "persistence",
    "scheduler",
    "backup",
    "queue",
    "reject",
)


@dataclass(frozen=True)
class ServerVerdict:
    name: str
    eligible: bool
    why: str | None  # None when eligible
    score: str | None  # the scheduler's own sort key, formatted; None when not eligible


@dataclass(frozen=True)
class Explanation:
    pick: str | None
    by: str
    servers: tuple[ServerVerdict, ...]
    panic: bool  # the pool offers every enabled server as if up (SPEC §23)

    def document(self) -> dict[str, Any]:
        return {
            "pick": self.pick,
            "by": self.by,
            "panic": self.panic,
            "servers": [
                {"name": s.name, "eligible": s.eligible, "why": s.why, "score": s.score}
                for s in self.servers
            ],
        }


def why_not(pool: Pool, rs: RealServer) -> str | None:
    """Why the scheduler cannot pick `rs` now, or None when it can (it is available)."""
    if rs.available:
        return None
    if rs.removed:
        return "removed"
    if rs.state != "enabled":
        return str(rs.state)  # drain | disabled
    agent = rs.agent
    if agent is not None and agent.down:
        return "agent down"
    if agent is not None and agent.admin != "ready":
        return f"agent {agent.admin}"  # agent drain | agent maint
    if rs.static_weight <= 0:
        return "weight 0"
    if rs.effective_weight <= 0:
        return "dynamic weight 0" if pool.polls_snmp else "weight 0"
    if not rs.health.up and not pool.panic:
        return "down"
    if pool.ejected_until(rs) is not None and not pool.panic:
        return "ejected"
    if rs.full:
        return "full"
    if rs.backup:
        return "backup standby"  # a primary is available
    return "unavailable"


def explain(pool: Pool, client: tuple[Any, ...], now: float, queue: bool = False) -> Explanation:
    """Where a new connection from `client` (`(host, port)`) would go at `now`.

    `queue`: the virtual server has a connection queue (a client finding only full
    servers waits instead of being refused)."""
    pool.advance(now)
    pick: RealServer | None = None
    by = REJECT
    persistence = pool.persistence
    if persistence is not None:
        entry = persistence.peek(client_key(client), now)
        if entry is not None and entry.server.available:
            pick, by = entry.server, PERSISTENCE
    if pick is None:
        pick = pool.scheduler.peek(client if pool.reads_client else None, now)
        if pick is not None:
            by = pool.scheduler.name if pool.scheduler.keyed else SCHEDULER
            if pick.backup:
                by = BACKUP
        elif queue and pool.full_servers:
            by = QUEUE
    verdicts = []
    for rs in pool.servers:
        why = why_not(pool, rs)
        score = None if why is not None else format_score(pool.scheduler.explain(rs))
        verdicts.append(ServerVerdict(rs.name, why is None, why, score))
    return Explanation(None if pick is None else pick.name, by, tuple(verdicts), pool.panic)
