"""least-load: Apache Geode's locator (seeds/000).

load(server) = last reported load + estimate x connections sent there since that report

- `load_source: connections`: the report is active / max_connections, sampled every
  `load_poll_interval` ("the number of connections to the server divided by the server's
  max-connections setting"); the estimate per connection is 1 / max_connections.
- `load_source: snmp`: the report is the polled value / `snmp.max_value`, arriving with
  every SNMP answer; the estimate is 1 / max_connections, or 1 / max_value (one unit of
  the reported value) when the server has no max_connections.
- `load_source: report`: the servers push their own load and per-connection estimate
  (`PUT .../load`, Geode's `ServerLoadProbe`; `Locator.report_load`). The estimate is
  the reported `per_connection`, by default 1 / max_connections (0 without one); a
  server that has never reported has load 0. Reports live in the pool's locator
  (core/locate.py, `pool.locator.reports`), so a reload that swaps this scheduler keeps them.

Locator answers (`Locator.answer`, HTTP and DNS locate) count exactly as connections sent:
the estimate is added for each. A `?current=` replacement takes one estimate step off
the client's old server (`on_moved_away`), as Geode's `decConnections`.

"Between updates from the servers, the locators estimate which server is the least
loaded by using the server estimates for the cost of additional connections": a load of
0.4 and an estimate of 0.1 make 0.6 after two connections. Connections that end between
reports are not seen until the next report, as with a locator. Least load wins; ties go
to the server picked longest ago, then configuration order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lbproxy.core.schedulers import REPORTS, SNMP, HeapScheduler, register

if TYPE_CHECKING:
    from lbproxy.config.model import VirtualServerConfig
    from lbproxy.core.pool import Pool, RealServer


@register
class LeastLoad(HeapScheduler):
    score_legend = "the server's load, reported or estimated: the lowest wins"
    name = "least-load"
    rank = 70
    # SNMP with `load_source: snmp`, reports with `load_source: report` (see below).
    reads = frozenset({SNMP, REPORTS})
    keys = frozenset({"load_source", "load_poll_interval"})
    shows_load = True

    @classmethod
    def reads_snmp(cls, config: VirtualServerConfig) -> bool:
        return config.load_source == "snmp"

    @classmethod
    def reads_reports(cls, config: VirtualServerConfig) -> bool:
        return config.load_source == "report"

    @classmethod
    def _snmp_reader(cls, config: VirtualServerConfig) -> str:
        return "least-load with load_source snmp"

    @classmethod
    def describe_source(cls, config: VirtualServerConfig) -> str:
        return f", load from {config.load_source}"

    @classmethod
    def problems(cls, config: VirtualServerConfig) -> Iterator[tuple[Any, str]]:
        yield from super().problems(config)
        if config.load_source != "connections":
            return
        # Load is connections / max_connections: unlimited servers have no load to compare.
        for rs in config.real_servers:
            if rs.max_connections == 0:
                yield (
                    rs,
                    f"real server {rs.name} needs max_connections > 0 "
                    "(scheduler least-load with load_source connections)",
                )
        if config.discovery is not None:
            yield (
                "discovery",
                "scheduler least-load with load_source connections cannot use discovery "
                "(discovered real servers have no max_connections)",
            )

    def __init__(self, pool: Pool) -> None:
        super().__init__(pool)
        self.reported: dict[RealServer, float] = {}
        self.since: dict[RealServer, int] = {}
        self.per_connection: dict[RealServer, float] = {}  # load_source report only
        # The reports the pool's locator kept (core/locate.py); a stand-in pool may have none.
        locator = getattr(pool, "locator", None)
        for rs, (load, step) in getattr(locator, "reports", {}).items():
            self.reported[rs] = load
            self.per_connection[rs] = step

    @property
    def sample_connections(self) -> bool:
        # Read from the live configuration, so a reload that changes it takes effect.
        return self.pool.config.load_source == "connections"

    @property
    def pushed(self) -> bool:
        return self.pool.config.load_source == "report"

    def estimate(self, rs: RealServer) -> float:
        if self.pushed:
            step = self.per_connection.get(rs)
            if step is not None:
                return step
            return 1.0 / rs.max_connections if rs.max_connections else 0.0
        if rs.max_connections:
            return 1.0 / rs.max_connections
        snmp = rs.config.snmp
        return 1.0 / snmp.max_value if snmp else 1.0

    def load(self, rs: RealServer) -> float:
        return self.reported.get(rs, 0.0) + self.since.get(rs, 0) * self.estimate(rs)

    def key(self, rs: RealServer) -> tuple[float, int]:
        # Rounded: 0.2 + 3 x 0.1 and 0.4 + 1 x 0.1 are the same load, and a tie goes to
        # the server picked longest ago, not to whichever float came out smaller.
        return (round(self.load(rs), 9), rs.seq)

    def on_take(self, rs: RealServer, now: float) -> None:
        self.since[rs] = self.since.get(rs, 0) + 1
        self._rekey(rs)

    def on_drop(self, rs: RealServer, now: float) -> None:
        pass  # unseen until the next report, as by a Geode locator

    def on_reset(self, now: float) -> None:
        pass

    def report(self, rs: RealServer, load: float, per_connection: float) -> None:
        """A pushed report (`load_source: report`): it replaces the load and clears the
        estimates added since the last one."""
        self.reported[rs] = load
        self.per_connection[rs] = per_connection
        self.since[rs] = 0
        self._rekey(rs)

    def on_moved_away(self, rs: RealServer, now: float) -> None:
        self.since[rs] = self.since.get(rs, 0) - 1
        self._rekey(rs)

    def balance_load(self, rs: RealServer) -> tuple[float, float]:
        return self.load(rs), self.estimate(rs)

    def on_report(self, rs: RealServer, value: float, now: float) -> None:
        if self.pool.config.load_source != "snmp":
            return
        snmp = rs.config.snmp
        self.reported[rs] = value / snmp.max_value if snmp else value
        self.since[rs] = 0
        self._rekey(rs)

    def on_tick(self, now: float) -> float:
        if not self.sample_connections:
            return float("inf")
        # The servers' periodic load probe: O(n) once per load_poll_interval.
        for rs in self.pool.servers:
            self.reported[rs] = rs.active / rs.max_connections if rs.max_connections else 0.0
            self.since[rs] = 0
            self._rekey(rs)
        return now + self.pool.config.load_poll_interval

    def explain(self, rs: RealServer) -> float:
        return self.load(rs)
