"""DNS discovery against a real dnsmasq, through real `lbproxy run` processes (SPEC §14).

Every wait is bounded; intervals are short (100-200 ms) so the file stays fast. SRV
changes restart dnsmasq (it reads srv-host only at start): the moment it is down is a
resolution error, which keeps the last set, so it is harmless where the test does not
look at error counts.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections import Counter

import pytest

from lbproxy.core.pool import RealServer
from tests.integration.dnsmasq import Dnsmasq, requires_dnsmasq
from tests.integration.harness import (
    NameServer,
    ask_name,
    counted,
    free_port,
    http,
    metrics,
    open_and_read_name,
    run_cli,
    sample,
    servers_of,
    virtual_server_document,
    wait_for,
    wait_for_log,
)

pytestmark = [pytest.mark.integration, requires_dnsmasq]

SRV_NAME = "_web._tcp.svc.test"
A_NAME = "web.k8s.test"


@pytest.fixture
def dnsmasq(tmp_path):
    started: list[Dnsmasq] = []

    def make(**records) -> Dnsmasq:
        server = Dnsmasq(tmp_path / f"dns{len(started)}")
        started.append(server)
        return server.start(**records) if records else server

    yield make
    for server in started:
        server.stop()


def config(
    port: int,
    admin_port: int,
    dns: Dnsmasq,
    *,
    allow: str = "[127.0.0.0/8, '::1/128']",
    name: str = SRV_NAME,
    record_type: str = "SRV",
    dns_port: int | None = None,
    interval: str = "150ms",
    hold: str = "1s",
    scheduler: str = "wrr",
    static: list[NameServer] = (),
    health: str = "{type: none}",
) -> str:
    lines = [
        "global:",
        f"  admin: {{listen: 127.0.0.1:{admin_port}}}",
        "  drain_timeout: 5s",
        "virtual_servers:",
        "  - name: web",
        f"    listen: 127.0.0.1:{port}",
        f"    scheduler: {scheduler}",
        f"    health_check: {health}",
        "    discovery:",
        "      dns:",
        f"        name: {name}",
        f"        type: {record_type}",
        *([f"        port: {dns_port}"] if dns_port else []),
        f"        resolvers: [{dns.address}]",
        f"        interval: {interval}",
        f"        hold: {hold}",
        "        timeout: 300ms",
        *([f"        allow_addresses: {allow}"] if allow else []),  # real servers on loopback
    ]
    if static:
        lines.append("    real_servers:")
        lines += [f"      - {{name: {s.name}, address: 127.0.0.1:{s.port}}}" for s in static]
    return "\n".join(lines) + "\n"


def wait_for_names(admin_port: int, names: set[str], timeout: float = 10.0) -> dict[str, dict]:
    found: dict[str, dict] = {}

    def listed() -> bool:
        found.clear()
        found.update(servers_of(admin_port))
        return found.keys() == names

    wait_for(listed, timeout, f"real servers {sorted(names)}")
    return found


def srv_for(*servers: NameServer, weights=None, priorities=None) -> dict:
    weights = weights or {}
    priorities = priorities or {}
    return {
        SRV_NAME: [
            (priorities.get(s.name, 0), weights.get(s.name, 1), s.port, f"{s.name}.node.test")
            for s in servers
        ]
    }


def glue_for(*servers: NameServer) -> dict[str, list[str]]:
    return {f"{s.name}.node.test": ["127.0.0.1"] for s in servers}


def rounds_go_by(admin_port: int, rounds: int) -> None:
    """Until `rounds` more discovery rounds are over (lbproxy_discovery_resolutions_total)."""

    def done() -> float:
        return counted(admin_port, "lbproxy_discovery_resolutions_total")

    start = done()
    wait_for(lambda: done() >= start + rounds, 10, f"{rounds} more discovery rounds")


def picks(port: int, n: int) -> Counter:
    return Counter(ask_name(port) for _ in range(n))


# -- SRV: servers appear, weights follow, names work everywhere ---------------------------


def test_srv_servers_appear_and_follow_weight_changes(name_servers, lbproxy, dnsmasq):
    a, b = name_servers("a", "b")
    dns = dnsmasq(srv=srv_for(a, b, weights={"a": 1, "b": 3}), hosts=glue_for(a, b))
    port, admin_port = free_port(), free_port()
    lbproxy(config(port, admin_port, dns))
    name_a, name_b = f"a.node.test:{a.port}", f"b.node.test:{b.port}"
    found = wait_for_names(admin_port, {name_a, name_b})
    assert found[name_a]["address"] == f"127.0.0.1:{a.port}"  # from the additional section
    assert [found[n]["weight"]["static"] for n in (name_a, name_b)] == [1, 3]
    assert all(rs["discovered"] for rs in found.values())
    assert picks(port, 8) == {"a": 2, "b": 6}  # smooth wrr: exact per cycle of 4

    dns.set_srv(srv_for(a, b, weights={"a": 3, "b": 3}))
    wait_for(lambda: servers_of(admin_port)[name_a]["weight"]["static"] == 3, what="weight 3")
    assert picks(port, 6) == {"a": 3, "b": 3}

    dns.set_srv(srv_for(a, b, weights={"a": 0, "b": 3}))  # SRV weight 0: no new connections
    wait_for(lambda: servers_of(admin_port)[name_a]["weight"]["static"] == 0, what="weight 0")
    assert picks(port, 4) == {"b": 4}

    samples = metrics(admin_port)
    assert sample(samples, "lbproxy_discovered_servers", virtual_server="web") == 2
    assert (
        sample(samples, "lbproxy_discovery_resolutions_total", virtual_server="web", result="ok")
        >= 3
    )
    assert (
        sample(samples, "lbproxy_connections_total", virtual_server="web", real_server=name_b)
        == 6 + 3 + 4
    )


def test_srv_records_all_of_weight_0_share_connections_alike(name_servers, lbproxy, dnsmasq):
    # What CoreDNS answers for a headless service of more than 100 endpoints.
    servers = name_servers("a", "b", "c")
    dns = dnsmasq(srv=srv_for(*servers, weights=dict.fromkeys("abc", 0)), hosts=glue_for(*servers))
    port, admin_port = free_port(), free_port()
    lbproxy(config(port, admin_port, dns))
    names = {f"{s.name}.node.test:{s.port}" for s in servers}
    found = wait_for_names(admin_port, names)
    assert [found[n]["weight"]["static"] for n in sorted(names)] == [1, 1, 1]
    assert picks(port, 9) == {"a": 3, "b": 3, "c": 3}  # smooth wrr: exact per cycle of 3
    assert counted(admin_port, "lbproxy_rejected_total", reason="no_server") == 0


def test_an_srv_target_of_several_addresses_is_one_server_at_its_lowest(lbproxy, dnsmasq):
    (a,) = servers = [NameServer("a")]
    try:
        # a.node.test has two addresses; only 127.0.0.1 has the real server
        dns = dnsmasq(srv=srv_for(a), hosts={"a.node.test": ["127.0.0.2", "127.0.0.1"]})
        port, admin_port = free_port(), free_port()
        proxy = lbproxy(config(port, admin_port, dns))
        name = f"a.node.test:{a.port}"
        found = wait_for_names(admin_port, {name})
        assert found[name]["address"] == f"127.0.0.1:{a.port}"  # the lowest
        assert picks(port, 3) == {"a": 3}
        said = "SRV target a.node.test has 2 addresses; only 127.0.0.1 is used"
        wait_for_log(proxy, said)
        rounds_go_by(admin_port, 3)
        assert proxy.log().count(said) == 1  # once per target, not every round
    finally:
        for server in servers:
            server.stop()


def test_check_resolve_prints_what_would_be_added(name_servers, dnsmasq, tmp_path):
    a, b, c = name_servers("a", "b", "c")
    dns = dnsmasq(srv=srv_for(a, b, c, weights={"b": 0}, priorities={"c": 5}), hosts=glue_for(a, b))
    path = tmp_path / "lbproxy.yaml"
    path.write_text(config(free_port(), free_port(), dns))
    out = run_cli("check", "--resolve", str(path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    start = lines.index("  would add 3 real server(s)")
    assert [line.split() for line in lines[start + 1 : start + 4]] == [
        [f"a.node.test:{a.port}", f"127.0.0.1:{a.port}", "weight", "1"],
        [f"b.node.test:{b.port}", f"127.0.0.1:{b.port}", "weight", "0"],
        # no address in the answer and none for its name: kept as a name
        [f"c.node.test:{c.port}", f"c.node.test:{c.port}", "weight", "1,", "backup"],
    ]

    dns.stop()
    out = run_cli("check", "--resolve", str(path))
    assert out.returncode == 1
    assert "would add no real server" in out.stdout


def test_discovered_names_in_patch_status_and_reload(name_servers, lbproxy, dnsmasq):
    a, b, s = name_servers("a", "b", "s")
    dns = dnsmasq(srv=srv_for(a, b), hosts=glue_for(a, b))
    port, admin_port = free_port(), free_port()
    proxy = lbproxy(config(port, admin_port, dns, static=[s], scheduler="rr"))
    name_a = f"a.node.test:{a.port}"
    wait_for_names(admin_port, {"s", name_a, f"b.node.test:{b.port}"})
    admin = f"http://127.0.0.1:{admin_port}"

    out = run_cli("drain", "web", name_a, "--admin", admin)  # the CLI quotes the ':'
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"web/{name_a}: state drain")
    quoted = urllib.parse.quote(name_a, safe="")
    assert "%3A" in quoted
    status, body = http("GET", f"{admin}/api/v1/virtual-servers/web/real-servers/{quoted}")
    assert status == 200 and json.loads(body)["state"] == "drain"

    rounds_go_by(admin_port, 3)  # the PATCHed state stays
    assert servers_of(admin_port)[name_a]["state"] == "drain"
    proxy.reload()  # a file reload keeps the discovered set and the PATCHed state
    found = wait_for_names(admin_port, {"s", name_a, f"b.node.test:{b.port}"})
    assert found[name_a]["state"] == "drain"
    assert {n: rs["discovered"] for n, rs in found.items()} == {
        "s": False,
        name_a: True,
        f"b.node.test:{b.port}": True,
    }
    assert "a" not in picks(port, 6)

    table = run_cli("status", "--admin", admin)
    assert table.returncode == 0
    # Piped: plain columns, the real server 4th and DISCOVERED 15th.
    rows = [line.split() for line in table.stdout.splitlines()]
    assert rows[0][3] == "REAL_SERVER" and rows[0][14] == "DISCOVERED"
    assert {row[3]: row[14] for row in rows[1:]} == {
        "s": "no",
        name_a: "yes",
        f"b.node.test:{b.port}": "yes",
    }

    def status_json_is_the_api_document() -> bool:
        # Two reads: the same unless the once-a-second rate sample falls between them.
        as_json = json.loads(run_cli("status", "--json", "--admin", admin).stdout)
        document = virtual_server_document(admin_port)
        return as_json["virtual_servers"][0]["real_servers"] == document["real_servers"]

    wait_for(status_json_is_the_api_document, 10, "status --json and the API agree")


# -- A records: hold, outage, start-up -------------------------------------------------------


def test_a_records_change_at_once_but_go_only_after_hold(lbproxy, dnsmasq):
    port, admin_port = free_port(), free_port()
    web_port = free_port()  # a Kubernetes pod each: one port, two IPs
    backends = [NameServer(f"n{i}", port=web_port, host=f"127.0.0.{i}") for i in (2, 3)]
    try:
        dns = dnsmasq(hosts={A_NAME: ["127.0.0.2", "127.0.0.3"]})
        proxy = lbproxy(
            config(
                port, admin_port, dns, name=A_NAME, record_type="A", dns_port=web_port, hold="2s"
            )
        )
        n2, n3 = f"127.0.0.2:{web_port}", f"127.0.0.3:{web_port}"
        wait_for_names(admin_port, {n2, n3})
        assert picks(port, 4) == {"n2": 2, "n3": 2}

        dns.set_hosts({A_NAME: ["127.0.0.2"]})  # a smaller answer applies at once
        wait_for_names(admin_port, {n2}, timeout=3)

        dns.set_hosts({})  # NXDOMAIN: the servers stay for `hold` (2 s)
        gone_at = time.monotonic()
        wait_for(lambda: "NXDOMAIN; its 1 server(s) go in 2s" in proxy.log(), what="log")
        rounds_go_by(admin_port, 2)  # NXDOMAIN again, within `hold`
        assert set(servers_of(admin_port)) == {n2}
        assert ask_name(port) == "n2"
        wait_for_names(admin_port, set(), timeout=5)
        assert time.monotonic() - gone_at >= 1.9
        assert "still NXDOMAIN after 2s: removing its 1 server(s)" in proxy.log()
        assert sample(metrics(admin_port), "lbproxy_discovered_servers", virtual_server="web") == 0
        samples = metrics(admin_port)
        nxdomain = sample(
            samples, "lbproxy_discovery_resolutions_total", virtual_server="web", result="nxdomain"
        )
        assert nxdomain >= 3
        status, _ = http("GET", f"http://127.0.0.1:{admin_port}/readyz")
        assert status == 200
    finally:
        for server in backends:
            server.stop()


def test_a_resolver_outage_keeps_the_last_set(name_servers, lbproxy, dnsmasq):
    a, b = name_servers("a", "b")
    dns = dnsmasq(srv=srv_for(a, b), hosts=glue_for(a, b))
    port, admin_port = free_port(), free_port()
    proxy = lbproxy(config(port, admin_port, dns, hold="200ms"))
    names = {f"a.node.test:{a.port}", f"b.node.test:{b.port}"}
    wait_for_names(admin_port, names)

    # Under load a round before this one may time out too (300 ms): that streak is
    # logged on its own; this streak's log starts here.
    before = len(proxy.log())
    dns.stop()  # silent: every round times out (300 ms), far beyond `hold`

    def errors() -> float:
        return sample(
            metrics(admin_port),
            "lbproxy_discovery_resolutions_total",
            virtual_server="web",
            result="error",
        )

    wait_for(lambda: errors() >= 4, timeout=10, what="4 failed rounds")
    assert set(servers_of(admin_port)) == names
    assert picks(port, 4) == {"a": 2, "b": 2}
    log = proxy.log()[before:]
    assert log.count("resolution failed") == 1  # once per streak
    assert "keeping the last 2 discovered server(s)" in log

    dns.start()
    wait_for(lambda: "resolving again after" in proxy.log(), what="recovery log")
    assert set(servers_of(admin_port)) == names


def test_start_up_without_an_answer_serves_the_static_servers(name_servers, lbproxy, dnsmasq):
    a, s = name_servers("a", "s")
    dns = dnsmasq()  # not started: nothing answers on its port
    port, admin_port = free_port(), free_port()
    proxy = lbproxy(config(port, admin_port, dns, static=[s]))
    status, _ = http("GET", f"http://127.0.0.1:{admin_port}/readyz")
    assert status == 200
    assert set(servers_of(admin_port)) == {"s"}
    assert ask_name(port) == "s"
    wait_for(lambda: "no answer yet: only the static real servers serve" in proxy.log(), what="log")
    dns.start(srv=srv_for(a), hosts=glue_for(a))
    wait_for_names(admin_port, {"s", f"a.node.test:{a.port}"})


# -- connections of a server that leaves ----------------------------------------------------


def test_connections_to_a_removed_server_finish_undisturbed(name_servers, lbproxy, dnsmasq):
    a, b = name_servers("a", "b")
    dns = dnsmasq(srv=srv_for(a, b), hosts=glue_for(a, b))
    port, admin_port = free_port(), free_port()
    checks = "{type: tcp, interval: 200ms, timeout: 200ms}"
    proxy = lbproxy(config(port, admin_port, dns, scheduler="first", health=checks))
    name_a, name_b = f"a.node.test:{a.port}", f"b.node.test:{b.port}"
    wait_for_names(admin_port, {name_a, name_b})
    held, served_by = open_and_read_name(port)
    assert served_by == "a"  # `first`: the first in order

    dns.set_srv(srv_for(b))
    found = wait_for(
        lambda: (rs := servers_of(admin_port)).get(name_a, {}).get("state") == "drain" and rs,
        what="a draining",
    )
    assert found[name_a]["active_connections"] == 1
    assert picks(port, 3) == {"b": 3}
    for i in range(5):
        held.sendall(f"still here {i}\n".encode())
        assert held.recv(100) == f"still here {i}\n".encode()
    rounds_go_by(admin_port, 2)  # it stays while its connection is open
    assert name_a in servers_of(admin_port)
    held.close()
    wait_for_names(admin_port, {name_b}, timeout=3)
    assert f"removed {name_a}" in proxy.log()
    samples = metrics(admin_port)
    checks_b = sample(
        samples,
        "lbproxy_health_checks_total",
        virtual_server="web",
        real_server=name_b,
        result="ok",
    )
    assert checks_b > 0  # health checks started for the discovered server


# -- churn ----------------------------------------------------------------------------------


def test_churn_of_the_record_set_breaks_no_connection(lbproxy, dnsmasq):
    """50 changes of the A records, 100 ms apart, while 20 held connections echo."""
    port, admin_port = free_port(), free_port()
    # One port on three addresses: one of this worker's (free_port), not an ephemeral one
    # the kernel gives 127.0.0.2, which a socket of another test may hold on 127.0.0.3.
    web_port = free_port()
    backends = [NameServer(f"n{i}", port=web_port, host=f"127.0.0.{i}") for i in (2, 3, 4)]
    try:
        ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        dns = dnsmasq(hosts={A_NAME: ips})
        proxy = lbproxy(
            config(
                port,
                admin_port,
                dns,
                name=A_NAME,
                record_type="A",
                dns_port=web_port,
                interval="100ms",
                scheduler="rr",
            )
        )
        wait_for_names(admin_port, {f"{ip}:{web_port}" for ip in ips})
        held = [open_and_read_name(port)[0] for _ in range(20)]
        echoed = 0
        for change in range(50):
            # Always one address at least: a subset that moves every time.
            subset = [ip for i, ip in enumerate(ips) if (change + 1) >> i & 1] or ips[:1]
            dns.set_hosts({A_NAME: subset})
            sock = held[change % len(held)]
            sock.sendall(b"ping %d\n" % change)
            assert sock.recv(100) == b"ping %d\n" % change
            echoed += 1
            assert ask_name(port) in {"n2", "n3", "n4"}  # new connections find a server
            rounds_go_by(admin_port, 1)  # a round has seen the change
        for i, sock in enumerate(held):
            sock.sendall(b"last %d\n" % i)
            assert sock.recv(100) == b"last %d\n" % i
            sock.close()
        assert echoed == 50
        assert "Traceback" not in proxy.log()
        # The proxy saw the churn: most of the 50 changes were applied one by one.
        assert proxy.log().count("lbproxy.server: discovery:") >= 25
        status, _ = http("GET", f"http://127.0.0.1:{admin_port}/readyz")
        assert status == 200
    finally:
        for server in backends:
            server.stop()


def test_an_aaaa_server_named_in_brackets_through_the_cli(lbproxy, dnsmasq):
    backend = NameServer("v6", host="::1")
    try:
        dns = dnsmasq(hosts={A_NAME: ["::1"]})
        port, admin_port = free_port(), free_port()
        lbproxy(
            config(port, admin_port, dns, name=A_NAME, record_type="AAAA", dns_port=backend.port)
        )
        name = f"[::1]:{backend.port}"
        found = wait_for_names(admin_port, {name})
        assert found[name]["address"] == name
        assert ask_name(port) == "v6"
        admin = f"http://127.0.0.1:{admin_port}"
        out = run_cli("set-weight", "web", name, "4", "--admin", admin)
        assert out.returncode == 0, out.stderr
        rounds_go_by(admin_port, 2)  # the same answer: the PATCHed weight stays
        assert servers_of(admin_port)[name]["weight"]["static"] == 4
        labels = {"virtual_server": "web", "real_server": name}
        assert sample(metrics(admin_port), "lbproxy_connections_total", **labels) == 1
    finally:
        backend.stop()


def test_a_reload_to_another_name_follows_it(name_servers, lbproxy, dnsmasq):
    a, b = name_servers("a", "b")
    records = {**srv_for(a), "_new._tcp.svc.test": srv_for(b)[SRV_NAME]}
    dns = dnsmasq(srv=records, hosts=glue_for(a, b))
    port, admin_port = free_port(), free_port()
    proxy = lbproxy(config(port, admin_port, dns))
    wait_for_names(admin_port, {f"a.node.test:{a.port}"})
    proxy.reload(config(port, admin_port, dns, name="_new._tcp.svc.test"))
    wait_for_names(admin_port, {f"b.node.test:{b.port}"})
    assert ask_name(port) == "b"
    proxy.reload(config(port, admin_port, dns))  # and back
    wait_for_names(admin_port, {f"a.node.test:{a.port}"})


@pytest.mark.skipif(
    "backup" not in RealServer.__slots__, reason="backup servers (SPEC §13) not built in"
)
def test_higher_srv_priorities_serve_only_while_the_primaries_are_down(lbproxy, dnsmasq):
    a, b, c = (NameServer(name) for name in "abc")
    servers = [a, b, c]
    try:
        dns = dnsmasq(srv=srv_for(a, b, c, priorities={"c": 10}), hosts=glue_for(a, b, c))
        port, admin_port = free_port(), free_port()
        checks = "{type: tcp, interval: 100ms, timeout: 100ms, rise: 1, fall: 1}"
        lbproxy(config(port, admin_port, dns, scheduler="rr", health=checks))
        names = {f"{s.name}.node.test:{s.port}" for s in servers}
        wait_for_names(admin_port, names)
        assert set(picks(port, 6)) == {"a", "b"}  # c is a backup: priority 10 > 0

        a.stop()
        b.stop()
        wait_for(
            lambda: all(
                rs["health"] == "down"
                for name, rs in servers_of(admin_port).items()
                if not name.startswith("c.")
            ),
            what="primaries down",
        )
        assert picks(port, 3) == {"c": 3}

        servers[0] = a = NameServer("a", port=a.port)  # a primary is back
        wait_for(
            lambda: servers_of(admin_port)[f"a.node.test:{a.port}"]["health"] == "up",
            what="a up",
        )
        assert picks(port, 3) == {"a": 3}
    finally:
        for server in servers:
            server.stop()


# -- addresses that are never (or not by default) used (SPEC §21) ------------------------


def refused(admin_port: int, reason: str) -> float:
    return sample(
        metrics(admin_port), "lbproxy_discovery_refused_total", virtual_server="web", reason=reason
    )


def test_an_answer_naming_the_admin_endpoint_is_never_used(name_servers, lbproxy, dnsmasq):
    a = name_servers("a")[0]
    port, admin_port = free_port(), free_port()
    records = {SRV_NAME: [(0, 1, a.port, "a.node.test"), (0, 1, admin_port, "admin.node.test"),
                          (0, 1, port, "loop.node.test")]}  # fmt: skip
    hosts = {"a.node.test": ["127.0.0.1"], "admin.node.test": ["127.0.0.1"],
             "loop.node.test": ["127.0.0.1"]}  # fmt: skip
    dns = dnsmasq(srv=records, hosts=hosts)
    proxy = lbproxy(config(port, admin_port, dns))  # 127.0.0.0/8 allowed: still refused
    wait_for_names(admin_port, {f"a.node.test:{a.port}"})
    wait_for(lambda: refused(admin_port, "self") >= 2, 5.0, "the admin endpoint and the listener")
    for _ in range(10):  # a client never reaches the admin endpoint (nor loops back)
        assert ask_name(port) == "a"
    rounds = refused(admin_port, "self")
    # several rounds more (150 ms each): one warning for the change, not one a round
    wait_for(lambda: refused(admin_port, "self") >= rounds + 6, 5.0, "three more rounds")
    log = proxy.log()
    assert log.count("not using these 2 addresses") == 1, log
    assert f"admin.node.test:{admin_port} (self)" in log and f"loop.node.test:{port} (self)" in log
    assert refused(admin_port, "loopback") == 0


def test_loopback_answers_are_refused_unless_allowed(lbproxy, dnsmasq, tmp_path):
    web_port = free_port()
    backends = [NameServer("n2", port=web_port, host="127.0.0.2")]
    try:
        dns = dnsmasq(hosts={A_NAME: ["127.0.0.2", "169.254.0.9", "224.0.0.9", "0.0.0.0"]})
        port, admin_port = free_port(), free_port()
        settings = dict(record_type="A", name=A_NAME, dns_port=web_port, allow="")
        proxy = lbproxy(config(port, admin_port, dns, **settings))
        wait_for(lambda: refused(admin_port, "loopback") >= 1, 5.0, "a refusal")
        assert servers_of(admin_port) == {}
        for reason in ("link_local", "multicast", "unspecified"):
            assert refused(admin_port, reason) >= 1
        assert f"127.0.0.2:{web_port} (loopback)" in proxy.log()
        # allowed: the loopback server is used; the others still are not
        proxy.reload(config(port, admin_port, dns, **{**settings, "allow": "[127.0.0.0/8]"}))
        wait_for_names(admin_port, {f"127.0.0.2:{web_port}"})
        assert ask_name(port) == "n2"
    finally:
        for server in backends:
            server.stop()
