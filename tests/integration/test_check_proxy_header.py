"""Health checks and the PROXY protocol (HAProxy's `check-send-proxy`), through a real
`lbproxy run` against real servers (redis-server, aiosmtpd, a TLS server) behind a front
that requires a PROXY header first, as a real server behind `send_proxy` does
(proxy_front.py): a check without the header is refused, and the server would go down.

What a user sees: the server up in the admin API, the header the server received (v1:
the check connection's own addresses; v2: the LOCAL command, as HAProxy's checks), and
no header where the check goes to another port, unless `health_check.send_proxy: true`.
"""

from __future__ import annotations

import re
import socket

import pytest

from tests.integration.databases import SmtpServer
from tests.integration.harness import free_port, get_json, run_cli, wait_for
from tests.integration.proxy_front import Header, ProxyFront
from tests.integration.redis_server import RedisServer, requires_redis
from tests.integration.tls_servers import Certificates, PlainServer, TlsServer
from tests.tools import requires

FAST = "interval: 200ms, timeout: 2s, rise: 1, fall: 1"
PING = 'type: send_expect, send: "PING\\r\\n", expect: "^\\\\+PONG"'


@pytest.fixture
def stopped():
    """keep(server) -> server, stopped (by its own stop()) after the test."""
    started = []

    def keep(server):
        started.append(server)
        return server

    yield keep
    for server in reversed(started):
        server.stop()


def _config(admin_port: int, groups) -> str:
    """Virtual servers, each (name, extra lines, health_check, [real server mappings])."""
    lines = [
        "global:",
        f"  admin: {{listen: 127.0.0.1:{admin_port}}}",
        "  drain_timeout: 2s",
        "virtual_servers:",
    ]
    for name, extra, check, members in groups:
        lines += [f"  - name: {name}", f"    listen: 127.0.0.1:{free_port()}"]
        lines += [f"    {line}" for line in extra]
        lines += [f"    health_check: {{{check}, {FAST}}}", "    real_servers:"]
        lines += [f"      - {member}" for member in members]
    return "\n".join(lines) + "\n"


def _wait_health(admin_port: int, vs: str, rs: str, health: str, reason: str = ""):
    """Wait until the API shows `vs/rs` with `health` after a check whose reason matches
    `reason` (the whole of it)."""
    seen: list[dict] = []

    def shown():
        document = get_json(admin_port, f"/api/v1/virtual-servers/{vs}")
        server = next(s for s in document["real_servers"] if s["name"] == rs)
        seen[:] = [server]
        check = server.get("check")
        return (
            server["health"] == health
            and check is not None
            and re.fullmatch(reason, check["reason"])
        )

    wait_for(shown, 20, f"{vs}/{rs} {health}", details=lambda: repr(seen))


def _member(name: str, port: int, check: str = "") -> str:
    own = f", health_check: {{{check}}}" if check else ""
    return f"{{name: {name}, address: 127.0.0.1:{port}{own}}}"


def _checked_with_v1(front: ProxyFront) -> None:
    """Every header `front` received is v1 with the check connection's own addresses."""
    assert front.headers
    for header in front.headers:
        assert header == Header(1, "PROXY", header.peer, ("127.0.0.1", front.port), header.peer), (
            header
        )


@requires_redis
def test_checks_send_the_header_the_traffic_sends(lbproxy, stopped, tmp_path):
    """`send_proxy: v2` and a redis check; `send_proxy: v1` and a send_expect check: both
    to redis-server behind a front that requires the header. Both servers are up, the
    header came first on every check connection, and the traffic gets through too."""
    redis = stopped(RedisServer(tmp_path / "redis").start())
    by_v2, by_v1 = stopped(ProxyFront(redis.port)), stopped(ProxyFront(redis.port))
    admin_port = free_port()
    config = _config(
        admin_port,
        [
            ("cache", ["send_proxy: v2"], "type: redis", [_member("a", by_v2.port)]),
            ("raw", ["send_proxy: v1"], PING, [_member("a", by_v1.port)]),
        ],
    )
    lbproxy(config)
    _wait_health(admin_port, "cache", "a", "up")
    _wait_health(admin_port, "raw", "a", "up")
    wait_for(lambda: len(by_v2.headers) >= 3 and len(by_v1.headers) >= 3, what="checks")
    assert by_v2.refused == [] and by_v1.refused == []
    # v2: the LOCAL command, no address (the check is lbproxy's own connection)
    assert {(h.version, h.command, h.source) for h in by_v2.headers} == {(2, "LOCAL", None)}
    _checked_with_v1(by_v1)
    # the data path's header to the same server: PROXY with the client's address
    listen = int(re.search(r"name: cache\n    listen: 127.0.0.1:(\d+)", config)[1])
    with socket.create_connection(("127.0.0.1", listen), timeout=5) as c:
        c.sendall(b"PING\r\n")
        assert c.recv(100) == b"+PONG\r\n"
        client = c.getsockname()
    assert any(h.command == "PROXY" and h.source == client for h in by_v2.headers)


def test_smtp_check_sends_the_header(lbproxy, stopped):
    pytest.importorskip("aiosmtpd")
    mail = stopped(SmtpServer().start())
    front = stopped(ProxyFront(mail.port))
    admin_port = free_port()
    config = _config(
        admin_port, [("mail", ["send_proxy: v1"], "type: smtp", [_member("a", front.port)])]
    )
    lbproxy(config)
    _wait_health(admin_port, "mail", "a", "up")
    assert front.refused == []
    _checked_with_v1(front)


@requires("openssl", package="openssl")
def test_tls_check_sends_the_header_before_the_handshake(lbproxy, stopped, tmp_path):
    certs = Certificates(tmp_path / "certs")
    tls = stopped(TlsServer("db", certs.signed("db", "db.example", "127.0.0.1")))
    front = stopped(ProxyFront(tls.port))
    admin_port = free_port()
    check = f"type: tls, verify: {certs.ca}"
    config = _config(admin_port, [("db", ["send_proxy: v2"], check, [_member("a", front.port)])])
    lbproxy(config)
    _wait_health(admin_port, "db", "a", "up")
    assert front.refused == [] and tls.failed_handshakes == []
    assert tls.handshakes  # the handshake went through the front, after the header
    assert {(h.version, h.command) for h in front.headers} == {(2, "LOCAL")}


@requires_redis
def test_a_check_port_gets_no_header_unless_send_proxy_says(lbproxy, stopped, tmp_path):
    """With `send_proxy: v1` on the virtual server:
    - `managed`: its checks go to a management port, which gets no header (HAProxy's
      rule: not with a `port` or `addr`);
    - `forced`: its checks go to another port with `send_proxy: true`: the header;
    - `without`: its checks go to its own port with `send_proxy: false`: no header, so the
      server that requires one refuses them and it goes down."""
    redis = stopped(RedisServer(tmp_path / "redis").start())
    traffic = [stopped(ProxyFront(redis.port)) for _ in range(3)]
    management = stopped(PlainServer("management", b"+PONG\r\n"))
    check_port = stopped(ProxyFront(redis.port))
    admin_port = free_port()
    members = [
        _member("managed", traffic[0].port, f"port: {management.port}"),
        _member("forced", traffic[1].port, f"port: {check_port.port}, send_proxy: true"),
        _member("without", traffic[2].port, "send_proxy: false"),
    ]
    lbproxy(_config(admin_port, [("cache", ["send_proxy: v1"], PING, members)]))
    _wait_health(admin_port, "cache", "managed", "up")
    _wait_health(admin_port, "cache", "forced", "up")
    _wait_health(
        admin_port, "cache", "without", "down", "send_expect check: closed without an answer"
    )
    assert management.requests and set(management.requests) == {b"PING\r\n"}
    assert check_port.refused == []
    _checked_with_v1(check_port)
    assert traffic[2].refused and traffic[2].headers == []
    assert traffic[0].headers == [] and traffic[1].headers == []  # checked elsewhere


def test_the_keys_are_checked_and_described(tmp_path):
    path = tmp_path / "lbproxy.yaml"
    path.write_text(
        "virtual_servers:\n"
        "  - name: db\n"
        "    listen: 127.0.0.1:5432\n"
        "    health_check: {type: pgsql, send_proxy: true}\n"
        "    real_servers:\n"
        "      - {name: a, address: 127.0.0.1:5433, health_check: {send_proxy: maybe}}\n"
    )
    result = run_cli("check", str(path))
    assert result.returncode == 2, result
    assert f"{path}:6: health_check.send_proxy must be true or false, got 'maybe'" in (
        result.stderr.splitlines()
    ), result.stderr
    path.write_text(path.read_text().replace("send_proxy: maybe", "send_proxy: false"))
    result = run_cli("check", str(path))
    assert result.returncode == 0, result
    assert "pgsql as user lbproxy, with a PROXY header every 2s" in result.stdout, result.stdout
    assert "checks without a PROXY header" in result.stdout, result.stdout
