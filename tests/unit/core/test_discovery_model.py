"""DNS discovery's pure part: answers -> real servers, the hold/streak state, the merge,
and what the pool keeps when a merged configuration is applied (explicit times)."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from lbproxy.config.model import Address, DnsDiscoveryConfig, RealServerConfig, SnmpConfig
from lbproxy.core.discovery_model import (
    DiscoveryState,
    Resolution,
    SrvRecord,
    resolution,
    servers_from_addresses,
    servers_from_srv,
)
from lbproxy.core.pool import Pool
from tests.factories import virtual_server

DNS = DnsDiscoveryConfig(name="_web._tcp.service.consul", hold=30.0, line=7)


def srv(priority: int, weight: int, port: int, target: str) -> SrvRecord:
    return SrvRecord(priority, weight, port, target)


def names(servers) -> list[str]:
    return [rs.name for rs in servers]


# -- answers -> servers ------------------------------------------------------------------


def test_srv_names_weights_and_backups():
    servers, skipped = servers_from_srv(
        [
            srv(1, 1, 8083, "web3.node.consul."),
            srv(0, 5, 8081, "Web1.Node.Consul."),
            srv(0, 0, 8082, "web2.node.consul."),
            srv(2, 9, 8084, "web4.node.consul."),
        ],
        {"web1.node.consul": "10.0.0.1", "web3.node.consul": "::1"},
    )
    assert skipped == []
    assert [(rs.name, str(rs.address), rs.weight, rs.backup) for rs in servers] == [
        ("web1.node.consul:8081", "10.0.0.1:8081", 5, False),
        ("web2.node.consul:8082", "web2.node.consul:8082", 0, False),  # weight 0 stays 0
        ("web3.node.consul:8083", "[::1]:8083", 1, True),
        ("web4.node.consul:8084", "web4.node.consul:8084", 9, True),
    ]
    assert all(rs.discovered and rs.state == "enabled" for rs in servers)


def test_srv_a_priority_of_weight_0_only_is_served_alike():
    # CoreDNS answers weight floor(100/N) per endpoint: 0 for every one beyond 100.
    servers, _ = servers_from_srv(
        [
            srv(0, 0, 80, "a."),
            srv(0, 0, 80, "b."),
            srv(0, 0, 80, "c."),
            srv(1, 0, 80, "d."),  # a backup priority: decided on its own
            srv(2, 3, 80, "e."),
            srv(2, 0, 80, "f."),  # beside a weighted record: stays 0
        ]
    )
    assert [(rs.name, rs.weight, rs.backup) for rs in servers] == [
        ("a:80", 1, False),
        ("b:80", 1, False),
        ("c:80", 1, False),
        ("d:80", 1, True),
        ("e:80", 3, True),
        ("f:80", 0, True),
    ]


def test_srv_weight_0_beside_a_weighted_record_of_its_priority_stays_0():
    servers, _ = servers_from_srv([srv(0, 0, 80, "a."), srv(0, 1, 80, "b."), srv(1, 0, 80, "c.")])
    assert [(rs.name, rs.weight) for rs in servers] == [("a:80", 0), ("b:80", 1), ("c:80", 1)]


def test_srv_a_target_listed_twice_counts_its_best_record_for_the_weight_0_rule():
    # a:80 counts at priority 0 with weight 0; b:80 at priority 0 with weight 0 too.
    servers, _ = servers_from_srv([srv(0, 0, 80, "a."), srv(1, 5, 80, "a."), srv(0, 0, 80, "b.")])
    assert [(rs.name, rs.weight, rs.backup) for rs in servers] == [
        ("a:80", 1, False),
        ("b:80", 1, False),
    ]


def test_srv_primaries_are_the_lowest_priority_whatever_its_number():
    servers, _ = servers_from_srv(
        [srv(10, 1, 80, "a."), srv(20, 1, 80, "b."), srv(10, 2, 81, "c.")]
    )
    assert [(rs.name, rs.backup) for rs in servers] == [
        ("a:80", False),
        ("c:81", False),
        ("b:80", True),
    ]


def test_a_target_listed_twice_counts_once_at_its_best():
    servers, _ = servers_from_srv(
        [srv(1, 9, 80, "a.x."), srv(0, 2, 80, "a.x."), srv(0, 7, 80, "A.X"), srv(0, 1, 81, "a.x.")]
    )
    assert [(rs.name, rs.weight, rs.backup) for rs in servers] == [
        ("a.x:80", 7, False),
        ("a.x:81", 1, False),
    ]


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (srv(0, 1, 80, "."), "no target"),
        (srv(0, 1, 0, "a.x."), "port 0"),
        (srv(0, 1, 80, "bad\\032name."), "is not an IP address or host name"),
        (srv(0, 70000, 80, "a.x."), "weight 70000"),
        (srv(-1, 1, 80, "a.x."), "priority -1"),
    ],
)
def test_unusable_srv_records_are_skipped_and_said(record, reason):
    servers, skipped = servers_from_srv([record, srv(0, 1, 80, "ok.x.")])
    assert names(servers) == ["ok.x:80"]
    assert len(skipped) == 1 and reason in skipped[0]


def test_an_answer_of_only_unusable_records_is_empty():
    outcome = resolution(*servers_from_srv([srv(0, 0, 80, ".")]))
    assert outcome.result == "empty" and outcome.servers == ()
    assert "no target" in outcome.detail


def test_addresses_are_named_with_the_port_ipv6_in_brackets():
    servers, skipped = servers_from_addresses(
        ["10.0.0.12", "::1", "10.0.0.2", "10.0.0.12", "2001:db8::0001", "junk"], 8080
    )
    assert names(servers) == [
        "10.0.0.2:8080",
        "10.0.0.12:8080",
        "[::1]:8080",
        "[2001:db8::1]:8080",
    ]
    assert servers[2].address == Address("::1", 8080)
    assert skipped == ["'junk': not an IP address"]


# -- the state: streaks and hold -----------------------------------------------------------


def ok(*names_: str, weight: int = 1) -> Resolution:
    servers = tuple(
        RealServerConfig(
            name, Address("127.0.0.1", int(name.rsplit(":")[1])), weight, discovered=True
        )
        for name in names_
    )
    return Resolution("ok", servers)


ERROR = Resolution("error", detail="The DNS operation timed out")
NXDOMAIN = Resolution("nxdomain")
EMPTY = Resolution("empty")


def test_an_error_keeps_the_last_set_and_is_logged_once_per_streak(caplog):
    state = DiscoveryState("web", DNS)
    assert state.record(ok("a:1", "b:2"), 0.0)
    with caplog.at_level(logging.INFO, logger="lbproxy.discovery_model"):
        assert not state.record(ERROR, 10.0)
        assert not state.record(ERROR, 20.0)
        assert not state.record(ERROR, 1000.0)  # far beyond hold: errors never remove
        assert not state.record(ok("a:1", "b:2"), 1010.0)  # same set: nothing to apply
        assert not state.record(ERROR, 1020.0)
    assert state.current == ["a:1", "b:2"]
    failed = [r.message for r in caplog.records if "resolution failed" in r.message]
    assert (
        failed
        == [
            "web: discovery SRV _web._tcp.service.consul: resolution failed "
            "(The DNS operation timed out); keeping the last 2 discovered server(s)"
        ]
        * 2
    )  # one per streak: two streaks
    assert "resolving again after 3 failed round(s)" in caplog.text
    assert state.results == {"ok": 2, "error": 4}


def test_a_target_of_several_addresses_is_said_once_while_it_has_them(caplog):
    state = DiscoveryState("web", DNS)
    several = replace(ok("a:1"), multiple=(("a", 3, "10.0.0.1"),))
    with caplog.at_level(logging.INFO, logger="lbproxy.discovery_model"):
        for now in (0.0, 10.0, 20.0):
            state.record(several, now)
        state.record(ok("a:1"), 30.0)  # one address now
        state.record(several, 40.0)  # several again: said again
    said = [r.message for r in caplog.records if "addresses" in r.message]
    assert (
        said
        == [
            "web: discovery SRV _web._tcp.service.consul: SRV target a has 3 addresses; only "
            "10.0.0.1 is used (one real server per target and port, at its lowest address)"
        ]
        * 2
    )
    assert all(r.levelno == logging.INFO for r in caplog.records if "addresses" in r.message)


def test_no_answer_yet_says_only_static_servers_serve(caplog):
    state = DiscoveryState("web", DNS)
    with caplog.at_level(logging.WARNING, logger="lbproxy.discovery_model"):
        assert not state.record(ERROR, 0.0)
    assert "no answer yet: only the static real servers serve" in caplog.text
    assert state.current == [] and not state.answered


@pytest.mark.parametrize("gone", [NXDOMAIN, EMPTY])
def test_empty_or_nxdomain_removes_only_after_hold(gone):
    state = DiscoveryState("web", DNS)
    state.record(ok("a:1", "b:2"), 0.0)
    assert not state.record(gone, 10.0)  # the streak starts
    assert not state.record(gone, 39.9)
    assert state.current == ["a:1", "b:2"]
    assert state.record(gone, 40.0)  # hold (30 s) since the first empty answer
    assert state.current == [] and state.leaving == {"a:1", "b:2"}
    assert not state.record(gone, 50.0)  # nothing more to remove
    assert state.results[gone.result] == 4


def test_an_answer_within_hold_ends_the_empty_streak():
    state = DiscoveryState("web", DNS)
    state.record(ok("a:1"), 0.0)
    state.record(NXDOMAIN, 10.0)
    state.record(ok("a:1"), 20.0)
    assert not state.record(NXDOMAIN, 45.0)  # a new streak: 0 s of hold spent
    assert not state.record(NXDOMAIN, 74.0)
    assert state.record(NXDOMAIN, 75.0)


def test_errors_inside_an_empty_streak_neither_end_nor_extend_it():
    state = DiscoveryState("web", DNS)
    state.record(ok("a:1"), 0.0)
    state.record(EMPTY, 10.0)
    state.record(ERROR, 20.0)
    assert state.record(EMPTY, 40.0)


def test_hold_zero_removes_at_the_first_empty_answer():
    state = DiscoveryState("web", replace(DNS, hold=0.0))
    state.record(ok("a:1"), 0.0)
    assert state.record(EMPTY, 1.0)


# -- the merge ---------------------------------------------------------------------------

VS = replace(virtual_server("wlc", {"s": {}}), discovery=DNS)


def test_merged_is_static_first_then_discovered_in_order_of_appearance():
    state = DiscoveryState("web", DNS)
    state.record(ok("b:2", "c:3"), 0.0)
    state.record(ok("a:1", "b:2", "c:3"), 10.0)  # a new name goes last
    merged = state.merged(VS)
    assert names(merged.real_servers) == ["s", "b:2", "c:3", "a:1"]
    assert [rs.discovered for rs in merged.real_servers] == [False, True, True, True]
    assert merged.real_servers[1].line == 7  # where: the discovery block


def test_a_leaving_server_drains_while_it_has_connections_then_goes():
    state = DiscoveryState("web", DNS)
    state.record(ok("a:1", "b:2"), 0.0)
    assert state.record(ok("b:2"), 10.0)
    active = {"a:1": 2}
    merged = state.merged(VS, lambda name: active.get(name, 0))
    assert [(rs.name, rs.state) for rs in merged.real_servers] == [
        ("s", "enabled"),
        ("a:1", "drain"),
        ("b:2", "enabled"),
    ]
    active["a:1"] = 0
    assert not state.forget_idle(lambda name: 1)
    assert state.forget_idle(lambda name: active.get(name, 0))
    assert names(state.merged(VS).real_servers) == ["s", "b:2"]
    assert state.leaving == set()


def test_a_leaving_server_that_comes_back_keeps_its_place():
    state = DiscoveryState("web", DNS)
    state.record(ok("a:1", "b:2"), 0.0)
    state.record(ok("b:2"), 10.0)
    assert state.record(ok("a:1", "b:2"), 20.0)
    merged = state.merged(VS, lambda name: 1)
    assert [(rs.name, rs.state) for rs in merged.real_servers][1:] == [
        ("a:1", "enabled"),
        ("b:2", "enabled"),
    ]


def test_a_weight_change_is_a_change_of_the_same_server():
    state = DiscoveryState("web", DNS)
    state.record(ok("a:1", "b:2"), 0.0)
    assert state.record(ok("a:1", "b:2", weight=4), 10.0)
    assert [rs.weight for rs in state.merged(VS).real_servers] == [1, 4, 4]


def test_a_static_name_wins_over_a_discovered_one(caplog):
    state = DiscoveryState("web", DNS)
    state.record(ok("s:9", "a:1"), 0.0)
    vs = replace(VS, real_servers=(replace(VS.real_servers[0], name="s:9"),))
    with caplog.at_level(logging.WARNING, logger="lbproxy.discovery_model"):
        merged = state.merged(vs)
        state.merged(vs)
    assert [(rs.name, rs.discovered) for rs in merged.real_servers] == [
        ("s:9", False),
        ("a:1", True),
    ]
    assert caplog.text.count("s:9 is a static real server") == 1


def test_discovered_servers_get_the_virtual_servers_snmp_block_with_their_host():
    state = DiscoveryState("web", DNS)
    state.record(ok("a:1"), 0.0)
    vs = replace(VS, snmp=SnmpConfig(port=1161))
    (rs,) = state.merged(vs).real_servers[1:]
    assert rs.snmp == SnmpConfig(port=1161, host="127.0.0.1")


# -- the pool, fed the merged configurations ------------------------------------------------


def test_a_discovery_round_keeps_runtime_changes_and_what_the_pool_keeps():
    vs = replace(VS, slow_start=10.0)
    state = DiscoveryState("web", DNS)
    state.record(ok("a:1", "b:2"), 0.0)
    pool = Pool(state.merged(vs), 0.0)
    s, a, b = pool.servers
    lease = pool.take(a, 1.0)
    pool.set_state(b, "drain", 1.0)  # PATCHed
    pool.set_weight(s, 7, 1.0)  # PATCHed, on the static server
    assert state.record(ok("a:1", "b:2", "c:3"), 2.0)
    pool.reconfigure(state.merged(vs), 2.0, keep_runtime=True)
    assert pool.servers[:3] == [s, a, b]  # the same objects: counters, health, leases
    c = pool.servers[3]
    assert (a.active, lease in a.leases, b.state, s.static_weight) == (1, True, "drain", 7)
    assert (a.ramp_start, c.ramp_start) == (0.0, 2.0)  # a's ramp goes on; c's starts
    assert c.effective_weight == pytest.approx(0.1)
    pool.drop(lease, 3.0)


def test_a_weight_change_applies_and_keeps_a_patched_state():
    state = DiscoveryState("web", DNS)
    state.record(ok("a:1"), 0.0)
    pool = Pool(state.merged(VS), 0.0)
    a = pool.by_name["a:1"]
    pool.set_state(a, "disabled", 0.0)
    state.record(ok("a:1", weight=5), 1.0)
    pool.reconfigure(state.merged(VS), 1.0, keep_runtime=True)
    assert (a.static_weight, a.state) == (5.0, "disabled")


def test_a_reload_applies_the_file_but_keeps_discovered_runtime_state():
    state = DiscoveryState("web", DNS)
    state.record(ok("a:1"), 0.0)
    pool = Pool(state.merged(VS), 0.0)
    s, a = pool.servers
    pool.set_state(s, "drain", 0.0)
    pool.set_state(a, "drain", 0.0)
    pool.reconfigure(state.merged(VS), 1.0)  # a reload: keep_runtime False
    assert (s.state, a.state) == ("enabled", "drain")


def test_removed_servers_drain_then_leave_the_pool():
    state = DiscoveryState("web", DNS)
    state.record(ok("a:1", "b:2"), 0.0)
    pool = Pool(state.merged(VS), 0.0)
    a = pool.by_name["a:1"]
    lease = pool.take(a, 0.0)

    def active(name: str) -> int:
        return pool.by_name[name].active if name in pool.by_name else 0

    state.record(ok("b:2"), 1.0)
    pool.reconfigure(state.merged(VS, active), 1.0, keep_runtime=True)
    assert (a.state, a.available) == ("drain", False)
    assert names(pool.servers) == ["s", "a:1", "b:2"]
    assert all(pool.pick(1.5) is not a for _ in range(10))
    pool.drop(lease, 2.0)
    pool.reconfigure(state.merged(VS, active), 2.0, keep_runtime=True)
    assert names(pool.servers) == ["s", "b:2"] and a.removed


def test_quiesce_resets_when_a_discovered_server_comes_online():
    vs = replace(VS, quiesce=True)
    state = DiscoveryState("web", DNS)
    state.record(ok("a:1"), 0.0)
    pool = Pool(state.merged(vs), 0.0)
    pool.take(pool.by_name["a:1"], 0.0)
    epoch = pool.epoch
    state.record(ok("a:1", "b:2"), 1.0)
    pool.reconfigure(state.merged(vs), 1.0, keep_runtime=True)
    assert pool.epoch == epoch + 1
    assert pool.by_name["a:1"].sched_active == 0 and pool.by_name["a:1"].active == 1


# -- what makes the usual round cheap ---------------------------------------------------


def test_known_addresses_are_reused_and_only_the_current_ones_kept():
    known: dict = {}
    first, _ = servers_from_addresses(["10.0.0.1", "10.0.0.2"], 80, known)
    second, _ = servers_from_addresses(["10.0.0.2", "10.0.0.3", "10.0.0.1"], 80, known)
    assert names(second) == ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]
    assert second[0] is first[0] and second[1] is first[1]  # not parsed again
    assert second == servers_from_addresses(["10.0.0.3", "10.0.0.2", "10.0.0.1"], 80)[0]
    servers_from_addresses(["10.0.0.3"], 80, known)
    assert set(known) == {"10.0.0.3"}


def test_the_same_resolution_again_is_no_change_and_merges_to_equal_configs():
    state = DiscoveryState("web", DNS)
    outcome = ok("a:1", "b:2")
    assert state.record(outcome, 0.0)
    vs = replace(VS, snmp=SnmpConfig())  # the running configuration: one object
    first = state.merged(vs)
    assert not state.record(outcome, 1.0)  # the very same tuple: recognised at once
    again = state.merged(vs)
    assert again == first and again.real_servers[1] is first.real_servers[1]
    assert not state.record(ok("a:1", "b:2"), 2.0)  # an equal answer: no change either


def test_best_records_keep_the_lowest_priority_then_highest_weight_then_name():
    from lbproxy.core.discovery_model import SrvRecord, best_records

    records = [
        SrvRecord(1, 90, 80, "z.example."),
        SrvRecord(0, 5, 80, "b.example."),
        SrvRecord(0, 5, 80, "a.example."),
        SrvRecord(0, 9, 80, "c.example."),
        SrvRecord(2, 1, 80, "c.example."),  # c:80 again: its best record counts
        SrvRecord(0, 1, 0, "bad.example."),  # unusable: passed on to be reported
    ]
    kept, beyond = best_records(records, 3)
    assert [r.target for r in kept] == ["c.example.", "a.example.", "b.example.", "bad.example."]
    assert beyond == 1
    assert best_records(records, 4)[1] == 0


def test_an_address_answer_beyond_max_servers_keeps_the_lowest_addresses():
    from lbproxy.core.discovery_model import resolution, servers_from_addresses

    servers = servers_from_addresses(["10.0.0.3", "10.0.0.1", "10.0.0.2"], 80)
    outcome = resolution(*servers, max_servers=2)
    assert [rs.name for rs in outcome.servers] == ["10.0.0.1:80", "10.0.0.2:80"]
    assert outcome.beyond == 1


# -- the address policy (SPEC §21) --------------------------------------------------------


def _policy_config(*listens: str, admin: str = "127.0.0.1:9100", dns: str | None = None):
    from lbproxy.config.model import AdminConfig, Config, DnsLocatorConfig, GlobalConfig
    from lbproxy.config.model import LocatorConfig as Locator
    from lbproxy.config.values import parse_address

    vs = virtual_server("rr", {})
    locator = Locator(DnsLocatorConfig(listen=parse_address(dns))) if dns else Locator()
    return Config(
        GlobalConfig(admin=AdminConfig(listen=parse_address(admin)), locator=locator),
        tuple(
            replace(vs, name=f"vs{i}", listen=(parse_address(text),))
            for i, text in enumerate(listens)
        ),
    )


THIS_HOST = {"10.1.2.3", "fe80::1"}


def _refusal(policy, text: str) -> str | None:
    from ipaddress import ip_address

    from lbproxy.config.values import parse_address

    return policy.refusal(
        parse_address(text), lambda ip: str(ip) in THIS_HOST or ip == ip_address("10.1.2.3")
    )


@pytest.mark.parametrize(
    ("address", "allowed", "expected"),
    [
        ("10.0.0.5:80", (), None),
        ("127.0.0.1:80", (), "loopback"),
        ("127.0.0.1:80", ("127.0.0.0/8",), None),
        ("[::1]:80", (), "loopback"),
        ("[::ffff:127.0.0.1]:80", (), "loopback"),  # an IPv4-mapped loopback is loopback
        ("169.254.1.1:80", (), "link_local"),
        ("[fe80::2]:80", (), "link_local"),
        ("224.0.0.1:80", (), "multicast"),
        ("0.0.0.0:80", (), "unspecified"),
        ("localhost:80", (), "loopback"),  # resolved when connecting: to loopback
        ("db.localhost:80", ("127.0.0.0/8",), None),
        ("web.internal:80", (), None),  # a name: resolved when connecting
        # the admin endpoint (127.0.0.1:9100) and the DNS locator (127.0.0.1:5353): never
        ("127.0.0.1:9100", ("127.0.0.0/8",), "self"),
        ("[::ffff:127.0.0.1]:9100", ("0.0.0.0/0",), "self"),
        ("localhost:9100", ("127.0.0.0/8", "::1/128"), "self"),
        ("0.0.0.0:9100", ("0.0.0.0/0",), "self"),  # a connection to it reaches 127.0.0.1
        ("127.0.0.1:5353", ("127.0.0.0/8",), "self"),
        ("127.0.0.2:9100", ("127.0.0.0/8",), None),  # another address: not the listener
        # a wildcard listener (0.0.0.0:8080) is every local address on its port
        ("10.1.2.3:8080", (), "self"),
        ("10.9.9.9:8080", (), None),  # not this host's
        ("127.0.0.5:8080", ("127.0.0.0/8",), "self"),
        ("[fe80::1]:8080", ("fe80::/10",), "self"),
        ("10.1.2.3:8081", (), None),
        ("10.1.2.4:443", (), None),
        ("10.1.2.3:443", (), "self"),  # the listener 10.1.2.3:443 itself
    ],
)
def test_which_addresses_discovery_may_use(address, allowed, expected):
    import ipaddress

    from lbproxy.core.discovery_model import address_policy

    config = _policy_config("0.0.0.0:8080", "10.1.2.3:443", dns="127.0.0.1:5353")
    policy = address_policy(config, tuple(ipaddress.ip_network(n) for n in allowed))
    assert _refusal(policy, address) == expected


def test_refused_servers_are_left_out_counted_every_round_and_logged_once(caplog):
    import ipaddress

    from lbproxy.core.discovery_model import AddressPolicy

    caplog.set_level(logging.INFO, logger="lbproxy.discovery_model")
    policy = AddressPolicy((ipaddress.ip_network("127.0.0.0/8"),),
                           frozenset({(ipaddress.ip_address("127.0.0.1"), 9100)}))  # fmt: skip
    servers, _ = servers_from_addresses(["127.0.0.1", "127.0.0.2", "169.254.0.1"], 9100)
    outcome = resolution(servers, [], refuse=lambda a: policy.refusal(a, lambda ip: False))
    assert [rs.name for rs in outcome.servers] == ["127.0.0.2:9100"]
    assert outcome.refused == (("127.0.0.1:9100", "self"), ("169.254.0.1:9100", "link_local"))
    state = DiscoveryState("web", DnsDiscoveryConfig("web.test", type="A", port=9100))
    for now in range(3):
        state.record(outcome, float(now))
    assert dict(state.refused) == {"self": 3, "link_local": 3}
    warnings = [r.getMessage() for r in caplog.records if "not using" in r.getMessage()]
    assert len(warnings) == 1 and "127.0.0.1:9100 (self)" in warnings[0]
    state.record(resolution(servers[1:2], []), 4.0)  # the refused ones left the answer
    assert any("no address of the answer is refused" in r.getMessage() for r in caplog.records)
