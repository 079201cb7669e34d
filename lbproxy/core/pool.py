"""The pool of one virtual server: its real servers' state, weights and counters.

PURE: no trio, no sockets, no clock — every method that needs the time takes `now`.

The pool owns everything a scheduler decides on and tells the scheduler what changed
through its hooks (schedulers/__init__.py). Three notions, kept apart on purpose:

- *online*: enabled, health up, not removed by a reload, base weight > 0. Coming online
  is what LVS calls a server (re)joining: it starts the `slow_start` ramp and, with
  `quiesce: true` and a scheduler that supports it, resets the connection table.
- *available*: online and below `max_connections`, with effective weight > 0. Only
  available servers are in the scheduler's structures and can be picked.
- *effective weight*: the base weight (static, or the dynamic SNMP weight for `dwd`/`dwr`
  unless every server's dynamic weight is 0, in which case the pool falls back to static
  weights) times the slow-start factor `max(0.1, elapsed / slow_start)`.

Connections are counted twice: `active` is the truth (metrics, max_connections), and
`sched_active` is what schedulers see — the quiesce reset zeroes it, and a connection
opened before a reset (its lease carries the old epoch) does not decrement it.

What is not the pool's lives beside it: a real server's configuration, state and
counters (real_server.py, `ServerCounters`), the locator's answers, load reports and
balance state (locate.py, `Locator`, made by the pool and reached as `pool.locator`; the
pool exposes `count_answer`, `load_of` and `balance_members` for it); the throttle's
mode (throttle.py, read through the virtual server); the queue's length and waits
(dataplane/queue.py, `QueueStats`; the pool gives it `available_servers`, `full_servers`
and the `on_available` hook).

Resilience (SPEC §23): outlier ejection (outlier.py, `pool.outlier`) holds a server
back from the scheduler while it is ejected, as `max_connections` does, and releases
it from the pool's timer (`_tick`). With `panic_threshold`, the pool counts on every
change the enabled non-backup servers and those of them available (up, not ejected);
when too few are, and no backup is up, it offers the scheduler every enabled non-backup
server as if all were up (Envoy's panic mode). Entering or leaving panic re-applies
every server: O(n), at that edge only.

Affinity (SPEC §12): `pick` and `take` are given the client's address. Only two things
read it — the persistence table (persistence.py), consulted before the scheduler, and a
`keyed` scheduler (maglev) — and a pool with neither never looks at it.
"""

from __future__ import annotations

import difflib
import json
import logging
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from lbproxy.config.model import (
    MAX_WEIGHT,
    RealServerConfig,
    VirtualServerConfig,
)
from lbproxy.core import schedulers
from lbproxy.core.agent import AgentSays, AgentState
from lbproxy.core.health import Health
from lbproxy.core.histogram import DURATION_BUCKETS, POLL_BUCKETS, Histogram
from lbproxy.core.locate import Locator
from lbproxy.core.outlier import OutlierDetector
from lbproxy.core.persistence import Entry, Persistence, client_key
from lbproxy.core.rate import Rate
from lbproxy.core.real_server import RealServer, ServerCounters

__all__ = ["Lease", "Pool", "RealServer", "ServerCounters"]  # RealServer: its own module
from lbproxy.core.udp_stats import UdpCounters

log = logging.getLogger("lbproxy.pool")

ENABLED, DRAIN, DISABLED = "enabled", "drain", "disabled"
STATES = (ENABLED, DRAIN, DISABLED)
REJECT_REASONS = (
    "no_server",
    "connect_failed",
    "throttle",
    "max_connections",
    "acl",
    "queue_timeout",
    "queue_full",
    "queue_abandoned",  # a queued client reset its connection before its turn
    "no_route",
    "proxy_untrusted",  # a PROXY sender outside accept_proxy_from (SPEC §21)
    "max_clients",  # beyond global.max_clients: closed at accept (SPEC §21)
    "per_source",  # a client network over its per_source limits: closed at accept (SPEC §23)
)
SLOW_START_FLOOR = 0.1  # a ramping server starts at 10 % of its weight (SPEC §3)
SLOW_START_STEPS = 50  # effective weight is recomputed this many times over the ramp


def weight_error(weight: object) -> str | None:
    """Why `weight` is not a static weight, or None when it is one.

    A static weight is an integer from 0 to MAX_WEIGHT, the rule of `weight:` in the
    configuration file, for every runtime change too (PATCH, `set-weight`, simulate
    events): not a boolean (True is an int in Python), not a string holding digits, and
    not a fraction, 3.0 included, as HAProxy's `server_parse_weight_change_request`
    refuses anything but digits. Effective weights may be fractional (slow start); the
    weight a user sets is not.
    """
    if isinstance(weight, int) and not isinstance(weight, bool) and 0 <= weight <= MAX_WEIGHT:
        return None
    hint = ""
    if isinstance(weight, bool):
        hint = " (a boolean is not a weight)"
    elif isinstance(weight, str):
        hint = " (a string; write the number without quotes)" if weight.isdigit() else ""
    elif isinstance(weight, float) and weight.is_integer() and 0 <= weight <= MAX_WEIGHT:
        hint = f" (write {int(weight)}: a weight has no fraction)"
    return f"weight must be an integer from 0 to {MAX_WEIGHT}, got {_shown(weight)}{hint}"


def state_error(state: object) -> str | None:
    """Why `state` is not an admin state (enabled | drain | disabled), or None."""
    if isinstance(state, str) and state in STATES:
        return None
    close = difflib.get_close_matches(state, STATES, n=1) if isinstance(state, str) else []
    hint = f" (did you mean {_shown(close[0])}?)" if close else ""
    return f"state must be one of {', '.join(STATES)}, got {_shown(state)}{hint}"


def _shown(value: object, limit: int = 60) -> str:
    """A value as JSON writes it (true, null, "3"), cut at `limit` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# The keys of a virtual server a reload applies to the next connections without the pool
# (its summary names them).
RESILIENCE_KEYS = (
    "allow",
    "deny",
    "per_source",
    "max_connection_duration",
    "max_connection_duration_jitter",
)


class Lease:
    """One connection to a real server, from `Pool.take` to `Pool.drop`."""

    __slots__ = ("answered", "epoch", "handle", "server", "sticky")

    def __init__(self, server: RealServer, epoch: int, handle: Any) -> None:
        self.server = server
        self.epoch = epoch
        self.handle = handle  # the proxy's per-connection object (byte counters, close)
        self.sticky: Entry | None = None  # its client's persistence entry, if any
        # Its server's first byte has been counted by outlier detection (`_answers`)
        self.answered = False


@dataclass(frozen=True)
class RealServerStats:
    name: str
    address: str
    state: str
    health: str  # up | down
    available: bool
    backup: bool
    weight_static: float
    weight_dynamic: float | None
    weight_effective: float
    active_connections: int
    connections_total: int
    bytes_in: int
    bytes_out: int
    connect_failures: dict[str, int]


@dataclass(frozen=True)
class PoolStats:
    name: str
    scheduler: str
    active_connections: int
    rejected: dict[str, int]
    dynamic_weight_fallback: bool
    real_servers: tuple[RealServerStats, ...] = field(default=())


class Pool:
    def __init__(self, config: VirtualServerConfig, now: float) -> None:
        self.name = config.name
        self.config = config
        # First: least-load reads the reports kept there when it is made.
        self.locator = Locator(self)
        self.scheduler: schedulers.Scheduler = schedulers.get(config.scheduler)(self)
        self.servers: list[RealServer] = []
        self.by_name: dict[str, RealServer] = {}
        self.active = 0  # connections leased to real servers
        self.clients = 0  # client connections accepted and not yet closed (proxy-owned)
        self.rejected: Counter[str] = Counter()
        self.durations = Histogram(DURATION_BUCKETS)  # connection lifetimes, seconds
        self.poll_durations = Histogram(POLL_BUCKETS)  # SNMP round trips, seconds
        # What the queue (SPEC §13, lbproxy/dataplane/queue.py) needs of the pool: these
        # two counts, to decide whether a new client waits, and one hook, called when a
        # server becomes available (the queue sets it; its own state is in queue.py).
        self.available_servers = 0  # servers in the scheduler's structures
        self.full_servers = 0  # servers held back only by their max_connections
        self.on_available: Callable[[], None] | None = None
        self.epoch = 0
        self.fallback = self.polls_snmp  # nothing answered yet
        self._dynamic_positive = 0
        # Backup servers (SPEC §13) are offered to the scheduler only while no primary is
        # available (online and below its max_connections): counts kept on every change,
        # so a pick never looks at the primaries. `_primaries_online` only decides what
        # is logged; `_backups` (in configuration order) is what a tier change re-applies.
        self._primaries_available = 0
        self._primaries_online = 0
        self._backups: dict[RealServer, None] = {}
        self._ramping: set[RealServer] = set()
        self._retrying: set[RealServer] = set()  # passively down, waiting for a trial
        self._next_tick = float("-inf")  # when `pick` next runs `_tick`
        self._scheduler_tick = float("-inf")  # when the scheduler next wants `on_tick`
        self._next_seq = len(config.real_servers)
        # Client persistence (SPEC §12), None when not configured: then neither pick nor
        # take looks at the client address.
        self.persistence: Persistence | None = None
        self._by_client = False  # persistence or a keyed scheduler: pick needs the client
        self._client_pick = self._pick_for  # with _by_client: what pick calls
        self._configure_affinity()
        self.conditioned: Counter[str] = Counter()  # connections closed by conditioning
        # connections health closed on purpose, by reason (core/health.py CLOSE_REASONS)
        self.closed: Counter[str] = Counter()
        # Outlier ejection (SPEC §23), None when not configured; panic and the counts
        # that decide it, kept on every change (`_count_for_panic`).
        self.outlier: OutlierDetector | None = None
        self.panic = False
        self._enabled_primaries: set[RealServer] = set()
        self._healthy_primaries: set[RealServer] = set()
        self._backups_up: set[RealServer] = set()
        self._configure_outlier(now)
        self.udp = UdpCounters()  # protocol: udp (SPEC §19): datagrams, drops
        self.rate = Rate()  # new connections a second, all its servers' (sample_rates)
        self._rate_at = now
        # Servers present at start-up come online together: resetting the (empty)
        # connection table for each of them would only cost O(n²).
        self._starting = True
        for rs_config in config.real_servers:
            self._add(rs_config, now)
        self._starting = False

    @property
    def polls_snmp(self) -> bool:
        """True when this virtual server's scheduler reads SNMP values."""
        return self.scheduler.reads_snmp(self.config)

    # -- the hot path -------------------------------------------------------------

    def pick(
        self, now: float, avoid: Collection[RealServer] = (), client: tuple[Any, ...] | None = None
    ) -> RealServer | None:
        """The real server for a new connection, or None when none is available.

        `client` is the client's address `(host, port)` (the PROXY header's, with
        accept_proxy); only persistence and keyed schedulers (maglev) read it. `avoid`
        holds the servers this connection already failed on: empty on its first pick,
        which is the one persistence counts.
        """
        if now >= self._next_tick:
            self._tick(now)
        if self._by_client:
            return self._client_pick(client, now, avoid)
        return self.scheduler.pick(now, avoid)

    def advance(self, now: float) -> None:
        """Bring time-driven state up to `now`, as `pick` does before it chooses.

        Slow-start steps, passive-health trials and the scheduler's periodic samples
        happen on the clock, not on traffic: a reader (metrics, the admin API, `lbproxy
        status`) calls this, through `statistics(now)`, so that what it shows is what
        the scheduler uses at that moment even when no connection has arrived since.
        O(1) when nothing is due; a due step costs O(ramping + retrying).
        """
        if now >= self._next_tick:
            self._tick(now)

    def _pick_for(
        self, client: tuple[Any, ...] | None, now: float, avoid: Collection[RealServer]
    ) -> RealServer | None:
        persistence = self.persistence
        if persistence is not None and client is not None and not avoid:
            key = client[0]
            if ":" in key:  # IPv6, or IPv4 through a dual-stack listener
                key = client_key(client)
            entry = persistence.lookup(key, now)
            if entry is None:
                persistence.lookups["miss"] += 1
            elif entry.server.available:
                persistence.lookups["hit"] += 1
                return entry.server  # type: ignore[no-any-return]  # persistence holds servers as Any (it imports no pool)
            else:
                persistence.lookups["moved"] += 1  # take() replaces the entry
        return self.scheduler.pick_for(client, now, avoid)

    @property
    def reads_client(self) -> bool:
        """True when picks depend on the client address (persistence or maglev)."""
        return self._by_client

    def persistence_entries(self, now: float) -> int:
        """Live persistence entries (expired ones are dropped first); 0 without it."""
        if self.persistence is None:
            return 0
        self.persistence.expire(now)
        return len(self.persistence)

    def take(
        self, rs: RealServer, now: float, handle: Any = None, client: tuple[Any, ...] | None = None
    ) -> Lease:
        """Count a connection sent to `rs`; pass the lease to `drop` when it ends.

        Called before the connect, as IPVS counts a connection from its SYN, so that
        concurrent arrivals see it and spread out. It is not yet one of `rs`'s
        `connections_total`: `established` counts it once the connect has completed.
        """
        lease = Lease(rs, self.epoch, handle)
        sticky = False
        persistence = self.persistence
        if persistence is not None and client is not None:
            key = client[0]
            if ":" in key:
                key = client_key(client)
            sticky = persistence.holds(key, rs, now)
            lease.sticky = persistence.acquire(key, rs, now)
        rs.leases.add(lease)
        rs.active += 1
        rs.sched_active += 1
        self.active += 1
        if sticky:
            # A persistence hit bypasses the scheduler (an LVS template, a HAProxy stick
            # table): counts include it, positions (rr's turn, `seq`) do not move.
            self.scheduler.on_sticky_take(rs, now)
        else:
            rs.seq = self._next_seq
            self._next_seq += 1
            self.scheduler.on_take(rs, now)
        if rs.trial:
            # The one trial connection of a passively-down server: no other until its
            # result (or, should that never come, until the next trial).
            self._schedule_trial(rs, now)
            self._apply(rs, now)
        elif rs.max_connections and rs.active >= rs.max_connections:
            self._apply(rs, now)
        return lease

    def established(self, lease: Lease) -> None:
        """The connect behind `lease` completed: one more of its server's connections.

        `connections_total` (metric, JSON document, status) counts connections
        established to a server; a failed attempt is only a connect failure. (The
        TCP connection handler, dataplane/connection.py `_establish`, and the UDP
        relays' `_opened` do the same inline: a Python frame per connection or session.)
        """
        lease.server.counters.connections_total += 1

    def drop(self, lease: Lease, now: float) -> None:
        rs = lease.server
        rs.leases.discard(lease)
        rs.active -= 1
        self.active -= 1
        if lease.sticky is not None:
            self.persistence.release(lease.sticky, now)  # type: ignore[union-attr]  # a sticky lease implies persistence
            lease.sticky = None
        if lease.epoch == self.epoch:
            rs.sched_active -= 1
            scheduler = self.scheduler
            if scheduler.watches_drops:
                scheduler.on_drop(rs, now)
        if rs.max_connections and rs.active == rs.max_connections - 1:
            self._apply(rs, now)

    def connect_failed(self, rs: RealServer, now: float) -> float | None:
        """A client connect to `rs` failed (refused, timed out), or its server reset an
        established connection before sending a byte: outlier detection counts it and
        may eject `rs` (the caller feeds health apart).

        Returns when the ejection ends if this failure ejected `rs`, else None: a
        caller with a clock of its own calls `advance` then, so the server returns on
        time even when no pick comes (the pool's own timer runs on picks and reads)."""
        outlier = self.outlier
        if outlier is None or rs.backup or rs.removed:
            return None
        record = rs.outlier
        if record is None or record.until is None:  # (an ejected server's are ignored)
            self._answers(rs)
        if outlier.failed(rs, now, len(self.servers) - len(self._backups)):
            rs.counters.ejections += 1
            log.warning(  # once per ejection, never per connection
                "%s/%s ejected for %gs: %d connects failed in a row",
                self.name,
                rs.name,
                rs.outlier.until - now,  # type: ignore[union-attr, operator]  # set by failed()
                outlier.config.consecutive_failures,
            )
            self._next_tick = min(self._next_tick, outlier.next_release)
            self._apply(rs, now)
            return rs.outlier.until  # type: ignore[union-attr]  # set by failed()
        return None

    def _answers(self, rs: RealServer) -> None:
        """Before a failure of `rs` is counted: a connection of its that has had its
        server's first byte since the last failure is a success in between, which ends
        the failures in a row. The first byte is noticed here and at the connection's
        end (`answered`) rather than when it arrives, which would cost the pump a test
        per chunk; the count only matters at a failure, so the result is the same.
        O(rs's open connections), on a failure only, never on a healthy server's path."""
        answered = False
        for lease in rs.leases:
            if not lease.answered and getattr(lease.handle, "bytes_out", 0) > 0:
                lease.answered = answered = True
        if answered:
            self.connect_completed(rs)

    def answered(self, lease: Lease) -> None:
        """An established connection ended other than by its server's reset before a
        byte, while that server had an outlier record (the caller's test, `rs.outlier is
        not None`): unless its first byte was counted already, a success."""
        if not lease.answered:
            lease.answered = True
            self.connect_completed(lease.server)

    def connect_completed(self, rs: RealServer, now: float = 0.0) -> None:
        """`rs` answered a client (its first byte) while it had an outlier record
        (`rs.outlier` is not None: the caller's test, so a healthy server costs nothing):
        its failures and ejections in a row are over. (`now` is unused: the simulator's
        call.)"""
        if self.outlier is None:
            rs.outlier = None
            return
        self.outlier.succeeded(rs)

    def ejected_until(self, rs: RealServer) -> float | None:
        """When `rs`'s ejection ends (the pool's clock), or None when it is not ejected."""
        record = rs.outlier
        return None if record is None else record.until

    @property
    def backup_servers(self) -> Collection[RealServer]:
        """The backup servers (not removed): a view of what the pool keeps, no scan."""
        return self._backups.keys()

    # -- state changes ------------------------------------------------------------

    def record_health(
        self, rs: RealServer, ok: bool, now: float, reason: str = "", *, passive: bool = False
    ) -> bool | None:
        """Feed one active check or passive connect result; returns a new up/down state.

        With `health_check.type: none` only passive results arrive, so a down server
        could never come back by itself: `interval` after it went down (or after its
        last failed trial) it becomes available for one trial connection (`_tick`),
        and that connection's successful connect brings it up at once.

        With an active check, a `passive` success changes nothing: the check alone
        says a server is up, and only it clears its failures (a database that accepts
        TCP but refuses service must go down under traffic). Passive failures count.
        """
        if ok and rs.agent is not None and rs.agent.down:
            return None  # the agent holds it down: only `rise` checks after its `up` count
        passive_only = self.config.health_check.type == "none"
        if passive and ok and not passive_only:
            return None
        was_trial = rs.trial
        if passive_only and ok and not rs.health.up:
            rs.health.force(True)  # the trial connection got through
            changed: bool | None = True
        else:
            changed = rs.health.record(ok)
        if passive_only and not ok and not rs.health.up:
            self._schedule_trial(rs, now)
        elif changed:
            self._cancel_trial(rs)
        if changed is not None:
            self._health_changed(rs, changed, now)
            log.info(  # not per check or connection: only on a transition
                "%s/%s is %s%s",
                self.name,
                rs.name,
                "up" if changed else "down",
                f" ({reason})" if reason else "",
            )
        if changed is not None or was_trial:
            self._update(rs, now)
        return changed

    def set_state(self, rs: RealServer, state: str, now: float) -> list[Lease]:
        """Change the admin state; returns the leases the caller must close (disabled)."""
        error = state_error(state)
        if error:
            raise ValueError(error)
        if state != rs.state:
            rs.changed_at = now
        rs.state = state
        self._update(rs, now)
        return list(rs.leases) if state == DISABLED else []

    def downtime(self, rs: RealServer, now: float) -> float:
        """Seconds `rs` has spent down (its health) since it was added, as HAProxy's
        `downtime`."""
        if rs.down_since is None:
            return rs.downtime
        return rs.downtime + max(now - rs.down_since, 0.0)

    def sample_rates(self, now: float) -> None:
        """The control plane's once-a-second reading of each server's connection count:
        its rate, and the virtual server's (their sum). O(servers), never per connection."""
        grown = 0
        for rs in self.servers:
            grown += rs.rate.sample(rs.counters.connections_total, now)
        elapsed = now - self._rate_at
        if elapsed > 0:
            self.rate.set(grown / elapsed)
        self._rate_at = now

    def _health_changed(self, rs: RealServer, up: bool, now: float) -> None:
        rs.changed_at = now
        if up and rs.down_since is not None:
            rs.downtime += max(now - rs.down_since, 0.0)
            rs.down_since = None
        elif not up and rs.down_since is None:
            rs.down_since = now

    def set_weight(self, rs: RealServer, weight: object, now: float) -> str | None:
        """Change the static weight at run time; returns an error message, or None.

        The one validated path for a weight (`weight_error`), as HAProxy's
        `server_parse_weight_change_request`; an invalid weight changes nothing.
        """
        error = weight_error(weight)
        if error:
            return error
        rs.static_weight = float(weight)  # type: ignore[arg-type]  # weight_error() checked it is a number
        self._update(rs, now)
        return None

    def set_dynamic_weight(self, rs: RealServer, weight: float, now: float) -> None:
        """The SNMP poller's weight for `rs`, after `on_no_answer` decided it (>= 0)."""
        rs.dynamic_weight = max(0.0, float(weight))
        self._update(rs, now)

    def report_value(self, rs: RealServer, value: float, now: float) -> None:
        """A raw SNMP value: a weight for dwd/dwr, a load report for least-load."""
        if self.scheduler.dynamic_weights:
            snmp = rs.config.snmp
            max_value = snmp.max_value if snmp else 100
            weight = self.scheduler.weight_from_value(value, max_value)  # type: ignore[attr-defined]  # on dynamic_weights schedulers only
            self.set_dynamic_weight(rs, weight, now)
        else:
            self.scheduler.on_report(rs, value, now)
            if self.polls_snmp:
                # least-load fed by SNMP: the dynamic weight only gates availability
                # (on_no_answer zero -> 0); an answer opens it at the static weight.
                self.set_dynamic_weight(rs, rs.static_weight, now)

    def apply_agent(
        self, rs: RealServer, answer: AgentSays, now: float, wall: float
    ) -> bool | None:
        """A good answer of `rs`'s agent check (received at `wall`, seconds since the
        epoch, for the API); returns the new up/down state of its health on a change.

        The agent's state and weight are its own (core/agent.py): they scale the
        effective weight and never touch the operator's state or static weight. A down
        word forces health down; `up` after it brings health back at once only with
        `health_check.type: none`, else through `rise` active checks passing after it.
        """
        if rs.agent is None:
            rs.agent = AgentState()
        change = rs.agent.apply(answer, wall)
        if rs.agent.max_connections is not None:
            rs.max_connections = rs.agent.max_connections
        health: bool | None = None
        if change.went_down and rs.health.up:
            rs.health.force(False)
            health = False
        elif change.went_down:
            rs.health.force(False)  # failures counted so far start again from 0
        elif change.came_up and self.config.health_check.type == "none" and not rs.health.up:
            rs.health.force(True)
            health = True
        if health is not None:
            self._health_changed(rs, health, now)
            self._cancel_trial(rs)
            reason = f"agent: {rs.agent.reason}" if rs.agent.reason else "agent"
            log.info("%s/%s is %s (%s)", self.name, rs.name, "up" if health else "down", reason)
        self._update(rs, now)
        return health

    def clear_agent(self, rs: RealServer, now: float) -> None:
        """The agent check is gone (a reload): what it said no longer applies."""
        if rs.agent is None:
            return
        rs.agent = None
        rs.max_connections = rs.config.max_connections
        if self.config.health_check.type == "none" and not rs.health.up:
            self._schedule_trial(rs, now)  # nothing else would bring it back now
        self._update(rs, now)

    # -- reload -------------------------------------------------------------------

    def reconfigure(
        self, config: VirtualServerConfig, now: float, *, keep_runtime: bool = False
    ) -> list[str]:
        """Apply a new configuration of this virtual server; returns what changed.

        Established connections are never touched: a removed server's leases finish on
        their own and still drop correctly. A reload applies the file as written
        (`apply_config`), except to discovered servers, which no file describes; with
        `keep_runtime` (a discovery round: the file did not change) no server loses a
        runtime change of a field its configuration leaves as it was (`apply_changes`).
        """
        changes: list[str] = []
        old_config, self.config = self.config, config
        if config.health_check != old_config.health_check:
            changes.append("health_check changed")
            self._retune_health(now)
        if config.persistence != old_config.persistence:
            changes.append("persistence changed")
        if config.outlier_detection != old_config.outlier_detection:
            changes.append("outlier_detection changed")
            self._configure_outlier(now)
        if config.panic_threshold != old_config.panic_threshold:
            changes.append(
                f"panic_threshold {old_config.panic_threshold} -> {config.panic_threshold}"
            )
        # Read from the configuration by the connection handler (the ACL, the per-source
        # table, the lifetime drawn at establishment): nothing to apply here, but the
        # summary names them, as they take effect for the next connections.
        for key in RESILIENCE_KEYS:
            if getattr(config, key) != getattr(old_config, key):
                changes.append(f"{key} changed")
        if (config.scheduler, config.options) != (old_config.scheduler, old_config.options):
            if config.scheduler != old_config.scheduler:
                changes.append(f"scheduler {old_config.scheduler} -> {config.scheduler}")
            else:
                keys = " or ".join(self.scheduler.options)
                changes.append(f"{config.scheduler} {keys} changed")
            self._swap_scheduler(config.scheduler, now)
        self._configure_affinity()
        wanted = {rs.name: (i, rs) for i, rs in enumerate(config.real_servers)}
        for rs in list(self.servers):
            if rs.name not in wanted:
                rs.removed = True
                self.locator.forget(rs)
                self._cancel_trial(rs)
                if self.outlier is not None:
                    self.outlier.forget(rs)
                self._update(rs, now)
                self.servers.remove(rs)
                del self.by_name[rs.name]
                changes.append(f"removed {rs.name}")
        reorder = False
        for index, rs_config in wanted.values():
            rs = self.by_name.get(rs_config.name)  # type: ignore[assignment]  # None: handled next
            if rs is None:
                self._add(rs_config, now)
                changes.append(f"added {rs_config.name}")
                continue
            reorder |= rs.index != index
            if rs.config != rs_config:
                changes.append(f"changed {rs.name}")
            if keep_runtime or rs_config.discovered:
                rs.apply_changes(rs_config)
            else:
                rs.apply_config(rs_config)
            self._update(rs, now)
        self.servers.sort(key=lambda s: wanted[s.name][0])
        if self.outlier is not None:
            for rs in list(self.outlier.ejected):
                if rs.backup:  # turned backup by this reload: backups are never ejected
                    self.outlier.forget(rs)
                    self._apply(rs, now)
        self._update_panic(now)  # panic_threshold may have changed
        if reorder:
            for i, rs in enumerate(self.servers):
                rs.index = i
            self._swap_scheduler(config.scheduler, now)
        return changes

    def _configure_outlier(self, now: float) -> None:
        """Set up, retune or drop outlier detection for the current configuration (a
        retune keeps the ejections under way; they end at the time they were given)."""
        wanted = self.config.outlier_detection
        if wanted is None:
            if self.outlier is not None:
                ejected = list(self.outlier.ejected)
                for rs in self.servers:
                    self.outlier.forget(rs)
                self.outlier = None
                for rs in ejected:
                    self._apply(rs, now)
        elif self.outlier is None:
            self.outlier = OutlierDetector(wanted)
        else:
            self.outlier.config = wanted

    def _configure_affinity(self) -> None:
        """Set up (or retune, or drop) the persistence table for the current config."""
        wanted = self.config.persistence
        if wanted is None:
            self.persistence = None
        elif self.persistence is None:
            self.persistence = Persistence(wanted.timeout, wanted.max_entries)
        else:  # a reload keeps the entries; new limits apply from now on
            self.persistence.timeout = wanted.timeout
            self.persistence.max_entries = wanted.max_entries
        self._by_client = self.persistence is not None or self.scheduler.keyed
        # maglev alone: straight to the scheduler, one call less per pick
        self._client_pick = self.scheduler.pick_for if self.persistence is None else self._pick_for

    def _swap_scheduler(self, name: str, now: float) -> None:
        self.scheduler = schedulers.get(name)(self)
        self._configure_affinity()
        for rs in self.servers:
            if rs.online:
                self.scheduler.on_online(rs, now)
            if rs.available:
                self.scheduler.on_available(rs, now)
        self._next_tick = self._scheduler_tick = float("-inf")

    def scores(self, tried: Collection[RealServer] = ()) -> dict[str, str]:
        """Every server's score as the scheduler sees it, for decision explain (O(n))."""
        return {
            rs.name: "tried"
            if rs in tried
            else schedulers.format_score(self.scheduler.explain(rs))
            if rs.available
            else "unavailable"
            for rs in self.servers
        }

    # -- what the locator (locate.py) needs ------------------------------------------

    def count_answer(self, rs: RealServer, now: float, hit: bool) -> None:
        """A locator answer, as the scheduler sees it: a connection sent to `rs` that
        closes at once (`hit`: persistence chose `rs`, not a pick; see `take`)."""
        rs.sched_active += 1
        if hit:
            self.scheduler.on_sticky_take(rs, now)
        else:
            rs.seq = self._next_seq
            self._next_seq += 1
            self.scheduler.on_take(rs, now)
        rs.sched_active -= 1
        self.scheduler.on_drop(rs, now)

    def load_of(self, rs: RealServer) -> float | None:
        """`rs`'s load as the balance rule sees it (None: the scheduler has none)."""
        pair = self.scheduler.balance_load(rs)
        return None if pair is None else pair[0]

    def balance_members(self) -> list[tuple[RealServer, float, float]]:
        """(server, L, p) for every server that takes part in balancing: the servers a
        new connection could go to now. O(n).

        That is `available` (enabled, weight > 0, not ejected, not full, of the tier
        the pool serves from: its primaries, or its backups while no primary is
        available) and health up. A backup the pool does not serve from, an ejected or
        a full server would otherwise look least loaded and have connections closed
        "toward" it that it never gets. Panic makes down primaries available to the
        pick; they stay out here, as draining, disabled and down servers always do:
        their connections are left alone and none is closed toward them."""
        members = []
        for rs in self.servers:
            if rs.available and rs.online:
                pair = self.scheduler.balance_load(rs)
                if pair is None:
                    return []
                members.append((rs, *pair))
        return members

    # -- statistics ---------------------------------------------------------------

    def statistics(self, now: float | None = None) -> PoolStats:
        """A frozen snapshot for metrics, the admin API and `lbproxy status`.

        With `now`, time-driven state is brought up to date first (`advance`): the
        effective weights are then those the scheduler uses at `now`.
        """
        if now is not None:
            self.advance(now)
        return PoolStats(
            name=self.name,
            scheduler=self.config.scheduler,
            active_connections=self.active,
            rejected={reason: self.rejected[reason] for reason in REJECT_REASONS},
            dynamic_weight_fallback=self.fallback,
            real_servers=tuple(self._server_stats(rs) for rs in self.servers),
        )

    @staticmethod
    def _server_stats(rs: RealServer) -> RealServerStats:
        # Bytes of connections still open are read from their live counters.
        live_in = sum(getattr(lease.handle, "bytes_in", 0) for lease in rs.leases)
        live_out = sum(getattr(lease.handle, "bytes_out", 0) for lease in rs.leases)
        counters = rs.counters
        return RealServerStats(
            name=rs.name,
            address=str(rs.address),
            state=rs.state,
            health="up" if rs.health.up else "down",
            available=rs.available,
            backup=rs.backup,
            weight_static=rs.static_weight,
            weight_dynamic=rs.dynamic_weight,
            weight_effective=rs.effective_weight,
            active_connections=rs.active,
            connections_total=counters.connections_total,
            bytes_in=counters.bytes_in + live_in,
            bytes_out=counters.bytes_out + live_out,
            connect_failures=dict(counters.connect_failures),
        )

    # -- internals ----------------------------------------------------------------

    def restore_health(self, rs: RealServer, up: bool, now: float) -> bool:
        """Start `rs` as the process before this one last saw it (an upgrade's hand-over),
        before any connection: True when that changed it. The checks go on from there;
        a down one needs `rise` successes, as after any failure. Only with active checks:
        without them health is passive, and every server starts up as at any start."""
        if self.config.health_check.type == "none" or rs.health.up == up:
            return False
        rs.health.force(up)
        self._health_changed(rs, up, now)
        self._update(rs, now)
        return True

    def restore_timeline(self, rs: RealServer, since: float, downtime: float, now: float) -> None:
        """`rs`'s last change (`since`, this run's clock) and the seconds it has spent down,
        as the process before this one counted them (an upgrade's hand-over); a server
        down now goes on counting from `now`."""
        rs.changed_at = min(since, now)
        rs.downtime = max(downtime, 0.0)
        rs.down_since = None if rs.health.up else now

    def await_first_check(self, rs: RealServer, now: float) -> None:
        """`rs` (just added at run time) takes no connection until an active check
        passes: down, one success from up. Without active checks it stays as it is."""
        if self.config.health_check.type != "none":
            rs.health.counter = rs.health.rise - 1
            self._update(rs, now)

    def _add(self, config: RealServerConfig, now: float) -> RealServer:
        check = self.config.health_check
        rs = RealServer(config, len(self.servers), Health(check.rise, check.fall, up=True))
        if self.polls_snmp and config.snmp is not None:
            # Until the agent answers, `on_no_answer` decides: static uses the static
            # weight, zero and hold (nothing to hold yet) give 0.
            if config.snmp.on_no_answer == "static":
                rs.dynamic_weight = rs.static_weight
            else:
                rs.dynamic_weight = 0.0
        rs.changed_at = now
        rs.rate = Rate(since=now)  # its connection count is 0 now
        self.servers.append(rs)
        self.by_name[rs.name] = rs
        self._update(rs, now)
        return rs

    def _base_weight(self, rs: RealServer) -> float:
        if self.polls_snmp and not self.fallback:
            base = rs.dynamic_weight or 0.0
        else:
            base = rs.static_weight
        if rs.agent is not None:
            base *= rs.agent.factor  # the agent's weight percent; 0 while it drains
        return base

    def _update(self, rs: RealServer, now: float) -> None:
        """Recompute `rs` after any change, and every server if the fallback flips."""
        if self.polls_snmp:
            positive = (
                not rs.removed
                and rs.state == ENABLED
                and rs.health.up
                and (rs.dynamic_weight or 0.0) > 0
            )
            if positive != rs.dyn_positive:
                rs.dyn_positive = positive
                self._dynamic_positive += 1 if positive else -1
            fallback = self._dynamic_positive == 0
            if fallback != self.fallback:
                self.fallback = fallback
                if fallback:
                    log.warning("%s: every dynamic weight is 0; using static weights", self.name)
                else:
                    log.info("%s: dynamic weights in use again", self.name)
                for other in self.servers:
                    self._apply(other, now)
                return
        self._apply(rs, now)

    def _apply(self, rs: RealServer, now: float) -> None:
        base = self._base_weight(rs)
        online = not rs.removed and rs.state == ENABLED and rs.health.up and base > 0
        if online and not rs.online:
            rs.online = True
            self._came_online(rs, now)
        elif not online and rs.online:
            rs.online = False
            rs.ramp_start = None
            self._ramping.discard(rs)
            self.scheduler.on_offline(rs, now)
        if rs.backup and not rs.removed:
            self._backups[rs] = None
        else:
            self._backups.pop(rs, None)
        primary_online = online and not rs.backup
        if primary_online != rs.primary_online:
            rs.primary_online = primary_online
            self._primaries_online += 1 if primary_online else -1
            if self._primaries_online == (1 if primary_online else 0):
                self._log_tier()
        ejected = rs.outlier is not None and rs.outlier.until is not None
        # Before the weight below changes: on a change of panic every server, `rs` too,
        # is re-applied, and that must see `rs`'s weight as the scheduler last did.
        if self._count_for_panic(rs, online, ejected, base, now):
            return
        old = rs.effective_weight
        rs.effective_weight = base * self._ramp_factor(rs, now)
        trial = rs.trial and not rs.removed and rs.state == ENABLED and base > 0
        if self.panic and not rs.backup:
            # as if every enabled primary were up and none ejected (drained, disabled
            # and weight-0 servers stay out)
            candidate = not rs.removed and rs.state == ENABLED and base > 0
        else:
            candidate = (
                (online or trial) and not ejected and not (rs.backup and self._primaries_available)
            )
        has_room = not rs.max_connections or rs.active < rs.max_connections
        available = candidate and has_room
        full = candidate and not has_room
        if full != rs.full:
            rs.full = full
            self.full_servers += 1 if full else -1
        if available and not rs.available:
            rs.available = True
            self.available_servers += 1
            self.scheduler.on_available(rs, now)
            if self.on_available is not None:
                self.on_available()
        elif not available and rs.available:
            rs.available = False
            self.available_servers -= 1
            self.scheduler.on_unavailable(rs, now)
        elif available and rs.effective_weight != old:
            self.scheduler.on_weight(rs, old, now)
        # A full primary is not available (SPEC §3): backups serve while every primary
        # is down, drained, disabled or at its max_connections (nginx `backup` with
        # `max_conns`); the first slot a primary frees sends new connections back to
        # the primaries (backups leave the scheduler, their connections finish on their
        # own). A primary filling and freeing its last slot flips this at that edge:
        # O(backups) then, never a scan of every server.
        primary_available = available and online and not rs.backup
        if primary_available != rs.primary_available:
            rs.primary_available = primary_available
            self._primaries_available += 1 if primary_available else -1
            if self._primaries_available == (1 if primary_available else 0):
                for other in list(self._backups):
                    self._apply(other, now)

    def _count_for_panic(
        self, rs: RealServer, online: bool, ejected: bool, base: float, now: float
    ) -> bool:
        """Keep the counts panic is decided on up to date with `rs`; on a change of
        panic, re-apply every server and return True. O(1) unless panic changes (kept
        without a threshold too, so a reload that sets one finds them right)."""
        enabled = not rs.removed and not rs.backup and rs.state == ENABLED and base > 0
        if enabled:
            self._enabled_primaries.add(rs)
        else:
            self._enabled_primaries.discard(rs)
        if enabled and online and not ejected:
            self._healthy_primaries.add(rs)
        else:
            self._healthy_primaries.discard(rs)
        if rs.backup and online:
            self._backups_up.add(rs)
        else:
            self._backups_up.discard(rs)
        return self._update_panic(now)

    def _update_panic(self, now: float) -> bool:
        """Enter or leave panic as the counts say; True when it changed (every server
        is then re-applied)."""
        threshold = self.config.panic_threshold
        enabled = len(self._enabled_primaries)
        panic = (
            threshold > 0
            and enabled > 0
            and len(self._healthy_primaries) * 100 < threshold * enabled
            and not self._backups_up
        )
        if panic == self.panic:
            return False
        self.panic = panic
        log.warning(  # at the edge only
            "%s: %s",
            self.name,
            f"panic: {len(self._healthy_primaries)} of {enabled} enabled servers available "
            f"(under {threshold}%); picking among all {enabled} as if all were up"
            if panic
            else "panic over: picking among the available servers again",
        )
        for other in list(self.servers):
            self._apply(other, now)
        return True

    def _log_tier(self) -> None:
        """On the first primary coming online, or the last going (not when one is
        merely full: that may flip with every connection)."""
        if self._backups and not self._starting:
            log.info(
                "%s: %s",
                self.name,
                "a primary is online again; backup servers stand by while one has room"
                if self._primaries_online
                else "no primary server online; using the backup servers",
            )

    def _came_online(self, rs: RealServer, now: float) -> None:
        if self.config.slow_start > 0:
            rs.ramp_start = now
            self._ramping.add(rs)
            self._next_tick = min(self._next_tick, now)
        if self.config.quiesce and self.scheduler.quiesce_resets and not self._starting:
            self._quiesce_reset(now)
        self.scheduler.on_online(rs, now)

    def _schedule_trial(self, rs: RealServer, now: float) -> None:
        """Passive health only: offer `rs` one trial connection `interval` from now."""
        rs.trial = False
        rs.retry_at = now + self.config.health_check.interval
        self._retrying.add(rs)
        self._next_tick = min(self._next_tick, rs.retry_at)

    def _cancel_trial(self, rs: RealServer) -> None:
        rs.trial = False
        rs.retry_at = None
        self._retrying.discard(rs)

    def _retune_health(self, now: float) -> None:
        """New health_check settings (a reload): keep each server's up/down state."""
        check = self.config.health_check
        for rs in self.servers:
            rs.health.rise, rs.health.fall = check.rise, check.fall
            rs.health.force(rs.health.up)
            if check.type == "none" and not rs.health.up:
                if rs not in self._retrying and not rs.trial:
                    self._schedule_trial(rs, now)
            elif check.type != "none":
                self._cancel_trial(rs)  # active checks bring it back now

    def _quiesce_reset(self, now: float) -> None:
        # LVS: "the least-connections table is reset to zero and the LVS router routes
        # requests as if all the real servers were newly added to the cluster".
        self.epoch += 1
        for rs in self.servers:
            rs.sched_active = 0
        self.scheduler.on_reset(now)
        log.info("%s: quiesce reset of the connection table", self.name)

    def _ramp_factor(self, rs: RealServer, now: float) -> float:
        if rs.ramp_start is None:
            return 1.0
        elapsed = now - rs.ramp_start
        if elapsed >= self.config.slow_start:
            return 1.0
        return max(SLOW_START_FLOOR, elapsed / self.config.slow_start)

    def _tick(self, now: float) -> None:
        """Time-driven work, run from `pick` when due: slow-start steps, load samples."""
        if now >= self._scheduler_tick:
            self._scheduler_tick = self.scheduler.on_tick(now)
        next_tick = self._scheduler_tick
        outlier = self.outlier
        if outlier is not None:
            if now >= outlier.next_release:
                for rs in outlier.due(now):
                    log.info("%s/%s: ejection over", self.name, rs.name)
                    self._apply(rs, now)
            next_tick = min(next_tick, outlier.next_release)
        for rs in list(self._retrying):
            if rs.removed or rs.health.up:
                self._cancel_trial(rs)
            elif now >= rs.retry_at:  # type: ignore[operator]  # set while in _retrying
                self._retrying.discard(rs)
                rs.retry_at = None
                rs.trial = True
                self._apply(rs, now)
            else:
                next_tick = min(next_tick, rs.retry_at)  # type: ignore[type-var, assignment]  # set while in _retrying
        if self._ramping:
            for rs in list(self._ramping):
                if now - rs.ramp_start >= self.config.slow_start:  # type: ignore[operator]  # set while in _ramping
                    rs.ramp_start = None
                    self._ramping.discard(rs)
                self._apply(rs, now)
            if self._ramping:
                next_tick = min(next_tick, now + self.config.slow_start / SLOW_START_STEPS)
        self._next_tick = next_tick
