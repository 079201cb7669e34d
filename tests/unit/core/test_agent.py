"""The agent's state in the pure pool (core/agent.py, Pool.apply_agent): kept apart from
the operator's, scaling the effective weight, holding health down, on a fake clock."""

from __future__ import annotations

from dataclasses import replace

from lbproxy.config.model import HealthCheckConfig
from lbproxy.core.pool import Pool
from lbproxy.wire.agent import AgentAnswer, parse
from tests.factories import SNMP, virtual_server

CHECKS = HealthCheckConfig(type="tcp", rise=3, fall=2)


def pool(scheduler: str = "wrr", health_check=CHECKS, **servers) -> Pool:
    servers = servers or {"a": {"weight": 4}, "b": {"weight": 4}}
    return Pool(virtual_server(scheduler, servers, health_check=health_check), 0.0)


def says(pool: Pool, name: str, line: str, now: float = 1.0) -> bool | None:
    answer = parse(line.encode())
    assert isinstance(answer, AgentAnswer), answer
    return pool.apply_agent(pool.by_name[name], answer, now, wall=1_700_000_000.0)


def picks(pool: Pool, count: int, now: float = 1.0) -> list[str]:
    """`count` connections, each ended before the next."""
    names = []
    for _ in range(count):
        rs = pool.pick(now)
        names.append(rs.name)
        pool.drop(pool.take(rs, now), now)
    return names


def test_weight_percent_scales_the_effective_weight_not_the_static_one():
    p = pool()
    b = p.by_name["b"]
    says(p, "b", "50%")
    assert (b.static_weight, b.effective_weight) == (4, 2)
    names = picks(p, 60)
    assert (names.count("a"), names.count("b")) == (40, 20)
    says(p, "b", "0%")
    assert not b.available and b.state == "enabled"
    assert p.set_weight(b, 8, 2.0) is None  # the operator changes the static weight
    says(p, "b", "25%")
    assert b.effective_weight == 2


def test_drain_and_maint_are_the_agents_own_state():
    p = pool()
    b = p.by_name["b"]
    for word in ("drain", "maint"):
        says(p, "b", f"{word} # deploy")
        assert (b.state, b.agent.state, b.agent.reason) == ("enabled", word, "deploy")
        assert not b.available and b.health.up
        assert set(picks(p, 5)) == {"a"}
    says(p, "b", "ready")
    assert b.available
    p.set_state(b, "drain", 2.0)  # the operator drains: the agent's ready changes nothing
    says(p, "b", "ready", 3.0)
    assert not b.available and b.state == "drain" and b.agent.state == "ready"


def test_down_holds_health_until_up_then_rise_checks_after_it():
    p = pool()
    b = p.by_name["b"]
    assert says(p, "b", "stopped # disk full") is False
    assert not b.health.up and b.agent.state == "down" and b.agent.reason == "disk full"
    for _ in range(10):  # passing checks while the agent holds it down count for nothing
        assert p.record_health(b, True, 2.0) is None
    assert says(p, "b", "up") is None
    assert not b.health.up and b.agent.state == "ready"
    assert p.record_health(b, True, 3.0) is None
    assert p.record_health(b, True, 3.1) is None
    assert p.record_health(b, True, 3.2) is True  # rise: 3 after the agent's up
    assert b.available


def test_down_and_up_with_passive_health_only():
    p = pool(health_check=HealthCheckConfig(type="none"))
    b = p.by_name["b"]
    assert says(p, "b", "fail") is False
    p.advance(100.0)  # no passive trial while the agent holds it down
    assert not b.available
    assert says(p, "b", "up") is True
    assert b.health.up and b.available


def test_maxconn_replaces_max_connections_until_the_agent_goes():
    p = pool(b={"max_connections": 5})
    b = p.by_name["b"]
    says(p, "b", "maxconn:1")
    assert b.max_connections == 1
    p.take(b, 1.0)
    assert not b.available and b.full
    p.reconfigure(p.config, 2.0)  # a reload keeps what the agent said
    assert b.max_connections == 1
    p.clear_agent(b, 3.0)
    assert b.agent is None and b.max_connections == 5 and b.available


def test_agent_percent_applies_to_the_dynamic_snmp_weight():
    p = pool("dwd", a={"snmp": SNMP}, b={"snmp": SNMP})
    a, b = p.by_name["a"], p.by_name["b"]
    p.set_dynamic_weight(a, 40, 1.0)
    p.set_dynamic_weight(b, 40, 1.0)
    says(p, "b", "50%")
    assert (a.effective_weight, b.effective_weight) == (40, 20)


def test_document():
    p = pool()
    says(p, "b", "75% maxconn:30 drain # deploy")
    assert p.by_name["b"].agent.document() == {
        "state": "drain",
        "weight_percent": 75,
        "max_connections": 30,
        "reason": "deploy",
        "at": "2023-11-14T22:13:20.000Z",  # as a check's `at` and `since`
    }
    assert p.by_name["a"].agent is None


def test_health_check_changes_keep_the_agents_hold():
    p = pool()
    b = p.by_name["b"]
    says(p, "b", "down")
    p.reconfigure(replace(p.config, health_check=replace(CHECKS, rise=1)), 2.0)
    assert p.record_health(b, True, 3.0) is None and not b.health.up


def test_removing_the_agent_of_a_server_it_held_down_lets_passive_health_try_it():
    p = pool(health_check=HealthCheckConfig(type="none", interval=2.0))
    b = p.by_name["b"]
    says(p, "b", "down")
    p.clear_agent(b, 10.0)
    assert not b.available
    p.advance(12.0)  # `interval` later: one trial connection, as after connect failures
    assert b.available and b.trial
    p.record_health(b, True, 12.5)
    assert b.health.up and b.available and not b.trial
