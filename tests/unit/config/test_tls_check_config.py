"""The keys of TLS and HTTPS health checks (SPEC §22): read into the model, and each one
refused with its FILE:LINE where the check's type does not take it or its value is
wrong (config/tls_check_keys.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lbproxy.config.reader import load
from tests.unit.config.support import messages, write


def _file(folder, check: str) -> str:
    return write(
        folder,
        "lbproxy.yaml",
        f"""
        virtual_servers:
          - name: db
            listen: 127.0.0.1:5432
            health_check: {check}
            real_servers: [{{name: a, address: 127.0.0.1:5433}}]
        """,
    )


@pytest.fixture
def ca_file(tmp_path) -> str:
    # A real CA certificate (any PEM certificate does): the system bundle's first one.
    bundle = Path("/etc/ssl/certs/ca-certificates.crt").read_text()
    first = bundle[: bundle.index("-----END CERTIFICATE-----") + 25] + "\n"
    path = tmp_path / "ca.pem"
    path.write_text(first)
    return str(path)


def test_tls_and_https_checks_are_read(tmp_path, ca_file):
    check = (
        load(
            [
                _file(
                    tmp_path,
                    f"{{type: tls, sni: DB.Example., alpn: [h2, http/1.1], verify: {ca_file}}}",
                )
            ]
        )
        .virtual_servers[0]
        .health_check
    )
    assert (check.type, check.sni, check.alpn, check.verify) == (
        "tls",
        "db.example",
        ("h2", "http/1.1"),
        ca_file,
    )
    check = (
        load(
            [
                _file(
                    tmp_path,
                    "{type: http, tls: true, method: HEAD, host: 'db.example:8008', "
                    "path: /primary, verify: none}",
                )
            ]
        )
        .virtual_servers[0]
        .health_check
    )
    assert (check.tls, check.method, check.host, check.verify, check.expect_body) == (
        True,
        "HEAD",
        "db.example:8008",
        None,
        None,
    )
    default = load([_file(tmp_path, "{type: http}")]).virtual_servers[0].health_check
    assert (default.tls, default.method, default.host, default.alpn) == (False, "GET", None, ())


@pytest.mark.parametrize("kind", ["send_expect, expect: PONG", "redis", "smtp"])
def test_the_checks_of_implicit_tls_servers_take_tls_sni_and_verify(tmp_path, ca_file, kind):
    written = f"{{type: {kind}, tls: true, sni: cache.example, verify: {ca_file}}}"
    check = load([_file(tmp_path, written)]).virtual_servers[0].health_check
    assert (check.tls, check.sni, check.verify) == (True, "cache.example", ca_file)


NEEDS_TLS = "needs type: tls, or a check with tls: true"
FOR_HTTP = "is for http checks"
FOR_TLS_OVER = "is for http, send_expect, redis and smtp checks"
REFUSED = [
    ("{type: tcp, alpn: h2}", "health_check.alpn is for tls checks"),
    ("{type: http, tls: true, alpn: [h2]}", "health_check.alpn is for tls checks"),
    ("{type: http, sni: a.example}", f"health_check.sni {NEEDS_TLS}"),
    ("{type: redis, sni: a.example}", f"health_check.sni {NEEDS_TLS}"),
    ("{type: tcp, verify: none}", f"health_check.verify {NEEDS_TLS}"),
    ("{type: tls, tls: true}", f"health_check.tls {FOR_TLS_OVER} (a tls check is TLS already)"),
    ("{type: tcp, tls: true}", f"health_check.tls {FOR_TLS_OVER}"),
    (
        "{type: pgsql, tls: true}",
        "health_check.tls is not for pgsql checks: PostgreSQL starts TLS inside its protocol "
        f"(SSLRequest), which the check does not do (tls {FOR_TLS_OVER})",
    ),
    (
        "{type: mysql, tls: true}",
        "health_check.tls is not for mysql checks: MySQL starts TLS inside its handshake, "
        f"which the check does not do (tls {FOR_TLS_OVER})",
    ),
    ("{type: tls, method: GET}", f"health_check.method {FOR_HTTP}"),
    ("{type: send_expect, expect: x, host: a}", f"health_check.host {FOR_HTTP}"),
    ("{type: tcp, expect_body: x}", f"health_check.expect_body {FOR_HTTP}"),
    (
        "{type: http, method: HEAD, expect_body: x}",
        "health_check.expect_body: a HEAD answer has no body",
    ),
    (
        "{type: tls, sni: 10.0.0.1}",
        "health_check.sni: an IP address is not sent as a server name; leave "
        "health_check.sni out and the address is verified",
    ),
    (
        "{type: tls, sni: 'a b'}",
        "health_check.sni must be a server name like db.example.com, got 'a b'",
    ),
    ("{type: tls, alpn: []}", "health_check.alpn must name at least one protocol"),
    (
        "{type: tls, alpn: ['h 2']}",
        "health_check.alpn must be protocol names like h2 or http/1.1 (printable ASCII, at "
        "most 255 characters), got 'h 2'",
    ),
    (
        "{type: http, method: get}",
        "health_check.method must be an HTTP method like GET, HEAD or OPTIONS (upper case), "
        "got 'get'",
    ),
    (
        '{type: http, host: "a\\r\\nX: y"}',  # a header injected: refused
        "health_check.host must be a host name or IP with an optional :PORT (the Host "
        "header), got 'a\\r\\nX: y'",
    ),
    (
        "{type: tls, verify: [a]}",
        "health_check.verify must be none or the path of a CA file, got a list",
    ),
]


@pytest.mark.parametrize(("check", "message"), REFUSED)
def test_misplaced_or_wrong_keys_are_refused(tmp_path, check, message):
    assert messages([_file(tmp_path, check)]) == [message]


def test_a_ca_file_must_exist_and_hold_a_certificate(tmp_path):
    missing = tmp_path / "missing.pem"
    assert messages([_file(tmp_path, f"{{type: tls, verify: {missing}}}")]) == [
        f"health_check.verify: {missing} does not exist"
    ]
    empty = tmp_path / "empty.pem"
    empty.write_text("not a certificate\n")
    assert messages([_file(tmp_path, f"{{type: tls, verify: {empty}}}")]) == [
        f"health_check.verify: {empty} holds no PEM certificate"
    ]
    assert messages([_file(tmp_path, f"{{type: tls, verify: {tmp_path}}}")])[0].startswith(
        f"health_check.verify: cannot read {tmp_path}"
    )


def test_a_tls_check_is_for_tcp_virtual_servers(tmp_path):
    path = write(
        tmp_path,
        "udp.yaml",
        """
        virtual_servers:
          - name: dns
            listen: 127.0.0.1:5353
            protocol: udp
            health_check: {type: tls}
            real_servers: [{name: a, address: 127.0.0.1:53}]
        """,
    )
    assert messages([path]) == [
        "health_check type tls is for TCP; a UDP virtual server takes udp, dns or none "
        "(passive: ICMP port unreachable)"
    ]
