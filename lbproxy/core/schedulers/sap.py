"""sap: least accumulated load, SAP gateway `gw/reg_lb_level = 2` (seeds/004).

Each server carries an accumulated load, starting at 0. The server with the lowest
accumulated load gets the job (ties: configuration order), then its `load_factor` is
added ("Je höher der Wert, desto schwächer ist der Server"). Connections ending do not
lower the load: it measures jobs handed out, weighted by how weak the server is.

A server that registers later "bekommt als Initialwert die höchste Load aller Server"
with the same id: here, a server that comes online starts at the highest accumulated
load of the other online servers (0 if none has taken a job). Load factors can change at
run time; weight 0 removes a server ("Server2=0 löscht den Eintrag").

Vector (the document's table): factors 2, 3, 4 and a fourth server of 4 joining after
job 7 give the sequence 1, 2, 3, 1, 2, 1, 3, 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lbproxy.core.schedulers import HeapScheduler, register

if TYPE_CHECKING:
    from lbproxy.core.pool import Pool, RealServer


@register
class LeastAccumulatedLoad(HeapScheduler):
    score_legend = "accumulated load (jobs given x load factor): the lowest wins"
    name = "sap"
    rank = 80
    keys = frozenset({"load_factor"})

    def __init__(self, pool: Pool) -> None:
        super().__init__(pool)
        self.load: dict[RealServer, float] = {}

    def key(self, rs: RealServer) -> tuple[float, int]:
        return (self.load[rs], rs.index)

    def on_online(self, rs: RealServer, now: float) -> None:
        # O(n), but only when a server joins, never per connection.
        others = [load for other, load in self.load.items() if other is not rs and other.online]
        self.load[rs] = max(others, default=0.0)

    def on_available(self, rs: RealServer, now: float) -> None:
        # Available without having come online (a down server offered in panic, or for
        # a passive-health trial): it joins as a server registering late does.
        if rs not in self.load:
            self.on_online(rs, now)
        super().on_available(rs, now)

    def on_take(self, rs: RealServer, now: float) -> None:
        self.load[rs] = self.load.get(rs, 0.0) + rs.load_factor
        self._rekey(rs)

    def on_drop(self, rs: RealServer, now: float) -> None:
        pass

    def on_reset(self, now: float) -> None:
        pass

    def explain(self, rs: RealServer) -> float:
        return self.load.get(rs, 0.0)

    def balance_load(self, rs: RealServer) -> tuple[float, float]:
        return self.load.get(rs, 0.0), rs.load_factor  # SPEC §11

    def on_moved_away(self, rs: RealServer, now: float) -> None:
        if rs in self.load:
            self.load[rs] -= rs.load_factor
            self._rekey(rs)
