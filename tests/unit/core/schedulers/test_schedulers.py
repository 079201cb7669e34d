"""Every scheduler against exact sequences, with the source documents as test vectors."""

from __future__ import annotations

from collections import Counter

import pytest

from lbproxy.core import schedulers
from lbproxy.core.pool import Pool
from tests.factories import SNMP, virtual_server


def run(pool: Pool, n: int, *, hold: bool, now: float = 0.0) -> list[str]:
    sequence = []
    for _ in range(n):
        rs = pool.pick(now)
        assert rs is not None
        lease = pool.take(rs, now)
        if not hold:
            pool.drop(lease, now)
        sequence.append(rs.name)
    return sequence


def test_registry_lists_every_scheduler_and_rejects_duplicates():
    assert schedulers.available() == [
        "dwd", "dwr", "first", "lc", "least-load", "maglev", "rr", "sap", "wlc", "wrr",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="already registered"):
        schedulers.register(type("Again", (schedulers.Scheduler,), {"name": "rr"}))


def test_rr_cycles_in_configuration_order_and_skips_unavailable():
    pool = Pool(virtual_server("rr", {"a": {}, "b": {"weight": 5}, "c": {}}), 0)
    assert run(pool, 6, hold=False) == ["a", "b", "c", "a", "b", "c"]
    pool.set_state(pool.by_name["b"], "drain", 0)
    assert run(pool, 4, hold=False) == ["a", "c", "a", "c"]


def test_wrr_lvs_one_to_five_interleaved():
    # LVS document: "one real server has a weight of 1 and the other a weight of 5,
    # then the server with a weight of 5 gets 5 connections for every 1".
    pool = Pool(virtual_server("wrr", {"a": {"weight": 1}, "b": {"weight": 5}}), 0)
    sequence = run(pool, 18, hold=False)
    assert sequence == list("bbabbb" "bbabbb" "bbabbb")  # fmt: skip
    # every window of six holds exactly one `a`: interleaved, not five b then one a
    for start in range(0, 13):
        assert sequence[start : start + 6].count("a") == 1


def test_wrr_weight_change_takes_effect():
    pool = Pool(virtual_server("wrr", {"a": {"weight": 1}, "b": {"weight": 1}}), 0)
    run(pool, 4, hold=False)
    assert pool.set_weight(pool.by_name["a"], 3, 0) is None
    shares = Counter(run(pool, 400, hold=False))
    assert shares["a"] == pytest.approx(300, abs=3)


def test_lc_fewest_active_ties_in_round_robin_order():
    pool = Pool(virtual_server("lc", {"a": {}, "b": {}, "c": {}}), 0)
    assert run(pool, 6, hold=False) == ["a", "b", "c", "a", "b", "c"]
    held = [pool.take(pool.by_name["a"], 0), pool.take(pool.by_name["a"], 0)]
    assert run(pool, 4, hold=True) == ["b", "c", "b", "c"]
    for lease in held:
        pool.drop(lease, 0)
    assert run(pool, 2, hold=True) == ["a", "a"]


def test_wlc_lvs_one_to_five_held():
    pool = Pool(virtual_server("wlc", {"a": {"weight": 1}, "b": {"weight": 5}}), 0)
    assert Counter(run(pool, 60, hold=True)) == {"a": 10, "b": 50}


def lvs_rejoin(quiesce: bool) -> Counter:
    """LVS document: A and B weight 1, C weight 2; C down while 60 connections are held."""
    pool = Pool(virtual_server("wlc", {"A": {}, "B": {}, "C": {"weight": 2}}, quiesce=quiesce), 0)
    c = pool.by_name["C"]
    for _ in range(3):  # fall = 3 failed checks
        pool.record_health(c, False, 0)
    assert not c.available
    assert Counter(run(pool, 60, hold=True)) == {"A": 30, "B": 30}
    for _ in range(2):  # rise = 2 good checks
        pool.record_health(c, True, 0)
    return Counter(run(pool, 30, hold=True))


def test_lvs_rejoin_floods_without_quiesce():
    assert lvs_rejoin(quiesce=False) == {"C": 30}


def test_lvs_rejoin_with_quiesce_shares_by_weight():
    shares = lvs_rejoin(quiesce=True)
    assert shares == {"C": 15, "A": 8, "B": 7}


def test_quiesce_old_connections_do_not_decrement_after_reset():
    pool = Pool(virtual_server("wlc", {"A": {}, "B": {}}, quiesce=True), 0)
    old = [pool.take(pool.by_name["A"], 0) for _ in range(5)]
    b = pool.by_name["B"]
    pool.set_state(b, "drain", 0)
    pool.set_state(b, "enabled", 0)  # comes online: reset
    assert (pool.by_name["A"].sched_active, pool.by_name["A"].active) == (0, 5)
    for lease in old:
        pool.drop(lease, 0)
    assert (pool.by_name["A"].sched_active, pool.by_name["A"].active) == (0, 0)


def test_first_fills_in_configuration_order():
    pool = Pool(
        virtual_server("first", {"a": {"max_connections": 2}, "b": {"max_connections": 2}}), 0
    )
    leases = [pool.take(pool.pick(0), 0) for _ in range(4)]
    assert [lease.server.name for lease in leases] == ["a", "a", "b", "b"]
    assert pool.pick(0) is None
    pool.drop(leases[0], 0)
    assert pool.pick(0).name == "a"


def test_sap_document_table():
    # seeds/004: Server1..3 with loads 2, 3, 4; Server4 (4) registers after job 7.
    pool = Pool(
        virtual_server(
            "sap",
            {
                "Server1": {"load_factor": 2},
                "Server2": {"load_factor": 3},
                "Server3": {"load_factor": 4},
                "Server4": {"load_factor": 4, "state": "disabled"},
            },
        ),
        0,
    )
    sequence = run(pool, 7, hold=False)
    loads = pool.scheduler.load
    assert [loads[pool.by_name[n]] for n in ("Server1", "Server2", "Server3")] == [6, 6, 8]
    pool.set_state(pool.by_name["Server4"], "enabled", 0)
    assert loads[pool.by_name["Server4"]] == 8  # starts at the highest load
    sequence += run(pool, 1, hold=False)
    assert sequence == [f"Server{i}" for i in (1, 2, 3, 1, 2, 1, 3, 1)]
    assert [loads[rs] for rs in pool.servers] == [8, 6, 8, 8]


def test_sap_weight_zero_removes_and_load_factor_changes():
    pool = Pool(virtual_server("sap", {"a": {}, "b": {}}), 0)
    pool.set_weight(pool.by_name["b"], 0, 0)
    assert run(pool, 3, hold=False) == ["a", "a", "a"]


def test_dwd_brocade_adx_shares():
    # seeds/002: weights 7, 8, 2, 2, 5 -> 7/24, 8/24, ...; a sixth of 10 -> 10/34.
    names = {f"s{i}": {"snmp": SNMP} for i in range(1, 7)}
    names["s6"]["state"] = "disabled"
    pool = Pool(virtual_server("dwd", names, snmp=SNMP), 0)
    for name, value in zip(names, (7, 8, 2, 2, 5, 10), strict=True):
        pool.report_value(pool.by_name[name], value, 0)
    assert not pool.fallback
    assert Counter(run(pool, 240, hold=True)) == {"s1": 70, "s2": 80, "s3": 20, "s4": 20, "s5": 50}
    pool.set_state(pool.by_name["s6"], "enabled", 0)
    assert Counter(run(pool, 100, hold=True))["s6"] == 100


def test_dwd_falls_back_to_static_weights_when_every_weight_is_zero():
    pool = Pool(
        virtual_server("dwd", {"a": {"weight": 1, "snmp": SNMP}, "b": {"weight": 3, "snmp": SNMP}}),
        0,
    )
    assert pool.fallback  # no agent answered yet
    assert Counter(run(pool, 40, hold=True)) == {"a": 10, "b": 30}
    pool.report_value(pool.by_name["a"], 5, 0)
    assert not pool.fallback
    assert not pool.by_name["b"].available  # dynamic weight 0: no new connections
    assert set(run(pool, 5, hold=True)) == {"a"}


def test_dwr_reverse_weights():
    pool = Pool(virtual_server("dwr", {"a": {"snmp": SNMP}, "b": {"snmp": SNMP}}), 0)
    pool.report_value(pool.by_name["a"], 20, 0)  # weight 80
    pool.report_value(pool.by_name["b"], 60, 0)  # weight 40
    assert Counter(run(pool, 300, hold=True)) == {"a": 200, "b": 100}
    pool.report_value(pool.by_name["b"], 150, 0)  # clamped at 0
    assert pool.by_name["b"].effective_weight == 0


def test_least_load_geode_max_connections_one_to_three():
    pool = Pool(
        virtual_server(
            "least-load",
            {"a": {"max_connections": 10}, "b": {"max_connections": 30}},
            load_poll_interval=1000.0,
        ),
        0,
    )
    assert Counter(run(pool, 40, hold=True)) == {"a": 10, "b": 30}


def test_least_load_estimate_between_reports():
    # Geode: load 0.4 plus 0.1 per connection -> 0.6 after two connections.
    pool = Pool(
        virtual_server(
            "least-load",
            {"a": {"max_connections": 10}, "b": {"max_connections": 10}},
            load_poll_interval=5.0,
        ),
        0,
    )
    a, b = pool.by_name["a"], pool.by_name["b"]
    leases = [pool.take(a, 0) for _ in range(4)]
    pool.pick(5.0)  # the probe samples at t=5: a reports 0.4
    assert pool.scheduler.load(a) == pytest.approx(0.4)
    pool.take(b, 5.0)
    pool.take(b, 5.0)
    assert pool.scheduler.load(b) == pytest.approx(0.2)
    for lease in leases:
        pool.drop(lease, 5.0)
    assert pool.scheduler.load(a) == pytest.approx(0.4)  # unseen until the next report


def test_least_load_snmp_source():
    pool = Pool(
        virtual_server(
            "least-load",
            {
                "a": {"snmp": SNMP, "max_connections": 100},
                "b": {"snmp": SNMP, "max_connections": 100},
            },
            load_source="snmp",
            snmp=SNMP,
        ),
        0,
    )
    pool.report_value(pool.by_name["a"], 50, 0)  # load 0.5
    pool.report_value(pool.by_name["b"], 10, 0)  # load 0.1
    # b takes connections until its estimate reaches a's report: 0.1 + 40 x 0.01 = 0.5
    assert run(pool, 41, hold=True) == ["b"] * 40 + ["a"]


def test_slow_start_ramps_from_ten_percent():
    pool = Pool(virtual_server("wrr", {"a": {"weight": 4}, "b": {"weight": 4}}, slow_start=10.0), 0)
    a = pool.by_name["a"]
    pool.pick(0)
    assert a.effective_weight == pytest.approx(0.4)
    pool.pick(5.0)
    assert a.effective_weight == pytest.approx(2.0)
    pool.pick(10.0)
    assert a.effective_weight == 4


def test_unavailable_servers_are_never_picked_and_none_when_nothing_left():
    pool = Pool(virtual_server("wlc", {"a": {}, "b": {"weight": 0}, "c": {"state": "drain"}}), 0)
    assert set(run(pool, 5, hold=True)) == {"a"}
    pool.set_state(pool.by_name["a"], "disabled", 0)
    assert pool.pick(0) is None


def test_avoid_skips_servers_already_tried():
    pool = Pool(virtual_server("rr", {"a": {}, "b": {}, "c": {}}), 0)
    a, b = pool.by_name["a"], pool.by_name["b"]
    assert pool.pick(0, avoid=[a]).name == "b"
    assert pool.pick(0, avoid=[a, b]).name == "c"
    assert pool.pick(0, avoid=list(pool.servers)) is None
    assert pool.pick(0).name == "a"  # avoided servers are put back
