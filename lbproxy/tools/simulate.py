"""`lbproxy simulate`: the real pool and scheduler code against a synthetic arrival sequence.

PURE. Connection k (1-based) arrives at simulated time (k - 1) / rate. Without `hold`,
each connection closes before the next arrives; with `hold`, every connection stays
open until a `close:` event ends it. Events (a YAML list) apply before connection
number `before`, in file order, each key of one event in the order written:

    - {before: 1, snmp: {s1: 7, s2: 8}}     SNMP values as if just polled
    - {before: 8, join: s4}                 a server comes online (enabled, health up)
    - {before: 20, leave: s2}               a server goes down (health)
    - {before: 30, weight: {s1: 3}}         runtime weight change (0 stops new connections)
    - {before: 35, load_factor: {s1: 3}}    sap load factor change
    - {before: 40, close: {s1: 5}}          s1's 5 oldest held connections end
    - {before: 50, rate: 200}               arrivals per second from connection 50 on
    - {before: 60, agent: {s1: "50%", s2: "drain # deploy"}}
                                            an agent check's answer (SPEC §22), as the
                                            agent would send it (a bad one is an error)
    - {before: 1, report: {s1: {load: 0.4, per_connection: 0.1}}}
                                            a pushed load report (least-load, load_source
                                            report; per_connection optional)
    - {before: 10, fail: [s1, s2]}          from here on, connects to s1 and s2 fail
    - {before: 90, recover: s1}             ... and to s1 complete again

With `locate`, every arrival is a locator answer (`Locator.locate`, SPEC §10): counted as a
pick exactly as `GET .../locate` counts it, and nothing is held -- so a report of 0.4
with 0.1 per connection reads 0.6 after two answers, Geode's own arithmetic.

With `rate:` events, connection k arrives 1 / rate after connection k - 1 (rate being
the one in force for k), so simulated time advances accordingly.

Clients (SPEC §12, for `maglev` and `persistence`): with `clients=K`, connection k comes
from client address number (k - 1) mod K + 1, counted from 10.0.0.0 (10.0.0.1, 10.0.0.2,
..., 10.0.0.255, 10.0.1.0, ...), source port 32768 + (k - 1) mod 28232 (Linux's ephemeral
range). Without it every connection comes from an address of its own. The result then
also holds each client's servers in order, and for every `join`, `leave`, `weight` or
`state` event how many clients moved: of the clients with a connection both before the
event and after it (before the next such event), those whose first server after it is
not their last server before it.

Connect failures (SPEC §23): a connect to a failing server is refused; the connection
is retried on another server, up to `retries` times, as `lbproxy run` does, and the
sequence holds the server that took it (`null`: none did). Failures feed outlier
detection (`outlier_detection:`), not health: in a simulation health changes only by
`join` and `leave` (no check runs). The result lists every ejection, with its end on the
simulated clock, every return, and every change of panic (`panic_threshold:`), each with
the connection it came before.

Per-source limits (a virtual server with a `per_source:` block, SPEC §23): every arrival
is admitted by the same table `lbproxy run` uses, before the throttle, with the client
address above (with `clients=K`, K clients; without, one address each, so only
`prefix_v4` groups them) on the simulated clock; an arrival refused is `null` in
`sequence` and counted in `rejected` ("per_source"). A connection's count ends with it:
at once without `hold`, at its `close:` event with it.

Throttle (a virtual server with a `throttle:` block): every arrival counts toward the
rate window; the monitor is simulated as it runs in `lbproxy run` -- an evaluation every
`throttle.interval` of simulated time while connections are held or arrived within the
last second, asleep (and set to low) once the virtual server is empty, woken by the next
arrival, which it evaluates at once; and, as there, an arrival that finds the load at
the next mode's threshold takes the mode up itself. Connections arriving in digg are
refused (`null` in `sequence`, counted as rejected "throttle"). Held connections count
as active; without `--hold` a connection is gone before the next arrives, so only the
rate drives the load. The result lists every change of mode or of the imposed idle
timeout; after the last arrival, evaluations go on until the mode is steady or the
monitor sleeps. Simulated connections carry no traffic, so the imposed idle timeout
closes none of them: a held connection stays until a `close:` event ends it.
"""

from __future__ import annotations

import ipaddress
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from lbproxy.config.model import Config, VirtualServerConfig
from lbproxy.core.per_source import Limits, PerSourceTable, SourceEntry
from lbproxy.core.pool import DISABLED, DRAIN, ENABLED, Lease, Pool, weight_error
from lbproxy.core.throttle import Change, Throttle
from lbproxy.wire.agent import AgentAnswer
from lbproxy.wire.agent import parse as parse_agent_answer

EVENT_KEYS = (
    "snmp",
    "join",
    "leave",
    "weight",
    "load_factor",
    "close",
    "state",
    "rate",
    "report",
    "agent",
    "fail",
    "recover",
)
REPORT_KEYS = ("load", "per_connection")


class SimulationError(Exception):
    """A bad events file or option; the message is for the user."""


@dataclass(frozen=True)
class Event:
    before: int
    actions: tuple[tuple[str, Any], ...]
    line: int = 0


@dataclass
class Pick:
    number: int  # 1-based connection number
    time: float
    server: str | None
    scores: dict[str, Any] = field(default_factory=dict)  # with explain: server -> score


@dataclass
class Moves:
    """How many clients changed server across one membership event."""

    before: int  # the event applied before this connection number
    event: str  # "leave s2", "join s2", "weight s1=3", ...
    seen: int = 0  # clients with a connection on both sides of the event
    moved: int = 0  # ... whose server changed
    moved_from: dict[str, int] = field(default_factory=dict)  # their old server -> count
    snapshot: dict[str, str | None] = field(default_factory=dict, repr=False)
    after: dict[str, str | None] = field(default_factory=dict, repr=False)

    def finish(self) -> None:
        for client, server in self.after.items():
            if client not in self.snapshot:
                continue
            self.seen += 1
            old = self.snapshot[client]
            if old != server:
                self.moved += 1
                key = old if old is not None else "-"
                self.moved_from[key] = self.moved_from.get(key, 0) + 1
        self.snapshot, self.after = {}, {}

    def as_json(self) -> dict[str, Any]:
        return {
            "before": self.before,
            "event": self.event,
            "clients": self.seen,
            "moved": self.moved,
            "moved_from": self.moved_from,
        }

    def line(self) -> str:
        origins = ", ".join(f"{name}: {n}" for name, n in sorted(self.moved_from.items()))
        return (
            f"{self.event} (before #{self.before}): {self.moved} of {self.seen} clients moved"
            + (f" (from {origins})" if origins else "")
        )


@dataclass(frozen=True)
class Protection:
    """An ejection, a return from one, or a change of panic, in a simulation."""

    connection: int  # the first connection to arrive after it
    time: float  # simulated seconds: when it happened (a return: when the ejection ended)
    event: str  # ejected | returned | panic | panic over
    real_server: str | None = None  # None: panic, of the virtual server
    until: float | None = None  # ejected: when it ends

    def as_json(self) -> dict[str, Any]:
        return {
            "connection": self.connection,
            "time": round(self.time, 6),
            "event": self.event,
            "real_server": self.real_server,
            "until": None if self.until is None else round(self.until, 6),
        }

    def line(self) -> str:
        at = f"{self.time:>9.3f}s  before #{self.connection:<6}"
        if self.event == "ejected":
            return f"  {at} {self.real_server} ejected until {self.until:.3f}s"
        if self.real_server is not None:
            return f"  {at} {self.real_server} {self.event}"
        return f"  {at} {self.event}"


@dataclass
class SimulationResult:
    virtual_server: str
    scheduler: str
    picks: dict[str, int]
    sequence: list[str | None]
    explain: list[Pick] = field(default_factory=list)
    throttle: ThrottleTimeline | None = None  # when the virtual server has a throttle
    clients: dict[str, list[str | None]] | None = None  # with `clients`: each one's servers
    moves: list[Moves] = field(default_factory=list)  # with `clients`: per membership event
    # Outlier ejections and panic (SPEC §23), when the virtual server has either
    protection: list[Protection] | None = None
    connect_failures: dict[str, int] = field(default_factory=dict)
    # Arrivals refused before a pick, by reason ("per_source", "throttle"); only those seen
    rejected: dict[str, int] = field(default_factory=dict)
    # What each score in `explain` is, in words (the scheduler's own legend)
    score_legend: str = ""

    def shares(self) -> dict[str, float]:
        total = sum(self.picks.values())
        return {name: (n / total if total else 0.0) for name, n in self.picks.items()}

    def as_json(self) -> dict[str, Any]:
        return (
            {
                "virtual_server": self.virtual_server,
                "picks": self.picks,
                "sequence": self.sequence,
            }
            | ({"throttle": self.throttle.as_json()} if self.throttle is not None else {})
            | (
                {"clients": self.clients, "moves": [m.as_json() for m in self.moves]}
                if self.clients is not None
                else {}
            )
            | (
                {
                    "protection": [p.as_json() for p in self.protection],
                    "connect_failures": self.connect_failures,
                }
                if self.protection is not None
                else {}
            )
            | ({"rejected": self.rejected} if self.rejected else {})
        )

    def protection_lines(self) -> list[str]:
        """Ejections and panic as text lines, for the terminal."""
        if self.protection is None:
            return []
        failed = ", ".join(f"{name} {n}" for name, n in self.connect_failures.items() if n)
        out = [f"connect failures: {failed or 'none'}"]
        out.append(f"ejections and panic: {len(self.protection) or 'none'}")
        out.extend(p.line() for p in self.protection)
        return out


@dataclass(frozen=True)
class ThrottleStep:
    """A change of throttle mode or imposed idle timeout in a simulation."""

    time: float  # simulated seconds
    connection: int  # the first connection to arrive under it (connections + 1: after all)
    mode: str
    load: float
    idle_timeout: float | None  # imposed; None: the virtual server's own

    def as_json(self) -> dict[str, Any]:
        return {
            "time": round(self.time, 6),
            "connection": self.connection,
            "mode": self.mode,
            "load": round(self.load, 4),
            "idle_timeout": None if self.idle_timeout is None else round(self.idle_timeout, 4),
        }


@dataclass
class ThrottleTimeline:
    """What the throttle decided during a simulation: the timeline and the refusals."""

    steps: list[ThrottleStep] = field(default_factory=list)
    refused: int = 0

    def as_json(self) -> dict[str, Any]:
        return {"refused": self.refused, "timeline": [s.as_json() for s in self.steps]}

    def lines(self) -> list[str]:
        """The timeline as aligned text lines, for the terminal."""
        out = [f"throttle: {self.refused} connection(s) refused in digg"]
        out.append(f"  {'time':>10}  {'from #':>7}  {'mode':<4}  {'load':>6}  idle timeout")
        for step in self.steps:
            timeout = "own" if step.idle_timeout is None else f"{step.idle_timeout:.3g}s"
            out.append(
                f"  {step.time:>9.3f}s  {step.connection:>7}  {step.mode:<4}  "
                f"{step.load:>6.2f}  {timeout}"
            )
        return out


def choose_virtual_server(config: Config, name: str | None) -> VirtualServerConfig:
    names = [vs.name for vs in config.virtual_servers]
    if name is None:
        if len(names) != 1:
            raise SimulationError(
                f"the configuration has {len(names)} virtual servers "
                f"({', '.join(names)}); choose one with --virtual-server"
            )
        return config.virtual_servers[0]
    for vs in config.virtual_servers:
        if vs.name == name:
            return vs
    raise SimulationError(f"no virtual server {name!r}; configured: {', '.join(names)}")


def parse_events(text: str, filename: str, servers: list[str]) -> list[Event]:
    """Parse and check an events file; every problem is reported at once."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else 1
        raise SimulationError(f"{filename}:{line}: {exc}") from None
    if root is None:
        return []
    if not isinstance(root, yaml.SequenceNode):
        raise SimulationError(f"{filename}:{root.start_mark.line + 1}: events must be a list")
    problems: list[str] = []
    events: list[Event] = []
    constructor = yaml.SafeLoader("")
    for node in root.value:
        line = node.start_mark.line + 1
        where = f"{filename}:{line}"
        if not isinstance(node, yaml.MappingNode):
            problems.append(f"{where}: each event must be a mapping like {{before: 1, ...}}")
            continue
        before = None
        actions: list[tuple[str, Any]] = []
        for key_node, value_node in node.value:
            key = key_node.value
            value = constructor.construct_object(value_node, deep=True)
            if key == "before":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    problems.append(f"{where}: before must be an integer >= 1, got {value!r}")
                else:
                    before = value
            elif key not in EVENT_KEYS:
                problems.append(
                    f"{where}: unknown event key {key!r}; known: before, {', '.join(EVENT_KEYS)}"
                )
            else:
                problem = _check_action(key, value, servers)
                if problem:
                    problems.append(f"{where}: {problem}")
                else:
                    actions.append((key, value))
        if before is None and not any(p.startswith(where) for p in problems):
            problems.append(f"{where}: event needs 'before: N'")
        if before is not None:
            events.append(Event(before, tuple(actions), line))
    if problems:
        raise SimulationError("\n".join(problems))
    events.sort(key=lambda e: e.before)  # stable: same `before` keeps file order
    return events


def _check_action(key: str, value: Any, servers: list[str]) -> str | None:
    def unknown(name: Any) -> str | None:
        if name not in servers:
            return f"{key}: unknown real server {name!r}; configured: {', '.join(servers)}"
        return None

    if key in ("join", "leave", "fail", "recover"):
        names = value if isinstance(value, list) else [value]
        return next((p for p in map(unknown, names) if p), None)
    if key == "rate":
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            return f"rate must be a number of connections per second > 0, got {value!r}"
        return None
    if not isinstance(value, dict):
        return f"{key} must be a mapping of real server to value, like {{s1: 3}}"
    for name, number in value.items():
        problem = unknown(name)
        if problem:
            return problem
        if key == "agent":
            problem = _check_agent(name, number)
            if problem:
                return problem
            continue
        if key == "report":
            problem = _check_report(name, number)
            if problem:
                return problem
            continue
        if key == "state":
            if number not in (ENABLED, DRAIN, DISABLED):
                return f"state of {name} must be enabled, drain or disabled, got {number!r}"
            continue
        if key == "weight" and (error := weight_error(number)):
            return f"{error} (real server {name})"  # the rule of PATCH and set-weight
        if isinstance(number, bool) or not isinstance(number, int | float) or number < 0:
            return f"{key} of {name} must be a number >= 0, got {number!r}"
        if key == "close" and not isinstance(number, int):
            return f"close of {name} must be an integer, got {number!r}"
        if key == "load_factor" and number <= 0:
            return f"load_factor of {name} must be > 0, got {number!r}"
    return None


def _check_agent(name: str, answer: Any) -> str | None:
    example = 'like "50%", "maxconn:10 drain # deploy" or "up"'
    if not isinstance(answer, str):
        return f"agent of {name} must be the agent's line as a string, {example}"
    parsed = parse_agent_answer(answer.encode())
    if not isinstance(parsed, AgentAnswer):
        return (
            f"agent of {name}: {answer!r} is a bad answer ({parsed.why}): lbproxy would "
            f"count it and change nothing; write a good one, {example}"
        )
    return None


def _check_report(name: str, report: Any) -> str | None:
    example = "like {load: 0.4, per_connection: 0.1}"
    if not isinstance(report, dict) or "load" not in report or set(report) - set(REPORT_KEYS):
        return f"report of {name} must be a mapping {example}"
    for key, number in report.items():
        if isinstance(number, bool) or not isinstance(number, int | float) or not number >= 0:
            return f"report of {name}: {key} must be a number >= 0, got {number!r}"
    return None


def simulate(
    vs: VirtualServerConfig,
    connections: int,
    *,
    hold: bool = False,
    locate: bool = False,
    events: list[Event] = (),  # type: ignore[assignment]  # an immutable default, never changed
    rate: float = 10.0,
    explain: bool = False,
    clients: int | None = None,
) -> SimulationResult:
    pool = Pool(vs, now=0.0)
    per_client: dict[str, list[str | None]] | None = {} if clients else None
    last: dict[str, str | None] = {}  # each client's latest server
    moves: list[Moves] = []
    held: dict[str, deque[Lease]] = {rs.name: deque() for rs in pool.servers}
    picks = {rs.name: 0 for rs in pool.servers}
    sequence: list[str | None] = []
    trace: list[Pick] = []
    pending = deque(events)
    monitor = _Monitor(vs.throttle) if vs.throttle is not None else None
    watch = _ProtectionWatch(pool) if _protects(vs, events) else None
    sources = _per_source_table(vs)
    counted: dict[int, SourceEntry] = {}  # a held lease's network entry, by id(lease)

    def ended(lease: Lease) -> None:  # a held connection closed: its network counts one less
        entry = counted.pop(id(lease), None)
        if entry is not None and sources is not None:
            sources.release(entry)

    # Connection k arrives at base_time + (k - base_number) / rate: exact multiples of
    # 1 / rate without `rate:` events, as before they existed.
    base_time, base_number, now = 0.0, 1, 0.0
    for number in range(1, connections + 1):
        due = []
        while pending and pending[0].before <= number:
            due.append(pending.popleft())
        new_rate = next(
            (v for event in reversed(due) for k, v in reversed(event.actions) if k == "rate"),
            None,
        )
        if new_rate is not None and number > 1:
            base_time, base_number = now + 1.0 / new_rate, number
        rate = rate if new_rate is None else float(new_rate)
        now = base_time + (number - base_number) / rate
        if monitor is not None:
            monitor.catch_up(now, pool.active, number)
        for event in due:
            for key, value in event.actions:
                if key in ("fail", "recover"):
                    if watch is not None:
                        watch.set_failing(value, key == "fail")
                elif key != "rate":
                    _apply(pool, key, value, held, now, ended)
            if per_client is not None and any(key in MEMBERSHIP_KEYS for key, _ in event.actions):
                if moves:
                    moves[-1].finish()
                moves.append(Moves(number, _describe(event), snapshot=dict(last)))
        client = (
            client_address(number, clients)
            if per_client is not None or pool.reads_client or sources is not None
            else None
        )
        tracked: SourceEntry | None = None
        if sources is not None:
            assert client is not None  # made above whenever there is a table
            admitted = sources.admit(client[0], now)
            if admitted is None:
                pool.rejected["per_source"] += 1
                sequence.append(None)
                if explain:
                    trace.append(Pick(number, now, None, {"per_source": "refused"}))
                continue
            if isinstance(admitted, SourceEntry):  # True: let in untracked (a full table)
                tracked = admitted
        if monitor is not None and monitor.arrival(now, pool.active, number):
            pool.rejected["throttle"] += 1
            sequence.append(None)
            if explain:
                trace.append(Pick(number, now, None, {"throttle": "refused (digg)"}))
            continue
        scores = pool.scores() if explain else {}
        if locate:  # a locator answer: counted as a pick, no connection held
            located = pool.locator.locate(now, via="simulate", client=client)
            rs = None if located is None else located.server
        else:
            rs = pool.pick(now, (), client)
            if watch is not None:
                watch.seen(number, now)  # ejections ended and panic changed by events
                rs = watch.connect(rs, now, client, number)
        if per_client is not None:
            assert client is not None  # made above whenever per_client is
            name = rs.name if rs is not None else None
            per_client.setdefault(client[0], []).append(name)
            last[client[0]] = name
            if moves and client[0] not in moves[-1].after:
                moves[-1].after[client[0]] = name
        if rs is None:
            sequence.append(None)
            if tracked is not None:
                sources.release(tracked)  # type: ignore[union-attr]  # set with the table
        else:
            picks[rs.name] += 1
            sequence.append(rs.name)
            if not locate:
                lease = pool.take(rs, now, None, client)
                pool.established(lease)  # connects to a failing server never get here
                if rs.outlier is not None:
                    pool.connect_completed(rs, now)
                if hold:
                    held[rs.name].append(lease)
                    if tracked is not None:
                        counted[id(lease)] = tracked
                else:
                    pool.drop(lease, now)
                    if tracked is not None:
                        sources.release(tracked)  # type: ignore[union-attr]  # set with the table
            elif tracked is not None:
                sources.release(tracked)  # type: ignore[union-attr]  # a locator answer holds nothing
        if explain:
            trace.append(Pick(number, now, rs.name if rs else None, scores))
        if monitor is not None:
            monitor.woken(now, pool.active, number)
    timeline = None
    if monitor is not None:
        monitor.finish(pool.active, connections + 1)
        timeline = monitor.timeline
    if moves:
        moves[-1].finish()
    result = SimulationResult(
        vs.name, vs.scheduler, picks, sequence, trace, timeline, per_client, moves
    )
    result.rejected = {reason: n for reason, n in pool.rejected.items() if n}
    result.score_legend = pool.scheduler.score_legend
    if watch is not None:
        pool.advance(now)
        watch.seen(connections + 1, now)
        result.protection = watch.timeline
        result.connect_failures = watch.failures
    return result


def _per_source_table(vs: VirtualServerConfig) -> PerSourceTable | None:
    """The per-source table `lbproxy run` would give `vs` (dataplane/virtual_server.py)."""
    config = vs.per_source
    if config is None:
        return None
    return PerSourceTable(Limits.of(config))


def _protects(vs: VirtualServerConfig, events: list[Event]) -> bool:
    """Does the simulation show ejections and panic (configured, or failures asked)?"""
    asked = any(key in ("fail", "recover") for event in events for key, _ in event.actions)
    return asked or vs.outlier_detection is not None or vs.panic_threshold > 0


class _ProtectionWatch:
    """Connect failures on simulated time, and what outlier detection and panic made
    of them: the pool's own code decides, this only records what changed."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.failing: set[str] = set()
        self.failures = {rs.name: 0 for rs in pool.servers}
        self.timeline: list[Protection] = []
        self.ejected: dict[str, float] = {}  # name -> until, as last seen
        self.panic = False

    def set_failing(self, names: Any, failing: bool) -> None:
        for name in names if isinstance(names, list) else [names]:
            if failing:
                self.failing.add(name)
            else:
                self.failing.discard(name)

    def connect(self, rs: Any, now: float, client: tuple[str, int] | None, number: int) -> Any:
        """Connect to `rs` (picked); on a failure, retry as the connection handler does.
        Returns the server that took the connection, or None."""
        pool = self.pool
        tried: list[Any] = []
        while rs is not None and rs.name in self.failing:
            pool.drop(pool.take(rs, now, None, client), now)
            rs.counters.connect_failures["refused"] += 1
            self.failures[rs.name] += 1
            pool.connect_failed(rs, now)
            self.seen(number, now)
            tried.append(rs)
            if len(tried) > pool.config.retries:
                pool.rejected["connect_failed"] += 1
                return None
            rs = pool.pick(now, tried, client)
        return rs

    def seen(self, number: int, now: float) -> None:
        """Record what changed since the last look (O(servers): offline only)."""
        pool = self.pool
        for rs in pool.servers:
            until = pool.ejected_until(rs)
            was = self.ejected.get(rs.name)
            if until is not None and until != was:
                self.ejected[rs.name] = until
                self.timeline.append(Protection(number, now, "ejected", rs.name, until))
            elif until is None and was is not None:
                del self.ejected[rs.name]
                self.timeline.append(Protection(number, was, "returned", rs.name))
        if pool.panic != self.panic:
            self.panic = pool.panic
            self.timeline.append(Protection(number, now, "panic" if pool.panic else "panic over"))


MEMBERSHIP_KEYS = ("join", "leave", "weight", "state", "agent")
_FIRST_CLIENT = ipaddress.IPv4Address("10.0.0.0")


def client_address(number: int, clients: int | None) -> tuple[str, int]:
    """The simulated client of connection `number` (1-based), as `(host, port)`."""
    index = (number - 1) % clients if clients else number - 1
    return str(_FIRST_CLIENT + 1 + index), 32768 + (number - 1) % 28232


def _describe(event: Event) -> str:
    parts = []
    for key, value in event.actions:
        if key not in MEMBERSHIP_KEYS:
            continue
        if isinstance(value, dict):
            parts.append(f"{key} " + ", ".join(f"{k}={v}" for k, v in value.items()))
        else:
            parts.append(f"{key} " + ", ".join(value if isinstance(value, list) else [value]))
    return "; ".join(parts)


class _Monitor:
    """throttle_monitor.ThrottleMonitor's schedule on simulated time."""

    def __init__(self, config: Any) -> None:
        self.model = Throttle(config)
        self.interval = config.interval
        self.next_eval: float | None = None  # None: asleep until the next arrival
        self.timeline = ThrottleTimeline()

    def catch_up(self, now: float, active: int, number: int) -> None:
        """Run the evaluations due up to `now`; nothing changed between arrivals."""
        model = self.model
        while self.next_eval is not None and self.next_eval <= now:
            at = self.next_eval
            if model.idle(active, at):
                self._record(model.reset(at), number)
                self.next_eval = None
                return
            change = model.evaluate(active, at)
            self._record(change, number)
            self.next_eval = at + self.interval
            if change is None and model.window.count(at) == 0 and self.next_eval <= now:
                # Steady: the same inputs give the same mode until the next arrival, so
                # skip to the last evaluation due (a long gap costs O(1), not O(gap)).
                steps = int((now - self.next_eval) / self.interval)
                self.next_eval += steps * self.interval

    def arrival(self, now: float, active: int, number: int) -> bool:
        """One arrival while `active` connections are held; True: refused (digg)."""
        model = self.model
        self._record(model.arrival(now, active), number)  # may take the mode up at once
        refused = model.refusing
        self.timeline.refused += refused
        return refused

    def woken(self, now: float, active: int, number: int) -> None:
        if self.next_eval is None:  # the arrival woke the monitor: evaluated at once
            self._record(self.model.evaluate(active, now), number + 1)
            self.next_eval = now + self.interval

    def finish(self, active: int, number: int) -> None:
        """After the last arrival: evaluate until the mode is steady or the VS is empty."""
        model = self.model
        while self.next_eval is not None:
            at = self.next_eval
            if model.idle(active, at):
                self._record(model.reset(at), number)
                return
            change = model.evaluate(active, at)
            self._record(change, number)
            if change is None and model.window.count(at) == 0:
                return
            self.next_eval = at + self.interval

    def _record(self, change: Change | None, number: int) -> None:
        if change is not None:
            self.timeline.steps.append(
                ThrottleStep(change.time, number, change.mode, change.load, change.idle_timeout)
            )


def _apply(
    pool: Pool,
    key: str,
    value: Any,
    held: dict[str, deque[Lease]],
    now: float,
    ended: Callable[[Lease], None] | None = None,
) -> None:
    by_name = pool.by_name
    if key in ("join", "leave"):
        for name in value if isinstance(value, list) else [value]:
            rs = by_name[name]
            if key == "join":
                rs.health.force(True)
                pool.set_state(rs, ENABLED, now)  # also re-evaluates health
            else:
                rs.health.force(False)
                pool.set_state(rs, rs.state, now)
        return
    for name, number in value.items():
        rs = by_name[name]
        if key == "snmp":
            pool.report_value(rs, number, now)
        elif key == "report":
            pool.locator.report_load(rs, number["load"], number.get("per_connection"))
        elif key == "weight":
            pool.set_weight(rs, number, now)
        elif key == "load_factor":
            rs.load_factor = float(number)
        elif key == "state":
            pool.set_state(rs, number, now)
        elif key == "agent":
            answer = parse_agent_answer(number.encode())
            if isinstance(answer, AgentAnswer):  # always: _check_agent refused bad ones
                pool.apply_agent(rs, answer, now, wall=now)
        elif key == "close":
            leases = held[name]
            for _ in range(min(number, len(leases))):
                lease = leases.popleft()
                pool.drop(lease, now)
                if ended is not None:
                    ended(lease)
