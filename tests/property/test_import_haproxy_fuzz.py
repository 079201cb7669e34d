"""The HAProxy reader and translator on any text: a Translation (whose YAML, when
anything was translated, `lbproxy check` accepts) or lines naming what was left
behind, never a traceback."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lbproxy.config.reader import load
from lbproxy.tools.importer.haproxy import translate_text
from lbproxy.tools.importer.haproxy_grammar import Statement, split_words
from lbproxy.tools.importer.translation import to_yaml

KEYWORDS = [
    "global", "defaults", "defaults d", "frontend f", "backend b", "listen l", "listen l from d",
    "peers p", "mode tcp", "mode http", "bind :7001", "bind 127.0.0.1:7002,:7003 accept-proxy",
    "bind [::1]:7004", "bind 127.0.0.1:1-3", "bind unix@/x", "balance roundrobin",
    "balance leastconn", "balance source", "balance first", "balance uri", "hash-type consistent",
    "server s1 127.0.0.1:9001 check", "server s2 127.0.0.1 weight 300 maxconn 0",
    "server s:3 [::1]:9003 backup disabled send-proxy slowstart 0",
    "server s4 10.0.0.1:99999 agent-check agent-port 1 agent-inter x", "server",
    "default-server inter 1s rise 0 fall 2", "default-server check", "option tcp-check",
    "option pgsql-check user u", "option httpchk", "option smtpchk EHLO", "tcp-check send x",
    "tcp-check expect string y", "tcp-check connect port 70000", "tcp-check send-binary 0000",
    "timeout connect 5s", "timeout client 0", "timeout server 99999999999d", "timeout tunnel x",
    "timeout check 1us", "acl a src 10.0.0.0/8", "acl a src nonsense", "acl n req.ssl_sni -i x.y",
    "tcp-request connection reject if a", "tcp-request connection reject if !a",
    "tcp-request connection accept if { src 1.2.3.4 }", "tcp-request connection reject",
    "tcp-request connection expect-proxy layer4 if a", "tcp-request content accept if {",
    "use_backend b if n", "use_backend b if { req.ssl_sni a.b } || n", "use_backend nowhere",
    "use_backend b if !", "default_backend b", "default_backend", "stick-table type ip size 1k",
    "stick on src", "stick-table type string", "maxconn 10", "maxconn x", "retries 9",
    "option tcplog", "option redispatch", "no option redispatch", "user 0", "disabled",
]  # fmt: skip

HEADERS = [
    k
    for k in KEYWORDS
    if k.split()[0] in ("global", "defaults", "frontend", "backend", "listen", "peers")
]
pieces = st.sampled_from(KEYWORDS) | st.text(max_size=40)
sections = st.tuples(
    st.sampled_from(HEADERS),
    st.just(["bind 127.0.0.1:7001", "server s0 127.0.0.1:9000"]) | st.just([]),
    st.lists(st.tuples(st.sampled_from(["", "  ", "\t"]), pieces), max_size=12),
)
configurations = st.lists(sections, max_size=5)


def as_text(config) -> str:
    out = []
    for header, base, body in config:
        out.append(header)
        out.extend(f"    {line}" for line in base)
        out.extend(indent + line for indent, line in body)
    return "\n".join(out)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configurations)
def test_any_configuration_translates_or_names_what_it_left(config):
    text = as_text(config)
    translation = translate_text(text, "fuzz.cfg")
    for left in translation.untranslated:
        assert str(left).startswith("fuzz.cfg:")
    assert bool(translation.translated) == bool(translation.virtual_servers)
    if translation.virtual_servers:
        document = to_yaml(translation)
        assert document == to_yaml(translate_text(text, "fuzz.cfg"))
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "imported.yaml"
            path.write_text(document)
            try:
                load([path])
            except Exception as e:  # only a configuration error naming its lines may do
                assert type(e).__name__ == "ConfigError", e
                raise AssertionError(f"{e}\n---\n{text}\n---\n{document}") from e


@given(st.text(max_size=200))
def test_any_line_splits_into_words_or_says_why_not(line):
    words, error = split_words(line)
    assert isinstance(words, list)
    assert error is None or isinstance(error, str)


printable_words = st.lists(
    st.text(st.characters(codec="ascii", exclude_categories=("Cc",)) | st.sampled_from("\r\n\t")),
    min_size=1,
    max_size=6,
)


@given(printable_words)
def test_a_statement_written_back_reads_as_the_same_words(words):
    """What the not-translated lines show of a directive is HAProxy syntax for it."""
    shown = Statement("f", 1, tuple(words)).text
    assert split_words(shown) == (words, None)
