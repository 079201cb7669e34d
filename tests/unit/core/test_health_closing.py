"""core/health.py's record_health on a fake clock (SPEC §22): with an active check a
client's successful connect neither brings a server up nor clears the check's
failures; `on_down: close` and `on_up: close_backups` close connections at a change of
health, once, counted by reason in `pool.closed`."""

from __future__ import annotations

from dataclasses import replace

from lbproxy.config.model import HealthCheckConfig
from lbproxy.core.health import BACKUP_RETURNED, MARKED_DOWN, record_health
from lbproxy.core.pool import Lease, Pool
from tests.factories import virtual_server

ACTIVE = HealthCheckConfig(type="send_expect", interval=2.0, timeout=1.0, rise=2, fall=3)


class Connection:
    """A connection's handle as the pool's lease carries it: `close()` is what health
    calls; the connection's task would then end and drop its lease."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.lease: Lease | None = None
        self.closed = False

    def close(self) -> None:
        self.closed = True
        assert self.lease is not None
        self.pool.drop(self.lease, 0.0)


def pool_of(check: HealthCheckConfig = ACTIVE, **servers: dict) -> Pool:
    return Pool(virtual_server("rr", servers or {"a": {}, "b": {}}, health_check=check), 0.0)


def connect(pool: Pool, name: str, now: float) -> Connection:
    connection = Connection(pool)
    connection.lease = pool.take(pool.by_name[name], now, connection)
    return connection


def check(pool: Pool, name: str, ok: bool, now: float) -> bool | None:
    return record_health(pool, pool.by_name[name], ok, now, "check")


def client_connect(pool: Pool, name: str, ok: bool, now: float) -> bool | None:
    return record_health(pool, pool.by_name[name], ok, now, "connect", passive=True)


# -- active checks win over client connects ----------------------------------------------


def test_client_connects_between_failed_checks_do_not_keep_a_server_up():
    pool = pool_of()
    a = pool.by_name["a"]
    now = 0.0
    for _ in range(ACTIVE.fall - 1):
        assert check(pool, "a", False, now) is None
        for _ in range(10):  # traffic keeps connecting to it
            now += 0.1
            assert client_connect(pool, "a", True, now) is None
        now += 1.0
    assert a.health.up  # fall - 1 failures, none of them cleared
    assert check(pool, "a", False, now) is False
    assert not a.health.up and not a.available


def test_a_client_connect_does_not_bring_a_down_server_up():
    pool = pool_of()
    a = pool.by_name["a"]
    for t in range(3):
        check(pool, "a", False, float(t))
    assert not a.health.up
    for t in range(5):
        assert client_connect(pool, "a", True, 10.0 + t) is None
    assert not a.health.up
    assert check(pool, "a", True, 20.0) is None  # rise 2
    assert check(pool, "a", True, 22.0) is True


def test_client_connect_failures_still_count_with_an_active_check():
    pool = pool_of()
    assert client_connect(pool, "a", False, 0.0) is None
    assert check(pool, "a", False, 1.0) is None
    assert client_connect(pool, "a", False, 1.5) is False  # the third failure in a row
    assert not pool.by_name["a"].health.up


def test_a_passing_check_clears_the_failures():
    pool = pool_of()
    check(pool, "a", False, 0.0)
    client_connect(pool, "a", False, 0.5)
    check(pool, "a", True, 2.0)
    assert pool.by_name["a"].health.clean


def test_without_an_active_check_a_client_connect_ends_a_failure_streak():
    pool = pool_of(replace(ACTIVE, type="none"))
    a = pool.by_name["a"]
    client_connect(pool, "a", False, 0.0)
    client_connect(pool, "a", False, 0.1)
    client_connect(pool, "a", True, 0.2)
    assert a.health.clean
    for t in (1.0, 1.1, 1.2):
        client_connect(pool, "a", False, t)
    assert not a.health.up
    assert client_connect(pool, "a", True, 3.2) is True  # its trial got through


# -- on_down: close ------------------------------------------------------------------------


def test_on_down_close_closes_the_servers_connections_once_counted():
    pool = pool_of(replace(ACTIVE, fall=1, on_down="close"))
    on_a = [connect(pool, "a", 0.0) for _ in range(3)]
    on_b = [connect(pool, "b", 0.0) for _ in range(2)]
    assert check(pool, "a", False, 1.0) is False
    assert all(c.closed for c in on_a) and not any(c.closed for c in on_b)
    assert pool.closed == {MARKED_DOWN: 3}
    assert check(pool, "a", False, 2.0) is None  # already down: nothing more
    assert pool.closed == {MARKED_DOWN: 3}


def test_on_down_close_by_client_connect_failures():
    pool = pool_of(replace(ACTIVE, fall=2, on_down="close"))
    held = connect(pool, "a", 0.0)
    client_connect(pool, "a", False, 0.5)
    assert not held.closed
    client_connect(pool, "a", False, 0.6)
    assert held.closed and pool.closed[MARKED_DOWN] == 1


def test_on_down_keep_closes_nothing():
    pool = pool_of(replace(ACTIVE, fall=1))
    held = connect(pool, "a", 0.0)
    check(pool, "a", False, 1.0)
    assert not held.closed and not pool.closed


# -- on_up: close_backups ------------------------------------------------------------------

WITH_BACKUP = {"p": {}, "backup": {"backup": True}}


def backup_pool(**check) -> Pool:
    config = replace(ACTIVE, rise=1, fall=1, on_up="close_backups", **check)
    return pool_of(config, **WITH_BACKUP)


def test_on_up_close_backups_closes_the_backups_connections_when_a_primary_returns():
    pool = backup_pool()
    check(pool, "p", False, 0.0)
    on_backup = [connect(pool, "backup", 1.0) for _ in range(4)]
    assert check(pool, "p", True, 2.0) is True
    assert all(c.closed for c in on_backup)
    assert pool.closed == {BACKUP_RETURNED: 4}
    assert pool.pick(2.0) is pool.by_name["p"]


def test_a_backup_coming_up_closes_nothing():
    pool = backup_pool()
    check(pool, "p", False, 0.0)
    check(pool, "backup", False, 0.0)
    check(pool, "backup", True, 1.0)
    held = connect(pool, "backup", 1.0)
    check(pool, "backup", False, 2.0)
    assert not held.closed  # on_down is keep
    check(pool, "backup", True, 3.0)
    assert not held.closed and not pool.closed


def test_a_primary_back_up_but_disabled_closes_nothing():
    pool = backup_pool()
    check(pool, "p", False, 0.0)
    pool.set_state(pool.by_name["p"], "disabled", 0.5)
    held = connect(pool, "backup", 1.0)
    check(pool, "p", True, 2.0)
    assert not held.closed and not pool.closed  # the backup still serves


def test_on_up_keep_leaves_the_backups_connections():
    pool = pool_of(replace(ACTIVE, rise=1, fall=1), **WITH_BACKUP)
    check(pool, "p", False, 0.0)
    held = connect(pool, "backup", 1.0)
    check(pool, "p", True, 2.0)
    assert not held.closed and not pool.closed
