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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import yaml

from lbproxy.config import Config, VirtualServerConfig
from lbproxy.pool import DISABLED, DRAIN, ENABLED, Lease, Pool

EVENT_KEYS = ("snmp", "join", "leave", "weight", "load_factor", "close", "state")


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
class SimulationResult:
    virtual_server: str
    scheduler: str
    picks: dict[str, int]
    sequence: list[str | None]
    explain: list[Pick] = field(default_factory=list)

    def shares(self) -> dict[str, float]:
        total = sum(self.picks.values())
        return {name: (n / total if total else 0.0) for name, n in self.picks.items()}

    def as_json(self) -> dict[str, Any]:
        return {
            "virtual_server": self.virtual_server,
            "picks": self.picks,
            "sequence": self.sequence,
        }


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

    if key in ("join", "leave"):
        names = value if isinstance(value, list) else [value]
        return next((p for p in map(unknown, names) if p), None)
    if not isinstance(value, dict):
        return f"{key} must be a mapping of real server to value, like {{s1: 3}}"
    for name, number in value.items():
        problem = unknown(name)
        if problem:
            return problem
        if key == "state":
            if number not in (ENABLED, DRAIN, DISABLED):
                return f"state of {name} must be enabled, drain or disabled, got {number!r}"
            continue
        if isinstance(number, bool) or not isinstance(number, int | float) or number < 0:
            return f"{key} of {name} must be a number >= 0, got {number!r}"
        if key == "close" and not isinstance(number, int):
            return f"close of {name} must be an integer, got {number!r}"
        if key == "load_factor" and number <= 0:
            return f"load_factor of {name} must be > 0, got {number!r}"
    return None


def simulate(
    vs: VirtualServerConfig,
    connections: int,
    *,
    hold: bool = False,
    events: list[Event] = (),  # type: ignore[assignment]
    rate: float = 10.0,
    explain: bool = False,
) -> SimulationResult:
    pool = Pool(vs, now=0.0)
    held: dict[str, deque[Lease]] = {rs.name: deque() for rs in pool.servers}
    picks = {rs.name: 0 for rs in pool.servers}
    sequence: list[str | None] = []
    trace: list[Pick] = []
    pending = deque(events)
    for number in range(1, connections + 1):
        now = (number - 1) / rate
        while pending and pending[0].before <= number:
            for key, value in pending.popleft().actions:
                _apply(pool, key, value, held, now)
        scores = pool.scores() if explain else {}
        rs = pool.pick(now)
        if rs is None:
            sequence.append(None)
        else:
            picks[rs.name] += 1
            sequence.append(rs.name)
            lease = pool.take(rs, now)
            if hold:
                held[rs.name].append(lease)
            else:
                pool.drop(lease, now)
        if explain:
            trace.append(Pick(number, now, rs.name if rs else None, scores))
    return SimulationResult(vs.name, vs.scheduler, picks, sequence, trace)


def _apply(pool: Pool, key: str, value: Any, held: dict[str, deque[Lease]], now: float) -> None:
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
        elif key == "weight":
            pool.set_weight(rs, number, now)
        elif key == "load_factor":
            rs.load_factor = float(number)
        elif key == "state":
            pool.set_state(rs, number, now)
        elif key == "close":
            leases = held[name]
            for _ in range(min(number, len(leases))):
                pool.drop(leases.popleft(), now)
