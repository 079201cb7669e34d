"""dwd and dwr: dynamic weights read from each real server's SNMP agent (Brocade ADX).

dwd, dynamic-weighted direct (seeds/002): "the SNMP response from each server is regarded
as a performance weight ... that weight determines the percentage of the current
connections that are given to the server". Weights 7, 8, 2, 2, 5 give 7/24, 8/24, ... of
the current connections, and a sixth server of weight 10 then gets 10/34. That is `wlc`
with the polled value as the weight: least (active + 1) / weight.

dwr, dynamic-weighted reverse, for values where higher means busier (CPU %, load
average): weight = `snmp.max_value` - value, clamped at 0.

The pool turns each answer into a weight with `weight_from_value`, applies
`snmp.on_no_answer` while an agent is silent, and falls back to static weights when every
server's dynamic weight is 0 (ADX: "the default weight is 0 if it does not receive any
SNMP response"). The quiesce reset applies as for `wlc`.
"""

from __future__ import annotations

from lbproxy.core.schedulers import SNMP, register
from lbproxy.core.schedulers.lc import WeightedLeastConnections


@register
class DynamicWeightedDirect(WeightedLeastConnections):
    name = "dwd"
    rank = 50
    dynamic_weights = True
    reads = frozenset({SNMP})

    @staticmethod
    def weight_from_value(value: float, max_value: float) -> float:
        return max(0.0, value)


@register
class DynamicWeightedReverse(WeightedLeastConnections):
    name = "dwr"
    rank = 60
    dynamic_weights = True
    reads = frozenset({SNMP})

    @staticmethod
    def weight_from_value(value: float, max_value: float) -> float:
        return max(0.0, max_value - value)
