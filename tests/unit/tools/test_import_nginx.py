"""`lbproxy import` of nginx `stream` configurations (SPEC §25): the reader of nginx's
grammar, the translation of each directive, and the command as a user runs it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from lbproxy.cli import main
from lbproxy.config.reader import load
from lbproxy.tools.importer.nginx import DIRECTIVES
from lbproxy.tools.importer.nginx_reader import NginxSyntaxError, read
from tests.unit.config.support import schema_validator
from tests.unit.tools.support import has_key

DATA = Path(__file__).resolve().parents[2] / "data" / "import" / "nginx"


def write(folder: Path, text: str, name: str = "nginx.conf") -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def run_import(path: Path, *args: str):
    return CliRunner().invoke(main, ["import", str(path), *args])


def imported(tmp_path: Path, text: str) -> tuple[dict, list[str]]:
    """The configuration `lbproxy import` prints for this nginx text (which must pass
    `lbproxy check`'s reader and the JSON schema) and its stderr lines."""
    path = write(tmp_path, text)
    result = run_import(path, "--from", "nginx")
    assert result.exit_code == 0, result.output
    checked = tmp_path / "imported.yaml"
    checked.write_text(result.stdout)
    load([str(checked)])
    document = yaml.safe_load(result.stdout)
    errors = list(schema_validator().iter_errors(document))
    assert not errors, errors
    return document, result.stderr.splitlines()


def stream(body: str) -> str:
    return "stream {\n" + textwrap.indent(textwrap.dedent(body), "    ") + "}\n"


def only_vs(document: dict) -> dict:
    [vs] = document["virtual_servers"]
    return vs


# --- the grammar ----------------------------------------------------------------------


def test_blocks_directives_and_their_lines(tmp_path):
    path = write(
        tmp_path,
        """\
        worker_processes 2;
        stream {
            upstream b { server 127.0.0.1:1; }

            server {
                listen 80;
            }
        }
        """,
    )
    top = read(path)
    assert [(d.name, d.args, d.line) for d in top] == [
        ("worker_processes", ("2",), 1),
        ("stream", (), 2),
    ]
    streams = top[1].block
    assert streams is not None
    assert [(d.name, d.args, d.line) for d in streams] == [
        ("upstream", ("b",), 3),
        ("server", (), 5),
    ]
    assert streams[0].block[0].args == ("127.0.0.1:1",)
    assert streams[1].block[0].where == f"{path}:6"


def test_quotes_escapes_comments_and_variables(tmp_path):
    path = write(
        tmp_path,
        r"""
        a "two words" 'semi;colon' "q\"uote" 'it\'s' "tab\there" "back\\slash" "\d";
        b x#y "#z"; # a comment ; {
        c ${name}suffix {
        }
        d "multi
        line";
        e;
        """,
    )
    a, b, c, d, e = read(path)
    assert a.args == (
        "two words",
        "semi;colon",
        'q"uote',
        "it's",
        "tab\there",
        "back\\slash",
        "\\d",
    )
    assert b.args == ("x#y", "#z")
    assert (c.args, c.block) == (("${name}suffix",), ())
    assert d.args == ("multi\nline",)
    assert (e.name, e.line) == ("e", 8)


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("a;\n}\n", 2, 'unexpected "}"'),
        ("stream {\n  a;\n", 2, 'unexpected end of file, expecting "}"'),
        ("a b\n", 1, 'unexpected end of file, expecting ";" or "}"'),
        ("a;\n;\n", 2, 'unexpected ";"'),
        ('a "open;\n\n', 1, "unexpected end of file"),
        ('a "x"y;\n', 1, 'unexpected "y" after a quoted word'),
        ("stream { a }\n", 1, 'unexpected "}" after "a"'),
    ],
)
def test_what_nginx_refuses_is_a_file_line_error(tmp_path, text, line, message):
    path = write(tmp_path, text)
    with pytest.raises(NginxSyntaxError) as info:
        read(path)
    assert str(info.value).startswith(f"{path}:{line}: {message}")


def test_include_globs_from_the_main_file_s_folder_each_file_naming_itself(tmp_path):
    main_file = write(
        tmp_path,
        """\
        stream {
            include upstreams/*.conf;
            include servers.conf;
            include nothing/*.conf;
        }
        """,
        name="etc/nginx.conf",
    )
    write(tmp_path, "upstream b { server 127.0.0.1:2; }\n", "etc/upstreams/b.conf")
    write(tmp_path, "\nupstream a { server 127.0.0.1:1; }\n", "etc/upstreams/a.conf")
    write(tmp_path, "server {\n  listen 127.0.0.1:7000;\n  proxy_pass a;\n}\n", "etc/servers.conf")
    [stream_block] = read(main_file)
    assert stream_block.block is not None
    shown = [(d.name, d.args, Path(d.file).name, d.line) for d in stream_block.block]
    assert shown == [
        ("upstream", ("a",), "a.conf", 2),  # in name order
        ("upstream", ("b",), "b.conf", 1),
        ("server", (), "servers.conf", 1),
    ]
    # an untranslated directive of an included file is named with that file's line
    write(tmp_path, "server {\n  listen 127.0.0.1:7000;\n  tcp_nodelay on;\n  proxy_pass a;\n}\n",
          "etc/servers.conf")  # fmt: skip
    result = run_import(main_file)
    assert result.exit_code == 0, result.output
    assert f"{tmp_path}/etc/servers.conf:3: not translated: tcp_nodelay on" in result.stderr


def test_include_of_a_missing_file_or_a_loop_is_an_error_at_the_include(tmp_path):
    missing = write(tmp_path, "stream {\n    include nowhere.conf;\n}\n")
    with pytest.raises(NginxSyntaxError, match=r'nginx.conf:2: include "nowhere.conf": No such'):
        read(missing)
    loop = write(tmp_path, "include loop.conf;\n", "loop.conf")
    with pytest.raises(NginxSyntaxError, match=r"loop\.conf:1: includes nested deeper than 32"):
        read(loop)


# --- each directive -----------------------------------------------------------------


def test_the_documentation_examples_import_and_pass_check(tmp_path):
    for example in sorted(DATA.glob("*-example.conf")):
        result = run_import(example)  # the source is guessed from the content
        assert result.exit_code == 0, (example, result.output)
        checked = tmp_path / f"{example.stem}.yaml"
        checked.write_text(result.stdout)
        load([str(checked)])
        assert not list(schema_validator().iter_errors(yaml.safe_load(result.stdout)))


def test_upstream_methods_are_schedulers(tmp_path):
    def scheduler(upstream_body: str) -> tuple[dict, list[str]]:
        document, stderr = imported(
            tmp_path,
            stream(
                f"upstream u {{ {upstream_body} }}\n"
                "server { listen 127.0.0.1:7000; proxy_pass u; }\n"
            ),
        )
        vs = only_vs(document)
        return {k: vs[k] for k in ("scheduler", "hash_key") if k in vs}, stderr

    one_two = "server 127.0.0.1:1; server 127.0.0.1:2;"
    weighted = "server 127.0.0.1:1 weight=1; server 127.0.0.1:2 weight=3;"
    assert scheduler(one_two) == ({"scheduler": "rr"}, [])
    assert scheduler(weighted) == ({"scheduler": "wrr"}, [])
    assert scheduler("least_conn; " + one_two) == ({"scheduler": "lc"}, [])
    assert scheduler("least_conn; " + weighted) == ({"scheduler": "wlc"}, [])
    maglev = {"scheduler": "maglev", "hash_key": "source"}
    assert scheduler("hash $remote_addr consistent; " + one_two) == (maglev, [])
    assert scheduler("hash $binary_remote_addr; " + one_two) == (maglev, [])
    by_port = {"scheduler": "maglev", "hash_key": "source_port"}
    assert scheduler("hash $remote_addr$remote_port consistent; " + one_two) == (by_port, [])
    found, stderr = scheduler("hash $ssl_preread_server_name; " + one_two)
    assert found == {"scheduler": "rr"}
    assert stderr == [
        f"{tmp_path}/nginx.conf:2: not translated: hash $ssl_preread_server_name (lbproxy "
        "hashes the client address, or address and port)"
    ]
    # nginx's power of two choices is closer to least connections than to round robin
    found, stderr = scheduler("random two least_conn; " + one_two)
    assert found == {"scheduler": "lc"}
    assert stderr == [
        f"{tmp_path}/nginx.conf:2: not translated: random two least_conn (lbproxy's lc takes "
        "the least loaded of all the servers, nginx of two picked at random)"
    ]
    found, stderr = scheduler("random two; " + weighted)
    assert found == {"scheduler": "wlc"} and len(stderr) == 1
    found, stderr = scheduler("random; " + one_two)
    assert found == {"scheduler": "rr"} and "random (kept round robin)" in stderr[0]


def test_upstream_server_parameters(tmp_path):
    document, stderr = imported(
        tmp_path,
        stream(
            """\
            upstream u {
                server 127.0.0.1:9001 weight=5 max_conns=100 max_fails=3 fail_timeout=1m30s;
                server [::1]:9002 max_fails=3 fail_timeout=90s down;
                server localhost:9003 backup max_fails=3 fail_timeout=90s;
                server 127.0.0.1:9004 slow_start=30s max_fails=3 fail_timeout=90s;
                server unix:/run/x.sock;
                zone u 64k;
            }
            server { listen 127.0.0.1:7000; proxy_pass u; }
            """
        ),
    )
    vs = only_vs(document)
    assert vs["health_check"] == {"type": "none", "fall": 3, "interval": "90s"}
    assert vs["real_servers"] == [
        {"name": "127.0.0.1-9001", "address": "127.0.0.1:9001", "weight": 5,
         "max_connections": 100},
        {"name": "1-9002", "address": "[::1]:9002", "state": "disabled"},
        {"name": "localhost-9003", "address": "localhost:9003", "backup": True},
        {"name": "127.0.0.1-9004", "address": "127.0.0.1:9004"},
    ]  # fmt: skip
    assert vs["retries"] == 3  # nginx tries each server once
    conf = f"{tmp_path}/nginx.conf"
    assert stderr == [
        f"{conf}:6: not translated: server 127.0.0.1:9004 slow_start=30s",
        f"{conf}:7: not translated: server unix:/run/x.sock: a Unix socket",
        f"{conf}:8: not translated: zone u 64k",
    ]


def test_nginx_s_passive_health_defaults_are_written_out(tmp_path):
    document, _ = imported(
        tmp_path, stream("server { listen 127.0.0.1:7000; proxy_pass 127.0.0.1:9001; }\n")
    )
    vs = only_vs(document)
    assert vs["health_check"] == {"type": "none", "fall": 1, "interval": "10s"}
    assert (vs["connect_timeout"], vs["idle_timeout"], vs["retries"]) == ("60s", "10m", 0)
    assert vs["real_servers"] == [{"name": "127.0.0.1-9001", "address": "127.0.0.1:9001"}]


def test_server_settings_and_what_they_inherit_from_stream(tmp_path):
    document, stderr = imported(
        tmp_path,
        stream(
            """\
            proxy_connect_timeout 2s;
            proxy_timeout 500ms;
            proxy_protocol on;
            set_real_ip_from 10.0.0.0/8;
            limit_conn_zone $binary_remote_addr zone=per_ip:10m;
            limit_conn_zone $server_addr zone=per_address:10m;
            upstream u { server 127.0.0.1:9001; server 127.0.0.1:9002; }
            server {
                listen 127.0.0.1:7000 proxy_protocol;
                listen 127.0.0.1:7001 proxy_protocol reuseport;
                proxy_timeout 1h;
                limit_conn per_ip 20;
                limit_conn per_address 100;
                proxy_next_upstream_tries 1;
                proxy_pass u;
            }
            server {
                listen 127.0.0.1:7053 udp;
                proxy_responses 1;
                proxy_pass u;
            }
            """
        ),
    )
    tcp, udp = document["virtual_servers"]
    assert tcp == {
        "name": "u",
        "listen": ["127.0.0.1:7000", "127.0.0.1:7001"],
        "scheduler": "rr",
        "connect_timeout": "2s",
        "idle_timeout": "1h",
        "retries": 0,
        "accept_proxy": True,
        "accept_proxy_from": ["10.0.0.0/8"],
        "send_proxy": "v1",
        "per_source": {"max_connections": 20, "prefix_v6": 128},
        "health_check": {"type": "none", "fall": 1, "interval": "10s"},
        "real_servers": tcp["real_servers"],
    }
    assert udp["name"] == "u-udp" and udp["protocol"] == "udp"
    assert udp["udp"] == {"idle_timeout": "500ms", "responses": 1}
    assert "connect_timeout" not in udp and "retries" not in udp
    conf = f"{tmp_path}/nginx.conf"
    assert stderr == [
        f"{conf}:4: not translated: proxy_protocol on (lbproxy sends no PROXY header over UDP)",
        f"{conf}:7: not translated: limit_conn_zone $server_addr zone=per_address:10m (no "
        "translated limit_conn uses it)",
        f"{conf}:11: not translated: listen 127.0.0.1:7001 reuseport",
        f"{conf}:14: not translated: limit_conn per_address 100 (a zone keyed by "
        "$server_addr, not the client address)",
    ]


@pytest.mark.parametrize(
    ("rules", "allow", "deny"),
    [
        # nginx's documentation example
        (
            ["deny 192.168.1.1", "allow 192.168.1.0/24", "allow 10.1.1.0/16",
             "allow 2001:0db8::/32", "deny all"],
            ["192.168.1.0/24", "10.1.0.0/16", "2001:db8::/32"],
            ["192.168.1.1/32"],
        ),
        # an allow before a wider deny: the deny loses what the allow took
        (["allow 10.0.0.1", "deny 10.0.0.0/30"], None, ["10.0.0.2/31", "10.0.0.0/32"]),
        (["deny 127.0.0.2"], None, ["127.0.0.2/32"]),
        (["allow all", "deny 127.0.0.2"], None, []),
    ],
)  # fmt: skip
def test_allow_and_deny_in_nginx_s_order(tmp_path, rules, allow, deny):
    body = " ".join(f"{rule};" for rule in rules)
    document, _ = imported(
        tmp_path,
        stream(f"server {{ listen 127.0.0.1:7000; {body} proxy_pass 127.0.0.1:9001; }}\n"),
    )
    vs = only_vs(document)
    assert vs.get("allow") == allow
    assert vs.get("deny", []) == deny


def test_an_ssl_preread_map_is_sni_routes_on_one_address(tmp_path):
    document, stderr = imported(
        tmp_path,
        stream(
            """\
            map $ssl_preread_server_name $route {
                hostnames;
                api.example.com    api;
                .example.org       web;
                *.example.com      web;
                ~^db[0-9]+\\.      api;
                default            127.0.0.1:9009;
            }
            upstream api { server 127.0.0.1:9001; }
            upstream web { server 127.0.0.1:9002; }
            server {
                listen 127.0.0.1:8443;
                ssl_preread on;
                proxy_pass $route;
            }
            """
        ),
    )
    routes = [(vs["name"], vs["listen"], vs.get("sni")) for vs in document["virtual_servers"]]
    assert routes == [
        ("api", "127.0.0.1:8443", ["api.example.com"]),
        ("web", "127.0.0.1:8443", ["example.org", "*.example.org", "*.example.com"]),
        ("stream-8443", "127.0.0.1:8443", None),
    ]
    conf = f"{tmp_path}/nginx.conf"
    assert stderr == [
        # nginx's wildcards match any depth, lbproxy's one label: each is named
        f"{conf}:5: not translated: map entry .example.org web for names deeper than "
        "*.example.org (nginx's wildcard matches any depth, lbproxy's one label: "
        "a.b.example.org gets the map's default)",
        f"{conf}:6: not translated: map entry *.example.com web for names deeper than "
        "*.example.com (nginx's wildcard matches any depth, lbproxy's one label: "
        "a.b.example.com gets the map's default)",
        f"{conf}:7: not translated: map entry ~^db[0-9]+\\. (a regular expression)",
    ]


def test_an_alpn_map_is_alpn_routes_on_one_address(tmp_path):
    document, stderr = imported(
        tmp_path,
        stream(
            """\
            map $ssl_preread_alpn_protocols $route {
                acme-tls/1       acme;
                XMPP-client      127.0.0.1:9003;
                h2               web;
                "h2,http/1.1"    127.0.0.1:9003;
                ~^http           acme;
                default          web;
            }
            upstream acme { server 127.0.0.1:9001; }
            upstream web { server 127.0.0.1:9002; }
            server {
                listen 127.0.0.1:8443;
                ssl_preread on;
                proxy_pass $route;
            }
            """
        ),
    )
    routes = [
        (vs["name"], vs["listen"], vs.get("sni"), vs.get("alpn"), vs["real_servers"][0]["address"])
        for vs in document["virtual_servers"]
    ]
    assert routes == [
        ("acme", "127.0.0.1:8443", None, ["acme-tls/1"], "127.0.0.1:9001"),
        # nginx compares a map's keys lowercased; h2 goes to the default's upstream anyway
        ("stream-8443", "127.0.0.1:8443", None, ["xmpp-client"], "127.0.0.1:9003"),
        ("web", "127.0.0.1:8443", None, None, "127.0.0.1:9002"),
    ]
    conf = f"{tmp_path}/nginx.conf"
    assert stderr == [
        # said once for the map: the keys were translated, their meaning widened
        f"{conf}:2: map $ssl_preread_alpn_protocols $route: lbproxy's alpn routes a client "
        "offering the protocol among others, nginx's key only a client offering that one "
        "alone (a client offering acme-tls/1,h2 gets the map's default in nginx)",
        f"{conf}:6: not translated: map entry h2,http/1.1 (a list of protocols: nginx "
        "matches a client offering exactly these, lbproxy routes by one protocol)",
        f"{conf}:7: not translated: map entry ~^http (a regular expression)",
    ]


def test_a_map_within_a_map_of_server_name_and_alpn_is_named(tmp_path):
    document, stderr = imported(
        tmp_path,
        stream(
            """\
            map $ssl_preread_alpn_protocols $by_alpn {
                acme-tls/1   127.0.0.1:9001;
                default      127.0.0.1:9002;
            }
            map $ssl_preread_server_name $route {
                example.com  $by_alpn;
                default      127.0.0.1:9003;
            }
            server { listen 127.0.0.1:8443; ssl_preread on; proxy_pass $route; }
            """
        ),
    )
    vs = only_vs(document)
    assert (vs.get("sni"), vs.get("alpn"), vs["real_servers"][0]["address"]) == (
        None,
        None,
        "127.0.0.1:9003",
    )
    conf = f"{tmp_path}/nginx.conf"
    assert stderr == [
        f"{conf}:2: not translated: map $ssl_preread_alpn_protocols $by_alpn {{ }} "
        "(used only within another map)",
        f"{conf}:7: not translated: map entry example.com $by_alpn: a map on "
        "$ssl_preread_alpn_protocols within a map (routing by both is not translated: give "
        "virtual servers both sni and alpn)",
    ]


def test_servers_proxying_to_one_upstream_alike_are_one_virtual_server(tmp_path):
    """nginx keeps one connection count (max_conns) and one balancing state per
    upstream, whichever server { } a client came through: so does one virtual server."""
    document, stderr = imported(
        tmp_path,
        stream(
            """\
            upstream u { server 127.0.0.1:9001 max_conns=1; server 127.0.0.1:9002; }
            server { listen 127.0.0.1:7001; listen 127.0.0.1:7002; proxy_pass u; }
            server { listen 127.0.0.1:7003; proxy_pass u; }
            server { listen 127.0.0.1:7003 udp; proxy_pass u; }
            server { listen 127.0.0.1:7004 udp; proxy_pass u; }
            server { listen 127.0.0.1:7005; proxy_pass 127.0.0.1:9003; }
            server { listen 127.0.0.1:7006; proxy_pass 127.0.0.1:9003; }
            """
        ),
    )
    vss = {vs["name"]: vs for vs in document["virtual_servers"]}
    assert list(vss) == ["u", "u-udp", "stream-7005", "stream-7006"]
    assert vss["u"]["listen"] == ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"]
    assert vss["u-udp"]["listen"] == ["127.0.0.1:7003", "127.0.0.1:7004"]
    # TCP and UDP are two virtual servers in lbproxy: max_conns counts them apart
    assert stderr == [
        f"{tmp_path}/nginx.conf:2: not translated: upstream u's max_conns over TCP and UDP "
        "together (virtual servers u and u-udp each count their own connections, one "
        "protocol each; nginx counts both against max_conns)"
    ]


def test_servers_proxying_to_one_upstream_differently_are_copies_named_once(tmp_path):
    document, stderr = imported(
        tmp_path,
        stream(
            """\
            upstream u {
                least_conn;
                server 127.0.0.1:9001 max_conns=5;
                server 127.0.0.1:9002;
            }
            server { listen 127.0.0.1:7001; proxy_pass u; proxy_next_upstream off; }
            server { listen 127.0.0.1:7002; proxy_pass u; }
            server { listen 127.0.0.1:7003; proxy_pass u; deny 10.0.0.0/8; }
            server { listen 127.0.0.1:7004; proxy_pass u; }
            """
        ),
    )
    routes = [(vs["name"], vs["listen"]) for vs in document["virtual_servers"]]
    assert routes == [
        ("u", "127.0.0.1:7001"),
        ("u-7002", ["127.0.0.1:7002", "127.0.0.1:7004"]),
        ("u-7003", "127.0.0.1:7003"),
    ]
    assert stderr == [
        f"{tmp_path}/nginx.conf:2: not translated: upstream u's shared state (the server "
        "{ } blocks proxying to it differ in their settings: virtual servers u, u-7002 and "
        "u-7003 each keep their own max_conns counts, least_conn counts and max_fails "
        "failures, where nginx keeps one for the upstream)"
    ]


def test_a_listen_port_range_is_one_address_per_port(tmp_path):
    document, stderr = imported(
        tmp_path,
        stream(
            """\
            server {
                listen 127.0.0.1:7001-7003;
                listen 7010-7011 udp;
                listen [::1]:7020-7021;
                proxy_pass 127.0.0.1:9001;
            }
            server { listen 127.0.0.1:8000-8064; proxy_pass 127.0.0.1:9002; }
            server { listen 127.0.0.1:8003-8001; proxy_pass 127.0.0.1:9002; }
            """
        ),
    )
    tcp, udp = document["virtual_servers"]
    assert tcp["listen"] == [
        "127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003", "[::1]:7020", "[::1]:7021"
    ]  # fmt: skip
    assert udp["listen"] == ["0.0.0.0:7010", "0.0.0.0:7011"]
    conf = f"{tmp_path}/nginx.conf"
    assert stderr == [
        f'{conf}:8: not translated: server {{ }} (listen 127.0.0.1:8000-8064: "127.0.0.1:'
        '8000-8064" is a range of 65 ports (lbproxy binds each port of a range as an '
        "address of its own: up to 64; list the ports in use instead))",
        f'{conf}:9: not translated: server {{ }} (listen 127.0.0.1:8003-8001: "127.0.0.1:'
        '8003-8001" is not a port range from 1 to 65535)',
    ]


def test_sni_names_routed_to_the_map_s_default_need_no_route_of_their_own(tmp_path):
    """A route to the default's upstream would be a second virtual server for it, with
    counts of its own; the default takes those names, unless another route's
    wildcard would catch them then."""
    document, stderr = imported(
        tmp_path,
        stream(
            """\
            map $ssl_preread_server_name $route {
                hostnames;
                a.example.com      main;
                *.b.example.com    main;
                x.c.example.com    main;
                *.c.example.com    other;
                default            main;
            }
            upstream main { server 127.0.0.1:9001; }
            upstream other { server 127.0.0.1:9002; }
            server { listen 127.0.0.1:8443; ssl_preread on; proxy_pass $route; }
            """
        ),
    )
    routes = [(vs["name"], vs.get("sni")) for vs in document["virtual_servers"]]
    assert routes == [
        ("main", ["x.c.example.com"]),
        ("other", ["*.c.example.com"]),
        ("main-8443", None),
    ]
    conf = f"{tmp_path}/nginx.conf"
    assert stderr == [
        f"{conf}:7: not translated: map entry *.c.example.com other for names deeper than "
        "*.c.example.com (nginx's wildcard matches any depth, lbproxy's one label: "
        "a.b.c.example.com gets the map's default)",
        f"{conf}:10: not translated: upstream main's shared state (the server {{ }} blocks "
        "and map routes proxying to it differ in their settings: virtual servers main and "
        "main-8443 each keep their own round-robin position and max_fails failures, where "
        "nginx keeps one for the upstream)",
    ]


def test_a_deny_outside_every_allowed_network_is_left_out(tmp_path):
    document, _ = imported(
        tmp_path,
        stream(
            "server { listen 127.0.0.1:7000; allow 127.0.0.1; deny 127.0.0.0/8; "
            "allow 10.0.0.0/8; deny all; proxy_pass 127.0.0.1:9001; }\n"
        ),
    )
    vs = only_vs(document)
    assert (vs["allow"], vs.get("deny")) == (["127.0.0.1/32", "10.0.0.0/8"], None)


def test_a_down_server_s_health_settings_are_not_named(tmp_path):
    document, stderr = imported(
        tmp_path,
        stream(
            """\
            upstream u {
                server 127.0.0.1:9001 max_fails=3 fail_timeout=30s;
                server 127.0.0.1:9002 down;
            }
            server { listen 127.0.0.1:7000; proxy_pass u; }
            """
        ),
    )
    assert only_vs(document)["health_check"] == {"type": "none", "fall": 3, "interval": "30s"}
    assert stderr == []


def test_outside_stream_each_block_and_directive_is_one_line(tmp_path):
    document, stderr = imported(
        tmp_path,
        """\
        user www-data;
        worker_processes auto;
        events { worker_connections 768; }
        http {
            server { listen 80; location / { root /srv; } }
        }
        """
        + stream(
            """\
            resolver 10.0.0.1;
            server { listen 127.0.0.1:7000; proxy_pass 127.0.0.1:9001; ssl_certificate x.pem; }
            upstream unused { server 127.0.0.1:1; }
            """
        ),
    )
    assert document["global"] == {"workers": "auto"}
    conf = f"{tmp_path}/nginx.conf"
    assert stderr == [
        f"{conf}:1: not translated: user www-data",
        f"{conf}:3: not translated: events {{ }} (only stream {{ }} is imported)",
        f"{conf}:4: not translated: http {{ }} (only stream {{ }} is imported)",
        f"{conf}:8: not translated: resolver 10.0.0.1",
        f"{conf}:9: not translated: ssl_certificate x.pem",
        f"{conf}:10: not translated: upstream unused {{ }} (no server proxies to unused)",
    ]


def test_a_server_that_cannot_be_carried_over_is_one_line(tmp_path):
    _document, stderr = imported(
        tmp_path,
        stream(
            """\
            server { listen 127.0.0.1:7000; proxy_pass 127.0.0.1:9001; }
            server { listen 127.0.0.1:7001 ssl; proxy_timeout 1s; proxy_pass 127.0.0.1:9001; }
            server { listen 127.0.0.1:7002; proxy_pass unix:/run/app.sock; }
            """
        ),
    )
    conf = f"{tmp_path}/nginx.conf"
    assert stderr == [
        f"{conf}:3: not translated: server {{ }} (listen 127.0.0.1:7001 ssl (lbproxy does "
        "not terminate TLS))",
        f"{conf}:4: not translated: server {{ }} (proxy_pass unix:/run/app.sock: a Unix socket)",
    ]


# --- the command ----------------------------------------------------------------------


def test_exit_2_when_nothing_could_be_translated(tmp_path):
    path = write(tmp_path, "events { }\nhttp { server { listen 80; } }\n")
    result = run_import(path)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.splitlines()[-1] == f"{path}: nothing could be translated"


def test_a_file_nginx_refuses_is_named_with_its_line_and_exits_2(tmp_path):
    path = write(tmp_path, "stream {\n    server { listen 1; }\n    }\n}\n")
    result = run_import(path, "--from", "nginx")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f'{path}:4: not translated: the configuration: unexpected "}}" (nginx would not '
        "start with it)",
        f"{path}: nothing could be translated",
    ]


def test_importing_twice_gives_identical_bytes(tmp_path):
    example = DATA / "ssl-preread-example.conf"
    first, second = run_import(example), run_import(example)
    assert first.exit_code == 0
    assert first.stdout_bytes == second.stdout_bytes
    assert first.stdout.startswith("# yaml-language-server: $schema=lbproxy.schema.json\n")


def test_every_row_of_the_migration_table_is_nginx_s():
    assert DIRECTIVES and all(row.source == "nginx" for row in DIRECTIVES)
    assert len({row.directive for row in DIRECTIVES}) == len(DIRECTIVES)


def test_every_translated_row_names_a_key_the_importer_writes(tmp_path):
    """Each row with an lbproxy key: a stream configuration holding its directive is
    translated whole (nothing named on stderr) and gives that key."""
    for row in DIRECTIVES:
        if not row.lbproxy:
            continue
        assert row.directive in EXAMPLES, f"no example for the row {row.directive!r}"
        document, stderr = imported(tmp_path, EXAMPLES[row.directive])
        left = [line for line in stderr if ": not translated: " in line]
        assert left == [], (row.directive, stderr)
        assert has_key(document, row.lbproxy), (row.directive, row.lbproxy, document)


def _server(*lines: str, listen: str = "127.0.0.1:7000", to: str = "127.0.0.1:9001") -> str:
    body = "".join(f" {line};" for line in lines)
    return f"server {{ listen {listen};{body} proxy_pass {to}; }}\n"


def _upstream(*lines: str) -> str:
    body = "".join(f" {line};" for line in lines)
    return stream(f"upstream u {{{body} }}\n" + _server(to="u"))


_SNI = stream(
    """\
    map $ssl_preread_server_name $name {
        a.example.com 127.0.0.1:9001;
        default 127.0.0.1:9002;
    }
    server { listen 127.0.0.1:7000; ssl_preread on; proxy_pass $name; }
    """
)
_ZONE = "limit_conn_zone $binary_remote_addr zone=addr:10m;\n"
EXAMPLES = {
    "stream { }": stream(_server()),
    "worker_processes": "worker_processes 2;\n" + stream(_server()),
    "server { } (in stream)": stream(_server()),
    "listen ADDRESS:PORT": stream(_server()),
    "listen ... udp": stream(_server(listen="127.0.0.1:7000 udp")),
    "listen ... proxy_protocol": stream(_server(listen="127.0.0.1:7000 proxy_protocol")),
    "set_real_ip_from": stream(
        _server("set_real_ip_from 10.0.0.0/8", listen="127.0.0.1:7000 proxy_protocol")
    ),
    "proxy_pass UPSTREAM": _upstream("server 127.0.0.1:9001"),
    "proxy_pass ADDRESS:PORT": stream(_server()),
    "proxy_pass $variable (a map on $ssl_preread_server_name)": _SNI,
    "proxy_pass $variable (a map on $ssl_preread_alpn_protocols)": stream(
        """\
        map $ssl_preread_alpn_protocols $name {
            acme-tls/1 127.0.0.1:9001;
            default 127.0.0.1:9002;
        }
        server { listen 127.0.0.1:7000; ssl_preread on; proxy_pass $name; }
        """
    ),
    "ssl_preread on": _SNI,
    "map": _SNI,
    "proxy_connect_timeout": stream(_server("proxy_connect_timeout 1s")),
    "proxy_timeout": stream(_server("proxy_timeout 1m")),
    "proxy_timeout (in a udp server)": stream(
        _server("proxy_timeout 1m", listen="127.0.0.1:7000 udp")
    ),
    "proxy_protocol on": stream(_server("proxy_protocol on")),
    "proxy_responses": stream(_server("proxy_responses 1", listen="127.0.0.1:7000 udp")),
    "proxy_next_upstream / proxy_next_upstream_tries": stream(
        "upstream u { server 127.0.0.1:9001; server 127.0.0.1:9002; }\n"
        + _server("proxy_next_upstream on", "proxy_next_upstream_tries 1", to="u")
    ),
    "allow / deny": stream(_server("allow 10.0.0.1", "deny 10.0.0.0/8")),
    "allow ... + deny all": stream(_server("allow 10.0.0.0/8", "deny all")),
    "limit_conn (a zone on $binary_remote_addr or $remote_addr)": stream(
        _ZONE + _server("limit_conn addr 1")
    ),
    "limit_conn (in a udp server)": stream(
        _ZONE + _server("limit_conn addr 1", listen="127.0.0.1:7000 udp")
    ),
    "limit_conn_zone": stream(_ZONE + _server("limit_conn addr 1")),
    "upstream { }": _upstream("server 127.0.0.1:9001"),
    "(round robin)": _upstream("server 127.0.0.1:9001", "server 127.0.0.1:9002"),
    "least_conn": _upstream("least_conn", "server 127.0.0.1:9001"),
    "hash $remote_addr [consistent]": _upstream(
        "hash $remote_addr consistent", "server 127.0.0.1:9001"
    ),
    "server ... weight=": _upstream("server 127.0.0.1:9001 weight=2"),
    "server ... max_conns=": _upstream("server 127.0.0.1:9001 max_conns=5"),
    "server ... max_fails= fail_timeout=": _upstream(
        "server 127.0.0.1:9001 max_fails=3 fail_timeout=5s"
    ),
    "server ... backup": _upstream("server 127.0.0.1:9001", "server 127.0.0.1:9002 backup"),
    "server ... down": _upstream("server 127.0.0.1:9001", "server 127.0.0.1:9002 down"),
}


def test_the_how_to_s_example_is_what_import_prints(tmp_path, monkeypatch):
    page = (Path(__file__).resolve().parents[3] / "docs" / "howto" / "import-nginx.md").read_text()
    nginx_text = page.split("```nginx\n", 1)[1].split("```", 1)[0]
    printed = page.split("```yaml\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    Path("nginx.conf").write_text(nginx_text)
    result = CliRunner().invoke(main, ["import", "nginx.conf"])
    assert result.exit_code == 0, result.output
    assert result.stdout == printed


def test_a_setting_no_translated_server_uses_is_named(tmp_path):
    _document, stderr = imported(
        tmp_path,
        stream(
            """\
            ssl_preread on;
            set_real_ip_from 10.0.0.0/8;
            server { listen 127.0.0.1:7000; proxy_pass 127.0.0.1:9001; }
            server { listen 127.0.0.1:7001 udp; proxy_connect_timeout 1s; proxy_pass u; }
            upstream u { server 127.0.0.1:9002; }
            """
        ),
    )
    conf = f"{tmp_path}/nginx.conf"
    assert stderr == [
        f"{conf}:2: not translated: ssl_preread on (nothing it applies to here)",
        f"{conf}:3: not translated: set_real_ip_from 10.0.0.0/8 (nothing it applies to here)",
        f"{conf}:5: not translated: proxy_connect_timeout 1s (nothing it applies to here)",
    ]
