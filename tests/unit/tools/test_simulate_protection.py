"""`lbproxy simulate` with connect failures: outlier ejection and panic (SPEC §23) on the
simulated clock, decided by the pool's own code."""

from __future__ import annotations

import pytest

from lbproxy.config.model import OutlierDetectionConfig
from lbproxy.tools.simulate import Event, SimulationError, parse_events, simulate
from tests.factories import virtual_server

OUTLIER = OutlierDetectionConfig(
    consecutive_failures=3, base_ejection_time=2.0, max_ejection_time=5.0, max_ejection_percent=50
)


def four(**options):
    return virtual_server("rr", {f"s{i}": {} for i in range(1, 5)}, retries=3, **options)


def timeline(result):
    return [(p.event, p.real_server, p.time, p.until) for p in result.protection]


def test_failing_servers_are_ejected_for_growing_times_within_the_cap():
    events = [
        Event(5, (("fail", ["s1", "s2", "s3"]),)),
        Event(150, (("recover", ["s1", "s2", "s3"]),)),
    ]
    result = simulate(four(outlier_detection=OUTLIER), 200, events=events, rate=10.0)
    assert None not in result.sequence  # every failed connect retried elsewhere
    steps = timeline(result)
    assert steps[:6] == [
        ("ejected", "s1", pytest.approx(0.6), pytest.approx(2.6)),
        ("ejected", "s2", pytest.approx(0.6), pytest.approx(2.6)),  # 50 % of 4: s3 waits
        ("returned", "s1", pytest.approx(2.6), None),
        ("returned", "s2", pytest.approx(2.6), None),
        ("ejected", "s3", pytest.approx(2.6), pytest.approx(4.6)),
        ("ejected", "s1", pytest.approx(2.8), pytest.approx(6.8)),  # second in a row: 4 s
    ]
    lengths = {round(until - time, 3) for event, _, time, until in steps if event == "ejected"}
    assert lengths == {2.0, 4.0, 5.0}  # base, 2 x base, then capped at max
    ejected_at_once = 0
    for event, *_ in steps:
        ejected_at_once += {"ejected": 1, "returned": -1}[event]
        assert ejected_at_once <= 2
    # recovered from #150: served again once back, and no more failures counted
    assert {"s1", "s2", "s3"} <= set(result.sequence[-20:])
    json = result.as_json()
    assert json["connect_failures"]["s4"] == 0 and json["connect_failures"]["s3"] > 0
    assert json["protection"][0] == {
        "connection": 7,
        "time": 0.6,
        "event": "ejected",
        "real_server": "s1",
        "until": 2.6,
    }


def test_panic_picks_every_enabled_server_while_too_few_are_up():
    events = [Event(10, (("leave", ["s2", "s3", "s4"]),)), Event(30, (("join", ["s2"]),))]
    result = simulate(four(panic_threshold=50), 40, events=events)
    in_panic = result.sequence[9:29]
    assert {name: in_panic.count(name) for name in set(in_panic)} == dict.fromkeys(
        ["s1", "s2", "s3", "s4"], 5
    )  # as if all were up
    assert set(result.sequence[29:]) == {"s1", "s2"}
    assert [(p.event, p.connection) for p in result.protection] == [
        ("panic", 10),
        ("panic over", 30),
    ]
    plain = simulate(four(), 40, events=events[:1])
    assert set(plain.sequence[9:]) == {"s1"} and plain.protection is None


def test_fail_and_recover_name_known_servers():
    with pytest.raises(SimulationError, match="fail: unknown real server 's9'"):
        parse_events("- {before: 1, fail: s9}", "events.yaml", ["s1"])
    events = parse_events("- {before: 1, fail: s1}\n- {before: 2, recover: [s1]}", "e", ["s1"])
    assert [e.actions for e in events] == [(("fail", "s1"),), (("recover", ["s1"]),)]
