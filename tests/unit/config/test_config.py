"""The configuration loader: values, defaults, and `FILE:LINE: message` for every problem."""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path

import pytest

from lbproxy.config.model import (
    Address,
    AdminConfig,
    ConfigError,
    GlobalConfig,
    HealthCheckConfig,
    SnmpConfig,
    ThrottleConfig,
)
from lbproxy.config.reader import load
from lbproxy.config.summary import summary, warnings
from lbproxy.config.values import parse_address, parse_duration
from tests.unit.config.support import messages, problems, write

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
SCHEDULER_FILES = [
    "rr.yaml",
    "wrr.yaml",
    "lc.yaml",
    "wlc.yaml",
    "first.yaml",
    "sap.yaml",
    "dwd.yaml",
    "dwr.yaml",
    "least-load.yaml",
    "maglev.yaml",
]

# A valid virtual server to put next to the thing under test.
MINIMAL = """\
virtual_servers:
  - name: web
    listen: 127.0.0.1:8080
    real_servers:
      - {name: a, address: 127.0.0.1:9001}
"""


# --------------------------------------------------------------------------------------
# Valid configurations
# --------------------------------------------------------------------------------------

FULL = """\
global:
  admin:
    listen: 127.0.0.1:9200
    token_file: /etc/lbproxy/admin.token
  log_format: json
  drain_timeout: 250ms
  workers: 4

virtual_servers:
  - name: web
    listen: [0.0.0.0:8080, "[::1]:8443"]
    scheduler: dwr
    quiesce: yes
    load_source: snmp
    load_poll_interval: 2m
    slow_start: 10s
    connect_timeout: 1.5
    idle_timeout: 1h
    retries: 0
    max_connections: 10000
    allow: [10.0.0.0/8, "2001:db8::/32", 192.168.1.7]
    deny: ["::1"]
    send_proxy: v2
    accept_proxy: true
    health_check:
      type: http
      interval: 3s
      timeout: 500ms
      rise: 1
      fall: 5
      path: /healthz
      expect_status: [200, 204]
      on_down: close
    snmp:
      oid: .1.3.6.1.4.1.2021.11.9.0
      version: 3
      community: private
      user: lbproxy
      auth_protocol: SHA256
      auth_key_file: /etc/auth.key
      priv_protocol: AES256
      priv_key_file: /etc/priv.key
      port: 1161
      interval: 10s
      timeout: 2s
      retries: 3
      on_no_answer: hold
      smoothing: 0.5
      max_value: 200
    throttle:
      max_connections: 5000
      max_rate: 2000
      digg_factor: 3
      high_idle_timeout: 40s
      min_idle_timeout: 2s
      interval: 500ms
    real_servers:
      - name: a
        address: 10.0.0.11:80
        weight: 3
        max_connections: 1000
        load_factor: 2.5
        state: drain
        snmp: {host: 10.0.0.99, port: 161, stale_after: 1m}
      - name: b
        address: backend.example.com:8080
"""


def test_every_key_is_read_into_the_dataclasses(tmp_path: Path) -> None:
    path = write(tmp_path, "full.yaml", FULL)
    config = load([path])

    assert config.files == (path,)
    assert config.global_ == GlobalConfig(
        admin=AdminConfig(Address("127.0.0.1", 9200), "/etc/lbproxy/admin.token"),
        log_format="json",
        drain_timeout=0.25,
        workers=4,
    )
    [vs] = config.virtual_servers
    assert (vs.name, vs.file, vs.line) == ("web", path, 10)
    assert vs.listen == (Address("0.0.0.0", 8080), Address("::1", 8443))
    assert (vs.scheduler, vs.quiesce, vs.load_source) == ("dwr", True, "snmp")
    assert (vs.load_poll_interval, vs.slow_start, vs.connect_timeout) == (120.0, 10.0, 1.5)
    assert (vs.idle_timeout, vs.retries, vs.max_connections) == (3600.0, 0, 10000)
    assert vs.allow == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("2001:db8::/32"),
        ipaddress.ip_network("192.168.1.7/32"),
    )
    assert vs.deny == (ipaddress.ip_network("::1/128"),)
    assert (vs.send_proxy, vs.accept_proxy) == ("v2", True)
    assert vs.health_check == HealthCheckConfig(
        type="http",
        interval=3.0,
        timeout=0.5,
        rise=1,
        fall=5,
        path="/healthz",
        expect_status=(200, 204),
        on_down="close",
    )
    vs_snmp = SnmpConfig(
        oid="1.3.6.1.4.1.2021.11.9.0",
        version="3",
        community="private",
        user="lbproxy",
        auth_protocol="SHA256",
        auth_key_file="/etc/auth.key",
        priv_protocol="AES256",
        priv_key_file="/etc/priv.key",
        host=None,
        port=1161,
        interval=10.0,
        timeout=2.0,
        retries=3,
        on_no_answer="hold",
        stale_after=30.0,  # 3 x interval
        smoothing=0.5,
        max_value=200,
    )
    assert vs.snmp == vs_snmp
    assert vs.throttle == ThrottleConfig(5000, 2000.0, 3.0, 40.0, 2.0, 0.5)

    a, b = vs.real_servers
    assert (a.name, a.address, a.line) == ("a", Address("10.0.0.11", 80), 58)
    assert (a.weight, a.max_connections, a.load_factor, a.state) == (3, 1000, 2.5, "drain")
    # The real server's overrides on top of the virtual server's block.
    assert a.snmp == SnmpConfig(
        **{**_fields(vs_snmp), "host": "10.0.0.99", "port": 161, "stale_after": 60.0}
    )
    assert (b.name, b.address, b.line) == ("b", Address("backend.example.com", 8080), 65)
    assert (b.weight, b.max_connections, b.load_factor, b.state) == (1, 0, 1.0, "enabled")
    # No override: the virtual server's block, with the server's own host as the agent.
    assert b.snmp == SnmpConfig(**{**_fields(vs_snmp), "host": "backend.example.com"})


def _fields(snmp: SnmpConfig) -> dict[str, object]:
    return {name: getattr(snmp, name) for name in SnmpConfig.__dataclass_fields__}


def test_defaults_of_a_minimal_file(tmp_path: Path) -> None:
    config = load([write(tmp_path, "web.yaml", MINIMAL)])

    assert config.global_ == GlobalConfig()
    assert config.global_.admin.listen == Address("127.0.0.1", 9100)
    [vs] = config.virtual_servers
    assert vs.scheduler == "wlc"
    assert (vs.quiesce, vs.load_source, vs.load_poll_interval) == (False, "connections", 5.0)
    assert (vs.slow_start, vs.connect_timeout, vs.idle_timeout) == (0.0, 3.0, 300.0)
    assert (vs.retries, vs.max_connections, vs.send_proxy, vs.accept_proxy) == (2, 0, "none", False)
    assert vs.allow == (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))
    assert vs.deny == ()
    assert vs.health_check == HealthCheckConfig()
    assert (vs.health_check.type, vs.health_check.interval, vs.health_check.timeout) == (
        "tcp",
        2.0,
        1.0,
    )
    assert (vs.snmp, vs.throttle) == (None, None)
    [rs] = vs.real_servers
    assert (rs.weight, rs.max_connections, rs.load_factor, rs.state, rs.snmp) == (
        1,
        0,
        1.0,
        "enabled",
        None,
    )


def test_a_real_server_snmp_block_alone_is_merged_over_the_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "dwd.yaml",
        """\
        virtual_servers:
          - name: web
            listen: 127.0.0.1:8080
            scheduler: dwd
            real_servers:
              - {name: a, address: "[::1]:9001", snmp: {port: 16101, interval: 2s}}
        """,
    )
    [vs] = load([path]).virtual_servers
    assert vs.snmp is None
    assert vs.real_servers[0].snmp == SnmpConfig(
        host="::1", port=16101, interval=2.0, stale_after=6.0
    )


@pytest.mark.parametrize("version", ["3", '"3"'])
def test_snmp_version_3_as_int_or_string(tmp_path: Path, version: str) -> None:
    text = MINIMAL.replace(
        "real_servers:", f"snmp: {{version: {version}, user: u}}\n    real_servers:"
    )
    [vs] = load([write(tmp_path, "v3.yaml", text)]).virtual_servers
    assert vs.snmp is not None and vs.snmp.version == "3"
    assert vs.real_servers[0].snmp is not None and vs.real_servers[0].snmp.user == "u"


def test_workers_auto_and_admin_off(tmp_path: Path) -> None:
    text = "global:\n  workers: auto\n  admin: {listen: none}\n" + MINIMAL
    config = load([write(tmp_path, "web.yaml", text)])
    assert config.global_.workers == (os.cpu_count() or 1)
    assert config.global_.admin.listen is None

    text = "global:\n  admin:\n    listen:\n" + MINIMAL.replace("8080", "9100")
    assert load([write(tmp_path, "web.yaml", text)]).global_.admin.listen is None


def test_an_empty_file_is_fine_beside_others(tmp_path: Path) -> None:
    empty = write(tmp_path, "empty.yaml", "# nothing yet\n")
    config = load([empty, write(tmp_path, "web.yaml", MINIMAL)])
    assert [vs.name for vs in config.virtual_servers] == ["web"]


# --------------------------------------------------------------------------------------
# Problems: every one, with its file and line
# --------------------------------------------------------------------------------------


def test_every_problem_of_a_file_is_reported_at_its_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "bad.yaml",
        """\
        virtual_servers:
          - name: web
            lisen: 127.0.0.1:8080
            scheduler: wlcc
            connect_timeout: -1s
            allow:
              - 10.0.0.0/8
              - 10.0.0.0/33
            health_check: {type: send_expect, rise: 0}
            real_servers:
              - name: a
                address: 10.0.0.1:99999
                weight: abc
              - name: b
                address: 10.0.0.2:80
                weight: true
                state: enable
                colour: blue
        """,
    )
    assert problems([path]) == [
        f"{path}:2: virtual server web needs 'listen'",
        f"{path}:3: unknown key 'lisen' in virtual server web (did you mean 'listen'?)",
        f"{path}:4: unknown scheduler 'wlcc' (did you mean 'wlc'?); known: "
        "dwd, dwr, first, lc, least-load, maglev, rr, sap, wlc, wrr",
        f"{path}:5: connect_timeout must be a duration (250ms, 5s, 2m, 1h or seconds) > 0, "
        "got '-1s'",
        f"{path}:8: allow must be a list of CIDR networks like 10.0.0.0/8, got '10.0.0.0/33' "
        "(not an IPv4 or IPv6 network)",
        f"{path}:9: health_check.rise must be an integer >= 1, got 0",
        f"{path}:9: health_check type send_expect needs 'expect' or 'expect_hex'",
        f"{path}:12: address must be HOST:PORT or [IPv6]:PORT, got '10.0.0.1:99999' "
        "(port 99999 is not in 1..65535)",
        f"{path}:13: weight must be an integer from 0 to 65535, got 'abc'",
        f"{path}:16: weight must be an integer from 0 to 65535, got true",
        f"{path}:17: state must be one of enabled, drain, disabled, got 'enable' "
        "(did you mean 'enabled'?)",
        f"{path}:18: unknown key 'colour' in real server b",
    ]


def test_problems_of_several_files_are_sorted_by_file_and_line(tmp_path: Path) -> None:
    b = write(tmp_path, "b.yaml", MINIMAL.replace("real_servers", "real_server"))
    a = write(tmp_path, "a.yaml", "virtual_servers:\n  - name: x\n    listen: 1.2.3.4:0\n")
    assert problems([b, a]) == [
        f"{a}:2: virtual server x needs 'real_servers'",
        f"{a}:3: listen must be HOST:PORT or [IPv6]:PORT, got '1.2.3.4:0' "
        "(port 0 is not in 1..65535)",
        f"{b}:2: virtual server web needs 'real_servers'",
        f"{b}:4: unknown key 'real_server' in virtual server web (did you mean 'real_servers'?)",
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("globl: {}\n", "unknown key 'globl' in the top level (did you mean 'global'?)"),
        (
            "global: {log_fromat: json}\n",
            "unknown key 'log_fromat' in global (did you mean 'log_format'?)",
        ),
        (
            "global: {admin: {tokenfile: x}}\n",
            "unknown key 'tokenfile' in global.admin (did you mean 'token_file'?)",
        ),
    ],
)
def test_did_you_mean_in_global(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in messages([write(tmp_path, "g.yaml", text + MINIMAL)])


@pytest.mark.parametrize(
    ("section", "typo", "where", "suggestion"),
    [
        ("health_check", "intervall", "health_check of virtual server web", "interval"),
        ("snmp", "comunity", "snmp of virtual server web", "community"),
        ("throttle", "max_rates", "throttle of virtual server web", "max_rate"),
    ],
)
def test_did_you_mean_in_nested_sections(
    tmp_path: Path, section: str, typo: str, where: str, suggestion: str
) -> None:
    text = MINIMAL.replace(
        "real_servers:", f"{section}: {{{typo}: 1, max_rate: 5}}\n    real_servers:"
    )
    expected = f"unknown key {typo!r} in {where} (did you mean {suggestion!r}?)"
    assert expected in messages([write(tmp_path, "web.yaml", text)])


def test_did_you_mean_for_real_server_keys_and_their_snmp(tmp_path: Path) -> None:
    text = MINIMAL.replace(
        "{name: a, address: 127.0.0.1:9001}",
        "{name: a, adress: 127.0.0.1:9001, snmp: {prot: 1}}",
    )
    assert messages([write(tmp_path, "web.yaml", text)]) == [
        "unknown key 'adress' in real server a (did you mean 'address'?)",
        "real server a needs 'address'",
        "unknown key 'prot' in snmp of real server a (did you mean 'port'?)",
    ]


def test_duplicate_virtual_server_across_files(tmp_path: Path) -> None:
    a = write(tmp_path, "a.yaml", MINIMAL)
    b = write(tmp_path, "b.yaml", "\n" + MINIMAL.replace("8080", "8081"))
    assert problems([a, b]) == [f"{b}:3: duplicate virtual server name 'web' (first at {a}:2)"]


def test_duplicate_real_server_and_duplicate_key(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "web.yaml",
        MINIMAL
        + """\
      - name: b
        address: 127.0.0.1:9002
        weight: 1
        weight: 2
      - {name: a, address: 127.0.0.1:9003}
""",
    )
    assert problems([path]) == [
        f"{path}:9: duplicate key 'weight' in real server b (first at line 8)",
        f"{path}:10: duplicate real server name 'a' (first at line 5)",
    ]


def test_required_keys_and_empty_lists(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "web.yaml",
        """\
        virtual_servers:
          - listen: 127.0.0.1:8080
            real_servers: []
          - name: other
            listen: []
            real_servers:
              - {weight: 2}
        """,
    )
    assert problems([path]) == [
        f"{path}:2: virtual server needs 'name'",
        f"{path}:3: real_servers is empty: a virtual server needs one",
        f"{path}:5: listen must name at least one address",
        f"{path}:7: real server needs 'name'",
        f"{path}:7: real server needs 'address'",
    ]


def test_wrong_shapes_are_problems_not_exceptions(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "web.yaml",
        """\
        virtual_servers:
          - just a string
          - name: web
            listen: {host: x}
            health_check: tcp
            real_servers: {a: 1}
          - name: tags
            listen: !!int 8080
            retries: !custom 3
            real_servers:
              - name: a
                address: 127.0.0.1:9001
                yes: 1
        """,
    )
    assert problems([path]) == [
        f"{path}:2: virtual server must be a mapping, got 'just a string'",
        f"{path}:4: listen must be HOST:PORT or [IPv6]:PORT, got a mapping "
        "(an address must be a string)",
        f"{path}:5: health_check of virtual server web must be a mapping, got 'tcp'",
        f"{path}:6: real_servers must be a list, got a mapping",
        f"{path}:8: listen must be HOST:PORT or [IPv6]:PORT, got 8080 "
        "(an address must be a string)",
        f"{path}:9: retries: cannot read '3' tagged !custom",
        f"{path}:13: keys must be strings, got yes in real server a",
    ]


@pytest.mark.parametrize(
    "text",
    [
        "- a list\n",
        "just text\n",
        "virtual_servers: web\n",
        "virtual_servers: [[1]]\n",
        "global: [1]\nvirtual_servers: []\n",
        "? [a, b]\n: 1\n",
        "virtual_servers:\n  - name: !!timestamp x\n",
        "virtual_servers:\n  - {name: a, listen: !!bool maybe}\n",
        "virtual_servers:\n  - {name: a, idle_timeout: 1e999, retries: 99999999999999999999999}\n",
        "virtual_servers:\n  - {name: a/b, listen: '*:80', real_servers: [x]}\n",
    ],
)
def test_odd_documents_give_config_errors(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError):
        load([write(tmp_path, "odd.yaml", text)])


# --------------------------------------------------------------------------------------
# Values: durations, addresses, networks, enumerations, ranges
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("250ms", 0.25), ("5s", 5.0), ("2m", 120.0), ("1h", 3600.0), ("1.5s", 1.5), (7, 7.0),
     (0.5, 0.5), ("10", 10.0), (0, 0.0), (" 3 s ", 3.0)],
)  # fmt: skip
def test_parse_duration(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize(
    "value", ["-1s", -1, "5 sec", "s", "1d", "", True, None, [1], float("nan"), "inf"]
)
def test_parse_duration_rejects(value: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)


@pytest.mark.parametrize(
    ("text", "listen", "address"),
    [
        ("127.0.0.1:80", True, Address("127.0.0.1", 80)),
        ("0.0.0.0:65535", True, Address("0.0.0.0", 65535)),
        ("localhost:8080", True, Address("localhost", 8080)),
        ("[::]:443", True, Address("::", 443)),
        ("[::0001]:1", True, Address("::1", 1)),
        ("backend-1.example.com:8080", False, Address("backend-1.example.com", 8080)),
    ],
)
def test_parse_address(text: str, listen: bool, address: Address) -> None:
    assert parse_address(text, listen=listen) == address


@pytest.mark.parametrize(
    ("text", "listen", "reason"),
    [
        ("127.0.0.1", False, "expected HOST:PORT"),
        (":80", False, "expected HOST:PORT"),
        ("127.0.0.1:0", False, "port 0 is not in 1..65535"),
        ("127.0.0.1:65536", False, "port 65536 is not in 1..65535"),
        ("127.0.0.1:http", False, "port 'http' is not a number"),
        ("::1:80", False, "an IPv6 address needs brackets"),
        ("[::1]80", False, "expected [IPv6]:PORT"),
        ("[1.2.3.4]:80", False, "'1.2.3.4' is not an IPv6 address"),
        ("999.1.1.1:80", False, "'999.1.1.1' is not an IP address or host name"),
        ("bad_host!:80", False, "'bad_host!' is not an IP address or host name"),
        ("example.com:80", True, "a listen host must be an IP address or localhost"),
    ],
)
def test_parse_address_rejects(text: str, listen: bool, reason: str) -> None:
    with pytest.raises(ValueError, match=reason.replace("[", r"\[")):
        parse_address(text, listen=listen)


def test_bad_values_in_a_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "web.yaml",
        """\
        virtual_servers:
          - name: web
            listen: [127.0.0.1:8080, example.com:8081]
            idle_timeout: 5 minutes
            slow_start: 0
            deny: [10.0.0.1/8, not-a-net]
            send_proxy: v3
            health_check: {type: http, expect_status: [200, 99]}
            snmp: {version: 2, smoothing: 0, max_value: 0, oid: abc, on_no_answer: keep}
            real_servers:
              - {name: a, address: "127.0.0.1:9001", load_factor: 0, max_connections: -1}
        """,
    )
    assert problems([path]) == [
        f"{path}:3: listen must be HOST:PORT or [IPv6]:PORT, got 'example.com:8081' "
        "(a listen host must be an IP address or localhost)",
        f"{path}:4: idle_timeout must be a duration (250ms, 5s, 2m, 1h or seconds) > 0, "
        "got '5 minutes'",
        f"{path}:6: deny must be a list of CIDR networks like 10.0.0.0/8, got '10.0.0.1/8' "
        "(host bits set; did you mean 10.0.0.0/8?)",
        f"{path}:7: send_proxy must be one of none, v1, v2, got 'v3'",
        f"{path}:8: health_check.expect_status must be an integer from 100 to 599, got 99",
        f"{path}:9: snmp.version must be 2c or 3, got 2",
        f"{path}:9: snmp.smoothing must be a number > 0 and <= 1, got 0",
        f"{path}:9: snmp.max_value must be an integer >= 1, got 0",
        f"{path}:9: snmp.oid must be a dotted numeric OID like 1.3.6.1.4.1.2021.10.1.5.1, "
        "got 'abc'",
        f"{path}:9: snmp.on_no_answer must be one of zero, hold, static, got 'keep'",
        f"{path}:11: load_factor must be a number > 0, got 0",
        f"{path}:11: max_connections must be an integer >= 0, got -1",
    ]


def test_cross_field_rules(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "web.yaml",
        """\
        virtual_servers:
          - name: probe
            listen: 127.0.0.1:8080
            health_check:
              type: send_expect
              expect: "(unclosed"
            throttle:
              digg_factor: 1
              min_idle_timeout: 60s
            snmp: {version: 3}
            real_servers:
              - {name: a, address: 127.0.0.1:9001}
              - {name: b, address: 127.0.0.1:9002, snmp: {user: admin}}
          - name: ll
            listen: 127.0.0.1:8081
            scheduler: least-load
            real_servers:
              - {name: a, address: 127.0.0.1:9001, max_connections: 10}
              - {name: b, address: 127.0.0.1:9002}
          - name: dyn
            listen: 127.0.0.1:8082
            scheduler: dwr
            real_servers:
              - {name: a, address: 127.0.0.1:9001, snmp: {port: 1161}}
              - {name: b, address: 127.0.0.1:9002}
              - {name: c, address: 127.0.0.1:9003}
          - name: lls
            listen: 127.0.0.1:8083
            scheduler: least-load
            load_source: snmp
            real_servers:
              - {name: a, address: 127.0.0.1:9001}
        """,
    )
    assert problems([path]) == [
        f"{path}:6: health_check.expect must be a regular expression, got '(unclosed' "
        "(missing ), unterminated subpattern at position 0)",
        f"{path}:7: throttle needs max_connections or max_rate (or both)",
        f"{path}:8: throttle.digg_factor must be a number > 1, got 1",
        f"{path}:9: throttle.min_idle_timeout (60s) must not exceed "
        "throttle.high_idle_timeout (49s)",
        f"{path}:10: snmp version 3 needs 'user'",
        f"{path}:19: real server b needs max_connections > 0 "
        "(scheduler least-load with load_source connections)",
        f"{path}:22: scheduler dwr needs an snmp block on the virtual server or on every "
        "real server (missing on b, c)",
        f"{path}:29: scheduler least-load with load_source snmp needs an snmp block on the "
        "virtual server or on every real server (missing on a)",
    ]


def test_max_clients_auto_or_a_number(tmp_path: Path) -> None:
    assert load([write(tmp_path, "a.yaml", MINIMAL)]).global_.max_clients is None
    text = "global:\n  max_clients: auto\n" + MINIMAL
    assert load([write(tmp_path, "b.yaml", text)]).global_.max_clients is None
    text = "global:\n  max_clients: 5000\n" + MINIMAL
    assert load([write(tmp_path, "c.yaml", text)]).global_.max_clients == 5000
    path = write(tmp_path, "d.yaml", "global:\n  max_clients: 0\n" + MINIMAL)
    assert problems([path]) == [f"{path}:2: max_clients must be an integer >= 1 or auto, got 0"]


def test_bad_global_values(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "g.yaml",
        "global:\n"
        '  admin: {listen: "example.com:9100"}\n'
        "  log_format: xml\n"
        "  drain_timeout: soon\n"
        "  workers: 0\n" + MINIMAL,
    )
    assert problems([path]) == [
        f"{path}:2: admin.listen must be HOST:PORT or [IPv6]:PORT, got 'example.com:9100' "
        "(a listen host must be an IP address or localhost)",
        f"{path}:3: log_format must be one of text, json, got 'xml'",
        f"{path}:4: drain_timeout must be a duration (250ms, 5s, 2m, 1h or seconds) >= 0, "
        "got 'soon'",
        f"{path}:5: workers must be an integer >= 1 or auto, got 0",
    ]


# --------------------------------------------------------------------------------------
# Port clashes
# --------------------------------------------------------------------------------------


def servers_on(*listens: str) -> str:
    """One virtual server per `listen` value, named vs1, vs2, ... (vs1 on line 2)."""
    real_servers = "[{name: a, address: 127.0.0.1:1}]"
    return "virtual_servers:\n" + "".join(
        f"  - {{name: vs{i}, listen: {listen}, real_servers: {real_servers}}}\n"
        for i, listen in enumerate(listens, start=1)
    )


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("127.0.0.1:8080", "127.0.0.1:8080"),
        ("0.0.0.0:8080", "127.0.0.1:8080"),
        ("127.0.0.2:8080", "0.0.0.0:8080"),
        ("localhost:8080", "127.0.0.1:8080"),
        ('"[::]:8080"', '"[::1]:8080"'),
        ('"[::1]:8080"', '"[0:0::1]:8080"'),
    ],
)
def test_port_clash_between_virtual_servers(tmp_path: Path, first: str, second: str) -> None:
    path = write(tmp_path, "web.yaml", servers_on(first, second))
    [problem] = problems([path])
    assert problem.startswith(f"{path}:3: listen address ")
    assert problem.endswith(" of virtual server vs1 at line 2")


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("127.0.0.1:8080", "127.0.0.1:8081"),
        ("127.0.0.1:8080", "127.0.0.2:8080"),
        ("0.0.0.0:8080", '"[::1]:8080"'),
        ('"[::]:8080"', "127.0.0.1:8080"),
    ],
)
def test_no_clash_on_other_ports_hosts_or_families(tmp_path: Path, first: str, second: str) -> None:
    assert len(load([write(tmp_path, "web.yaml", servers_on(first, second))]).virtual_servers) == 2


def test_a_virtual_server_listing_an_address_twice(tmp_path: Path) -> None:
    path = write(tmp_path, "web.yaml", servers_on("[127.0.0.1:8080, 0.0.0.0:8080]"))
    assert problems([path]) == [
        f"{path}:2: listen address 0.0.0.0:8080 clashes with 127.0.0.1:8080 "
        "of virtual server vs1 at line 2"
    ]


def test_clash_with_the_admin_endpoint(tmp_path: Path) -> None:
    g = write(tmp_path, "g.yaml", "global:\n  admin:\n    listen: 0.0.0.0:9200\n")
    web = write(tmp_path, "web.yaml", servers_on("127.0.0.1:9200"))
    assert problems([g, web]) == [
        f"{web}:2: listen address 127.0.0.1:9200 clashes with "
        f"the admin endpoint 0.0.0.0:9200 at {g}:3"
    ]


def test_clash_with_the_default_admin_address_and_admin_off(tmp_path: Path) -> None:
    web = write(tmp_path, "web.yaml", servers_on("127.0.0.1:9100"))
    assert problems([web]) == [
        f"{web}:2: listen address 127.0.0.1:9100 clashes with the admin endpoint "
        "127.0.0.1:9100 (the default; set global.admin.listen to move it)"
    ]
    off = write(tmp_path, "off.yaml", "global: {admin: {listen: none}}\n")
    assert len(load([off, web]).virtual_servers) == 1


# --------------------------------------------------------------------------------------
# Files and folders
# --------------------------------------------------------------------------------------


def test_a_folder_is_read_in_name_order(tmp_path: Path) -> None:
    folder = tmp_path / "conf.d"
    folder.mkdir()
    write(folder, "20-b.yml", servers_on("127.0.0.1:8082").replace("vs1", "b"))
    write(folder, "10-a.yaml", servers_on("127.0.0.1:8081").replace("vs1", "a"))
    write(folder, "30-c.yaml", servers_on("127.0.0.1:8083").replace("vs1", "c"))
    write(folder, "README.md", "not: [yaml")
    write(folder, "old.yaml.bak", "not: [yaml")
    (folder / "sub.yaml").mkdir()

    config = load([folder])
    assert [vs.name for vs in config.virtual_servers] == ["a", "b", "c"]
    assert config.files == tuple(
        os.path.join(str(folder), name) for name in ("10-a.yaml", "20-b.yml", "30-c.yaml")
    )
    assert config.virtual_servers[1].file == os.path.join(str(folder), "20-b.yml")


def test_global_in_two_files(tmp_path: Path) -> None:
    a = write(tmp_path, "a.yaml", "global: {log_format: json}\n" + MINIMAL)
    b = write(tmp_path, "b.yaml", "# second\nglobal: {}\n")
    assert problems([a, b]) == [f"{b}:2: only one file may hold global: (first at {a}:1)"]


def test_yaml_syntax_error_is_reported_at_its_line(tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.yaml", "virtual_servers:\n  - name: web\n      listen: x\n")
    good = write(tmp_path, "good.yaml", MINIMAL)
    assert problems([bad, good]) == [
        f"{bad}:3: YAML syntax error: mapping values are not allowed here"
    ]


def test_missing_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    assert problems([missing, write(tmp_path, "web.yaml", MINIMAL)]) == [
        f"{missing}:1: cannot read: No such file or directory"
    ]


def test_no_virtual_servers_at_all(tmp_path: Path) -> None:
    g = write(tmp_path, "g.yaml", "global: {}\n")
    empty = write(tmp_path, "empty.yaml", "")
    assert problems([g, empty]) == [f"{g}:1: no virtual servers configured"]
    missing = str(tmp_path / "empty-folder-that-is-missing")  # its own problem, alone
    assert problems([missing]) == [f"{missing}:1: cannot read: No such file or directory"]


def test_a_yaml_syntax_error_alone_is_the_one_problem_not_no_virtual_servers(
    tmp_path: Path,
) -> None:
    bad = write(tmp_path, "bad.yaml", "virtual_servers:\n  - name: web\n    real_servers: [\n")
    assert problems([bad]) == [
        f"{bad}:4: YAML syntax error: expected the node content, but found '<stream end>'"
        " (while parsing a flow node)"
    ]


# --------------------------------------------------------------------------------------
# The shipped examples and the summary
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULER_FILES)
def test_each_example_loads_with_the_global_file(name: str) -> None:
    config = load([CONFIGS / "global.yaml", CONFIGS / name])
    [vs] = config.virtual_servers
    assert vs.scheduler == name.removesuffix(".yaml")
    assert config.global_.admin.listen == Address("127.0.0.1", 9100)


FEATURE_FILES = ["front-door.yaml", "locator.yaml"]


def test_the_examples_folder_loads_as_a_whole() -> None:
    config = load([CONFIGS])
    by_file = {}
    for vs in config.virtual_servers:
        by_file.setdefault(Path(vs.file).name, []).append(vs)
    assert sorted(by_file) == sorted(SCHEDULER_FILES + FEATURE_FILES)
    for name in SCHEDULER_FILES:
        [vs] = by_file[name]
        assert vs.scheduler == name.removesuffix(".yaml")
    scheduler_ports = sorted(
        address.port for name in SCHEDULER_FILES for vs in by_file[name] for address in vs.listen
    )
    assert scheduler_ports == list(range(8081, 8091))


def test_the_front_door_example_routes_by_sni_with_a_backup_and_a_queue() -> None:
    api, web, default = load([CONFIGS / "front-door.yaml"]).virtual_servers
    assert api.listen == web.listen == default.listen == (Address("127.0.0.1", 8443),)
    assert api.sni == ("api.example.com",) and "*.example.com" in web.sni and not default.sni
    assert api.queue is not None and [rs.backup for rs in api.real_servers] == [
        False,
        False,
        True,
    ]


def test_the_locator_example_is_locator_only_with_pushed_loads() -> None:
    [db] = load([CONFIGS / "locator.yaml"]).virtual_servers
    assert db.listen == () and db.scheduler == "least-load" and db.load_source == "report"
    assert db.conditioning is not None


def test_check_warns_of_report_servers_whose_answers_add_no_load(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "db.yaml",
        """\
        virtual_servers:
          - name: db
            listen: none
            scheduler: least-load
            load_source: report
            real_servers:
              - {name: a, address: 127.0.0.1:9001}
              - {name: b, address: 127.0.0.1:9002, max_connections: 100}
          - name: web
            listen: 127.0.0.1:8080
            scheduler: wlc
            real_servers:
              - {name: a, address: 127.0.0.1:9001}
        """,
    )
    [warning] = warnings(load([path]))
    assert warning.startswith(f"{path}:7: db/a has no max_connections: ")
    assert "one that never reports gets them all" in warning
    assert warnings(load([CONFIGS])) == []  # the examples set max_connections


def test_only_global_yaml_holds_global() -> None:
    for name in SCHEDULER_FILES + FEATURE_FILES:
        assert "global:" not in (CONFIGS / name).read_text(), name


def test_the_sap_example_has_the_documents_load_factors() -> None:
    [vs] = load([CONFIGS / "sap.yaml"]).virtual_servers
    assert [rs.load_factor for rs in vs.real_servers] == [2, 3, 4, 4]


def test_summary_names_every_server(tmp_path: Path) -> None:
    config = load([CONFIGS])
    text = summary(config)
    assert text.splitlines()[0] == "admin 127.0.0.1:9100, log text, workers 1, drain timeout 30s"
    assert "virtual server wlc-web (" in text
    assert "scheduler   wlc, quiesce" in text
    servers = sum(len(vs.real_servers) for vs in config.virtual_servers)
    assert (
        text.splitlines()[-1]
        == f"{len(config.virtual_servers)} virtual servers, {servers} real servers"
    )
    for vs in config.virtual_servers:
        assert f"  listen      {vs.listen[0] if vs.listen else 'none (locator only)'}" in text
        for rs in vs.real_servers:
            assert re.search(rf"\b{re.escape(rs.name)}  +{re.escape(str(rs.address))}", text)


# --------------------------------------------------------------------------------------
# Affinity (SPEC §12): maglev keys and persistence
# --------------------------------------------------------------------------------------


def test_maglev_and_persistence_keys_and_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "m.yaml",
        """\
        virtual_servers:
          - name: m
            listen: 127.0.0.1:8080
            scheduler: maglev
            table_size: 131071
            hash_key: source_port
            persistence: {timeout: 90s, max_entries: 10}
            real_servers:
              - {name: a, address: 127.0.0.1:9001}
          - name: d
            listen: 127.0.0.1:8081
            scheduler: maglev
            persistence:
            real_servers:
              - {name: a, address: 127.0.0.1:9001}
        """,
    )
    m, d = load([path]).virtual_servers
    assert (m.options.table_size, m.options.hash_key) == (131071, "source_port")
    assert (m.persistence.timeout, m.persistence.max_entries) == (90.0, 10)
    assert (d.options.table_size, d.options.hash_key) == (65537, "source")
    assert (d.persistence.timeout, d.persistence.max_entries) == (300.0, 100000)
    assert load([write(tmp_path, "min.yaml", MINIMAL)]).virtual_servers[0].persistence is None


def test_maglev_and_persistence_problems(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "bad.yaml",
        """\
        virtual_servers:
          - name: m
            listen: 127.0.0.1:8080
            scheduler: maglev
            table_size: 65536
            hash_key: port
            real_servers:
              - {name: a, address: 127.0.0.1:9001}
          - name: small
            listen: 127.0.0.1:8081
            scheduler: maglev
            table_size: 97
            persistence: {timeout: 0s, max_entries: 0, sticky: yes}
            real_servers:
              - {name: a, address: 127.0.0.1:9001}
          - name: r
            listen: 127.0.0.1:8082
            scheduler: rr
            table_size: 101
            hash_key: source
            real_servers:
              - {name: a, address: 127.0.0.1:9001}
        """,
    )
    assert problems([path]) == [
        f"{path}:5: table_size must be a prime from 101 to 1000003 (e.g. 65537, 131071 or "
        "1000003), got 65536 (65536 is not prime)",
        f"{path}:6: hash_key must be one of source, source_port, got 'port'",
        f"{path}:12: table_size must be a prime from 101 to 1000003 (e.g. 65537, 131071 or "
        "1000003), got 97",
        f"{path}:13: persistence.timeout must be a duration (250ms, 5s, 2m, 1h or seconds) > 0, "
        "got '0s'",
        f"{path}:13: persistence.max_entries must be an integer >= 1, got 0",
        f"{path}:13: unknown key 'sticky' in persistence of virtual server small",
        f"{path}:19: table_size applies to scheduler maglev only",
        f"{path}:20: hash_key applies to scheduler maglev only",
    ]


def test_keys_a_scheduler_never_reads_are_errors_at_their_line(tmp_path: Path) -> None:
    """slow_start ramps a weight and quiesce resets a weighted table: with a scheduler
    that reads neither they would do nothing, so check says so instead of accepting."""
    cases = [
        ("rr", "slow_start", "10s"),
        ("lc", "slow_start", "10s"),
        ("sap", "slow_start", "10s"),
        ("first", "slow_start", "10s"),
        ("lc", "quiesce", "true"),
        ("rr", "quiesce", "true"),
    ]
    body = "".join(
        f"  - name: {name}{number}\n"
        f"    listen: 127.0.0.1:{8080 + number}\n"
        f"    scheduler: {name}\n"
        f"    {key}: {value}\n"
        "    real_servers:\n"
        "      - {name: a, address: 127.0.0.1:9001}\n"
        for number, (name, key, value) in enumerate(cases)
    )
    path = write(tmp_path, "ignored.yaml", "virtual_servers:\n" + body)
    readers = {"slow_start": "wrr, wlc, dwd, dwr, maglev", "quiesce": "wlc, dwd, dwr"}
    assert problems([path]) == [
        f"{path}:{5 + 6 * number}: {key} applies to schedulers {readers[key]} only "
        f"(scheduler {name} has no use for it)"
        for number, (name, key, _) in enumerate(cases)
    ]


def test_slow_start_and_quiesce_with_the_schedulers_that_read_them(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "read.yaml",
        """\
        virtual_servers:
          - name: default
            listen: 127.0.0.1:8080
            quiesce: true
            slow_start: 4s
            real_servers:
              - {name: a, address: 127.0.0.1:9001}
          - name: weighted
            listen: 127.0.0.1:8081
            scheduler: wrr
            slow_start: 4s
            real_servers:
              - {name: a, address: 127.0.0.1:9001}
        """,
    )
    config = load([path])
    assert [(vs.scheduler, vs.quiesce, vs.slow_start) for vs in config.virtual_servers] == [
        ("wlc", True, 4.0),
        ("wrr", False, 4.0),
    ]
    assert "scheduler   wlc, quiesce, slow start 4s" in summary(config)


def test_summary_shows_maglev_and_persistence() -> None:
    text = summary(load([CONFIGS / "maglev.yaml"]))
    assert "scheduler   maglev, table 65537, hash source" in text
    assert "persistence 300s, at most 100000 clients" in text


# -- the locator and conditioning (SPEC §10, §11) -----------------------------------------


def test_locator_listen_none_reports_and_conditioning(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "locator.yaml",
        """\
        global:
          locator:
            dns: {listen: 127.0.0.1:5353, zone: LB.Internal, ttl: 5}
        virtual_servers:
          - name: db
            listen: none
            scheduler: least-load
            load_source: report
            conditioning: {interval: 2s, idle_for: 250ms, max_per_interval: 3, threshold: 4}
            real_servers:
              - {name: a, address: 127.0.0.1:9001}
        """,
    )
    config = load([path])
    dns = config.global_.locator.dns
    assert (dns.listen, dns.zone, dns.ttl) == (Address("127.0.0.1", 5353), "lb.internal.", 5)
    vs = config.virtual_servers[0]
    assert vs.listen == () and vs.load_source == "report"
    assert (vs.conditioning.interval, vs.conditioning.idle_for) == (2.0, 0.25)
    assert (vs.conditioning.max_per_interval, vs.conditioning.threshold) == (3, 4.0)
    text = summary(config)
    assert "listen      none (locator only)" in text
    assert "DNS locator 127.0.0.1:5353 (UDP and TCP), zone lb.internal., ttl 5" in text
    assert "conditioning every 2s, idle for 0.25s, at most 3 per interval, threshold 4" in text
    assert load([write(tmp_path, "plain.yaml", MINIMAL)]).global_.locator.dns is None


def test_locator_and_conditioning_problems(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "bad.yaml",
        """\
        global:
          admin: {listen: 127.0.0.1:9100}
          locator:
            dns: {listen: 127.0.0.1:9100, zone: "bad zone!", tll: 3}
        virtual_servers:
          - name: web
            listen: 127.0.0.1:8080
            scheduler: rr
            conditioning: {interval: 0s, max_per_interval: 0}
            real_servers:
              - {name: a, address: 127.0.0.1:9001}
          - name: db
            listen: none
            scheduler: wlc
            load_source: pushed
            conditioning: {threshold: -1}
            real_servers:
              - {name: a, address: 127.0.0.1:9001}
        """,
    )
    found = messages([path])
    assert any("zone must be a DNS zone like lb.internal." in m for m in found), found
    assert any("unknown key 'tll' in global.locator.dns (did you mean 'ttl'?)" in m for m in found)
    assert any("the DNS locator 127.0.0.1:9100 clashes with the admin endpoint" in m for m in found)
    lines = problems([path])
    assert any(m.endswith(":9: conditioning.interval must be a duration (250ms, 5s, 2m, 1h or "
               "seconds) > 0, got '0s'") for m in lines), lines  # fmt: skip
    assert any("conditioning.max_per_interval must be an integer >= 1" in m for m in found)
    assert any("conditioning needs a scheduler with a load" in m and "rr" in m for m in found)
    assert any("load_source must be one of connections, snmp, report" in m for m in found)
    assert any("conditioning.threshold must be a number > 0" in m for m in found)


def test_admin_allowed_hosts_are_host_names_lower_cased(tmp_path: Path) -> None:
    text = "global:\n  admin:\n    allowed_hosts: [LB.Example.com., lb-0]\n" + MINIMAL
    config = load([write(tmp_path, "g.yaml", text)])
    assert config.global_.admin.allowed_hosts == ("lb.example.com", "lb-0")
    assert load([write(tmp_path, "h.yaml", MINIMAL)]).global_.admin.allowed_hosts == ()


@pytest.mark.parametrize("bad", ["'bad host'", "10.0.0.1", "3"])
def test_a_bad_admin_allowed_host_is_named_at_its_line(tmp_path: Path, bad: str) -> None:
    # An IP address needs no listing (every IP literal is answered); a number is no name.
    text = f"global:\n  admin:\n    allowed_hosts:\n      - ok.example\n      - {bad}\n"
    path = write(tmp_path, "g.yaml", text + MINIMAL)
    (problem,) = problems([path])
    assert problem.startswith(
        f"{path}:5: admin.allowed_hosts must be a host name like lb.example.com, got "
    )
