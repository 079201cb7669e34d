"""TLS and HTTPS health checks (SPEC §22) through a real `lbproxy run`, against real TLS
servers on loopback (Python's `ssl`) with certificates made by openssl.

What a user sees: the server's health in the admin API, the reason in the log line of
its change (`db/a is down (tls: certificate verify failed: self-signed certificate)`),
and the check results counted in /metrics.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.integration.databases import SmtpServer
from tests.integration.harness import (
    counted,
    free_port,
    get_json,
    run_cli,
    wait_for,
    wait_port,
)
from tests.integration.redis_server import REDIS_SERVER, requires_redis
from tests.integration.tls_servers import (
    Certificates,
    HttpsServer,
    PlainServer,
    TlsServer,
)
from tests.tools import requires

pytestmark = requires("openssl", package="openssl")

TIMING = "interval: 200ms, timeout: 2s, rise: 1, fall: 1"  # 2s: a loaded machine


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certificates:
    return Certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def servers():
    started = []

    def keep(server):
        started.append(server)
        return server

    yield keep
    for server in started:
        server.stop()


def _config(admin_port: int, groups) -> str:
    """Virtual servers, each (name, health_check flow mapping, [servers]), on free ports."""
    lines = [
        "global:",
        f"  admin: {{listen: 127.0.0.1:{admin_port}}}",
        "  drain_timeout: 2s",
        "virtual_servers:",
    ]
    for name, check, members in groups:
        lines += [
            f"  - name: {name}",
            f"    listen: 127.0.0.1:{free_port()}",
            f"    health_check: {{{check}, {TIMING}}}",
            "    real_servers:",
        ]
        lines += [f"      - {{name: {s.name}, address: 127.0.0.1:{s.port}}}" for s in members]
    return "\n".join(lines) + "\n"


def _health(admin_port: int) -> dict[tuple[str, str], str]:
    document = get_json(admin_port, "/api/v1/virtual-servers")
    return {
        (vs["name"], rs["name"]): rs["health"]
        for vs in document["virtual_servers"]
        for rs in vs["real_servers"]
    }


def _reason_down(proxy, vs: str, rs: str, after: int = 0) -> str:
    """The reason of the line `vs/rs is down (...)` in the log, once it is there."""
    pattern = re.compile(rf"{vs}/{rs} is down \((.*)\)\n")

    def found():
        return pattern.search(proxy.log()[after:])

    return wait_for(found, 15, f"{vs}/{rs} to go down", details=proxy.log)[1]


def _checked(admin_port: int, vs: str, rs: str, result: str) -> float:
    return counted(
        admin_port,
        "lbproxy_health_checks_total",
        virtual_server=vs,
        real_server=rs,
        result=result,
    )


def test_tls_checks_verify_alpn_and_servers_that_are_not_tls(certs, servers, lbproxy):
    good = certs.signed("db", "db.example", "127.0.0.1")
    other = certs.signed("other", "other.example")
    own = certs.self_signed("own", "db.example", "127.0.0.1")
    ca = certs.ca
    verified = servers(TlsServer("a", good, alpn=["h2", "http/1.1"]))
    by_address = servers(TlsServer("a", good))
    self_signed = servers(TlsServer("a", own))
    other_name = servers(TlsServer("a", other))
    h2 = servers(TlsServer("h2", good, alpn=["h2"]))
    no_alpn = servers(TlsServer("none", good))
    ssh = servers(PlainServer("ssh", b"SSH-2.0-OpenSSH_9.2p1\r\n"))
    silent = servers(PlainServer("silent", b""))
    garbage = servers(PlainServer("garbage", b"\x16\x03\x01\x00\x08\xff\x00garbage, not a hello"))
    mutual = servers(TlsServer("a", good, client_ca=ca))
    admin_port = free_port()
    proxy = lbproxy(
        _config(
            admin_port,
            [
                ("sni", f"type: tls, sni: db.example, verify: {ca}", [verified]),
                ("address", f"type: tls, verify: {ca}", [by_address]),
                ("selfsigned", f"type: tls, sni: db.example, verify: {ca}", [self_signed]),
                ("othername", f"type: tls, sni: db.example, verify: {ca}", [other_name]),
                ("alpn", "type: tls, alpn: [h2]", [h2, no_alpn]),
                ("nottls", "type: tls", [ssh, silent, garbage]),
                ("mtls", "type: tls", [mutual]),
            ],
        )
    )
    reasons = {
        ("selfsigned", "a"): "tls: certificate verify failed: self-signed certificate",
        ("othername", "a"): (
            "tls: certificate verify failed: Hostname mismatch, certificate is not valid for "
            "'db.example'"
        ),
        ("alpn", "none"): "tls: no ALPN protocol agreed (offered h2; the server chose none)",
        ("nottls", "ssh"): 'tls: not a TLS server (it sent "SSH-2.0-OpenSSH_9.2p1\\r\\n")',
        ("nottls", "silent"): "tls: no answer to the ClientHello within 2s",
        ("mtls", "a"): "tls: handshake failed: alert 'handshake failure' from the server",
    }
    for (vs, rs), reason in reasons.items():
        assert _reason_down(proxy, vs, rs) == reason
    assert _reason_down(proxy, "nottls", "garbage").startswith("tls: handshake failed: ")
    healthy = [("sni", "a"), ("address", "a"), ("alpn", "h2")]
    wait_for(
        lambda: all(_checked(admin_port, vs, rs, "ok") >= 3 for vs, rs in healthy),
        what="three good checks of each healthy server",
    )
    health = _health(admin_port)
    assert {key: health[key] for key in healthy} == dict.fromkeys(healthy, "up")
    assert {key: health[key] for key in reasons} == dict.fromkeys(reasons, "down")
    assert health[("nottls", "garbage")] == "down"
    assert _checked(admin_port, "nottls", "silent", "timeout") >= 1
    assert _checked(admin_port, "nottls", "ssh", "fail") >= 1
    for vs, rs in healthy:
        assert _checked(admin_port, vs, rs, "fail") == _checked(admin_port, vs, rs, "timeout") == 0
    assert set(h2.handshakes) == {"h2"}  # the protocol agreed is the one offered
    assert set(verified.handshakes) == {None}  # no ALPN offered without `alpn`
    assert set(verified.server_names) == {"db.example"}
    assert set(by_address.server_names) == {None}  # an IP address is never sent as SNI
    assert self_signed.failed_handshakes  # lbproxy ended those handshakes, not the server


def test_send_expect_over_tls_and_an_endless_answer(certs, servers, lbproxy):
    good = certs.signed("db", "db.example", "127.0.0.1")
    pong = servers(TlsServer("pong", good, answer=b"+PONG\r\n"))
    wrong = servers(TlsServer("wrong", good, answer=b"-ERR not ready\r\n"))
    endless = servers(TlsServer("endless", good, answer=b"", endless=True))
    admin_port = free_port()
    check = 'type: tls, send: "PING\\r\\n", expect: "^\\\\+PONG"'
    proxy = lbproxy(_config(admin_port, [("redis", check, [pong, wrong, endless])]))
    assert _reason_down(proxy, "redis", "wrong") == (
        "tls check: '^\\\\+PONG' not found in 16 bytes \"-ERR not ready\\r\\n\" within 2s"
    )
    endless_reason = _reason_down(proxy, "redis", "endless")
    assert endless_reason.startswith(
        "tls check: '^\\\\+PONG' not found in the first 4096 bytes (4096 bytes \"xxxx"
    )
    wait_for(lambda: _checked(admin_port, "redis", "pong", "ok") >= 3, what="good checks")
    assert _health(admin_port)[("redis", "pong")] == "up"
    assert _checked(admin_port, "redis", "pong", "fail") == 0
    assert set(pong.requests) == {b"PING\r\n"}  # sent over TLS, read by the server


@requires_redis
def test_redis_and_send_expect_checks_over_tls(certs, servers, lbproxy, tmp_path):
    """A redis-server that listens with TLS only (`tls-port`, as HAProxy's `check-ssl`
    with `redis-check` expects), checked by a redis check with `tls: true`, the
    certificate verified; and send_expect with `tls: true`: the request over TLS, a
    self-signed certificate refused."""
    cert = certs.signed("cache", "cache.example", "127.0.0.1")
    port = free_port()
    assert REDIS_SERVER is not None
    redis = subprocess.Popen(
        [
            REDIS_SERVER, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", cert[0], "--tls-key-file", cert[1],
            "--tls-ca-cert-file", certs.ca, "--tls-auth-clients", "no",
            "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_port(port)
        pong = servers(TlsServer("pong", cert, answer=b"+PONG\r\n"))
        own = certs.self_signed("own", "cache.example", "127.0.0.1")
        self_signed = servers(TlsServer("own", own, answer=b"+PONG\r\n"))
        admin_port = free_port()
        redis_check = f"type: redis, tls: true, sni: cache.example, verify: {certs.ca}"
        ping = (
            'type: send_expect, tls: true, send: "PING\\r\\n", expect: "^\\\\+PONG", '
            f"verify: {certs.ca}"
        )
        config = _config(
            admin_port,
            [
                ("cache", redis_check, [SimpleNamespace(name="a", port=port)]),
                ("raw", ping, [pong, self_signed]),
            ],
        )
        proxy = lbproxy(config)
        assert _reason_down(proxy, "raw", "own") == (
            "tls: certificate verify failed: self-signed certificate"
        )
        wait_for(lambda: _checked(admin_port, "cache", "a", "ok") >= 2, what="redis checks")
        wait_for(lambda: _checked(admin_port, "raw", "pong", "ok") >= 2, what="TLS PINGs")
        health = _health(admin_port)
        assert (health[("cache", "a")], health[("raw", "pong")]) == ("up", "up")
        assert _checked(admin_port, "cache", "a", "fail") == 0
        assert set(pong.requests) == {b"PING\r\n"}  # sent over TLS, read by the server
    finally:
        redis.terminate()
        redis.wait(30)


def test_smtp_check_over_implicit_tls(certs, servers, lbproxy):
    """An SMTPS server (aiosmtpd with implicit TLS) checked with `tls: true`: up, the
    greeting and EHLO read inside TLS; a plain SMTP server and an SMTPS server whose
    certificate does not verify are down with the TLS reason."""
    pytest.importorskip("aiosmtpd")
    smtps = servers(SmtpServer(tls=certs.signed("mail", "mail.example", "127.0.0.1")))
    plain = servers(SmtpServer())
    own = servers(SmtpServer(tls=certs.self_signed("own", "mail.example", "127.0.0.1")))
    for server in (smtps, plain, own):
        server.start()
    admin_port = free_port()
    check = f"type: smtp, helo: lb.example, tls: true, sni: mail.example, verify: {certs.ca}"
    members = [
        SimpleNamespace(name=name, port=server.port)
        for name, server in (("smtps", smtps), ("plain", plain), ("own", own))
    ]
    proxy = lbproxy(_config(admin_port, [("mail", check, members)]))
    assert _reason_down(proxy, "mail", "own") == (
        "smtp: tls: certificate verify failed: self-signed certificate"
    )
    # the plain server's greeting, shown as the reason (the host name is the machine's)
    assert _reason_down(proxy, "mail", "plain").startswith(
        'smtp: tls: not a TLS server (it sent "220 '
    )
    wait_for(lambda: _checked(admin_port, "mail", "smtps", "ok") >= 2, what="SMTPS checks")
    assert _health(admin_port)[("mail", "smtps")] == "up"
    assert _checked(admin_port, "mail", "smtps", "fail") == 0


def test_https_check_of_a_patroni_style_primary(certs, servers, lbproxy):
    """`/primary` answers 200 on the leader and 503 on a replica (Patroni's REST API);
    the body must say the database is running."""
    cert = certs.signed("pg", "pg.example", "127.0.0.1")
    leader, running = 200, b'{"state": "running", "role": "master"}'
    replica = 503, b'{"state": "running", "role": "replica"}'
    one = servers(HttpsServer("one", cert, (leader, running)))
    two = servers(HttpsServer("two", cert, replica))
    admin_port = free_port()
    check = (
        "type: http, tls: true, sni: pg.example, "
        f"verify: {certs.ca}, path: /primary, host: pg.example:8008, expect_body: running"
    )
    proxy = lbproxy(_config(admin_port, [("pg", check, [one, two])]))
    assert _reason_down(proxy, "pg", "two") == "http check: GET /primary answered 503"
    wait_for(lambda: _checked(admin_port, "pg", "one", "ok") >= 2, what="good checks of one")
    assert _health(admin_port) == {("pg", "one"): "up", ("pg", "two"): "down"}
    assert one.requests[0] == ("GET", "/primary", "pg.example:8008")

    # a failover: two is promoted, one answers 200 while it is still starting up
    mark = len(proxy.log())
    two.answer = leader, running
    one.answer = 200, b'{"state": "starting", "role": "master"}'
    assert _reason_down(proxy, "pg", "one", after=mark) == (
        "http check: GET /primary: body did not match 'running' "
        '(39 bytes "{\\"state\\": \\"starting\\", \\"role\\": \\"master\\"}")'
    )
    wait_for(lambda: _health(admin_port)[("pg", "two")] == "up", what="two to come up")


def test_https_answers_that_never_end_fail_within_the_timeout(certs, servers, lbproxy):
    cert = certs.signed("web", "127.0.0.1")
    body = servers(HttpsServer("body", cert, (200, b""), endless_body=True))
    head = servers(TlsServer("head", cert, answer=b"HTTP/1.1 200 OK\r\nX-Endless: ", endless=True))
    half = servers(TlsServer("half", cert, answer=b"HTTP/1.1 200 OK\r\nContent-Le"))
    admin_port = free_port()
    check = f"type: http, tls: true, verify: {certs.ca}"
    proxy = lbproxy(
        _config(
            admin_port,
            [
                ("body", f"{check}, expect_body: ready", [body]),
                ("head", check, [head]),
                ("half", check, [half]),
            ],
        )
    )
    assert _reason_down(proxy, "half", "half") == (
        'http check: GET /: the answer did not end within 2s (27 bytes "HTTP/1.1 200 OK\\r\\n'
        'Content-Le")'
    )
    assert _reason_down(proxy, "body", "body").startswith(
        "http check: GET /: body did not match 'ready' (4096 bytes \"     "
    )
    assert _reason_down(proxy, "head", "head").startswith("http check: GET /: not an HTTP answer")
    rss = [_rss_kib(proxy.proc.pid)]
    wait_for(  # many more checks of each: the memory they take does not grow
        lambda: min(_checked(admin_port, vs, vs, "fail") for vs in ("body", "head")) >= 10,
        timeout=30,
        what="ten failed checks of each",
    )
    rss.append(_rss_kib(proxy.proc.pid))
    assert rss[1] - rss[0] < 8 * 1024, rss  # KiB; each server sent megabytes meanwhile


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1])


def test_invalid_tls_and_http_keys_are_errors_at_their_line(tmp_path):
    path = tmp_path / "lbproxy.yaml"
    path.write_text(
        "virtual_servers:\n"
        "  - name: db\n"
        "    listen: 127.0.0.1:5432\n"
        "    health_check:\n"
        "      type: tcp\n"
        "      alpn: [h2]\n"  # line 6
        "    real_servers: [{name: a, address: 127.0.0.1:5433}]\n"
        "  - name: web\n"
        "    listen: 127.0.0.1:8080\n"
        "    health_check:\n"
        "      type: http\n"
        "      tls: true\n"
        f"      verify: {tmp_path}/missing-ca.pem\n"  # line 13
        "      expect_body: '(unclosed'\n"  # line 14
        "    real_servers: [{name: a, address: 127.0.0.1:8081}]\n"
        "  - name: mail\n"
        "    listen: 127.0.0.1:2525\n"
        "    health_check: {type: pgsql, tls: true}\n"  # line 18
        "    real_servers: [{name: a, address: 127.0.0.1:25}]\n"
    )
    result = run_cli("check", str(path))
    assert result.returncode == 2, result
    lines = result.stderr.splitlines()
    assert f"{path}:6: health_check.alpn is for tls checks" in lines
    assert f"{path}:13: health_check.verify: {tmp_path}/missing-ca.pem does not exist" in lines
    assert any(
        line.startswith(f"{path}:14: health_check.expect_body must be a regular") for line in lines
    )
    assert (
        f"{path}:18: health_check.tls is not for pgsql checks: PostgreSQL starts TLS inside "
        "its protocol (SSLRequest), which the check does not do (tls is for http, "
        "send_expect, redis and smtp checks)"
    ) in lines


def test_check_describes_tls_and_https_checks(certs, tmp_path):
    path = tmp_path / "lbproxy.yaml"
    path.write_text(
        "virtual_servers:\n"
        "  - name: db\n"
        "    listen: 127.0.0.1:5432\n"
        "    health_check: {type: tls, sni: db.example, alpn: [h2]}\n"
        "    real_servers: [{name: a, address: 127.0.0.1:5433}]\n"
        "  - name: pg\n"
        "    listen: 127.0.0.1:5442\n"
        f"    health_check: {{type: http, tls: true, path: /primary, verify: {certs.ca}}}\n"
        "    real_servers: [{name: a, address: 127.0.0.1:8008}]\n"
        "  - name: web\n"
        "    listen: 127.0.0.1:8080\n"
        "    health_check: {type: http, method: HEAD, expect_status: [200, 204]}\n"
        "    real_servers: [{name: a, address: 127.0.0.1:8081}]\n"
    )
    result = run_cli("check", str(path))
    assert result.returncode == 0, result
    assert (
        "  health      http HEAD / expecting 200 or 204 every 2s, rise 2, fall 3"
        in result.stdout.splitlines()
    )
    assert (
        "  health      tls with SNI db.example (ALPN h2, not verified) every 2s, rise 2, fall 3"
        in result.stdout.splitlines()
    )
    assert (
        f"  health      https GET /primary expecting 200 (verified by {certs.ca}) every 2s, "
        "rise 2, fall 3"
    ) in result.stdout.splitlines()


def test_a_reload_changes_verification_and_a_bad_ca_file_keeps_the_old(certs, servers, lbproxy):
    own = certs.self_signed("own", "db.example")
    server = servers(TlsServer("a", own))
    admin_port = free_port()
    config = _config(admin_port, [("db", "type: tls, sni: db.example, verify: none", [server])])
    proxy = lbproxy(config)
    wait_for(lambda: _checked(admin_port, "db", "a", "ok") >= 2, what="good checks")

    missing = certs.folder / "missing-ca.pem"
    proxy.reload(config.replace("verify: none", f"verify: {missing}"))
    assert f"health_check.verify: {missing} does not exist" in proxy.log()
    ok = _checked(admin_port, "db", "a", "ok")
    wait_for(lambda: _checked(admin_port, "db", "a", "ok") >= ok + 2, what="checks go on")
    assert _health(admin_port)[("db", "a")] == "up"

    proxy.reload(config.replace("verify: none", f"verify: {certs.ca}"))
    reason = _reason_down(proxy, "db", "a")
    assert reason == "tls: certificate verify failed: self-signed certificate"


def test_a_replaced_ca_file_is_read_again_without_a_reload(certs, servers, lbproxy, tmp_path):
    own_cert = certs.self_signed("pinned", "db.example")
    server = servers(TlsServer("a", own_cert))
    ca_file = tmp_path / "ca.pem"
    ca_file.write_text(Path(certs.ca).read_text())
    admin_port = free_port()
    check = f"type: tls, sni: db.example, verify: {ca_file}"
    proxy = lbproxy(_config(admin_port, [("db", check, [server])]))
    assert _reason_down(proxy, "db", "a") == (
        "tls: certificate verify failed: self-signed certificate"
    )
    replaced = tmp_path / "ca.pem.new"
    replaced.write_text(Path(own_cert[0]).read_text())  # now trusts the server's own certificate
    replaced.rename(ca_file)
    wait_for(lambda: _health(admin_port)[("db", "a")] == "up", what="the server to come up")
    assert "is up" in proxy.log()
