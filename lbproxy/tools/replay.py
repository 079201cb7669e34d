"""`lbproxy simulate --replay`: a traffic log through the real pools and schedulers of
one or several configurations, on a clock the log drives (SPEC §25).

PURE (no sockets, no sleeping, no clock read). The log is read whole (`read_log`), its
connections kept in compact arrays, and replayed in order of start time: a log is
written as connections end, so its lines are in order of end, and any two lines may be
out of start order. The order is a stable sort by start (lines that start together
keep their order in the file), whatever the lines' order in the file.

Each configuration gets a `Pool` per virtual server (core/pool.py: the object `lbproxy
run` and `lbproxy simulate` use), made at the log's first start. Each logged
connection, at its logged start (seconds after the first one, the pool's clock), first
ends the held connections due by then (each at its own end, in order of end: a
connection ending when another starts is gone before that one arrives), then gets a
`pick` with its client address and port, and holds its `take` for its logged duration.
A pick that finds no server (all disabled, all at max_connections) is counted as not
placed. No health check, agent or SNMP poll runs: the servers are as the configuration
starts them.

What is counted, per configuration, virtual server and real server: connections
(share: of the virtual server's placed ones) and the peak of concurrent connections;
per client (source address) and virtual server, the server of its first connection,
from which `moved` compares a configuration with the first one.
"""

from __future__ import annotations

import gzip
import heapq
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any

from lbproxy.config.model import Config
from lbproxy.core.pool import ENABLED, Pool
from lbproxy.tools.traffic_log import PARSERS, Logged, Malformed

MALFORMED_SHOWN = 5  # the first this many malformed lines are named


@dataclass
class Traffic:
    """A log's connections, in compact arrays (index i: one connection), sorted by start."""

    source: str
    starts: array[float] = field(default_factory=lambda: array("d"))  # since the first
    durations: array[float] = field(default_factory=lambda: array("d"))
    vs_ids: array[int] = field(default_factory=lambda: array("I"))  # into virtual_servers
    client_ids: array[int] = field(default_factory=lambda: array("I"))  # into clients
    ports: array[int] = field(default_factory=lambda: array("H"))
    virtual_servers: list[str] = field(default_factory=list)
    frontends: list[str] = field(default_factory=list)  # each virtual server's ("": none)
    clients: list[str] = field(default_factory=list)
    lines: int = 0  # lines read
    malformed: int = 0
    first_malformed: list[tuple[int, str]] = field(default_factory=list)  # (line, reason)
    first_start: float = 0.0  # seconds since the epoch, of the earliest start
    span: float = 0.0  # seconds from the first start to the last end

    def __len__(self) -> int:
        return len(self.starts)


def open_log(path: str) -> IO[str]:
    """The log as text: gzip'd when its name ends in .gz; bad bytes are replaced (the
    line is then malformed, not the reading)."""
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def read_log(lines: Iterable[str], log_format: str, source: str = "-") -> Traffic:
    """Parse every line, count and keep the first malformed ones, and sort by start."""
    parse: Callable[[str], Logged | Malformed | None] = PARSERS[log_format]
    raw_starts, durations = array("d"), array("d")
    vs_ids, client_ids, ports = array("I"), array("I"), array("H")
    vs_index: dict[tuple[str, str], int] = {}
    client_index: dict[str, int] = {}
    traffic = Traffic(source)
    number = 0
    for number, line in enumerate(lines, 1):
        parsed = parse(line)
        if parsed is None:
            continue
        if isinstance(parsed, Malformed):
            traffic.malformed += 1
            if len(traffic.first_malformed) < MALFORMED_SHOWN:
                traffic.first_malformed.append((number, parsed.reason))
            continue
        start, duration, vs, client, port, frontend = parsed
        raw_starts.append(start)
        durations.append(duration)
        vs_id = vs_index.get((vs, frontend))
        if vs_id is None:
            vs_id = vs_index[vs, frontend] = len(vs_index)
        vs_ids.append(vs_id)
        client_id = client_index.get(client)
        if client_id is None:
            client_id = client_index[client] = len(client_index)
        client_ids.append(client_id)
        ports.append(port)
    traffic.lines = number
    traffic.virtual_servers = [vs for vs, _ in vs_index]
    traffic.frontends = [frontend for _, frontend in vs_index]
    traffic.clients = list(client_index)
    if not raw_starts:
        return traffic
    first = min(raw_starts)
    traffic.first_start = first
    order = sorted(range(len(raw_starts)), key=raw_starts.__getitem__)  # stable
    traffic.starts = array("d", [raw_starts[i] - first for i in order])
    traffic.durations = array("d", map(durations.__getitem__, order))
    traffic.vs_ids = array("I", map(vs_ids.__getitem__, order))
    traffic.client_ids = array("I", map(client_ids.__getitem__, order))
    traffic.ports = array("H", map(ports.__getitem__, order))
    traffic.span = max(s + d for s, d in zip(traffic.starts, traffic.durations, strict=True))
    return traffic


@dataclass
class VirtualServerReplay:
    """One virtual server of one configuration, after the replay."""

    name: str
    scheduler: str
    connections: dict[str, int]  # real server -> connections placed on it
    peaks: dict[str, int]  # real server -> most connections at once
    not_placed: int = 0  # picks that found no server
    # Servers configured to stand by (disabled, drain, weight 0, backup): not in the
    # mean of the peaks unless they held a connection, so that a backup server waiting
    # as it should does not make the others look busy
    standby: frozenset[str] = frozenset()
    # client id -> the real server of its first connection here (None: not placed)
    first: dict[int, str | None] = field(default_factory=dict, repr=False)

    @property
    def placed(self) -> int:
        return sum(self.connections.values())

    def shares(self) -> dict[str, float]:
        total = self.placed
        return {name: (n / total if total else 0.0) for name, n in self.connections.items()}

    def mean_peak(self) -> float:
        """The mean of the peaks of the servers that take connections (see `standby`)."""
        counted = [n for name, n in self.peaks.items() if n or name not in self.standby]
        return sum(counted) / len(counted) if counted else 0.0

    def peak_ratio(self) -> float | None:
        """The busiest server's peak over `mean_peak`; None when no server ever held a
        connection (or there is none)."""
        mean = self.mean_peak()
        return max(self.peaks.values()) / mean if mean else None

    def busiest(self) -> str | None:
        """The real server with the highest peak (the first configured, on a tie)."""
        if not self.peaks:
            return None
        return max(self.peaks, key=lambda name: self.peaks[name])

    def as_json(self) -> dict[str, Any]:
        shares = self.shares()
        ratio = self.peak_ratio()
        return {
            "scheduler": self.scheduler,
            "connections": self.placed + self.not_placed,
            "not_placed": self.not_placed,
            "clients": len(self.first),
            "peak_ratio": None if ratio is None else round(ratio, 4),
            "real_servers": {
                name: {
                    "connections": n,
                    "share": round(shares[name], 6),
                    "peak": self.peaks[name],
                }
                for name, n in self.connections.items()
            },
        }


@dataclass(frozen=True)
class Moved:
    """Between the first configuration and another, for one virtual server: of the
    clients both saw, those whose first connection went to another real server."""

    virtual_server: str
    clients: int
    moved: int

    @property
    def percent(self) -> float:
        return 100.0 * self.moved / self.clients if self.clients else 0.0

    def as_json(self) -> dict[str, Any]:
        return {"clients": self.clients, "moved": self.moved, "percent": round(self.percent, 4)}


@dataclass
class ConfigurationReplay:
    label: str  # what the user named it (the CONFIG argument)
    virtual_servers: dict[str, VirtualServerReplay]
    missing: dict[str, int]  # virtual servers of the log it lacks -> their connections
    moved: list[Moved] | None = None  # vs the first configuration; None for the first

    def moved_total(self) -> Moved | None:
        if self.moved is None:
            return None
        return Moved("*", sum(m.clients for m in self.moved), sum(m.moved for m in self.moved))

    def as_json(self) -> dict[str, Any]:
        total = self.moved_total()
        return {
            "configuration": self.label,
            "virtual_servers": {name: vs.as_json() for name, vs in self.virtual_servers.items()},
            "missing_virtual_servers": self.missing,
            "moved": None
            if self.moved is None or total is None
            else {
                "clients": total.clients,
                "moved": total.moved,
                "percent": round(total.percent, 4),
                "virtual_servers": {m.virtual_server: m.as_json() for m in self.moved},
            },
        }


def replay(traffic: Traffic, config: Config, label: str) -> ConfigurationReplay:
    """Replay `traffic` through the pools of `config` (see the module's docstring)."""
    pools: list[Pool | None] = []
    results: list[VirtualServerReplay | None] = []
    configured = {vs.name: vs for vs in config.virtual_servers}
    made_for: dict[str, tuple[Pool, VirtualServerReplay]] = {}
    for logged, frontend in zip(traffic.virtual_servers, traffic.frontends, strict=True):
        name = _virtual_server_of(logged, frontend, configured)
        vs = configured.get(name)
        if vs is None:
            pools.append(None)
            results.append(None)
            continue
        if name in made_for:  # several frontends' lines, one virtual server
            pools.append(made_for[name][0])
            results.append(made_for[name][1])
            continue
        made = Pool(vs, now=0.0)
        pools.append(made)
        names = [rs.name for rs in made.servers]
        standby = frozenset(
            rs.name for rs in vs.real_servers if rs.state != ENABLED or rs.weight == 0 or rs.backup
        )
        made_result = VirtualServerReplay(
            name,
            vs.scheduler,
            dict.fromkeys(names, 0),
            dict.fromkeys(names, 0),
            standby=standby,
        )
        results.append(made_result)
        made_for[name] = (made, made_result)
    missing = dict.fromkeys(
        (name for name, pool in zip(traffic.virtual_servers, pools, strict=True) if pool is None),
        0,
    )
    reads_client = [pool is not None and pool.reads_client for pool in pools]
    clients, ports = traffic.clients, traffic.ports
    held: list[tuple[float, int, Pool, Any]] = []  # (end, number, pool, lease): a heap
    push, pop = heapq.heappush, heapq.heappop
    for number, (now, duration, vs_id, client_id) in enumerate(
        zip(traffic.starts, traffic.durations, traffic.vs_ids, traffic.client_ids, strict=True)
    ):
        while held and held[0][0] <= now:
            end, _, ending_pool, lease = pop(held)
            ending_pool.drop(lease, end)
        pool = pools[vs_id]
        result = results[vs_id]
        if pool is None or result is None:
            missing[traffic.virtual_servers[vs_id]] += 1
            continue
        client = (clients[client_id], ports[number]) if reads_client[vs_id] else None
        rs = pool.pick(now, (), client)
        first = result.first
        if rs is None:
            result.not_placed += 1
            if client_id not in first:
                first[client_id] = None
            continue
        name = rs.name
        if client_id not in first:
            first[client_id] = name
        result.connections[name] += 1
        lease = pool.take(rs, now, None, client)
        if rs.active > result.peaks[name]:
            result.peaks[name] = rs.active
        push(held, (now + duration, number, pool, lease))
    return ConfigurationReplay(
        label,
        {r.name: r for r in results if r is not None},
        {name: n for name, n in missing.items()},
    )


def _virtual_server_of(logged: str, frontend: str, configured: dict[str, Any]) -> str:
    """The virtual server of a log line: HAProxy's backend, or the copy `lbproxy import`
    made of it for this frontend (`BACKEND-FRONTEND`, `:` written `-`) when there is one."""
    if frontend:
        copy = f"{logged}-{frontend}".replace(":", "-")
        if copy in configured:
            return copy
    return logged


def compare(first: ConfigurationReplay, other: ConfigurationReplay) -> list[Moved]:
    """For each virtual server both replayed: how many of its clients' first connection
    went to another real server in `other` than in `first`."""
    moved = []
    for name, before in first.virtual_servers.items():
        after = other.virtual_servers.get(name)
        if after is None:
            continue
        seen = changed = 0
        for client, server in before.first.items():
            if client in after.first:
                seen += 1
                changed += after.first[client] != server
        moved.append(Moved(name, seen, changed))
    return moved


def replay_all(traffic: Traffic, configs: list[tuple[str, Config]]) -> list[ConfigurationReplay]:
    """Each configuration in turn; every one after the first compared with the first."""
    results: list[ConfigurationReplay] = []
    for label, config in configs:
        result = replay(traffic, config, label)
        if results:
            result.moved = compare(results[0], result)
        results.append(result)
    return results


@dataclass(frozen=True)
class GateFailure:
    gate: str  # max-moved | max-peak-ratio
    configuration: str
    virtual_server: str
    limit: float
    value: float
    detail: str

    def line(self) -> str:
        over = self.value - self.limit
        unit = " points" if self.gate == "max-moved" else ""
        return (
            f"gate --{self.gate} {self.limit:g} exceeded by {over:.4g}{unit}: "
            f"{self.configuration}, virtual server {self.virtual_server}: {self.detail}"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "gate": self.gate,
            "configuration": self.configuration,
            "virtual_server": self.virtual_server,
            "limit": self.limit,
            "value": round(self.value, 6),
            "over": round(self.value - self.limit, 6),
        }


def gates(
    results: list[ConfigurationReplay],
    max_moved: float | None,
    max_peak_ratio: float | None,
) -> list[GateFailure]:
    """Every virtual server of every configuration over a limit given (None: no gate)."""
    failures = []
    for result in results:
        if max_peak_ratio is not None:
            for name, vs in result.virtual_servers.items():
                ratio = vs.peak_ratio()
                if ratio is not None and ratio > max_peak_ratio:
                    busiest = vs.busiest()
                    mean = vs.mean_peak()
                    failures.append(
                        GateFailure(
                            "max-peak-ratio",
                            result.label,
                            name,
                            max_peak_ratio,
                            ratio,
                            f"peak {vs.peaks[busiest] if busiest else 0} on {busiest} "
                            f"over a mean peak of {mean:.4g} is {ratio:.4g}",
                        )
                    )
        if max_moved is not None and result.moved is not None:
            for moved in result.moved:
                if moved.percent > max_moved:
                    failures.append(
                        GateFailure(
                            "max-moved",
                            result.label,
                            moved.virtual_server,
                            max_moved,
                            moved.percent,
                            f"{moved.moved} of {moved.clients} clients moved "
                            f"({moved.percent:.4g}%) from {results[0].label}",
                        )
                    )
    return failures


def summary_lines(traffic: Traffic, results: list[ConfigurationReplay]) -> Iterator[str]:
    """The replay for a terminal: the log, then each configuration's table."""
    yield (
        f"replayed {len(traffic)} connections from {traffic.source} "
        f"({traffic.lines} lines, {traffic.malformed} malformed), "
        f"{len(traffic.clients)} clients, {traffic.span:.3f}s of traffic"
    )
    for result in results:
        yield ""
        yield f"configuration {result.label}"
        for name, vs in result.virtual_servers.items():
            ratio = vs.peak_ratio()
            yield (
                f"  virtual server {name} ({vs.scheduler}): {vs.placed + vs.not_placed} "
                f"connections, {len(vs.first)} clients, peak ratio "
                + ("-" if ratio is None else f"{ratio:.2f}")
                + (f", {vs.not_placed} not placed (no server)" if vs.not_placed else "")
            )
            width = max([len("real server"), *map(len, vs.connections)])
            yield f"    {'real server':<{width}}  {'connections':>11}  {'share':>7}  {'peak':>6}"
            shares = vs.shares()
            for rs, n in vs.connections.items():
                yield (f"    {rs:<{width}}  {n:>11}  {100 * shares[rs]:>6.2f}%  {vs.peaks[rs]:>6}")
        for name, n in result.missing.items():
            yield (
                f"  virtual server {name}: not in this configuration "
                f"({n} connection{'s' if n != 1 else ''})"
            )
        if result.moved is not None:
            total = result.moved_total()
            assert total is not None  # with `moved`
            yield (
                f"  moved from {results[0].label}: {total.moved} of {total.clients} clients "
                f"({total.percent:.2f}%)"
            )
            for moved in result.moved:
                yield (
                    f"    {moved.virtual_server}: {moved.moved} of {moved.clients} "
                    f"({moved.percent:.2f}%)"
                )


def as_json(
    traffic: Traffic, results: list[ConfigurationReplay], failures: list[GateFailure]
) -> dict[str, Any]:
    return {
        "log": traffic.source,
        "lines": traffic.lines,
        "connections": len(traffic),
        "malformed": traffic.malformed,
        "clients": len(traffic.clients),
        "first_start": _iso(traffic.first_start) if len(traffic) else None,
        "span_s": round(traffic.span, 6),
        "configurations": [result.as_json() for result in results],
        "gates": [failure.as_json() for failure in failures],
    }


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=UTC).isoformat().replace("+00:00", "Z")
