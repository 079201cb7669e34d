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

Before any of that, the admission checks the data path runs on a new client, in its
order (`admission_refusal`): the process at `global.max_clients`, the throttle in digg,
the ACL (`allow`/`deny`), the virtual server's `max_connections`, the client network's
`per_source` limits. Each is read without counting anything (`Throttle.would_refuse`,
`PerSourceTable.would_admit`); the first that refuses answers `by: reject` with its
reason, named as `lbproxy_rejected_total{reason=...}` names it.

The one thing done for real is `Pool.advance(now)`: the time-driven steps (slow start,
ejections ending, passive-health trials, load samples) that the next pick would run
first, as every reader of the pool does (`Pool.statistics`).

Costs O(number of servers) per call (a score for each), and nothing on the connection path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lbproxy.core.client_address import SourceFilter
from lbproxy.core.persistence import client_key
from lbproxy.core.schedulers import format_score

if TYPE_CHECKING:
    from lbproxy.core.per_source import PerSourceTable
    from lbproxy.core.pool import Pool, RealServer
    from lbproxy.core.throttle import Throttle

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
class Admission:
    """The runtime state a TCP virtual server's admission reads beyond its pool and
    configuration: whether the process already holds `global.max_clients` clients, its
    throttle's model and its per-source table (None: it has none)."""

    clients_full: bool = False
    throttle: Throttle | None = None
    per_source: PerSourceTable | None = None


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
    # Why the connection would be refused (`by` is reject), as lbproxy_rejected_total's
    # `reason` label names it; None otherwise.
    reason: str | None = None

    def document(self) -> dict[str, Any]:
        return {
            "pick": self.pick,
            "by": self.by,
            "reason": self.reason,
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


def admission_refusal(pool: Pool, host: str, now: float, admission: Admission) -> str | None:
    """The reason the data path would refuse a new connection from `host` at `now`
    before any pick (lbproxy_rejected_total's), or None when it would be admitted. The
    checks and their order are the accept's and the connection handler's
    (dataplane/connection.py `_begin` and `_admit`)."""
    config = pool.config
    if admission.clients_full:
        return "max_clients"
    # The throttle weighs the clients already open; the handler asks it once the new
    # one is counted, with `pool.clients - 1`: the same number.
    throttle = admission.throttle
    if throttle is not None and throttle.would_refuse(now, pool.clients):
        return "throttle"
    acl = SourceFilter(config.allow, config.deny)
    if not acl.everyone and not acl.decide(host):
        return "acl"
    # The handler compares after counting the new client: clients + 1 > max.
    if config.max_connections and pool.clients >= config.max_connections:
        return "max_connections"
    sources = admission.per_source if config.per_source is not None else None
    if sources is not None and not sources.would_admit(host, now):
        return "per_source"
    return None


def explain(
    pool: Pool,
    client: tuple[Any, ...],
    now: float,
    queue: bool = False,
    admission: Admission | None = None,
) -> Explanation:
    """Where a new connection from `client` (`(host, port)`) would go at `now`.

    `queue`: the virtual server has a connection queue (a client finding only full
    servers waits instead of being refused). `admission`: the state its admission
    checks read (None: none are run, as for a UDP virtual server, whose sessions are
    decided by the relay)."""
    pool.advance(now)
    pick: RealServer | None = None
    by = REJECT
    reason = None if admission is None else admission_refusal(pool, client[0], now, admission)
    persistence = pool.persistence if reason is None else None
    if persistence is not None:
        entry = persistence.peek(client_key(client), now)
        if entry is not None and entry.server.available:
            pick, by = entry.server, PERSISTENCE
    if pick is None and reason is None:
        pick = pool.scheduler.peek(client if pool.reads_client else None, now)
        if pick is not None:
            by = pool.scheduler.name if pool.scheduler.keyed else SCHEDULER
            if pick.backup:
                by = BACKUP
        elif queue and pool.full_servers:
            by = QUEUE
        else:
            reason = "no_server"
    verdicts = []
    for rs in pool.servers:
        why = why_not(pool, rs)
        score = None if why is not None else format_score(pool.scheduler.explain(rs))
        verdicts.append(ServerVerdict(rs.name, why is None, why, score))
    name = None if pick is None else pick.name
    return Explanation(name, by, tuple(verdicts), pool.panic, reason)
