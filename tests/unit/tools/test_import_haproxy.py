"""`lbproxy import` of HAProxy configurations: the grammar, `defaults` inheritance, each
directive §25 lists, the FILE:LINE lines of what is left behind, and the command itself
(exit codes, identical output twice, output that `lbproxy check` and the schema accept)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from lbproxy.cli import main
from lbproxy.config.reader import load
from lbproxy.config.schema import json_schema
from lbproxy.tools.importer import haproxy
from lbproxy.tools.importer.haproxy_grammar import parse, split_words
from lbproxy.tools.importer.translation import to_yaml
from tests.unit.tools.support import has_key

DATA = Path(__file__).resolve().parents[2] / "data" / "import" / "haproxy"


def imported(text: str, tmp_path: Path) -> tuple[list[dict], list[str], dict]:
    """The virtual servers, the untranslated lines (without the file) and the document,
    after checking the YAML with `lbproxy check`'s reader and the schema."""
    source = tmp_path / "haproxy.cfg"
    source.write_text(textwrap.dedent(text))
    translation = haproxy.translate(source)
    document_text = to_yaml(translation)
    document = yaml.safe_load(document_text)
    if translation.virtual_servers:
        jsonschema.validate(document, json_schema())
        written = tmp_path / "lbproxy.yaml"
        written.write_text(document_text)
        load([written])  # raises ConfigError with every FILE:LINE problem
    left = [u.what for u in translation.untranslated]
    lines = [f"{u.line}: {u.what}" for u in translation.untranslated]
    return translation.virtual_servers, left + lines, document


def check_of(vs: dict) -> dict:
    """The health check without its timeout (HAProxy's `inter`, tested on its own)."""
    return {key: value for key, value in vs["health_check"].items() if key != "timeout"}


def only(text: str, tmp_path: Path) -> dict:
    servers, _, _ = imported(text, tmp_path)
    assert len(servers) == 1, servers
    return servers[0]


# --- the grammar ------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, words",
    [
        ("  server s1 10.0.0.1:80   check  ", ["server", "s1", "10.0.0.1:80", "check"]),
        ("bind :80 # a comment", ["bind", ":80"]),
        ("tcp-check send PING\\r\\n", ["tcp-check", "send", "PING\r\n"]),
        ("tcp-check send info\\ replication", ["tcp-check", "send", "info replication"]),
        ("agent-send 'a \\n b'", ["agent-send", "a \\n b"]),  # nothing escaped in '...'
        ('x "a # b" c', ["x", "a # b", "c"]),
        ('x a"b c"d', ["x", "ab cd"]),
        ('x "say \\"hi\\""', ["x", 'say "hi"']),
        ("x \\x41\\#", ["x", "A#"]),
        ('x "" y', ["x", "", "y"]),
        ("# only a comment", []),
    ],
)
def test_words_follow_haproxys_quoting_and_escapes(line, words):
    assert split_words(line) == (words, None)


@pytest.mark.parametrize("line", ["x 'open", 'x "open', "x \\x4", "x \\"])
def test_a_malformed_line_is_a_problem_not_an_exception(line):
    assert split_words(line)[1]


def test_sections_keep_their_statements_with_file_and_line():
    parsed = parse("global\n  daemon\n\ndefaults web from base\n  mode tcp\nlisten a\n", "f.cfg")
    kinds = [(s.kind, s.name, s.source, s.header.line) for s in parsed.sections]
    assert kinds == [
        ("global", "", None, 1),
        ("defaults", "web", "base", 4),
        ("listen", "a", None, 6),
    ]
    assert parsed.sections[1].statements[0].file == "f.cfg"
    assert parsed.sections[1].statements[0].line == 5


# --- inheritance ------------------------------------------------------------------


def test_a_proxy_takes_the_last_defaults_above_it_and_overrides_them(tmp_path):
    servers, _, _ = imported(
        """
        defaults
            mode tcp
            balance leastconn
            timeout connect 2s
        defaults second
            mode tcp
            timeout connect 4s
            timeout client 30s
        listen a
            bind 127.0.0.1:7001
            timeout client 40s
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    a = servers[0]
    assert a["scheduler"] == "wrr"  # the second defaults reset balance to roundrobin
    assert a["connect_timeout"] == "4s"
    assert a["idle_timeout"] == "40s"


def test_from_names_the_defaults_a_proxy_inherits(tmp_path):
    servers, _, _ = imported(
        """
        defaults tcp_first
            mode tcp
            balance first
        defaults http_stuff
            mode http
        listen a from tcp_first
            bind 127.0.0.1:7001
            server s1 127.0.0.1:9001 maxconn 5
        listen b
            bind 127.0.0.1:7002
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    assert [vs["name"] for vs in servers] == ["a"]
    assert servers[0]["scheduler"] == "first"


def test_a_mode_http_proxy_is_one_line_at_its_start(tmp_path):
    _, left, _ = imported(
        """
        listen web
            mode http
            bind :80
            option httplog
            server s1 10.0.0.1:80
        listen db
            bind :5432
            server s1 10.0.0.2:5432
        """,
        tmp_path,
    )
    assert left[: len(left) // 2] == ["listen web: mode http (lbproxy is Layer 4)"]
    assert left[len(left) // 2 :] == ["2: listen web: mode http (lbproxy is Layer 4)"]


# --- directives -----------------------------------------------------------------------


def test_binds_several_addresses(tmp_path):
    vs = only(
        """
        frontend f
            bind :7001,127.0.0.1:7002
            bind [::1]:7003
            bind 127.0.0.1:7010-7012
            default_backend b
        backend b
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    assert vs["listen"] == [
        "0.0.0.0:7001",
        "127.0.0.1:7002",
        "[::1]:7003",
        "127.0.0.1:7010",
        "127.0.0.1:7011",
        "127.0.0.1:7012",
    ]
    assert "accept_proxy" not in vs
    assert vs["name"] == "b"  # named after the backend, as HAProxy's logs name it


def test_accept_proxy_is_the_binds_that_say_it_only(tmp_path):
    servers, left, _ = imported(
        """
        frontend f
            bind :7001,127.0.0.1:7002 accept-proxy
            bind [::1]:7003
            default_backend b
        backend b
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    assert [(vs["name"], vs["listen"], vs.get("accept_proxy")) for vs in servers] == [
        ("b", "[::1]:7003", None),
        ("b-7001", ["0.0.0.0:7001", "127.0.0.1:7002"], True),
    ]
    assert any(line.startswith("6: backend b: 2 virtual servers") for line in left)


def test_accept_proxy_on_every_bind_is_one_virtual_server(tmp_path):
    vs = only(
        """
        frontend f
            bind 127.0.0.1:7001 accept-proxy
            bind 127.0.0.1:7002 accept-proxy
            default_backend b
        backend b
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    assert (vs["name"], vs["listen"], vs["accept_proxy"]) == (
        "b",
        ["127.0.0.1:7001", "127.0.0.1:7002"],
        True,
    )


def test_a_dropped_bind_option_says_the_address_is_kept(tmp_path):
    servers, left, _ = imported(
        """
        listen l
            bind [::]:15000 ipv6only=on
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    assert servers[0]["listen"] == "[::]:15000"
    assert "3: bind option ipv6only=on (the address [::]:15000 is translated without it)" in left


@pytest.mark.parametrize(
    "balance, scheduler",
    [
        ("roundrobin", "wrr"),
        ("static-rr", "wrr"),
        ("leastconn", "wlc"),
        ("first", "first"),
        ("source", "maglev"),
    ],
)
def test_balance_becomes_the_scheduler_that_behaves_alike(tmp_path, balance, scheduler):
    vs = only(
        f"""
        listen a
            bind 127.0.0.1:7001
            balance {balance}
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    assert vs["scheduler"] == scheduler
    if balance == "source":
        assert vs["hash_key"] == "source"


def test_an_unknown_balance_is_named_and_the_default_roundrobin_kept(tmp_path):
    servers, left, _ = imported(
        """
        listen a
            bind 127.0.0.1:7001
            balance uri
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    assert servers[0]["scheduler"] == "wrr"
    assert "4: balance uri (another algorithm)" in left


def test_slowstart_with_balance_first_is_left_behind_not_written(tmp_path):
    """lbproxy's `first` reads no weight, so a slow_start there is a configuration error:
    the import names the slowstart it leaves instead of writing one check refuses."""
    servers, left, _ = imported(
        """
        listen a
            bind 127.0.0.1:7001
            balance first
            server s1 127.0.0.1:9001 slowstart 5s
        """,
        tmp_path,
    )
    assert servers[0]["scheduler"] == "first"
    assert "slow_start" not in servers[0]
    assert "5: server s1: slowstart (scheduler first reads no weight to ramp)" in left


def test_server_options(tmp_path):
    vs = only(
        """
        listen a
            bind 127.0.0.1:7001
            default-server inter 3s fall 5 rise 4 send-proxy-v2 slowstart 20s
            server s1 127.0.0.1:9001 check weight 3 maxconn 10 port 8080 addr 127.0.0.9
            server s2 127.0.0.1:9002 check backup
            server s3 127.0.0.1:9003 check disabled
        """,
        tmp_path,
    )
    s1, s2, s3 = vs["real_servers"]
    assert s1 == {
        "name": "s1",
        "address": "127.0.0.1:9001",
        "weight": 3,
        "max_connections": 10,
        "health_check": {"port": 8080, "address": "127.0.0.9"},
    }
    assert s2["backup"] is True
    assert s3["state"] == "disabled"
    assert vs["health_check"] == {
        "type": "tcp",
        "interval": "3s",
        "rise": 4,
        "fall": 5,
        "timeout": "3s",  # HAProxy waits `inter` for a check without `timeout check`
    }
    assert vs["send_proxy"] == "v2"
    assert vs["slow_start"] == "20s"
    assert vs["queue"] == {}  # a full server queues its clients in HAProxy


def test_no_check_is_type_none_and_a_server_without_check_is_named(tmp_path):
    vs = only("listen a\n  bind 127.0.0.1:7001\n  server s1 127.0.0.1:9001\n", tmp_path)
    assert vs["health_check"] == {"type": "none"}
    _, left, _ = imported(
        """
        listen a
            bind 127.0.0.1:7001
            server s1 127.0.0.1:9001 check
            server s2 127.0.0.1:9002
        """,
        tmp_path,
    )
    assert any(line.startswith("5: server s2 without check") for line in left)


def test_send_proxy_differing_between_servers_is_named(tmp_path):
    vs_list, left, _ = imported(
        """
        listen a
            bind 127.0.0.1:7001
            server s1 127.0.0.1:9001 send-proxy
            server s2 127.0.0.1:9002
        """,
        tmp_path,
    )
    assert vs_list[0]["send_proxy"] == "v1"
    assert "5: server s2: send_proxy none (lbproxy has one per virtual server: v1)" in left


def test_check_send_proxy_is_the_servers_health_check_send_proxy(tmp_path):
    vs_list, left, _ = imported(
        """
        listen a
            bind 127.0.0.1:7001
            server s1 127.0.0.1:9001 check port 8080 check-send-proxy
            server s2 127.0.0.1:9002 check port 8080
        """,
        tmp_path,
    )
    s1, s2 = vs_list[0]["real_servers"]
    assert s1["health_check"] == {"port": 8080, "send_proxy": True}
    assert s2["health_check"] == {"port": 8080}
    assert not any("check-send-proxy" in line for line in left), left


def test_agent_check(tmp_path):
    vs = only(
        """
        listen a
            bind 127.0.0.1:7001
            server s1 127.0.0.1:9001 check agent-check agent-port 9777 agent-inter 4s
            server s2 127.0.0.1:9002 check agent-check agent-port 9777 agent-addr 127.0.0.3
        """,
        tmp_path,
    )
    assert vs["agent_check"] == {"port": 9777, "interval": "4s"}
    assert vs["real_servers"][1]["agent_check"] == {"address": "127.0.0.3"}


def test_an_agent_on_some_servers_is_theirs_alone(tmp_path):
    servers, left, _ = imported(
        """
        listen a
            bind 127.0.0.1:7001
            server s1 127.0.0.1:9001 check agent-check agent-port 9999 agent-inter 2s
            server s2 127.0.0.1:9002 check
            server s3 127.0.0.1:9003 check agent-check agent-port 9998 agent-inter 5s
        """,
        tmp_path,
    )
    vs = servers[0]
    assert "agent_check" not in vs  # else lbproxy would ask s2's host too
    assert [rs.get("agent_check") for rs in vs["real_servers"]] == [
        {"port": 9999},
        None,
        {"port": 9998},
    ]
    assert left[: len(left) // 2] == [
        "server s3 agent-inter 5s (lbproxy's agents share one value per virtual server: 2s)"
    ]


def test_agent_settings_that_differ_between_servers_are_named(tmp_path):
    servers, left, _ = imported(
        """
        listen a
            bind 127.0.0.1:7001
            server s1 127.0.0.1:9001 check agent-check agent-port 9 agent-send ready
            server s2 127.0.0.1:9002 check agent-check agent-port 9 agent-send up
        """,
        tmp_path,
    )
    assert servers[0]["agent_check"] == {"port": 9, "send": "ready"}
    assert left[0].startswith("server s2 agent-send up ")


@pytest.mark.parametrize(
    "lines, check, named",
    [
        # HAProxy's default request is OPTIONS /
        (["option httpchk"], {"method": "OPTIONS"}, []),
        (["option httpchk /ping"], {"method": "OPTIONS", "path": "/ping"}, []),
        (
            [r"option httpchk GET /health HTTP/1.1\r\nHost:\ example.com\r\nX-Check:\ 1"],
            {"method": "GET", "path": "/health", "host": "example.com"},
            ["the check's header X-Check: 1"],
        ),
        (
            ["option httpchk HEAD / HTTP/1.0"],
            {"method": "HEAD"},
            ["the check's HTTP version HTTP/1.0 (lbproxy's: HTTP/1.1)"],
        ),
        (
            [
                "option httpchk",
                "http-check send meth GET uri /ready ver HTTP/1.1 hdr Host example.com",
                "http-check expect string ok.",
            ],
            {"method": "GET", "path": "/ready", "host": "example.com", "expect_body": r"ok\."},
            [],
        ),
    ],
)
def test_httpchk_carries_its_method_path_and_host(tmp_path, lines, check, named):
    body = "\n".join(f"    {line}" for line in lines)
    servers, left, _ = imported(
        f"listen w\n    bind 127.0.0.1:7001\n{body}\n    server w1 127.0.0.1:8081 check\n",
        tmp_path,
    )
    assert check_of(servers[0]) == {"type": "http", **check}
    assert [line.split(" (lbproxy")[0] for line in left[: len(left) // 2]] == [
        n.split(" (lbproxy")[0] for n in named
    ]


def test_smtpchk_helo_is_named_lbproxy_says_ehlo(tmp_path):
    servers, left, _ = imported(
        "listen m\n bind 127.0.0.1:7001\n option smtpchk HELO example.com\n"
        " server m1 127.0.0.1:25 check\n",
        tmp_path,
    )
    assert check_of(servers[0]) == {"type": "smtp", "helo": "example.com"}
    assert left == [
        "option smtpchk HELO example.com (lbproxy's smtp check says EHLO)",
        "3: option smtpchk HELO example.com (lbproxy's smtp check says EHLO)",
    ]


@pytest.mark.parametrize(
    "option, check",
    [
        ("option tcp-check", {"type": "tcp"}),
        ("option pgsql-check user haproxy", {"type": "pgsql", "user": "haproxy"}),
        ("option mysql-check user haproxy", {"type": "mysql", "user": "haproxy"}),
        ("option redis-check", {"type": "redis"}),
        ("option smtpchk EHLO lb.example.com", {"type": "smtp", "helo": "lb.example.com"}),
        ("option ssl-hello-chk", {"type": "tls"}),
        ("option httpchk GET /health", {"type": "http", "method": "GET", "path": "/health"}),
    ],
)
def test_check_options(tmp_path, option, check):
    vs = only(
        f"""
        listen a
            bind 127.0.0.1:7001
            {option}
            server s1 127.0.0.1:9001 check
        """,
        tmp_path,
    )
    assert check_of(vs) == check


def test_a_redis_role_sequence_is_the_redis_check_with_its_role(tmp_path):
    # HAProxy's configuration manual's example of a tcp-check sequence for Redis
    vs = only(
        r"""
        listen redis
            bind 127.0.0.1:7001
            option tcp-check
            tcp-check connect
            tcp-check send PING\r\n
            tcp-check expect string +PONG
            tcp-check send info\ replication\r\n
            tcp-check expect string role:master
            tcp-check send QUIT\r\n
            tcp-check expect string +OK
            server r1 127.0.0.1:6379 check inter 1s
        """,
        tmp_path,
    )
    assert vs["health_check"] == {"type": "redis", "role": "master", "interval": "1s"}


def test_an_smtp_sequence_and_a_pgsql_startup_message(tmp_path):
    vs = only(
        r"""
        listen smtp
            bind 127.0.0.1:7001
            option tcp-check
            tcp-check expect rstring ^220
            tcp-check send EHLO\ lb.example.com\r\n
            tcp-check expect rstring ^250
            server m1 127.0.0.1:25 check
        """,
        tmp_path,
    )
    assert check_of(vs) == {"type": "smtp", "helo": "lb.example.com"}
    startup = "00000025" + "00030000" + b"user\0haproxy\0database\0postgres\0\0".hex()
    vs = only(
        f"""
        listen pg
            bind 127.0.0.1:7001
            option tcp-check
            tcp-check connect port 5432
            tcp-check send-binary {startup}
            tcp-check expect binary 52
            server p1 127.0.0.1:5432 check
        """,
        tmp_path,
    )
    assert check_of(vs) == {"type": "pgsql", "user": "haproxy", "port": 5432}


def test_a_startup_message_over_several_sends_is_one_message(tmp_path):
    # the usual way to write the pgsql check: a field a line
    vs = only(
        """
        listen pg
            bind 127.0.0.1:7001
            option tcp-check
            tcp-check connect
            tcp-check send-binary 00000025
            tcp-check send-binary 00030000
            tcp-check send-binary 7573657200
            tcp-check send-binary 706f737467726573
            tcp-check send-binary 00
            tcp-check send-binary 6461746162617365
            tcp-check send-binary 00
            tcp-check send-binary 706f737467726573
            tcp-check send-binary 0000
            tcp-check expect binary 52
            server p1 127.0.0.1:5432 check
        """,
        tmp_path,
    )
    assert check_of(vs) == {"type": "pgsql", "user": "postgres"}
    # and a send_expect's message is the sends in a row, joined
    vs = only(
        """
        listen raw
            bind 127.0.0.1:7001
            option tcp-check
            tcp-check send-binary 0102
            tcp-check send-binary 0304
            tcp-check expect binary 05
            server p1 127.0.0.1:5432 check
        """,
        tmp_path,
    )
    assert check_of(vs) == {"type": "send_expect", "send_hex": "01020304", "expect_hex": "05"}


MYSQL_41 = (  # what `option mysql-check user haproxy post-41` sends: flags, max, charset
    "28000001" + "00a20000" + "00000001" + "21" + "00" * 23 + b"haproxy\0".hex()
)


@pytest.mark.parametrize(
    "sends",
    [
        [MYSQL_41],
        [MYSQL_41[:8], MYSQL_41[8:40], MYSQL_41[40:]],  # over several lines
        ["0e000001" + "8500" + "000000" + b"haproxy\0".hex() + "00"],  # before 4.1
    ],
)
def test_the_usual_mysql_sequence_is_the_mysql_check(tmp_path, sends):
    lines = "\n".join(f"    tcp-check send-binary {hex_text}" for hex_text in sends)
    servers, left, _ = imported(
        "listen db\n    bind 127.0.0.1:7001\n    option tcp-check\n    tcp-check connect\n"
        f"{lines}\n    tcp-check expect binary 0700000200000002000000\n"
        "    server db1 127.0.0.1:3306 check\n",
        tmp_path,
    )
    assert check_of(servers[0]) == {"type": "mysql", "user": "haproxy"}
    assert left == []


def test_a_mysql_packet_whose_length_is_wrong_is_named(tmp_path):
    wrong = "2b000001" + MYSQL_41[8:]  # says 43 bytes, holds 40
    servers, left, _ = imported(
        f"listen db\n bind 127.0.0.1:7001\n option tcp-check\n tcp-check send-binary {wrong}\n"
        " server db1 127.0.0.1:3306 check\n",
        tmp_path,
    )
    assert check_of(servers[0]) == {"type": "mysql", "user": "haproxy"}
    assert any(
        line.startswith("4: tcp-check send-binary ... (its MySQL packet says 43") for line in left
    )


def test_another_sequence_keeps_its_first_send_and_expect_and_names_the_rest(tmp_path):
    servers, left, _ = imported(
        r"""
        listen a
            bind 127.0.0.1:7001
            option tcp-check
            tcp-check send HELLO\n
            tcp-check expect string READY
            tcp-check send STATUS\n
            tcp-check expect rstring ^OK
            server s1 127.0.0.1:9001 check
        """,
        tmp_path,
    )
    assert check_of(servers[0]) == {
        "type": "send_expect",
        "send": "HELLO\n",
        "expect": "READY",
    }
    assert [line for line in left if line[0].isdigit()] == [
        "7: tcp-check send 'STATUS\\n' (lbproxy's check: the first send and expect)".replace(
            "'STATUS\\n'", "STATUS\\n"
        ),
        "8: tcp-check expect rstring ^OK (lbproxy's check: the first send and expect)",
    ]


def test_option_abortonclose_drops_queued_clients_that_close(tmp_path):
    """From defaults to a backend whose full servers queue; `no option abortonclose`
    turns it off again; where nothing queues it has nothing to drop (not named)."""
    vss, left, _document = imported(
        """
        defaults
            mode tcp
            option abortonclose
        listen full
            bind 127.0.0.1:7001
            server s1 127.0.0.1:9001 maxconn 4
        listen plain
            bind 127.0.0.1:7002
            no option abortonclose
            server s1 127.0.0.1:9002 maxconn 4
        listen unlimited
            bind 127.0.0.1:7003
            server s1 127.0.0.1:9003
        """,
        tmp_path,
    )
    queues = {vs["name"]: vs.get("queue") for vs in vss}
    assert queues == {"full": {"abort_on_close": True}, "plain": {}, "unlimited": None}
    assert left == []


def test_timeouts(tmp_path):
    vs = only(
        """
        listen a
            bind 127.0.0.1:7001
            timeout connect 500
            timeout client 2m
            timeout server 90s
            timeout check 700ms
            timeout queue 3s
            server s1 127.0.0.1:9001 check maxconn 4
        """,
        tmp_path,
    )
    assert vs["connect_timeout"] == "500ms"  # HAProxy's bare number is milliseconds
    assert vs["idle_timeout"] == "2m"
    assert vs["health_check"]["timeout"] == "700ms"
    assert vs["queue"] == {"timeout": "3s"}
    tunnel = only(
        """
        listen a
            bind 127.0.0.1:7001
            timeout client 1m
            timeout tunnel 1h
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    assert tunnel["idle_timeout"] == "1h"


SNI = """
frontend tls
    bind 127.0.0.1:8443
    tcp-request inspect-delay 5s
    tcp-request content accept if { req_ssl_hello_type 1 }
    acl api req.ssl_sni -i api.example.com
    acl api req.ssl_sni -i api2.example.com
    use_backend api if api
    use_backend web if { req.ssl_sni -i www.example.com } || { req.ssl_sni example.com }
    use_backend web if { req.ssl_sni -m end .example.com }
    default_backend other
backend api
    server a1 127.0.0.1:9441
backend web
    server w1 127.0.0.1:9451
backend other
    server o1 127.0.0.1:9459
"""


def test_use_backend_on_req_ssl_sni_becomes_sni_routes(tmp_path):
    servers, left, _ = imported(SNI, tmp_path)
    routes = {vs["name"]: (vs["listen"], vs.get("sni")) for vs in servers}
    assert routes == {
        "api": ("127.0.0.1:8443", ["api.example.com", "api2.example.com"]),
        "web": ("127.0.0.1:8443", ["www.example.com", "example.com"]),
        "other": ("127.0.0.1:8443", None),
    }
    assert [line for line in left if line[0].isdigit()] == [
        "10: use_backend web if { req.ssl_sni -m end .example.com } (req.ssl_sni -m end "
        "(lbproxy matches exact names and `*.example.com`, one label))"
    ]


ALPN = """
frontend tls
    bind 127.0.0.1:8443
    tcp-request inspect-delay 5s
    tcp-request content accept if { req_ssl_hello_type 1 }
    use_backend web if { req.ssl_sni -i www.example.com }
    acl acme req.ssl_alpn acme-tls/1
    use_backend certs if acme
    use_backend xmpp if { req.ssl_alpn -m str xmpp-client } || { req.ssl_alpn xmpp-server }
    use_backend web2 if { req.ssl_alpn -i h2 }
    use_backend web2 if { req.ssl_alpn -m beg h }
    use_backend web2 if { req.ssl_alpn h2 } { req.ssl_sni -i a.example.com }
    default_backend other
backend web
    server w1 127.0.0.1:9451
backend web2
    server w2 127.0.0.1:9452
backend certs
    server c1 127.0.0.1:9461
backend xmpp
    server x1 127.0.0.1:9471
backend other
    server o1 127.0.0.1:9459
"""


def test_use_backend_on_req_ssl_alpn_becomes_alpn_routes(tmp_path):
    servers, left, _ = imported(ALPN, tmp_path)
    routes = {vs["name"]: (vs.get("sni"), vs.get("alpn")) for vs in servers}
    assert routes == {
        "web": (["www.example.com"], None),
        "certs": (None, ["acme-tls/1"]),
        "xmpp": (None, ["xmpp-client", "xmpp-server"]),
        "other": (None, None),
    }
    assert [line for line in left if line[0].isdigit()] == [
        "10: use_backend web2 if { req.ssl_alpn -i h2 } (req.ssl_alpn -i (lbproxy matches "
        "protocol names exactly, case and all))",
        "11: use_backend web2 if { req.ssl_alpn -m beg h } (req.ssl_alpn -m beg (lbproxy "
        "matches exact protocol names))",
        "12: use_backend web2 if { req.ssl_alpn h2 } { req.ssl_sni -i a.example.com } "
        "(a server-name condition other than a name list (negated, or AND-ed))",
        "16: backend web2: no frontend uses it",
    ]


def test_a_req_ssl_sni_rule_after_a_req_ssl_alpn_rule_is_left_out(tmp_path):
    """HAProxy tries the ALPN rule first for every name; lbproxy would try the name's
    own route first, so that route is not made (and said)."""
    servers, left, _ = imported(
        """
        frontend tls
            bind 127.0.0.1:8443
            use_backend certs if { req.ssl_alpn acme-tls/1 }
            use_backend web if { req.ssl_sni -i www.example.com }
            default_backend web
        backend web
            server w1 127.0.0.1:9451
        backend certs
            server c1 127.0.0.1:9461
        """,
        tmp_path,
    )
    routes = {vs["name"]: (vs.get("sni"), vs.get("alpn")) for vs in servers}
    assert routes == {"certs": (None, ["acme-tls/1"]), "web": (None, None)}
    assert [line for line in left if line[0].isdigit()] == [
        "5: use_backend web if { req.ssl_sni -i www.example.com } (after a req.ssl_alpn "
        "rule, which HAProxy tries first and lbproxy after a name's own routes)"
    ]


@pytest.mark.parametrize(
    "rules, keys",
    [
        (
            ["tcp-request connection reject if { src 10.0.0.0/8 192.168.1.1 }"],
            {"deny": ["10.0.0.0/8", "192.168.1.1"]},
        ),
        (
            [
                "acl trusted src 127.0.0.1 10.1.0.0/16",
                "tcp-request connection accept if trusted",
                "tcp-request connection reject",
            ],
            {"allow": ["127.0.0.1", "10.1.0.0/16"]},
        ),
        (
            ["tcp-request connection reject if !{ src 127.0.0.1 }"],
            {"allow": ["127.0.0.1"]},
        ),
        (
            [
                "acl bad src 127.0.0.2",
                "tcp-request connection reject if bad",
                "tcp-request connection accept if { src 127.0.0.0/8 }",
                "tcp-request connection reject",
            ],
            {"deny": ["127.0.0.2"], "allow": ["127.0.0.0/8"]},
        ),
        (
            ["tcp-request connection expect-proxy layer4 if { src 10.0.0.1 10.0.0.2 }"],
            {"accept_proxy": True, "accept_proxy_from": ["10.0.0.1", "10.0.0.2"]},
        ),
    ],
)
def test_tcp_request_connection_on_src_becomes_allow_and_deny(tmp_path, rules, keys):
    body = "\n".join(f"    {rule}" for rule in rules)
    vs = only(
        f"frontend f\n    bind 127.0.0.1:7001\n{body}\n    default_backend b\n"
        "backend b\n    server s1 127.0.0.1:9001\n",
        tmp_path,
    )
    assert {key: vs[key] for key in keys} == keys
    assert not {"allow", "deny", "accept_proxy"} - set(keys) & set(vs)


def test_a_rule_lbproxy_cannot_say_is_named(tmp_path):
    _, left, _ = imported(
        """
        frontend f
            bind 127.0.0.1:7001
            tcp-request connection accept if { src 10.0.0.0/8 }
            tcp-request connection reject if { src 10.1.0.0/16 }
            tcp-request connection track-sc0 src
            default_backend b
        backend b
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    numbered = [line for line in left if line[0].isdigit()]
    assert numbered == [
        "5: tcp-request connection reject if { src 10.1.0.0/16 } (a reject after an "
        "accept: lbproxy's deny wins over allow)",
        "6: tcp-request connection track-sc0 src",
    ]


def test_a_stick_table_on_src_becomes_persistence(tmp_path):
    vs = only(
        """
        listen a
            bind 127.0.0.1:7001
            stick-table type ip size 200k expire 30m
            stick on src
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    assert vs["persistence"] == {"timeout": "30m", "max_entries": 204800}


def test_global_settings_and_tcplog(tmp_path):
    _, left, document = imported(
        """
        global
            maxconn 20000
            user haproxy
            group haproxy
            daemon
        defaults
            mode tcp
            option tcplog
            retries 5
            option redispatch
        listen a
            bind 127.0.0.1:7001
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    assert document["global"] == {
        "max_clients": 20000,
        "user": "haproxy",
        "group": "haproxy",
        "access_log": True,
    }
    assert document["virtual_servers"][0]["retries"] == 5
    assert "6: daemon" in left


def test_other_sections_are_one_line_at_their_start(tmp_path):
    _, left, _ = imported(
        """
        peers mine
            peer a 127.0.0.1:1024
            peer b 127.0.0.1:1025
        resolvers dns
            nameserver a 127.0.0.1:53
        listen a
            bind 127.0.0.1:7001
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    numbered = [line for line in left if line[0].isdigit()]
    assert numbered == ["2: the peers section mine", "5: the resolvers section dns"]


# --- the command ----------------------------------------------------------------------


def test_the_command_prints_yaml_names_file_and_line_and_is_identical_twice(tmp_path):
    source = tmp_path / "haproxy.cfg"
    text = SNI + "listen web80\n    mode http\n    bind :80\n"
    source.write_text(text)
    web80 = text.splitlines().index("listen web80") + 1
    runner = CliRunner()
    first = runner.invoke(main, ["import", str(source)])
    second = runner.invoke(main, ["import", str(source)])
    assert first.exit_code == 0, first.output
    assert first.stdout == second.stdout
    assert first.stdout.startswith("# yaml-language-server: $schema=lbproxy.schema.json\n")
    assert f"{source}:{web80}: not translated: listen web80: mode http (lbproxy is Layer 4)" in (
        first.stderr.splitlines()
    )
    written = tmp_path / "lbproxy.yaml"
    written.write_text(first.stdout)
    checked = runner.invoke(main, ["check", str(written)])
    assert checked.exit_code == 0, checked.output


def test_nothing_translated_exits_2(tmp_path):
    source = tmp_path / "haproxy.cfg"
    source.write_text("global\n    maxconn 10\nlisten web\n    mode http\n    bind :80\n")
    result = CliRunner().invoke(main, ["import", "--from", "haproxy", str(source)])
    assert result.exit_code == 2
    assert f"{source}: nothing could be translated" in result.stderr


def test_a_malformed_line_is_named_and_the_rest_translated(tmp_path):
    source = tmp_path / "haproxy.cfg"
    source.write_text(
        "listen a\n  bind 127.0.0.1:7001\n  server 's1 1\n  server s2 127.0.0.1:9002\n"
    )
    result = CliRunner().invoke(main, ["import", str(source)])
    assert result.exit_code == 0
    assert f"{source}:3: not translated: unmatched quote (')" in result.stderr
    assert "s2" in result.stdout


@pytest.mark.parametrize("path", sorted(DATA.glob("*.cfg")), ids=lambda p: p.name)
def test_the_real_world_configurations_import_and_pass_check(tmp_path, path):
    servers, _, _ = imported(path.read_text(), tmp_path)
    assert servers


# --- the guide's rows are what translate does --------------------------------------


def test_every_translated_row_names_a_key_the_importer_writes(tmp_path):
    """Each row with an lbproxy key: a configuration holding its directive gives that key."""
    for row in haproxy.DIRECTIVES:
        if not row.lbproxy:
            continue
        if row.directive == "mode tcp":
            # lbproxy's default: a virtual server without `protocol` is TCP
            _, _, document = imported(EXAMPLES["mode tcp"], tmp_path)
            assert document["virtual_servers"] and "protocol" not in document["virtual_servers"][0]
            continue
        (tmp_path / "sni.map").write_text("a.example.com b\n")  # the map an example reads
        assert row.directive in EXAMPLES, f"no example for the row {row.directive!r}"
        _, _, document = imported(EXAMPLES[row.directive], tmp_path)
        assert has_key(document, row.lbproxy), (row.directive, row.lbproxy, document)


def _listen(*lines: str, servers: str = "    server s1 127.0.0.1:9001 check") -> str:
    body = "\n".join(f"    {line}" for line in lines)
    return f"listen a\n    bind 127.0.0.1:7001\n{body}\n{servers}\n"


_FRONT = (
    "frontend f\n    bind 127.0.0.1:7001\n{}\n    default_backend b\n"
    "backend b\n    server s1 127.0.0.1:9001\n"
)
EXAMPLES = {
    "use_backend %[req.ssl_sni,lower,map(FILE,DEFAULT)]": _FRONT.format(
        "    use_backend %[req.ssl_sni,lower,map(sni.map,b)]"
    ),
    "listen NAME": _listen(),
    "defaults [NAME], from NAME": "defaults d\n    balance first\nlisten a from d\n"
    "    bind 127.0.0.1:7001\n    server s1 127.0.0.1:9001\n",
    "frontend NAME + default_backend B": _FRONT.format(""),
    "mode tcp": "defaults\n    mode tcp\n" + _listen(),
    "bind ADDR:PORT[,...] (several binds)": _listen("bind 127.0.0.1:7002"),
    "bind ... accept-proxy": "listen a\n  bind 127.0.0.1:7001 accept-proxy\n"
    "  server s1 127.0.0.1:9001\n",
    "tcp-request connection expect-proxy layer4 if { src ... }": _FRONT.format(
        "    tcp-request connection expect-proxy layer4 if { src 10.0.0.1 }"
    ),
    "balance roundrobin": _listen("balance roundrobin"),
    "balance static-rr": _listen("balance static-rr"),
    "balance leastconn": _listen("balance leastconn"),
    "balance first": _listen("balance first"),
    "balance source": _listen("balance source"),
    "hash-type consistent": _listen("balance source", "hash-type consistent"),
    "server NAME ADDR:PORT": _listen(),
    "server ... weight N": _listen(servers="    server s1 127.0.0.1:9001 weight 3"),
    "server ... maxconn N": _listen(servers="    server s1 127.0.0.1:9001 maxconn 3"),
    "server ... backup": _listen(servers="    server s1 127.0.0.1:9001 backup"),
    "option allbackups": _listen(
        "option allbackups",
        servers="    server s1 127.0.0.1:9001\n    server s2 127.0.0.1:9002 backup",
    ),
    "server ... disabled": _listen(servers="    server s1 127.0.0.1:9001 disabled"),
    "server ... check": _listen(),
    "server ... inter T": _listen(servers="    server s1 127.0.0.1:9001 check inter 1s"),
    "server ... rise N": _listen(servers="    server s1 127.0.0.1:9001 check rise 4"),
    "server ... fall N": _listen(servers="    server s1 127.0.0.1:9001 check fall 4"),
    "server ... port N": _listen(servers="    server s1 127.0.0.1:9001 check port 8"),
    "server ... on-marked-down shutdown-sessions": _listen(
        servers="    server s1 127.0.0.1:9001 check on-marked-down shutdown-sessions"
    ),
    "server ... on-marked-up shutdown-backup-sessions": _listen(
        servers="    server s1 127.0.0.1:9001 check on-marked-up shutdown-backup-sessions"
    ),
    "server ... addr A": _listen(servers="    server s1 127.0.0.1:9001 check addr ::1"),
    "server ... send-proxy, send-proxy-v2": _listen(
        servers="    server s1 127.0.0.1:9001 send-proxy"
    ),
    "server ... check-send-proxy": _listen(
        servers="    server s1 127.0.0.1:9001 check port 8080 check-send-proxy"
    ),
    "server ... slowstart T": _listen(servers="    server s1 127.0.0.1:9001 slowstart 5s"),
    "server ... agent-check agent-port agent-inter agent-addr agent-send": _listen(
        servers="    server s1 127.0.0.1:9001 agent-check agent-port 9777"
    ),
    "default-server ...": _listen("default-server weight 2"),
    "option tcp-check": _listen("option tcp-check"),
    "option pgsql-check user U": _listen("option pgsql-check user u"),
    "option mysql-check user U": _listen("option mysql-check user u"),
    "option redis-check": _listen("option redis-check"),
    "option smtpchk [EHLO name]": _listen("option smtpchk"),
    "option ssl-hello-chk": _listen("option ssl-hello-chk"),
    "option httpchk [METHOD] [URI] [VERSION\\r\\nHost:\\ NAME]": _listen("option httpchk GET /"),
    "http-check send meth M uri U hdr Host NAME": _listen(
        "option httpchk", "http-check send meth GET uri /ready hdr Host h.example"
    ),
    "http-check expect string|rstring S": _listen("option httpchk", "http-check expect string ok"),
    "http-check expect status N": _listen("option httpchk GET /", "http-check expect status 204"),
    "tcp-check send/expect sequence": _listen(
        "option tcp-check", "tcp-check send PING", "tcp-check expect string PONG"
    ),
    "tcp-check connect port N": _listen("option tcp-check", "tcp-check connect port 8"),
    "timeout connect": _listen("timeout connect 1s"),
    "timeout client, timeout server": _listen("timeout client 1m", "timeout server 1m"),
    "timeout tunnel": _listen("timeout tunnel 1h"),
    "timeout check": _listen("timeout check 1s"),
    "timeout queue": _listen("timeout queue 1s", servers="    server s1 127.0.0.1:9001 maxconn 3"),
    "maxconn (frontend, listen, defaults)": _listen("maxconn 100"),
    "maxconn (global)": "global\n    maxconn 100\n" + _listen(),
    "user, group (global)": "global\n    user nobody\n" + _listen(),
    "option abortonclose": _listen(
        "option abortonclose", servers="    server s1 127.0.0.1:9001 maxconn 3"
    ),
    "retries N, option redispatch": _listen("retries 1", "option redispatch"),
    "option tcplog": _listen("option tcplog"),
    "use_backend B if { req.ssl_sni -i NAME }": SNI,
    "use_backend B if { req.ssl_alpn PROTOCOL }": ALPN,
    "tcp-request inspect-delay, tcp-request content accept if { req.ssl_hello_type 1 }": SNI,
    "tcp-request connection reject if { src ... }": _FRONT.format(
        "    tcp-request connection reject if { src 10.0.0.1 }"
    ),
    "tcp-request connection accept if { src ... } + reject": _FRONT.format(
        "    tcp-request connection accept if { src 10.0.0.1 }\n    tcp-request connection reject"
    ),
    "stick-table type ip size N expire T + stick on src": _listen(
        "stick-table type ip size 1k expire 1m", "stick on src"
    ),
}


def test_older_and_rarer_forms(tmp_path):
    servers, left, _ = imported(
        """
        defaults checks
            mode tcp
            option tcp-check
            tcp-check send PING\\r\\n
            tcp-check expect string PONG
        listen old 127.0.0.1:7001
            server s1 127.0.0.1:9001 check
        listen own from checks
            bind 127.0.0.1:7002
            tcp-check send HELLO\\r\\n
            tcp-check expect string HI
            server s1 127.0.0.1:9001 check
        frontend f1
            bind 127.0.0.1:7003
            default_backend shared
        frontend f2
            bind 127.0.0.1:7004
            default_backend shared
        backend shared
            server s1 127.0.0.1
        listen unknown from nowhere
            bind localhost:7005
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    by_name = {vs["name"]: vs for vs in servers}
    # `listen NAME ADDR:PORT`, and the defaults' tcp-check sequence inherited
    assert by_name["old"]["listen"] == "127.0.0.1:7001"
    assert by_name["old"]["health_check"]["send"] == "PING\r\n"
    # a proxy's own sequence replaces the inherited one
    assert by_name["own"]["health_check"]["send"] == "HELLO\r\n"
    # one backend behind two frontends: two virtual servers; a server without a port
    # takes the frontend's
    assert by_name["shared"]["real_servers"][0]["address"] == "127.0.0.1:7003"
    assert by_name["shared-f2"]["real_servers"][0]["address"] == "127.0.0.1:7004"
    assert "22: from nowhere: no such defaults" in left
    assert "23: bind localhost:7005 (lbproxy listens on an IP address)" in left
    assert "22: listen unknown: no address lbproxy can listen on" in left


def test_a_default_backend_in_defaults_serves_every_frontend_below(tmp_path):
    servers, _, _ = imported(
        """
        defaults
            mode tcp
            default_backend pool
        frontend a
            bind 127.0.0.1:7001
        frontend b
            bind 127.0.0.1:7002
        backend pool
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    # one virtual server: the frontends share the backend's servers, as in HAProxy
    assert [(vs["name"], vs["listen"]) for vs in servers] == [
        ("pool", ["127.0.0.1:7001", "127.0.0.1:7002"])
    ]


def test_frontends_that_take_clients_alike_share_their_backends_virtual_server(tmp_path):
    servers, left, _ = imported(
        """
        defaults
            mode tcp
            timeout client 30s
        frontend ft_a
            bind 127.0.0.1:11001
            default_backend bk_shared
        frontend ft_b
            bind 127.0.0.1:11002
            default_backend bk_shared
        frontend ft_c
            bind 127.0.0.1:11003
            maxconn 50
            default_backend bk_shared
        backend bk_shared
            server s1 127.0.0.1:9201 maxconn 5
            server s2 127.0.0.1:9202 maxconn 5
        """,
        tmp_path,
    )
    assert [(vs["name"], vs["listen"], vs.get("max_connections")) for vs in servers] == [
        ("bk_shared", ["127.0.0.1:11001", "127.0.0.1:11002"], None),
        ("bk_shared-ft_c", "127.0.0.1:11003", 50),
    ]
    assert servers[0]["real_servers"][0]["max_connections"] == 5
    # ft_c's maxconn differs: its copy's servers take 5 more, and that is said
    assert (
        "15: backend bk_shared: 2 virtual servers, one for each way its frontends' addresses "
        "take clients (ft_a, ft_b on 127.0.0.1:11001, 127.0.0.1:11002; ft_c on "
        "127.0.0.1:11003): each has its own server limits (maxconn) and balancing state, "
        "which HAProxy shares"
    ) in left


def test_a_store_without_a_lookup_is_no_persistence(tmp_path):
    servers, left, _ = imported((DATA / "manual-stick-src.cfg").read_text(), tmp_path)
    assert "persistence" not in {vs["name"]: vs for vs in servers}["pop"]
    assert {vs["name"]: vs for vs in servers}["https"]["persistence"] == {
        "timeout": "30m",
        "max_entries": 204800,
    }
    assert any("stick match src table pop" in line for line in left)


def test_src_lists_are_read_from_the_configurations_folder(tmp_path):
    (tmp_path / "allowed.lst").write_text("# ours\n127.0.0.1\n  10.0.0.0/8  \n")
    vs = only(
        """
        frontend f
            bind 127.0.0.1:7001
            tcp-request connection accept if { src -f allowed.lst }
            tcp-request connection reject
            default_backend b
        backend b
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    assert vs["allow"] == ["127.0.0.1", "10.0.0.0/8"]
    (tmp_path / "allowed.lst").write_text("127.0.0.1\n10.0.0.0/8 # a comment\n")
    _, left, _ = imported(
        "frontend f\n  bind 127.0.0.1:7001\n"
        "  tcp-request connection reject if { src -f allowed.lst }\n"
        "  tcp-request connection reject if { src -f missing.lst }\n"
        "  default_backend b\nbackend b\n  server s1 127.0.0.1:9001\n",
        tmp_path,
    )
    assert (
        "3: tcp-request connection reject if { src -f allowed.lst } (allowed.lst:2: "
        "'10.0.0.0/8 # a comment' is not an address or a network)"
    ) in left
    assert (
        "4: tcp-request connection reject if { src -f missing.lst } "
        "(the list missing.lst cannot be read)"
    ) in left


def test_the_manuals_banner_check_with_a_comment(tmp_path):
    vs = only(
        r"""
        listen imap
            bind 127.0.0.1:7001
            option tcp-check
            tcp-check expect string *\ OK\ IMAP4\ ready comment IMAP\ protocol
            server i1 127.0.0.1:9001 check
        """,
        tmp_path,
    )
    check = vs["health_check"]
    assert check["type"] == "send_expect"
    assert re.search(check["expect"], "* OK IMAP4 ready")
    assert not re.search(check["expect"], "+ OK IMAP4 ready")


def test_the_manuals_sni_list_becomes_the_routes_names(tmp_path):
    (tmp_path / "allowed_sites").write_text((DATA / "allowed_sites").read_text())
    servers, left, _ = imported((DATA / "manual-sni.cfg").read_text(), tmp_path)
    assert [(vs["name"], vs.get("sni")) for vs in servers] == [
        ("bk_allow", ["www.example.com", "shop.example.com"]),
        ("bk_sorry_page", None),
    ]
    assert left == []


def test_several_backups_are_named_unless_allbackups(tmp_path):
    text = """
    listen a
        bind 127.0.0.1:7001
        {option}
        server s1 127.0.0.1:9001
        server b1 127.0.0.1:9002 backup
        server b2 127.0.0.1:9003 backup
    """
    _, left, _ = imported(text.format(option=""), tmp_path)
    assert [line for line in left if line[0].isdigit()] == [
        "7: server b2 backup (HAProxy uses only the first backup without option allbackups; "
        "lbproxy uses them all)"
    ]
    _, left, _ = imported(text.format(option="option allbackups"), tmp_path)
    assert left == []


def test_timeout_client_is_the_frontends_and_timeout_server_the_backends(tmp_path):
    vs = only(
        """
        defaults
            mode tcp
            timeout client 10s
            timeout server 10s
        frontend f
            bind 127.0.0.1:7001
            timeout client 3m
            default_backend b
        backend b
            timeout client 1h
            timeout server 20s
            server s1 127.0.0.1:9001
        """,
        tmp_path,
    )
    assert vs["idle_timeout"] == "3m"


def test_sni_routing_through_a_map_becomes_the_maps_routes(tmp_path):
    (tmp_path / "sni.map").write_text(
        "# server name -> backend\nA.example.com bk_a\nb.example.com bk_b\nc.example.com nope\n"
    )
    servers, left, _ = imported(
        """
        frontend ft_tls
            mode tcp
            bind 127.0.0.1:10443
            tcp-request inspect-delay 5s
            tcp-request content accept if { req_ssl_hello_type 1 }
            use_backend %[req.ssl_sni,lower,map(sni.map,bk_default)]
        backend bk_a
            server a1 127.0.0.1:8443
        backend bk_b
            server b1 127.0.0.1:9443
        backend bk_default
            server d1 127.0.0.1:7443
        """,
        tmp_path,
    )
    assert [(vs["name"], vs.get("sni")) for vs in servers] == [
        ("bk_a", ["a.example.com"]),
        ("bk_b", ["b.example.com"]),
        ("bk_default", None),
    ]
    assert left[: len(left) // 2] == ["sni.map:4: c.example.com nope (no backend nope)"]


@pytest.mark.parametrize("converter", ["map_beg", "map_reg"])
def test_a_map_lbproxy_cannot_match_is_named(tmp_path, converter):
    (tmp_path / "sni.map").write_text("a.example.com bk_a\n")
    _, left, _ = imported(
        f"frontend f\n bind 127.0.0.1:10443\n"
        f" use_backend %[req.ssl_sni,lower,{converter}(sni.map,bk_a)]\n"
        " default_backend bk_a\nbackend bk_a\n server a1 127.0.0.1:8443\n",
        tmp_path,
    )
    assert f"3: use_backend %[req.ssl_sni,lower,{converter}(sni.map,bk_a)] ({converter}: " in (
        "\n".join(left)
    )


# --- environment variables and .if blocks, as HAProxy 2.6 reads them ---------------


def run_import(text: str, tmp_path: Path, env: dict[str, str]) -> tuple[dict, list[str]]:
    """`lbproxy import` in the environment `env` (and no other variable): the document
    and its stderr lines without the file name."""
    source = tmp_path / "haproxy.cfg"
    source.write_text(textwrap.dedent(text).lstrip("\n"))
    names = ("LB_ADDR", "MODE", "PROD", "UNSET_ONE", "SRV", "STAGE", "A", "B", "C", "L", "E")
    environment: dict[str, str | None] = dict.fromkeys(names)
    environment.update(env)
    result = CliRunner().invoke(main, ["import", str(source)], env=environment)
    lines = [line.removeprefix(f"{source}:") for line in result.stderr.splitlines()]
    assert result.exit_code == 0, result.stderr
    return yaml.safe_load(result.stdout), lines


BACKEND = """
backend b
    server s 127.0.0.1:9001
"""


def listens(document: dict) -> list[str]:
    """Every address the virtual servers listen on (one is written without a list)."""
    found = []
    for vs in document["virtual_servers"]:
        found += [vs["listen"]] if isinstance(vs["listen"], str) else vs["listen"]
    return found


@pytest.mark.parametrize(
    "line, env, words",
    [
        ('x "${A}" "$A." "a${A}b"', {"A": "1"}, ["x", "1", "1.", "a1b"]),
        ("x '${A}' $A ${A}", {"A": "1"}, ["x", "${A}", "$A", "${A}"]),  # quoted '' or not
        ('x "${A-dflt}" "${U-dflt}" "${E-dflt}"', {"A": "1", "E": ""}, ["x", "1", "dflt", ""]),
        ('x "${L[*]}" y', {"L": "a  b c"}, ["x", "a", "b", "c", "y"]),
        ('x "${L}"', {"L": "a b"}, ["x", "a b"]),
        ('x "\\$A" \\$A', {"A": "1"}, ["x", "$A", "\\$A"]),
        ('x "${U}" "a$U"', {}, ["x", "", "a"]),
    ],
)
def test_variables_expand_within_double_quotes_only(line, env, words):
    assert split_words(line, env.get) == (words, None)


@pytest.mark.parametrize("line", ['x "${A:-d}"', 'x "$1"', 'x "${A"', 'x "${A[x]}"'])
def test_a_variable_haproxy_refuses_is_a_problem(line):
    assert split_words(line, {"A": "1"}.get)[1]


def test_an_unquoted_variable_in_an_address_is_expanded_as_haproxy_does(tmp_path):
    document, lines = run_import(
        """
        defaults
            mode tcp
        frontend f
            bind ${LB_ADDR}:15433
            bind "$LB_ADDR:15434",'${LB_ADDR}:15435'
            bind "${STAGE-127.0.0.3}:15436"
            default_backend b
        backend b
            server s $SRV:9001
        """,
        tmp_path,
        {"LB_ADDR": "127.0.0.2", "SRV": "127.0.0.9"},
    )
    assert listens(document) == [
        "127.0.0.2:15433",
        "127.0.0.2:15434",
        "127.0.0.2:15435",
        "127.0.0.3:15436",
    ]
    assert document["virtual_servers"][0]["real_servers"][0]["address"] == "127.0.0.9:9001"
    assert lines == []


def test_a_variable_not_set_is_empty_with_one_line(tmp_path):
    document, lines = run_import(
        """
        defaults
            mode tcp
        frontend f
            bind "${LB_ADDR}:15433"
            bind ${UNSET_ONE}:15434
            default_backend b
        """
        + BACKEND,
        tmp_path,
        {},
    )
    assert listens(document) == ["0.0.0.0:15433", "0.0.0.0:15434"]
    assert lines == [
        "4: environment variable LB_ADDR is not set: empty here",
        "5: environment variable UNSET_ONE is not set: empty here",
    ]


def test_global_setenv_changes_the_lines_below(tmp_path):
    document, lines = run_import(
        """
        global
            setenv LB_ADDR 127.0.0.4
            presetenv STAGE 127.0.0.5
        defaults
            mode tcp
        frontend f
            bind "${LB_ADDR}:1"
            bind "${STAGE}:2"
            default_backend b
        """
        + BACKEND,
        tmp_path,
        {"LB_ADDR": "127.0.0.2", "STAGE": "127.0.0.6"},
    )
    assert listens(document) == ["127.0.0.4:1", "127.0.0.6:2"]
    assert lines == []


CONDITIONAL = """
defaults
    mode tcp
.if defined(PROD)
frontend prod
    bind 127.0.0.1:15001
    default_backend b
.elif streq("$MODE",staging) || strneq("${MODE-x}",x) && 0
frontend staging
    bind 127.0.0.1:15002
    default_backend b
.elif !(0x0 || defined(MODE))
frontend dev
    bind 127.0.0.1:15003
    .if streq("${A}",1)
    bind 127.0.0.1:15004
    .else
    bind 127.0.0.1:15005
    .endif
    default_backend b
.else
frontend other
    bind 127.0.0.1:15006
    default_backend b
.endif
"""


@pytest.mark.parametrize(
    "env, ports, said",
    [
        (
            {"PROD": ""},
            ["15001"],
            [
                '7: .elif streq("$MODE",staging) || strneq("${MODE-x}",x) && 0 is not '
                "taken here (line 3 is): lines 8-10 left out",
                "11: .elif !(0x0 || defined(MODE)) is not taken here (line 3 is): "
                "lines 12-19 left out",
                "20: .else is not taken here (line 3 is): lines 21-23 left out",
            ],
        ),
        (
            {"MODE": "staging"},
            ["15002"],
            [
                "3: .if defined(PROD) is false here: lines 4-6 left out",
                "11: .elif !(0x0 || defined(MODE)) is not taken here (line 7 is): "
                "lines 12-19 left out",
                "20: .else is not taken here (line 7 is): lines 21-23 left out",
            ],
        ),
        (
            {"A": "1"},
            ["15003", "15004"],
            [
                "3: .if defined(PROD) is false here: lines 4-6 left out",
                "7: environment variable MODE is not set: empty here",
                '7: .elif streq("$MODE",staging) || strneq("${MODE-x}",x) && 0 is false '
                "here: lines 8-10 left out",
                "16: .else is not taken here (line 14 is): line 17 left out",
                "20: .else is not taken here (line 11 is): lines 21-23 left out",
            ],
        ),
        (
            {"MODE": "prod"},
            ["15006"],
            [
                "3: .if defined(PROD) is false here: lines 4-6 left out",
                '7: .elif streq("$MODE",staging) || strneq("${MODE-x}",x) && 0 is false '
                "here: lines 8-10 left out",
                "11: .elif !(0x0 || defined(MODE)) is false here: lines 12-19 left out",
            ],
        ),
    ],
)
def test_if_elif_else_keep_the_lines_haproxy_keeps(tmp_path, env, ports, said):
    document, lines = run_import(CONDITIONAL + BACKEND, tmp_path, env)
    assert [a.rsplit(":", 1)[1] for a in listens(document)] == ports
    assert lines == said


def test_a_condition_only_haproxy_can_tell_leaves_its_block_out_named(tmp_path):
    document, lines = run_import(
        """
        defaults
            mode tcp
        frontend f
            bind 127.0.0.1:15001
        .if feature(OPENSSL) && defined(PROD)
            bind 127.0.0.1:15002
        .elif version_atleast(2.4)
            bind 127.0.0.1:15003
        .else
            bind 127.0.0.1:15004
        .endif
        .if 0 && version_before(3.0)
            bind 127.0.0.1:15005
        .endif
        .if 1 || feature(LUA)
            bind 127.0.0.1:15006
        .endif
            default_backend b
        """
        + BACKEND,
        tmp_path,
        {"PROD": "1"},
    )
    assert listens(document) == ["127.0.0.1:15001", "127.0.0.1:15006"]
    assert lines == [
        "5: not translated: .if feature(OPENSSL) && defined(PROD): only HAProxy itself can "
        "tell feature(OPENSSL) (lbproxy is not HAProxy): line 6 left out",
        "7: not translated: .elif version_atleast(2.4): only HAProxy itself can tell "
        "version_atleast(2.4) (lbproxy is not HAProxy): line 8 left out",
        "9: not translated: .else: taken only if the branches above it are not, which "
        "lbproxy cannot tell: line 10 left out",
        "12: .if 0 && version_before(3.0) is false here: line 13 left out",
    ]


def test_a_condition_haproxy_refuses_leaves_its_block_out_named(tmp_path):
    document, lines = run_import(
        """
        defaults
            mode tcp
        frontend f
            bind 127.0.0.1:15001
        .if yes
            bind 127.0.0.1:15002
        .endif
        .if streq(a)
            bind 127.0.0.1:15003
        .endif
            default_backend b
        """
        + BACKEND,
        tmp_path,
        {},
    )
    assert listens(document) == ["127.0.0.1:15001"]
    assert lines[0] == (
        "5: not translated: .if yes: HAProxy refuses it (unparsable conditional expression "
        "'yes'): line 6 left out"
    )
    assert lines[1].startswith("8: not translated: .if streq(a): HAProxy refuses it (missing")
    assert lines[1].endswith(": line 9 left out")


def test_a_block_left_out_takes_its_sections_header_with_it(tmp_path):
    """A `frontend` line left out: the lines after the block belong to the section
    above it again, as in HAProxy."""
    document, lines = run_import(
        """
        defaults
            mode tcp
        listen kept
            bind 127.0.0.1:15001
        .if 0
        listen gone
            bind 127.0.0.1:15002
        .endif
            server s 127.0.0.1:9001
        """,
        tmp_path,
        {},
    )
    assert [(vs["name"], vs["listen"]) for vs in document["virtual_servers"]] == [
        ("kept", "127.0.0.1:15001")
    ]
    assert lines == ["5: .if 0 is false here: lines 6-7 left out"]


def test_messages_and_misplaced_directives_are_named(tmp_path):
    _, lines = run_import(
        """
        defaults
            mode tcp
        .notice "hello"
        .if 0
            .alert "never said"
        .else
            .warning "careful"
            .alert "stop"
        .endif
        .endif
        .if 1
        listen a
            bind 127.0.0.1:15001
            server s 127.0.0.1:9001
        """,
        tmp_path,
        {},
    )
    assert lines == [
        "3: not translated: .notice hello (HAProxy's notice when it starts)",
        "4: .if 0 is false here: line 5 left out",
        "7: not translated: .warning careful (HAProxy's warning when it starts (in "
        "strict-mode it refuses to start))",
        "8: not translated: .alert stop (HAProxy refuses to start here)",
        "10: not translated: .endif without an .if above it: HAProxy refuses the file",
        "11: not translated: this .if has no .endif: HAProxy refuses the file",
    ]


@pytest.mark.parametrize(
    "condition, value",
    [
        ("", False),
        ("0", False),
        ("1", True),
        ("-1", True),
        ("0x10", True),
        ("00", False),
        ("!0", True),
        ("! ! 1", True),
        ("1 && 0 || 1", True),
        ("0 || 1 && 0", False),
        ("(0 || 1) && 0", False),
        ("!(1 && 0)", True),
        ("defined(A)", True),
        ("defined(B)", False),
        ("defined()", False),
        ("streq(x,x)", True),
        ("streq('a b',\"a b\")", True),
        ("streq(\"a,b\",'a,b')", True),
        ("streq(a\\ b,'a b')", True),
        ("strneq(x,y)", True),
        ("streq(,)", True),
        ("defined", False),  # one empty argument, as without parentheses HAProxy reads
    ],
)
def test_conditions_evaluate_as_haproxys(condition, value):
    from lbproxy.tools.importer.haproxy_conditions import evaluate

    assert evaluate(condition, {"A": ""}) is value


@pytest.mark.parametrize(
    "condition",
    [
        "yes",
        "1 &&",
        "(1",
        "defined (A)",
        "streq(a)",
        "streq(a,b,c)",
        "streq(a\\,b,a)",  # a lone backslash: the comma still ends the argument
        "1 1",
        "08",
        "feature(X",
    ],
)
def test_conditions_haproxy_refuses_are_malformed(condition):
    from lbproxy.tools.importer.haproxy_conditions import Malformed, evaluate

    assert isinstance(evaluate(condition, {}), Malformed)
