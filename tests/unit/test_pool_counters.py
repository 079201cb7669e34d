"""The pure pool's counters and time-driven state, as metrics and the admin API read them."""

from __future__ import annotations

from lbproxy.pool import Pool
from tests.factories import virtual_server


def test_a_taken_lease_counts_as_a_connection_only_once_established():
    pool = Pool(virtual_server("wlc", {"a": {}, "b": {}}), 0)
    a, b = pool.by_name["a"], pool.by_name["b"]
    attempt = pool.take(pool.pick(0), 0)  # a: taken before the connect, as IPVS does
    assert attempt.server is a
    # while it connects, a concurrent arrival already sees it and goes elsewhere
    assert pool.pick(0) is b
    pool.drop(attempt, 0.1)  # the connect failed
    assert (a.connections_total, a.active) == (0, 0)
    lease = pool.take(pool.pick(0.2), 0.2)
    pool.established(lease)
    pool.drop(lease, 0.3)
    stats = {rs.name: rs.connections_total for rs in pool.statistics().real_servers}
    assert stats == {lease.server.name: 1, ({"a", "b"} - {lease.server.name}).pop(): 0}
