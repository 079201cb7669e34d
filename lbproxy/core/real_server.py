"""One real server of a pool: its configuration, its state, and its counters apart.

PURE: no trio, no sockets, no clock.

A `RealServer` holds three kinds of things, kept apart so that each has one owner:

- configuration, re-applied on every reload (`apply_config`): address, static weight,
  max_connections, load factor, state, backup;
- state, owned by the pool (pool.py) and read by the schedulers: online, available,
  full, effective and dynamic weight, the slow-start ramp, the passive-health trial,
  its outlier-ejection record, `active` / `sched_active`, its leases;
- counters (`ServerCounters`), only ever added to, by whoever sees the event (the
  connection, the health checker, the SNMP poller) and read at scrape time by the
  metrics, the API and `lbproxy status`; nothing decides on them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lbproxy.config.model import RealServerConfig
from lbproxy.core.agent import AgentState
from lbproxy.core.health import Health
from lbproxy.core.outlier import Ejection
from lbproxy.core.rate import Rate

if TYPE_CHECKING:
    from lbproxy.core.pool import Lease


@dataclass(frozen=True, slots=True)
class CheckRecord:
    """The last active health check of a real server, for the API (SPEC §24)."""

    result: str  # ok | fail | timeout
    reason: str  # why it failed; empty when ok
    at: float  # when it ended, seconds since the epoch (the checker's clock)
    duration: float  # seconds it took


class ServerCounters:
    """What happened to one real server, for the metrics and the API: counts only."""

    __slots__ = (
        "agent_checks",
        "bytes_in",
        "bytes_out",
        "check_last",
        "connect_failures",
        "connections_total",
        "ejections",
        "health_checks",
        "resets",
        "snmp_last",
        "snmp_polls",
    )

    def __init__(self) -> None:
        self.connections_total = 0  # connections established (Pool.established)
        self.bytes_in = 0  # of ended connections; open ones are read from their leases
        self.bytes_out = 0
        self.connect_failures: Counter[str] = Counter()  # refused | timeout | error
        self.resets = 0  # established connections the real server reset
        self.ejections = 0  # times outlier detection ejected it (core/outlier.py)
        self.health_checks: Counter[str] = Counter()  # ok | fail | timeout
        self.agent_checks: Counter[str] = Counter()  # ok | fail | timeout | bad_answer
        self.snmp_polls: Counter[str] = Counter()  # ok | timeout | error | bad_value
        self.snmp_last: tuple[str, int | None] | None = None  # last poll: (result, value)
        self.check_last: CheckRecord | None = None  # the last active health check


class RealServer:
    __slots__ = (
        "active",
        "address",
        "agent",
        "available",
        "backup",
        "changed_at",
        "config",
        "counters",
        "down_since",
        "downtime",
        "dyn_positive",
        "dynamic_weight",
        "effective_weight",
        "full",
        "health",
        "index",
        "leases",
        "load_factor",
        "max_connections",
        "name",
        "online",
        "outlier",
        "primary_available",
        "primary_online",
        "ramp_start",
        "rate",
        "removed",
        "retry_at",
        "sched_active",
        "seq",
        "state",
        "static_weight",
        "trial",
    )

    def __init__(self, config: RealServerConfig, index: int, health: Health) -> None:
        self.name = config.name
        self.index = index  # configuration order: the last tie-break everywhere
        self.seq = index  # when it was last picked: round-robin order among ties
        self.health = health
        self.dynamic_weight: float | None = None
        self.dyn_positive = False
        self.online = False
        self.primary_online = False  # counted in Pool._primaries_online
        self.primary_available = False  # counted in Pool._primaries_available
        self.available = False
        self.full = False  # would be available but for max_connections
        self.removed = False
        # Passive health only (`health_check.type: none`): a down server is offered one
        # trial connection at `retry_at` (see Pool.record_health).
        self.trial = False
        self.retry_at: float | None = None
        # Outlier detection's record (core/outlier.py) while its connects fail or it is
        # ejected; None otherwise, so a completed connect costs one test.
        self.outlier: Ejection | None = None
        self.effective_weight = 0.0
        self.ramp_start: float | None = None
        self.active = 0
        self.sched_active = 0
        self.counters = ServerCounters()
        # The operator's view (SPEC §24), on the pool's clock: when its state or health
        # last changed (set when the pool adds it), since when it is down, and the time
        # it spent down before that; new connections a second, sampled by the control plane.
        self.changed_at = 0.0
        self.down_since: float | None = None
        self.downtime = 0.0
        self.rate = Rate()
        self.leases: set[Lease] = set()
        # What the agent check said (core/agent.py); None while there is none.
        self.agent: AgentState | None = None
        self.apply_config(config)

    def apply_config(self, config: RealServerConfig) -> None:
        self.config = config
        self.address = config.address
        self.static_weight = float(config.weight)
        self.max_connections = config.max_connections
        if self.agent is not None and self.agent.max_connections is not None:
            self.max_connections = self.agent.max_connections  # the agent's, until it goes
        self.load_factor = config.load_factor
        self.state = config.state
        self.backup = config.backup

    def apply_changes(self, config: RealServerConfig) -> None:
        """Apply `config` but keep a runtime change (a PATCHed state or weight) of every
        field `config` leaves as it was: a discovery round, or a reload, re-applying a
        discovered server's unchanged configuration must not undo what an operator set."""
        old, state, weight = self.config, self.state, self.static_weight
        self.apply_config(config)
        if config.state == old.state:
            self.state = state
        if config.weight == old.weight:
            self.static_weight = weight

    def __repr__(self) -> str:
        return f"<RealServer {self.name} {self.address} {self.state}>"
