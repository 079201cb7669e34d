"""first: the first available server in configuration order.

SAP gateway `gw/reg_lb_level = 0` ("das erste freie registrierte Programm", seeds/004) and
HAProxy's `balance first`: fill the first server up to its `max_connections`, then the
next. The heap is keyed by position, so the next free server is found in O(log n).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lbproxy.core.schedulers import HeapScheduler, Scheduler, register

if TYPE_CHECKING:
    from lbproxy.core.pool import RealServer


@register
class First(HeapScheduler):
    score_legend = "(position in the list,): the first available server wins"
    name = "first"
    rank = 90

    def key(self, rs: RealServer) -> tuple[int]:
        return (rs.index,)

    def on_take(self, rs: RealServer, now: float) -> None:
        pass  # the key never changes with load

    on_drop = Scheduler.on_drop  # the key never changes with load (watches_drops)
