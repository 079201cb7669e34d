"""A real server's counters live in their own object, apart from configuration and state."""

from __future__ import annotations

from dataclasses import replace

from lbproxy.core.pool import Pool
from lbproxy.core.real_server import RealServer, ServerCounters
from tests.factories import virtual_server


def test_counters_are_apart_from_configuration_and_state():
    assert not set(RealServer.__slots__) & set(ServerCounters.__slots__)
    pool = Pool(virtual_server("rr", {"a": {}}), 0)
    rs = pool.by_name["a"]
    lease = pool.take(rs, 0.0)
    pool.established(lease)
    pool.drop(lease, 1.0)
    assert (rs.counters.connections_total, rs.active) == (1, 0)
    # A reload re-applies the configuration; what was counted stays.
    rs.apply_config(replace(rs.config, weight=3))
    assert (rs.counters.connections_total, rs.static_weight) == (1, 3.0)
    assert pool.statistics().real_servers[0].connections_total == 1
