"""The locator's pure core: load reports, locate answers, Geode's balance rule (SPEC §10, §11)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from lbproxy.config.model import ConditioningConfig, HealthCheckConfig, OutlierDetectionConfig
from lbproxy.core.balance import Balance, Member, is_balanced, plan_round
from lbproxy.core.pool import DRAIN, Pool
from lbproxy.tools.simulate import SimulationError, parse_events, simulate
from tests.factories import virtual_server

CHECKS = HealthCheckConfig(type="tcp", rise=1, fall=1)


def report_pool(**servers):
    config = virtual_server("least-load", servers or {"a": {}, "b": {}}, load_source="report")
    return Pool(config, 0)


def test_geode_arithmetic_two_answers_take_0_4_to_0_6():
    # seeds/000: "if the current pool connection load ... is 0.4 and each additional
    # connection would add 0.1 to its load, ... adding two new pool connections will take
    # the server's pool connection load to 0.6."
    pool = report_pool(a={})
    a = pool.by_name["a"]
    assert pool.locator.report_load(a, 0.4, 0.1) is None
    loads = [pool.locator.locate(0.0).load for _ in range(2)]
    assert loads == pytest.approx([0.5, 0.6])


def test_two_servers_reporting_answer_in_geode_order():
    pool = report_pool()
    pool.locator.report_load(pool.by_name["a"], 0.4, 0.1)
    pool.locator.report_load(pool.by_name["b"], 0.2, 0.1)
    answers = [pool.locator.locate(0.0) for _ in range(6)]
    assert [x.server.name for x in answers] == ["b", "b", "a", "b", "a", "b"]
    assert [x.load for x in answers] == pytest.approx([0.3, 0.4, 0.5, 0.5, 0.6, 0.6])
    assert pool.locator.answers["a", "http"] == 2 and pool.locator.answers["b", "http"] == 4
    # a new report replaces the load and clears the estimates added since the last one
    pool.locator.report_load(pool.by_name["b"], 0.0, 0.1)
    assert pool.load_of(pool.by_name["b"]) == 0.0
    assert pool.locator.locate(0.0).server.name == "b"


def test_never_reported_is_zero_and_default_step_is_one_over_max_connections():
    pool = report_pool(a={"max_connections": 4}, b={})
    a, b = pool.by_name["a"], pool.by_name["b"]
    assert pool.load_of(a) == 0.0 and pool.load_of(b) == 0.0
    pool.locator.report_load(a, 0.5)
    pool.locator.report_load(b, 0.5)
    assert pool.locator.reports[a] == (0.5, 0.25)
    assert pool.locator.reports[b] == (0.5, 0.0)  # no max_connections: 0 per connection
    pool.locator.locate(0.0)
    pool.locator.locate(0.0)
    assert pool.load_of(a) == pytest.approx(0.75)
    assert pool.load_of(b) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("load", "per_connection"),
    [
        (-0.1, None),
        (math.nan, None),
        (math.inf, None),
        (True, None),
        ("0.4", None),
        (None, None),
        (0.4, -1),
        (0.4, False),
        (0.4, math.nan),
        (10**400, None),
        ([0.4], None),
    ],
)
def test_bad_report_changes_nothing(load, per_connection):
    pool = report_pool()
    a = pool.by_name["a"]
    pool.locator.report_load(a, 0.3, 0.1)
    assert pool.locator.report_load(a, load, per_connection)
    assert pool.locator.reports[a] == (0.3, 0.1)
    assert pool.locator.report_counts["a"] == 1


def test_reload_keeps_reports_of_remaining_servers():
    pool = report_pool(a={}, b={})
    pool.locator.report_load(pool.by_name["a"], 0.7, 0.1)
    pool.locator.report_load(pool.by_name["b"], 0.1, 0.1)
    # reorder (the scheduler is rebuilt) and remove b, add c
    new = virtual_server("least-load", {"c": {}, "a": {}}, load_source="report")
    pool.reconfigure(new, 1.0)
    a, c = pool.by_name["a"], pool.by_name["c"]
    assert pool.load_of(a) == pytest.approx(0.7)
    assert pool.load_of(c) == 0.0
    assert [rs.name for rs in pool.locator.reports] == ["a"]


def test_locate_counts_a_pick_per_scheduler():
    # rr advances
    pool = Pool(virtual_server("rr", {"a": {}, "b": {}}), 0)
    assert [pool.locator.locate(0.0).server.name for _ in range(4)] == ["a", "b", "a", "b"]
    assert pool.locator.locate(0.0).load is None
    # sap adds its load factor
    pool = Pool(virtual_server("sap", {"a": {"load_factor": 2}, "b": {"load_factor": 3}}), 0)
    assert [pool.locator.locate(0.0).server.name for _ in range(5)] == ["a", "b", "a", "b", "a"]
    # lc counts a connection that closes at once: ties go round robin, nothing stays open
    pool = Pool(virtual_server("lc", {"a": {}, "b": {}}), 0)
    assert [pool.locator.locate(0.0).server.name for _ in range(4)] == ["a", "b", "a", "b"]
    assert pool.active == 0 and pool.by_name["a"].counters.connections_total == 0


def test_locate_none_when_nothing_available():
    pool = Pool(virtual_server("wlc", {"a": {"state": "disabled"}}), 0)
    assert pool.locator.locate(0.0) is None
    assert pool.locator.locate(0.0, current="a") is None


def test_replace_when_current_is_unavailable_or_unknown():
    pool = report_pool()
    pool.set_state(pool.by_name["a"], DRAIN, 0.0)
    answer = pool.locator.locate(0.0, current="a")
    assert (answer.server.name, answer.replace) == ("b", True)
    answer = pool.locator.locate(0.0, current="gone")
    assert (answer.server.name, answer.replace) == ("b", True)


def test_replace_follows_threshold_and_hysteresis():
    pool = report_pool()
    a, b = pool.by_name["a"], pool.by_name["b"]
    pool.locator.report_load(a, 0.5, 0.1)
    pool.locator.report_load(b, 0.0, 0.1)
    # imbalance 0.5 < 10 x 0.1: tolerated, stay, nothing counted
    answer = pool.locator.locate(0.0, current="a")
    assert (answer.server.name, answer.replace) == ("a", False)
    assert pool.load_of(a) == pytest.approx(0.5) and pool.load_of(b) == 0.0
    pool.locator.report_load(a, 1.0, 0.1)  # imbalance 1.0 = 10 steps: rebalancing starts
    answer = pool.locator.locate(0.0, current="b")  # b is not the most loaded: stays
    assert (answer.server.name, answer.replace) == ("b", False)
    assert pool.locator.balance.rebalancing
    moves = []
    for _ in range(10):
        answer = pool.locator.locate(0.0, current="a")
        moves.append(answer.replace)
        if not answer.replace:
            break
    # each move takes 0.1 off a and puts 0.1 on b: 1.0/0.0 -> 0.6/0.4 is balanced
    # (gap 0.2 > 0.1 after 4 moves, 0.0 after 5)
    assert moves == [True] * 5 + [False]
    assert pool.load_of(a) == pytest.approx(0.5) and pool.load_of(b) == pytest.approx(0.5)
    assert not pool.locator.balance.rebalancing


def test_balance_rule_is_geodes():
    assert is_balanced(0.5, 0.6, 0.1)  # floats: 0.6 - 0.5 is one step
    assert not is_balanced(0.0, 0.3, 0.1)
    balance = Balance()
    assert balance.check(0, 9, 1, threshold=10)  # tolerated
    assert not balance.rebalancing
    assert not balance.check(0, 10, 1, threshold=10)
    assert balance.rebalancing
    assert not balance.check(0, 5, 1, threshold=10)  # keeps going below the threshold
    assert balance.check(0, 1, 1, threshold=10)
    assert not balance.rebalancing


def members(loads, idle=None):
    idle = idle or {}
    return [
        Member(name, float(load), 1.0, list(idle.get(name, range(100))))
        for name, load in loads.items()
    ]


def test_round_moves_from_most_to_least_loaded_up_to_the_limit():
    balance = Balance()
    plan = plan_round(members({"a": 15, "b": 15, "c": 0}), balance, 10, 5)
    assert [m.server for m in plan.moves] == ["a", "b", "a", "b", "a"]
    assert all(m.to == "c" for m in plan.moves)
    assert plan.rebalancing
    # the clients reconnected to c: 12/13/5 -> balanced within the next round
    plan = plan_round(members({"a": 12, "b": 13, "c": 5}), balance, 10, 5)
    assert [m.server for m in plan.moves] == ["b", "a", "b", "a", "b"]
    assert not plan.rebalancing
    assert plan_round(members({"a": 10, "b": 10, "c": 10}), balance, 10, 5) is None


def test_round_takes_the_longest_idle_first_and_stops_without_candidates():
    balance = Balance()
    plan = plan_round(members({"a": 20, "b": 0}, idle={"a": ["x", "y"]}), balance, 10, 5)
    assert [m.connection for m in plan.moves] == ["x", "y"]
    assert plan.rebalancing  # not balanced yet: the next round goes on


def test_round_tolerates_imbalance_below_threshold():
    assert plan_round(members({"a": 9, "b": 0}), Balance(), 10, 5) is None
    assert plan_round(members({"a": 3, "b": 0}), Balance(), 2, 5).moves


def test_pool_balance_members_skip_draining_and_down():
    pool = Pool(virtual_server("wlc", {"a": {"weight": 2}, "b": {}, "c": {}}), 0)
    pool.set_state(pool.by_name["b"], DRAIN, 0.0)
    pool.by_name["c"].health.force(False)
    pool.set_state(pool.by_name["c"], "enabled", 0.0)
    for _ in range(3):
        pool.take(pool.by_name["a"], 0.0)
    assert [(rs.name, load, step) for rs, load, step in pool.balance_members()] == [("a", 1.5, 0.5)]
    assert Pool(virtual_server("rr", {"a": {}}), 0).balance_members() == []


def names_of(pool):
    return [rs.name for rs, _, _ in pool.balance_members()]


def lc_pool(servers, **options):
    return Pool(virtual_server("lc", servers, health_check=CHECKS, **options), 0.0)


def test_pool_balance_members_are_where_a_new_connection_could_go():
    # an idle backup is not where the pool sends anyone while a primary is available
    pool = lc_pool({"a": {}, "b": {}, "c": {"backup": True}})
    for name in "aabb":
        pool.take(pool.by_name[name], 0.0)
    assert names_of(pool) == ["a", "b"]
    plan = plan_round(
        [Member(rs, load, step, [rs.name]) for rs, load, step in pool.balance_members()],
        Balance(),
        1,
        10,
    )
    assert plan is None  # 2/2 is balanced: nothing is closed "toward" c
    # once no primary is available the pool serves from its backups, and so does balancing
    for name in "ab":
        pool.record_health(pool.by_name[name], False, 1.0)
    assert names_of(pool) == ["c"]


def test_pool_balance_members_skip_ejected_and_full_servers():
    outlier = OutlierDetectionConfig(consecutive_failures=1, max_ejection_percent=50)
    pool = lc_pool({"a": {}, "b": {}, "c": {}}, outlier_detection=outlier)
    pool.connect_failed(pool.by_name["c"], 0.0)
    assert pool.ejected_until(pool.by_name["c"]) is not None
    assert names_of(pool) == ["a", "b"]
    pool = lc_pool({"a": {}, "b": {"max_connections": 1}})
    pool.take(pool.by_name["b"], 0.0)
    assert names_of(pool) == ["a"]


def test_pool_balance_members_in_panic_are_the_up_servers_the_pick_may_choose():
    pool = lc_pool({"a": {}, "b": {}, "c": {}, "d": {}}, panic_threshold=50)
    for name in "bcd":
        pool.record_health(pool.by_name[name], False, 1.0)
    assert pool.panic  # the pick chooses among all four; b, c and d are down
    assert names_of(pool) == ["a"]


def test_replace_is_not_answered_toward_an_idle_backup():
    config = virtual_server(
        "lc",
        {"a": {}, "b": {}, "c": {"backup": True}},
        health_check=CHECKS,
        conditioning=ConditioningConfig(threshold=2),
    )
    pool = Pool(config, 0.0)
    for name in "aabb":
        pool.take(pool.by_name[name], 0.0)
    answer = pool.locator.locate(0.0, current="a")
    assert (answer.server.name, answer.replace) == ("a", False)


def test_threshold_comes_from_conditioning():
    config = virtual_server("lc", {"a": {}, "b": {}})
    assert Pool(config, 0).locator.imbalance_threshold == 10
    config = dataclasses.replace(config, conditioning=ConditioningConfig(threshold=3))
    assert Pool(config, 0).locator.imbalance_threshold == 3


def test_simulate_locate_reproduces_geode():
    config = virtual_server("least-load", {"a": {}, "b": {}}, load_source="report")
    events = parse_events(
        "- {before: 1, report: {a: {load: 0.4, per_connection: 0.1},"
        " b: {load: 0.2, per_connection: 0.1}}}\n"
        "- {before: 5, report: {b: {load: 0.9}}}\n",
        "events.yaml",
        ["a", "b"],
    )
    result = simulate(config, 8, events=events, locate=True, explain=True)
    assert result.sequence == ["b", "b", "a", "b", "a", "a", "a", "a"]
    # at #5: a 0.5; b reported 0.9, and 0 per connection (no max_connections)
    assert result.explain[4].scores == {"a": "0.5", "b": "0.9"}


def test_simulate_report_events_are_checked():
    with pytest.raises(SimulationError, match="report of a must be a mapping"):
        parse_events("- {before: 1, report: {a: 0.4}}", "e.yaml", ["a"])
    with pytest.raises(SimulationError, match="load must be a number"):
        parse_events("- {before: 1, report: {a: {load: -1}}}", "e.yaml", ["a"])
