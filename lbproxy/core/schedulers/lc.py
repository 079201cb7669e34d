"""lc and wlc: (weighted) least connections, with the LVS quiesce reset.

lc : least active connections.
wlc: least (active + 1) / effective weight, active = this pool's open connections to the
     server (`sched_active`). This is the key of LVS's *sed* (`ip_vs_sed.c`: overhead =
     activeconns + 1), not of `ip_vs_wlc.c`, which minimises overhead / weight with
     overhead = activeconns * 256 + inactconns and no +1. The orders agree when weights
     are equal; with unequal weights the +1 makes an idle light server lose to a busier
     heavy one (weights 1 and 5, a idle, b with 3: wlc's 0/1 < 3/5 picks a, this key's
     1/1 > 4/5 picks b), so a heavy server takes its share sooner. A float key, not
     `ip_vs_*`'s cross-multiplication, because effective weights may be fractional
     (slow start, smoothing, agent percent).
Ties: the tied server that was picked longest ago, then configuration order — round-robin
order among tied servers, kept in the heap key instead of a scan.

Quiesce (`quiesce: true`, wlc and the dynamic-weight schedulers): when a server comes
online the pool resets every server's scheduling count to zero, and connections opened
before the reset no longer count (nor decrement when they close). Without it, a server
that rejoins with zero connections takes every new connection until it is level with the
others — the "flood" of the LVS document.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lbproxy.core.schedulers import HeapScheduler, register

if TYPE_CHECKING:
    from lbproxy.core.pool import RealServer


@register
class LeastConnections(HeapScheduler):
    score_legend = "(active connections, order last picked): the lowest wins"
    name = "lc"
    rank = 30

    def key(self, rs: RealServer) -> tuple[float, int]:
        return (rs.sched_active, rs.seq)

    def balance_load(self, rs: RealServer) -> tuple[float, float]:
        return float(rs.active), 1.0  # SPEC §11: L = active, p = 1


@register
class WeightedLeastConnections(HeapScheduler):
    score_legend = "((active + 1) / effective weight, order last picked): the lowest wins"
    name = "wlc"
    rank = 40
    quiesce_resets = True
    keys = frozenset({"quiesce", "slow_start"})

    def key(self, rs: RealServer) -> tuple[float, int]:
        return ((rs.sched_active + 1) / rs.effective_weight, rs.seq)

    def balance_load(self, rs: RealServer) -> tuple[float, float]:
        # SPEC §11: L = active / weight, p = 1 / weight (dwd, dwr inherit it)
        weight = rs.effective_weight
        if weight <= 0:
            return float("inf") if rs.active else 0.0, 0.0
        return rs.active / weight, 1.0 / weight
