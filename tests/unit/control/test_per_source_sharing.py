"""per_source.shared without Redis (control/cluster.py): what another instance publishes
is checked, kept per origin, summed and given to the table; stale, forged and own
publications are not. The Redis side is tested end to end in
tests/integration/test_per_source.py."""

from __future__ import annotations

import time

import trio

from lbproxy.config.model import ClusterConfig, RedisConfig
from lbproxy.control.cluster import SOURCES_TTL, Cluster
from lbproxy.core.per_source import Limits, PerSourceTable
from lbproxy.wire.cluster_messages import Signer, SourceCounts, encode_sources

KEY = b"k" * 32
SIGNER = Signer(KEY, "lbproxy")


class Target:
    def __init__(self, table: PerSourceTable) -> None:
        self.table = table

    def pools(self):
        return []

    def shared_sources(self):
        return {"web": self.table}


def publication(
    origin: str, networks, at: float | None = None, signer=SIGNER, instance: str | None = None
) -> bytes:
    at = time.time() if at is None else at
    counts = SourceCounts(origin, "web", at, tuple(networks), instance)
    return signer.sign("sources", encode_sources(counts))


def test_the_others_counts_are_summed_into_the_table_and_expire():
    table = PerSourceTable(Limits(max_connections=10, rate=10, prefix_v4=24))

    async def main():
        config = ClusterConfig(RedisConfig("redis://127.0.0.1:1/0", name="lb1"), "key", KEY)
        cluster = Cluster(config, Target(table))
        now = trio.current_time()
        cluster._receive_sources(publication("lb2", [("10.0.0.0/24", 3, 1)]), now)
        cluster._receive_sources(publication("lb3", [("10.0.0.0/24", 4, 2)]), now)
        own = publication("lb1", [("10.0.0.0/24", 50, 50)], instance=cluster.instance)
        cluster._receive_sources(own, now)
        forged = Signer(b"x" * 32, "lbproxy")
        cluster._receive_sources(publication("lb4", [("10.0.0.0/24", 9, 9)], signer=forged), now)
        cluster._receive_sources(publication("lb5", [("10.0.0.0/16", 9, 9)]), now)  # /16: not ours
        await cluster.apply_sources(cluster.target.shared_sources(), now)
        assert table.remote_open() == 7
        assert cluster.ignored["signature"] == 1
        # 7 open elsewhere: 3 more here, then refused
        assert all(table.admit("10.0.0.9", 0.0) is not None for _ in range(3))
        assert table.admit("10.0.0.9", 0.0) is None
        # lb2's newer publication replaces its older one; lb3 says nothing more
        cluster._receive_sources(publication("lb2", [], at=time.time() + 1), now + 1)
        await cluster.apply_sources(cluster.target.shared_sources(), now + 1)
        assert table.remote_open() == 4
        await cluster.apply_sources(cluster.target.shared_sources(), now + SOURCES_TTL + 0.5)
        assert table.remote_open() == 0  # lb3's is stale: dropped
        assert table.admit("10.0.0.9", 0.0) is not None

    trio.run(main)
