"""`protocol: udp` and `udp:` on a virtual server (SPEC §19): defaults, every key read,
TCP-only keys refused at FILE:LINE, and a TCP and a UDP virtual server on one port."""

from __future__ import annotations

from lbproxy.config.model import SourcePrefixConfig, UdpConfig
from lbproxy.config.reader import load
from tests.unit.config.support import problems, write

RS = "    real_servers: [{name: a, address: 127.0.0.1:5301}]\n"


def test_defaults_and_every_key(tmp_path):
    path = write(
        tmp_path,
        "lb.yaml",
        "virtual_servers:\n"
        "  - name: dns\n    protocol: udp\n    listen: 127.0.0.1:5300\n"
        "    udp: {idle_timeout: 5s, responses: 1, max_sessions: 50,"
        " max_sessions_per_source: 3}\n" + RS + "  - name: syslog\n    protocol: udp\n"
        "    listen: 127.0.0.1:5514\n" + RS + "  - name: web\n    listen: 127.0.0.1:8080\n" + RS,
    )
    dns, syslog, web = load([path]).virtual_servers
    assert dns.protocol == "udp"
    assert dns.udp == UdpConfig(
        idle_timeout=5.0, responses=1, max_sessions=50, max_sessions_per_source=3
    )
    assert syslog.udp == UdpConfig(30.0, None, 10000, 100)
    # A TCP connect says nothing of a UDP service: passive health only unless asked.
    assert syslog.health_check.type == "none"
    assert web.protocol == "tcp" and web.health_check.type == "tcp"


def test_responses_zero_and_none(tmp_path):
    for text, expected in (("0", 0), ("none", None), ("3", 3)):
        path = write(
            tmp_path,
            "lb.yaml",
            "virtual_servers:\n  - name: s\n    protocol: udp\n    listen: 127.0.0.1:5514\n"
            f"    udp: {{responses: {text}}}\n" + RS,
        )
        assert load([path]).virtual_servers[0].udp.responses == expected


def test_tcp_only_keys_refused_with_file_and_line(tmp_path):
    path = write(
        tmp_path,
        "lb.yaml",
        "virtual_servers:\n"
        "  - name: dns\n"
        "    protocol: udp\n"
        "    listen: 127.0.0.1:5300\n"
        "    sni: [a.example]\n"  # 5
        "    accept_proxy: true\n"  # 6
        "    send_proxy: v2\n"  # 7
        "    queue: {}\n"  # 8
        "    udp: {responses: -1}\n"  # 9
        "    health_check: {type: http}\n" + RS,  # 10
    )
    assert problems([path]) == [
        f"{path}:5: sni is for TCP; a UDP virtual server refuses it",
        f"{path}:6: accept_proxy is for TCP; a UDP virtual server refuses it",
        f"{path}:7: send_proxy is for TCP; a UDP virtual server refuses it",
        f"{path}:8: queue is for TCP; a UDP virtual server refuses it",
        f"{path}:9: udp.responses must be an integer >= 0 or none, got -1",
        f"{path}:10: health_check type http is for TCP; a UDP virtual server takes udp, "
        "dns or none (passive: ICMP port unreachable)",
    ]


def test_udp_block_needs_protocol_udp(tmp_path):
    path = write(
        tmp_path,
        "lb.yaml",
        "virtual_servers:\n  - name: web\n    listen: 127.0.0.1:8080\n    udp: {}\n" + RS,
    )
    assert problems([path]) == [f"{path}:4: udp: needs protocol: udp on the virtual server"]


def test_tcp_and_udp_share_a_port_two_udp_clash(tmp_path):
    shared = write(
        tmp_path,
        "ok.yaml",
        "virtual_servers:\n  - name: dns\n    protocol: udp\n    listen: 127.0.0.1:5300\n"
        + RS
        + "  - name: dns-tcp\n    listen: 127.0.0.1:5300\n"
        + RS,
    )
    assert [vs.name for vs in load([shared]).virtual_servers] == ["dns", "dns-tcp"]
    clash = write(
        tmp_path,
        "clash.yaml",
        "virtual_servers:\n  - name: a\n    protocol: udp\n    listen: 127.0.0.1:5300\n"
        + RS
        + "  - name: b\n    protocol: udp\n    listen: 0.0.0.0:5300\n"
        + RS,
    )
    assert problems([clash]) == [
        f"{clash}:8: listen address 0.0.0.0:5300 clashes with 127.0.0.1:5300 of virtual "
        "server a (udp) at line 4"
    ]


def test_udp_and_dns_checks_read_and_refused_where_they_do_not_apply(tmp_path):
    path = write(
        tmp_path,
        "lb.yaml",
        "virtual_servers:\n"
        "  - name: dns\n    protocol: udp\n    listen: 127.0.0.1:5300\n"
        "    health_check: {type: dns, query: health.example, query_type: SOA}\n"
        + RS
        + "  - name: game\n    protocol: udp\n    listen: 127.0.0.1:5301\n"
        "    health_check: {type: udp, send: 'ping\\n', expect: ^pong}\n" + RS,
    )
    dns, game = load([path]).virtual_servers
    assert (dns.health_check.type, dns.health_check.query) == ("dns", "health.example")
    assert dns.health_check.query_type == "SOA"
    assert (game.health_check.type, game.health_check.expect) == ("udp", "^pong")
    bad = write(
        tmp_path,
        "bad.yaml",
        "virtual_servers:\n"
        "  - name: dns\n    protocol: udp\n    listen: 127.0.0.1:5300\n"
        "    health_check: {type: dns, query_type: AXFR}\n"
        + RS  # 5
        + "  - name: web\n    listen: 127.0.0.1:8080\n"
        "    health_check: {type: udp}\n" + RS,  # 9
    )
    found = problems([bad])
    assert found[0].startswith(f"{bad}:5: health_check.query_type must be one of A, AAAA")
    assert found[1:] == [
        f"{bad}:5: health_check type dns needs 'query' (a name)",
        f"{bad}:9: health_check type udp is for UDP; it needs protocol: udp",
    ]


def test_check_summary_says_how_sessions_end(tmp_path):
    from lbproxy.config.summary import summary

    path = write(
        tmp_path,
        "lb.yaml",
        "virtual_servers:\n"
        "  - name: dns\n    protocol: udp\n    listen: 127.0.0.1:5300\n"
        "    udp: {responses: 1, idle_timeout: 5s}\n"
        + RS
        + "  - name: syslog\n    protocol: udp\n    listen: 127.0.0.1:5514\n"
        "    udp: {responses: 0, max_sessions: 50, max_sessions_per_source: 3}\n" + RS,
    )
    lines = summary(load([path])).splitlines()
    assert [line for line in lines if line.startswith("  udp ")] == [
        "  udp         1 reply per request, else 5s idle; at most 10000 sessions, 100 per source",
        "  udp         no replies, sessions end 30s idle; at most 50 sessions, 3 per source",
    ]


def test_source_prefix_defaults_to_32_and_64_and_is_checked(tmp_path):
    path = write(
        tmp_path,
        "lb.yaml",
        "virtual_servers:\n"
        "  - name: dns\n    protocol: udp\n    listen: 127.0.0.1:5300\n"
        "    udp: {max_sessions_per_source: 4, source_prefix: {v4: 24}}\n" + RS,
    )
    [dns] = load([path]).virtual_servers
    assert dns.udp.source_prefix == SourcePrefixConfig(v4=24, v6=64)
    assert UdpConfig().source_prefix == SourcePrefixConfig(v4=32, v6=64)
    bad = write(
        tmp_path,
        "bad.yaml",
        "virtual_servers:\n"
        "  - name: dns\n    protocol: udp\n    listen: 127.0.0.1:5300\n"
        "    udp:\n"
        "      source_prefix: {v4: 0, v6: 129, v5: 1}\n" + RS,  # 6
    )
    assert problems([bad]) == [
        f"{bad}:6: udp.source_prefix.v4 must be an integer from 1 to 32, got 0",
        f"{bad}:6: udp.source_prefix.v6 must be an integer from 1 to 128, got 129",
        f"{bad}:6: unknown key 'v5' in udp.source_prefix of virtual server dns",
    ]
