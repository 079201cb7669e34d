"""Fuzz `lbproxy import --from nginx` (lbproxy/tools/importer/nginx_reader.py and
nginx.py) with any text and with nginx-like text: the reader returns directives or
raises NginxSyntaxError (FILE:LINE: message), never anything else; the translator
returns a Translation whose YAML `lbproxy check` accepts, or nothing translated with
the reason as its line. And allow/deny rewritten for lbproxy decide every address as
nginx's first matching rule does."""

from __future__ import annotations

import ipaddress
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lbproxy.config.model import ConfigError
from lbproxy.config.reader import load
from lbproxy.tools.importer.nginx import _access_lists, translate
from lbproxy.tools.importer.nginx_reader import NginxSyntaxError, read
from lbproxy.tools.importer.translation import to_yaml

WORDS = [
    "stream", "server", "upstream", "u", "listen", "proxy_pass", "map", "hostnames",
    "default", "least_conn", "hash", "$remote_addr", "consistent", "weight=2", "weight=x",
    "max_fails=0", "max_fails=2", "fail_timeout=5s", "fail_timeout=0", "backup", "down",
    "max_conns=3", "127.0.0.1:9001", "127.0.0.1:9002", "[::1]:9003", "unix:/x",
    "127.0.0.1:7000", "127.0.0.1:7001", "7002", "udp", "proxy_protocol", "ssl",
    "proxy_timeout", "proxy_connect_timeout", "1s", "0", "1m30s", "10x", "proxy_responses",
    "ssl_preread", "on", "off", "$ssl_preread_server_name", "$route", "a.example.com",
    "*.example.com", ".example.org", "~^x", "allow", "deny", "all", "10.0.0.0/8",
    "127.0.0.2", "limit_conn_zone", "$binary_remote_addr", "zone=z:1m", "limit_conn",
    "z", "1", "set_real_ip_from", "include", "http", "events", "worker_processes", "auto",
    "proxy_next_upstream_tries", "proxy_protocol", "{", "}", ";", ";", ";", "#", '"',
    "'", "\\", "${v}", "\n",
]  # fmt: skip

nginx_like = st.lists(st.sampled_from(WORDS) | st.text(max_size=6), max_size=80).map(" ".join)


def _pick(draw, words: list[str], most: int) -> str:
    return " ".join(draw(st.lists(st.sampled_from(words), max_size=most)))


@st.composite
def stream_configs(draw) -> str:
    """stream { } with upstreams, a map and servers made of the words §25 names, in any
    combination (many of them wrong: nginx would refuse some)."""
    address = ["127.0.0.1:9001", "127.0.0.1:9002", "[::1]:9003", "unix:/x", "h.test:1", "h"]
    server_params = ["weight=2", "weight=0", "weight=x", "max_fails=0", "max_fails=2",
                     "fail_timeout=5s", "fail_timeout=0", "backup", "down", "max_conns=3",
                     "slow_start=1s"]  # fmt: skip
    methods = ["", "least_conn;", "hash $remote_addr consistent;", "hash $x;", "random;",
               "hash;", "zone z 64k;"]  # fmt: skip
    lines = [
        f"upstream {name} {{ {draw(st.sampled_from(methods))} "
        + " ".join(
            f"server {draw(st.sampled_from(address))} {_pick(draw, server_params, 3)};"
            for _ in range(draw(st.integers(0, 3)))
        )
        + " }"
        for name in draw(st.lists(st.sampled_from(["u", "v", "w-x"]), max_size=3))
    ]
    entries = ["a.example.com u;", "*.example.com v;", ".example.org u;", "~^x u;",
               "default u;", "default 127.0.0.1:9009;", "hostnames;", '"" v;',
               "b.test unix:/y;"]  # fmt: skip
    if draw(st.booleans()):
        lines.append(f"map $ssl_preread_server_name $route {{ {_pick(draw, entries, 5)} }}")
    if draw(st.booleans()):
        lines.append("limit_conn_zone $binary_remote_addr zone=z:1m;")
    listens = ["127.0.0.1:7000", "127.0.0.1:7001", "7000", "[::1]:7002", "*:7003", "h:1",
               "unix:/z"]  # fmt: skip
    listen_params = ["udp", "proxy_protocol", "ssl", "reuseport"]
    settings_lines = ["proxy_timeout 1s;", "proxy_timeout 0;", "proxy_connect_timeout 2m;",
                      "proxy_protocol on;", "proxy_responses 1;", "proxy_responses x;",
                      "ssl_preread on;", "allow 10.0.0.0/8;", "deny all;", "deny x;",
                      "limit_conn z 2;", "limit_conn q 1;", "set_real_ip_from 10.0.0.0/8;",
                      "proxy_next_upstream off;", "proxy_next_upstream_tries 2;"]  # fmt: skip
    targets = ["u", "v", "w-x", "$route", "$other", "127.0.0.1:9005", "unix:/s", "nowhere"]
    for _ in range(draw(st.integers(0, 3))):
        body = " ".join(
            f"listen {draw(st.sampled_from(listens))} {_pick(draw, listen_params, 2)};"
            for _ in range(draw(st.integers(0, 2)))
        )
        body += " " + " ".join(draw(st.lists(st.sampled_from(settings_lines), max_size=4)))
        if draw(st.booleans()):
            body += f" proxy_pass {draw(st.sampled_from(targets))};"
        lines.append(f"server {{ {body} }}")
    lines.extend(draw(st.lists(st.sampled_from(settings_lines), max_size=2)))
    return "stream {\n" + "\n".join(draw(st.permutations(lines))) + "\n}\n"


def _translate(text: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "nginx.conf"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            read(path)
        except NginxSyntaxError as e:
            assert str(e).startswith(f"{path}:{e.line}: ")
        translation = translate(path)
        if translation.translated == 0:
            return
        out = Path(folder) / "imported.yaml"
        out.write_text(to_yaml(translation))
        try:
            load([str(out)])
        except ConfigError as e:
            pytest.fail(f"{text!r} imported to a configuration check refuses:\n{e}")
        assert to_yaml(translate(path)) == to_yaml(translation)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=300))
def test_any_text_is_a_translation_or_a_clear_error(text):
    _translate(text)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nginx_like)
def test_nginx_like_text_is_a_translation_check_accepts_or_a_clear_error(text):
    _translate(text)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream_configs())
def test_stream_configurations_translate_to_what_check_accepts(text):
    _translate(text)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.sampled_from(
                ["10.0.0.0/8", "10.0.0.0/30", "10.0.0.1/32", "10.0.0.2/31", "10.1.0.0/16",
                 "127.0.0.0/8", "127.0.0.2/32", "0.0.0.0/0", "::/0", "2001:db8::/32"]
            ),
        ),
        max_size=6,
    ),
)  # fmt: skip
def test_allow_and_deny_decide_every_address_as_nginx(rules):
    nginx_rules = [(allow, [network]) for allow, network in rules]
    allow, deny = _access_lists(nginx_rules)
    allowed_networks = [ipaddress.ip_network(n) for n in (allow or ["0.0.0.0/0", "::/0"])]
    denied_networks = [ipaddress.ip_network(n) for n in deny]
    for text in ("10.0.0.0", "10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.1.2.3",
                 "127.0.0.1", "127.0.0.2", "192.0.2.1", "2001:db8::1", "::1"):  # fmt: skip
        address = ipaddress.ip_address(text)
        first = next(
            (allow for allow, network in rules if address in ipaddress.ip_network(network)),
            True,
        )
        lbproxy = any(address in n for n in allowed_networks) and not any(
            address in n for n in denied_networks
        )
        assert lbproxy == first, (rules, allow, deny, text)
