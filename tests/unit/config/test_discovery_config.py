"""`discovery.dns` in the configuration: values, defaults, `FILE:LINE: message` problems."""

from __future__ import annotations

from pathlib import Path

from lbproxy.config.model import Address, DnsDiscoveryConfig
from lbproxy.config.reader import load
from lbproxy.config.summary import summary
from tests.unit.config.support import problems, write

CONSUL = """\
virtual_servers:
  - name: web
    listen: 127.0.0.1:8080
    discovery:
      dns:
        name: _web._tcp.service.consul
        type: SRV
        resolvers: [127.0.0.1:8600, "[::1]:8600", 10.0.0.2]
        interval: 5s
        hold: 1m
        timeout: 500ms
"""


def test_every_key_is_read(tmp_path: Path) -> None:
    (vs,) = load([write(tmp_path, "a.yaml", CONSUL)]).virtual_servers
    assert vs.real_servers == ()
    assert vs.discovery == DnsDiscoveryConfig(
        name="_web._tcp.service.consul",
        type="SRV",
        port=None,
        resolvers=(Address("127.0.0.1", 8600), Address("::1", 8600), Address("10.0.0.2", 53)),
        interval=5.0,
        hold=60.0,
        timeout=0.5,
    )
    assert vs.discovery.line == 5


def test_defaults_and_static_servers_beside(tmp_path: Path) -> None:
    text = """\
    virtual_servers:
      - name: k8s
        listen: 127.0.0.1:8080
        discovery: {dns: {name: web.default.svc.cluster.local, type: a, port: 8080}}
        real_servers:
          - {name: fallback, address: 127.0.0.1:9000}
    """
    (vs,) = load([write(tmp_path, "a.yaml", text)]).virtual_servers
    assert vs.discovery == DnsDiscoveryConfig(
        name="web.default.svc.cluster.local", type="A", port=8080
    )
    assert (vs.discovery.resolvers, vs.discovery.interval, vs.discovery.hold) == ((), 10.0, 30.0)
    assert vs.discovery.timeout == 2.0
    assert [rs.name for rs in vs.real_servers] == ["fallback"]
    assert "discovery   A web.default.svc.cluster.local port 8080 via the system's" in summary(
        load([write(tmp_path, "a.yaml", text)])
    )


def test_real_servers_may_be_empty_or_null_with_discovery(tmp_path: Path) -> None:
    for real_servers in ("[]", ""):
        text = CONSUL + f"    real_servers: {real_servers}\n"
        (vs,) = load([write(tmp_path, "a.yaml", text)]).virtual_servers
        assert vs.real_servers == ()


def test_every_problem_is_reported_at_its_line(tmp_path: Path) -> None:
    text = """\
    virtual_servers:
      - name: a
        listen: 127.0.0.1:8001
        discovery:
          dns:
            name: 10.0.0.1
            type: SRV
            port: 80
            resolvers: [dns.google:53]
            interval: 0s
            hold: -1s
            timout: 1s
      - name: b
        listen: 127.0.0.1:8002
        discovery:
          dns: {name: "bad name", type: AAAA}
      - name: c
        listen: 127.0.0.1:8003
        discovery:
          dns: {name: x.example, type: MX, resolvers: "1.2.3.4:0"}
      - name: d
        listen: 127.0.0.1:8004
        discovery:
      - name: e
        listen: 127.0.0.1:8005
        discovery: {dnss: {name: x.example}}
      - name: f
        listen: 127.0.0.1:8006
        discovery: {dns: {type: A, port: 70000}}
      - name: g
        listen: 127.0.0.1:8007
        discovery: {dns: [x.example]}
    """
    path = write(tmp_path, "a.yaml", text)
    assert problems([path]) == [
        f"{path}:6: discovery.dns.name must be a DNS name, not an address, got '10.0.0.1' "
        "(list it in real_servers)",
        f"{path}:8: discovery.dns.port is only for type A or AAAA: SRV records carry their "
        "own port",
        f"{path}:9: discovery.dns.resolvers must be an IP address or IP:PORT, [IPv6]:PORT, "
        "got 'dns.google:53' (a resolver must be an IP address)",
        f"{path}:10: discovery.dns.interval must be a duration (250ms, 5s, 2m, 1h or seconds) "
        "> 0, got '0s'",
        f"{path}:11: discovery.dns.hold must be a duration (250ms, 5s, 2m, 1h or seconds) "
        ">= 0, got '-1s'",
        f"{path}:12: unknown key 'timout' in discovery.dns of virtual server a "
        "(did you mean 'timeout'?)",
        f"{path}:16: discovery.dns.name must be a DNS name like _web._tcp.service.consul, "
        "got 'bad name'",
        f"{path}:16: discovery.dns type AAAA needs 'port' (AAAA records carry none)",
        f"{path}:20: discovery.dns.type must be one of SRV, A, AAAA, got 'MX'",
        f"{path}:20: discovery.dns.resolvers must be an IP address or IP:PORT, [IPv6]:PORT, "
        "got '1.2.3.4:0' (port 0 is not in 1..65535)",
        f"{path}:23: discovery needs 'dns'",
        f"{path}:26: unknown key 'dnss' in discovery of virtual server e (did you mean 'dns'?)",
        f"{path}:26: discovery needs 'dns'",
        f"{path}:29: discovery.dns.port must be an integer from 1 to 65535, got 70000",
        f"{path}:29: discovery.dns needs 'name'",
        f"{path}:32: discovery.dns of virtual server g must be a mapping, got a list",
    ]


def test_without_discovery_real_servers_are_still_required(tmp_path: Path) -> None:
    text = "virtual_servers:\n  - {name: a, listen: 127.0.0.1:8001}\n"
    path = write(tmp_path, "a.yaml", text)
    assert problems([path]) == [f"{path}:2: virtual server a needs 'real_servers'"]


def test_what_a_scheduler_needs_from_discovered_servers(tmp_path: Path) -> None:
    text = """\
    virtual_servers:
      - name: a
        listen: 127.0.0.1:8001
        scheduler: dwd
        discovery: {dns: {name: x.example, type: A, port: 80}}
      - name: b
        listen: 127.0.0.1:8002
        scheduler: least-load
        discovery: {dns: {name: x.example, type: A, port: 80}}
      - name: c
        listen: 127.0.0.1:8003
        scheduler: dwr
        snmp: {community: public}
        discovery: {dns: {name: x.example, type: A, port: 80}}
    """
    path = write(tmp_path, "a.yaml", text)
    assert problems([path]) == [
        f"{path}:5: scheduler dwd with discovery needs an snmp block on the virtual server "
        "(discovered real servers are polled with it)",
        f"{path}:9: scheduler least-load with load_source connections cannot use discovery "
        "(discovered real servers have no max_connections)",
    ]
