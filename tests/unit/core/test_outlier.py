"""Outlier ejection and panic in the pure pool (SPEC §23), on a fake clock: times passed
in as `now`, connects reported as the connection handler reports them."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from lbproxy.config.model import HealthCheckConfig, OutlierDetectionConfig
from lbproxy.core.pool import DRAIN, Pool
from tests.factories import virtual_server

CHECKS = HealthCheckConfig(type="tcp", rise=1, fall=1)
OUTLIER = OutlierDetectionConfig(
    consecutive_failures=3, base_ejection_time=10.0, max_ejection_time=25.0, max_ejection_percent=50
)


def pool_of(n: int = 4, outlier=OUTLIER, backups: int = 0, **options) -> Pool:
    servers = {f"s{i}": {} for i in range(1, n + 1)}
    servers.update({f"b{i}": {"backup": True} for i in range(1, backups + 1)})
    config = virtual_server(
        "rr", servers, health_check=CHECKS, outlier_detection=outlier, **options
    )
    return Pool(config, 0.0)


def fail(pool: Pool, name: str, now: float, times: int = 1) -> None:
    for _ in range(times):
        pool.connect_failed(pool.by_name[name], now)


def complete(pool: Pool, name: str, now: float) -> None:
    rs = pool.by_name[name]
    if rs.outlier is not None:  # as the connection handler calls it
        pool.connect_completed(rs, now)


def picked(pool: Pool, now: float, n: int = 40) -> Counter[str]:
    names: Counter[str] = Counter()
    for _ in range(n):
        rs = pool.pick(now)
        assert rs is not None
        names[rs.name] += 1
        pool.drop(pool.take(rs, now), now)
    return names


def ejected(pool: Pool) -> set[str]:
    return {rs.name for rs in pool.servers if pool.ejected_until(rs) is not None}


def test_consecutive_failures_eject_until_the_time_is_up_whatever_health_says():
    pool = pool_of()
    fail(pool, "s1", 1.0, times=2)
    assert ejected(pool) == set()
    fail(pool, "s1", 2.0)
    assert ejected(pool) == {"s1"}
    assert pool.ejected_until(pool.by_name["s1"]) == 12.0
    assert pool.by_name["s1"].health.up  # ejection is not health
    assert "s1" not in picked(pool, 5.0)
    assert pool.by_name["s1"].counters.ejections == 1
    # back on the timer, with no check: the first pick at or after 12.0 sees it again
    assert set(picked(pool, 12.0)) == {"s1", "s2", "s3", "s4"}
    assert ejected(pool) == set()


def test_ejection_times_grow_with_ejections_in_a_row_and_are_capped():
    pool = pool_of()
    now, lengths = 0.0, []
    for _ in range(4):
        fail(pool, "s1", now, times=3)
        until = pool.ejected_until(pool.by_name["s1"])
        assert until is not None
        lengths.append(until - now)
        now = until
        pool.advance(now)
        assert ejected(pool) == set()
    assert lengths == [10.0, 20.0, 25.0, 25.0]  # base x ejections in a row, max 25
    assert pool.by_name["s1"].counters.ejections == 4


def test_the_failure_count_restarts_at_each_ejection():
    pool = pool_of()
    fail(pool, "s1", 0.0, times=3)
    fail(pool, "s1", 1.0, times=5)  # connects started before it: not counted
    pool.advance(10.0)
    fail(pool, "s1", 10.0, times=2)
    assert ejected(pool) == set()
    fail(pool, "s1", 10.0)
    assert ejected(pool) == {"s1"}


def test_a_completed_connect_resets_the_failures_and_the_ejections_in_a_row():
    pool = pool_of()
    fail(pool, "s1", 0.0, times=2)
    complete(pool, "s1", 0.5)
    fail(pool, "s1", 1.0, times=2)
    assert ejected(pool) == set()  # 2 + 2, not 4 in a row
    assert pool.by_name["s1"].outlier is not None
    fail(pool, "s1", 1.0)
    assert pool.ejected_until(pool.by_name["s1"]) == 11.0
    pool.advance(11.0)
    complete(pool, "s1", 11.0)
    assert pool.by_name["s1"].outlier is None  # nothing left to count: the check is free
    fail(pool, "s1", 12.0, times=3)
    assert pool.ejected_until(pool.by_name["s1"]) == 22.0  # base again, not 2 x base


def test_never_more_than_max_ejection_percent_rounded_down():
    pool = pool_of(n=4)  # 50 % of 4: 2 at once
    for name in ("s1", "s2", "s3"):
        fail(pool, name, 0.0, times=3)
    assert ejected(pool) == {"s1", "s2"}
    assert set(picked(pool, 1.0)) == {"s3", "s4"}
    fail(pool, "s3", 1.0, times=4)  # keeps counting while the cap holds
    assert ejected(pool) == {"s1", "s2"}
    pool.advance(10.0)  # s1 and s2 are back: room for s3 at its next failure
    fail(pool, "s3", 10.0)
    assert ejected(pool) == {"s3"}
    pool5 = pool_of(n=5)  # 50 % of 5 rounds down to 2
    for name in ("s1", "s2", "s3"):
        fail(pool5, name, 0.0, times=3)
    assert len(ejected(pool5)) == 2


def test_at_least_one_server_stays_and_backups_are_never_ejected():
    pool = pool_of(n=2, outlier=replace(OUTLIER, max_ejection_percent=100), backups=1)
    fail(pool, "s1", 0.0, times=3)
    fail(pool, "s2", 0.0, times=3)
    fail(pool, "b1", 0.0, times=3)
    assert ejected(pool) == {"s1"}
    assert pool_of(n=1, outlier=replace(OUTLIER, max_ejection_percent=100)).outlier.allowed(1) == 0


def test_without_outlier_detection_nothing_is_ejected():
    pool = pool_of(outlier=None)
    fail(pool, "s1", 0.0, times=10)
    assert ejected(pool) == set()
    assert pool.by_name["s1"].outlier is None


def test_a_reload_that_removes_outlier_detection_releases_the_ejected():
    pool = pool_of()
    fail(pool, "s1", 0.0, times=3)
    assert "s1" not in picked(pool, 1.0)
    changes = pool.reconfigure(replace(pool.config, outlier_detection=None), 1.0)
    assert "outlier_detection changed" in changes
    assert ejected(pool) == set()
    assert "s1" in picked(pool, 1.0)


# -- panic ---------------------------------------------------------------------------------


def down(pool: Pool, *names: str) -> None:
    for name in names:
        pool.record_health(pool.by_name[name], False, 1.0)


def test_panic_picks_among_every_enabled_server_when_too_few_are_up():
    pool = pool_of(outlier=None, panic_threshold=50)
    down(pool, "s1", "s2")  # 2 of 4 up: 50 %, not under it
    assert not pool.panic
    assert set(picked(pool, 2.0)) == {"s3", "s4"}
    down(pool, "s3")  # 1 of 4: 25 % < 50 %
    assert pool.panic
    shares = picked(pool, 2.0, n=400)
    assert set(shares) == {"s1", "s2", "s3", "s4"}
    assert all(90 <= count <= 110 for count in shares.values()), shares
    pool.record_health(pool.by_name["s1"], True, 3.0)  # 2 of 4 again
    assert not pool.panic
    assert set(picked(pool, 3.0)) == {"s1", "s4"}


def test_panic_leaves_drained_servers_out_and_counts_ejected_ones_as_unavailable():
    pool = pool_of(panic_threshold=60)
    pool.set_state(pool.by_name["s4"], DRAIN, 0.0)  # 3 enabled: s1, s2, s3
    fail(pool, "s1", 0.0, times=3)  # ejected: 2 of 3 available (66 %)
    assert not pool.panic
    down(pool, "s2")  # 1 of 3 (33 %) < 60 %
    assert pool.panic
    assert set(picked(pool, 2.0)) == {"s1", "s2", "s3"}  # ejected and down included


def test_no_panic_while_a_backup_is_up_nor_without_a_threshold():
    pool = pool_of(outlier=None, backups=1, panic_threshold=50)
    down(pool, "s1", "s2", "s3")
    assert not pool.panic
    assert set(picked(pool, 2.0)) == {"s4"}
    down(pool, "s4")
    assert not pool.panic  # the backup serves
    assert set(picked(pool, 2.0)) == {"b1"}
    down(pool, "b1")
    assert pool.panic
    assert set(picked(pool, 2.0)) == {"s1", "s2", "s3", "s4"}
    plain = pool_of(outlier=None)
    down(plain, "s1", "s2", "s3")
    assert not plain.panic


@pytest.mark.parametrize("threshold", [0, 80])
def test_a_reload_can_set_and_clear_the_threshold(threshold):
    pool = pool_of(outlier=None, panic_threshold=threshold)
    down(pool, "s1", "s2")
    assert pool.panic is (threshold == 80)
    pool.reconfigure(replace(pool.config, panic_threshold=80 - threshold), 2.0)
    assert pool.panic is (threshold == 0)


class Connection:
    """A lease's handle as the pool reads it: the bytes its server has sent so far."""

    bytes_out = 0


def test_the_servers_first_byte_ends_the_failures_in_a_row_once():
    """The success is a connection's first server byte, noticed at the next failure or at
    the connection's end -- and counted once, however many failures follow."""
    pool = pool_of()
    s1 = pool.by_name["s1"]
    held = Connection()
    lease = pool.take(s1, 0.0, held)  # established, nothing from the server yet
    fail(pool, "s1", 1.0, times=2)
    held.bytes_out = 10  # its first bytes, between the 2nd and the 3rd failure
    fail(pool, "s1", 2.0, times=2)
    assert ejected(pool) == set()  # 2 in a row since the answer, not 4
    fail(pool, "s1", 3.0)
    assert ejected(pool) == {"s1"}  # the same answer does not count again
    pool.drop(lease, 4.0)
    # A connection that answered and ended while its server had a record: the end counts it
    pool.advance(20.0)
    other = pool.take(s1, 20.0, Connection())
    fail(pool, "s1", 20.0, times=2)
    other.handle.bytes_out = 1
    pool.answered(other)
    pool.answered(other)  # once only
    pool.drop(other, 21.0)
    assert s1.outlier is None  # no failures, no ejections in a row left
    fail(pool, "s1", 22.0, times=2)
    assert ejected(pool) == set()


def test_a_connection_that_never_answered_is_no_success():
    pool = pool_of()
    s1 = pool.by_name["s1"]
    lease = pool.take(s1, 0.0, Connection())
    fail(pool, "s1", 1.0, times=3)  # an open, silent connection clears nothing
    assert ejected(pool) == {"s1"}
    pool.drop(lease, 2.0)
