"""Configuration of ALPN routing on a shared address (`alpn` beside `sni`): what is read,
what `lbproxy check` shows, and every ambiguous setup reported as FILE:LINE."""

from __future__ import annotations

from pathlib import Path

from lbproxy.config.reader import load
from lbproxy.config.summary import summary
from tests.unit.config.support import problems, write

ACME = """\
virtual_servers:
  - name: certs
    listen: 127.0.0.1:8443
    sni: [example.com]
    alpn: [acme-tls/1]
    real_servers: [{name: a, address: 127.0.0.1:9001}]
  - name: web
    listen: 127.0.0.1:8443
    sni: [example.com]
    real_servers: [{name: b, address: 127.0.0.1:9002}]
  - name: xmpp
    listen: 127.0.0.1:8443
    alpn: xmpp-client
    real_servers: [{name: c, address: 127.0.0.1:9003}]
  - name: default
    listen: 127.0.0.1:8443
    real_servers: [{name: d, address: 127.0.0.1:9004}]
"""


def test_alpn_is_read_and_shown_by_check(tmp_path: Path) -> None:
    config = load([write(tmp_path, "acme.yaml", ACME)])
    certs, web, xmpp, default = config.virtual_servers
    assert certs.alpn == ("acme-tls/1",) and certs.sni == ("example.com",)
    assert web.alpn == () and xmpp.alpn == ("xmpp-client",) and default.alpn == ()
    text = summary(config)
    assert "  sni         example.com\n  alpn        acme-tls/1\n" in text
    assert "  alpn        xmpp-client\n" in text


def two(tmp_path: Path, first: str, second: str) -> str:
    """Two virtual servers on one address with these keys (lines split by "; ")."""

    def keys(text: str) -> str:
        return "".join(f"    {line}\n" for line in text.split("; "))

    return write(
        tmp_path,
        "two.yaml",
        "virtual_servers:\n"
        "  - name: one\n"
        "    listen: 127.0.0.1:8443\n"
        f"{keys(first)}"
        "    real_servers: [{name: a, address: 127.0.0.1:9001}]\n"
        "  - name: two\n"
        "    listen: 127.0.0.1:8443\n"
        f"{keys(second)}"
        "    real_servers: [{name: b, address: 127.0.0.1:9002}]\n",
    )


def test_the_same_name_with_overlapping_alpn_is_ambiguous(tmp_path: Path) -> None:
    path = two(
        tmp_path,
        "sni: [example.com]; alpn: [h2, acme-tls/1]",
        "sni: [example.com]; alpn: [http/1.1, acme-tls/1]",
    )
    assert problems([path]) == [
        f"{path}:10: sni name 'example.com' with alpn protocol 'acme-tls/1' on 127.0.0.1:8443 "
        "is routed to virtual server one already (at line 5)"
    ]


def test_the_same_name_with_disjoint_alpn_or_one_without_is_fine(tmp_path: Path) -> None:
    path = two(tmp_path, "sni: [example.com]; alpn: [h2]", "sni: [example.com]")
    assert len(load([path]).virtual_servers) == 2
    path = two(tmp_path, "sni: [example.com]; alpn: [h2]", "sni: [example.com]; alpn: [H2]")
    assert len(load([path]).virtual_servers) == 2  # case-sensitive: two protocols


def test_without_sni_alpn_shares_the_address_with_the_default(tmp_path: Path) -> None:
    path = two(tmp_path, "alpn: [xmpp-client]", "scheduler: rr")
    assert [vs.alpn for vs in load([path]).virtual_servers] == [("xmpp-client",), ()]
    path = two(tmp_path, "alpn: [xmpp-client, h2]", "alpn: [h2]")
    assert problems([path]) == [
        f"{path}:8: alpn protocol 'h2' without sni on 127.0.0.1:8443 is routed to virtual "
        "server one already (at line 4)"
    ]


def test_bad_alpn_lists(tmp_path: Path) -> None:
    for value, wanted in (
        ("[]", "alpn must name at least one protocol"),
        ("['']", "alpn must be protocol names like h2 or http/1.1"),
        (f"[{'x' * 256}]", "alpn must be protocol names like h2 or http/1.1"),
        ("[1]", "alpn must be protocol names like h2 or http/1.1"),
        ("['a b']", "alpn must be protocol names like h2 or http/1.1"),
    ):
        path = two(tmp_path, "sni: [example.com]", f"alpn: {value}")
        [problem] = problems([path])
        assert problem.startswith(f"{path}:8: {wanted}"), (value, problem)
    path = two(tmp_path, "sni: [example.com]", "alpn:;   - h2;   - h2")
    assert problems([path]) == [f"{path}:10: duplicate alpn protocol 'h2' (first at line 9)"]
    assert len(load([two(tmp_path, "scheduler: rr", f"alpn: [{'x' * 255}]")]).virtual_servers)


def test_alpn_on_udp_is_refused(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "udp.yaml",
        """\
        virtual_servers:
          - name: dns
            listen: 127.0.0.1:8053
            protocol: udp
            alpn: [h2]
            real_servers: [{name: a, address: 127.0.0.1:9001}]
        """,
    )
    [problem] = problems([path])
    assert problem.startswith(f"{path}:5:") and "alpn" in problem
