"""Helpers of the core tests: a pool with persistence, and connections through it."""

from __future__ import annotations

from lbproxy.config.model import PersistenceConfig
from lbproxy.core.pool import Pool
from tests.factories import virtual_server


def sticky_pool(scheduler: str = "rr", timeout: float = 10.0, max_entries: int = 100, n=3):
    servers = {name: {} for name in "abcdefgh"[:n]}
    persistence = PersistenceConfig(timeout=timeout, max_entries=max_entries)
    return Pool(virtual_server(scheduler, servers, persistence=persistence), 0)


def connect(pool: Pool, host: str, now: float, hold: list | None = None) -> str | None:
    client = (host, 40000)
    rs = pool.pick(now, (), client)
    if rs is None:
        return None
    lease = pool.take(rs, now, None, client)
    if hold is None:
        pool.drop(lease, now)
    else:
        hold.append(lease)
    return rs.name


def lookups(pool: Pool) -> dict[str, int]:
    return dict(pool.persistence.lookups)
