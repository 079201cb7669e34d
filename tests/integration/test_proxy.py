"""End to end through real `lbproxy run` processes over loopback."""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import threading
import time
from collections import Counter

import pytest

from lbproxy.wire import proxy_protocol
from tests.integration.harness import (
    ask_name,
    assert_rejected,
    counted,
    free_port,
    metrics,
    open_and_read_name,
    sample,
    vs_config,
    wait_for,
    with_admin,
)


def rejected(admin_port: int, reason: str, vs: str = "web") -> float:
    """lbproxy_rejected_connections_total{virtual_server=vs, reason} as /metrics says."""
    name = "lbproxy_rejected_connections_total"
    return sample(metrics(admin_port), name, virtual_server=vs, reason=reason)


def test_rr_exact_order(name_servers, lbproxy):
    servers = name_servers("a", "b", "c")
    port = free_port()
    lbproxy(vs_config(port, servers, "rr"))
    assert [ask_name(port) for _ in range(9)] == list("abcabcabc")


def test_wrr_one_to_five(name_servers, lbproxy):
    servers = name_servers("a", "b")
    port = free_port()
    lbproxy(vs_config(port, servers, "wrr", rs_extra={"a": "weight: 1", "b": "weight: 5"}))
    sequence = "".join(ask_name(port) for _ in range(12))
    assert sequence == "bbabbbbbabbb"  # 5:1, interleaved (smooth weighted round robin)


def test_wlc_shares_with_held_connections(name_servers, lbproxy):
    servers = name_servers("a", "b", "c")
    port = free_port()
    lbproxy(
        vs_config(
            port, servers, "wlc", rs_extra={"a": "weight: 1", "b": "weight: 2", "c": "weight: 3"}
        )
    )
    held = [open_and_read_name(port) for _ in range(30)]
    try:
        assert Counter(name for _, name in held) == {"a": 5, "b": 10, "c": 15}
    finally:
        for sock, _ in held:
            sock.close()


def _send_and_receive(port: int, payload: bytes) -> tuple[bytes, bytes]:
    """Send payload while reading the echo at the same time; returns (greeting, echo)."""
    received = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:

        def reader() -> None:
            while True:
                chunk = s.recv(1 << 20)
                if not chunk:
                    return
                received.extend(chunk)

        thread = threading.Thread(target=reader)
        thread.start()
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        thread.join(60)
    greeting, _, echo = bytes(received).partition(b"\n")
    return greeting, echo


def test_twenty_megabytes_byte_exact_both_ways(name_servers, lbproxy):
    (server,) = name_servers("a")
    port = free_port()
    lbproxy(vs_config(port, [server]))
    payload = os.urandom(20 * 1024 * 1024)
    greeting, echo = _send_and_receive(port, payload)
    assert greeting == b"a"
    assert len(echo) == len(payload)
    assert hashlib.sha256(echo).digest() == hashlib.sha256(payload).digest()
    assert hashlib.sha256(b"".join(server.received)).digest() == hashlib.sha256(payload).digest()


def test_half_close_client_still_gets_the_reply(lbproxy):
    """The client shuts down its sending side; the server answers after the FIN."""
    listener = socket.create_server(("127.0.0.1", 0))
    backend_port = listener.getsockname()[1]

    def backend() -> None:
        conn, _ = listener.accept()
        with conn:
            request = b""
            while chunk := conn.recv(65536):
                request += chunk
            time.sleep(0.2)  # answer well after the FIN arrived
            conn.sendall(b"reply to " + request)

    thread = threading.Thread(target=backend)
    thread.start()
    port = free_port()

    class Fake:
        name = "a"
        port = backend_port

    # No active checks: the backend accepts one connection, and a health check's
    # connect could otherwise be the one it accepts.
    lbproxy(vs_config(port, [Fake], extra="health_check: {type: none}"))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"question")
            s.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        thread.join(10)
    finally:
        listener.close()
    assert answer == b"reply to question"


def test_half_close_server_first_client_keeps_sending(lbproxy):
    """The server sends and shuts down its side first: the client sees the FIN (a
    half-close, not a close) and can still send, and the server still receives it all."""
    listener = socket.create_server(("127.0.0.1", 0))
    backend_port = listener.getsockname()[1]
    received: list[bytes] = []

    def backend() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            conn.sendall(b"hello, then no more from me")
            conn.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
            received.append(data)

    thread = threading.Thread(target=backend)
    thread.start()
    port = free_port()

    class Fake:
        name = "a"
        port = backend_port

    # No health check: its connection could be the one the backend accepts.
    lbproxy(vs_config(port, [Fake], extra="health_check: {type: none}"))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        greeting = b""
        while chunk := s.recv(65536):  # ends at the server's FIN, passed on
            greeting += chunk
        time.sleep(0.2)  # send well after the FIN arrived
        for i in range(3):
            s.sendall(b"late %d;" % i)
        s.shutdown(socket.SHUT_WR)
        assert s.recv(1) == b""
    thread.join(10)
    listener.close()
    assert greeting == b"hello, then no more from me"
    assert received == [b"late 0;late 1;late 2;"]


def test_connect_retry_past_a_dead_server(name_servers, lbproxy):
    servers = name_servers("a", "c")
    dead_port = free_port()  # nothing listens here

    class Dead:
        name = "b"
        port = dead_port

    port = free_port()
    proxy = lbproxy(
        vs_config(port, [servers[0], Dead, servers[1]], "rr", "health_check: {type: none}")
    )
    names = [ask_name(port) for _ in range(12)]
    assert "" not in names and set(names) == {"a", "c"}
    assert "b" not in names
    del proxy


def test_acl_deny_wins_over_allow(name_servers, lbproxy):
    # Each refusal is a close by a live process, counted as reason acl; a client of a
    # virtual server without an ACL is served after them (nothing crashed to refuse).
    (a,) = name_servers("a")
    deny, allow, open_port, admin_port = free_port(), free_port(), free_port(), free_port()
    server = f"real_servers: [{{name: a, address: 127.0.0.1:{a.port}}}]"
    lbproxy(
        f"""
        global: {{admin: {{listen: 127.0.0.1:{admin_port}}}}}
        virtual_servers:
          - {{name: web, listen: 127.0.0.1:{deny}, {server},
              allow: [127.0.0.0/8], deny: [127.0.0.1/32]}}
          - {{name: web2, listen: 127.0.0.1:{allow}, {server}, allow: [10.0.0.0/8]}}
          - {{name: open, listen: 127.0.0.1:{open_port}, {server}}}
        """,
        [admin_port],
    )
    assert_rejected(deny, lambda: rejected(admin_port, "acl"), 1, "deny 127.0.0.1")
    assert_rejected(allow, lambda: rejected(admin_port, "acl", "web2"), 1, "allow 10/8 only")
    assert ask_name(open_port) == "a"
    assert rejected(admin_port, "acl", "open") == 0


def test_acl_allows_listed_clients(name_servers, lbproxy):
    servers = name_servers("a")
    port = free_port()
    lbproxy(vs_config(port, servers, extra="allow: [127.0.0.0/8]\ndeny: [10.0.0.0/8]"))
    assert ask_name(port) == "a"


def test_max_connections_per_virtual_and_real_server(name_servers, lbproxy):
    servers = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    config = vs_config(
        port, servers, "lc", extra="max_connections: 3", rs_extra={"a": "max_connections: 1"}
    )
    lbproxy(with_admin(config, admin_port), [admin_port])
    held = [open_and_read_name(port) for _ in range(3)]
    try:
        assert Counter(name for _, name in held) == {"a": 1, "b": 2}
        # the fourth is over the virtual server's limit: closed, counted, and the held
        # three still answer
        assert_rejected(port, lambda: rejected(admin_port, "max_connections"), 1)
        for sock, _ in held:
            sock.sendall(b"ping")
            assert sock.recv(100) == b"ping"
    finally:
        for sock, _ in held:
            sock.close()
    # the slots come back as lbproxy sees those ends
    wait_for(lambda: counted(admin_port, "lbproxy_active_connections") == 0, what="no connection")
    assert ask_name(port) in ("a", "b")


def test_real_server_max_connections_then_no_server(name_servers, lbproxy):
    servers = name_servers("a")
    port, admin_port = free_port(), free_port()
    config = vs_config(port, servers, rs_extra={"a": "max_connections: 2"})
    lbproxy(with_admin(config, admin_port), [admin_port])
    held = [open_and_read_name(port) for _ in range(2)]
    try:
        assert_rejected(port, lambda: rejected(admin_port, "no_server"), 1)
    finally:
        for sock, _ in held:
            sock.close()
    # a freed slot serves the next client: the process lives
    assert wait_for(lambda: ask_name(port) == "a", what="a served after a slot freed")


def test_idle_timeout_closes_a_silent_connection(name_servers, lbproxy):
    servers = name_servers("a")
    port = free_port()
    lbproxy(vs_config(port, servers, extra="idle_timeout: 500ms"))
    sock, name = open_and_read_name(port)
    with sock:
        started = time.monotonic()
        sock.settimeout(10)
        assert sock.recv(100) == b""  # closed by the proxy
        waited = time.monotonic() - started
    assert name == "a"
    assert 0.3 < waited < 5


def _proxy_header_backend():
    """A backend that records the first bytes it receives."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(5)
            data = b""
            while b"hello" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            seen.append(data)
            conn.sendall(b"ok")

    thread = threading.Thread(target=serve)
    thread.start()
    return listener, thread, seen


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_send_proxy_header_as_the_real_server_sees_it(lbproxy, version):
    listener, thread, seen = _proxy_header_backend()

    class Backend:
        name = "a"
        port = listener.getsockname()[1]

    port = free_port()
    # No active checks: the backend accepts one connection (see the half-close test).
    extra = f"send_proxy: {version}\nhealth_check: {{type: none}}"
    lbproxy(vs_config(port, [Backend], extra=extra))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"hello")
        assert s.recv(10) == b"ok"
        client_port = s.getsockname()[1]
    thread.join(5)
    listener.close()
    data = seen[0]
    if version == "v1":
        assert data == f"PROXY TCP4 127.0.0.1 127.0.0.1 {client_port} {port}\r\nhello".encode()
    else:
        assert data[:12] == b"\r\n\r\n\x00\r\nQUIT\n"
        assert data[12:16] == b"\x21\x11\x00\x0c"  # PROXY command, TCP over IPv4, 12 bytes
        src, dst, sport, dport = struct.unpack("!4s4sHH", data[16:28])
        assert (socket.inet_ntoa(src), socket.inet_ntoa(dst)) == ("127.0.0.1", "127.0.0.1")
        assert (sport, dport) == (client_port, port)
        assert data[28:] == b"hello"


def test_accept_proxy_uses_the_header_address_for_acl_and_send_proxy(lbproxy):
    listener, thread, seen = _proxy_header_backend()

    class Backend:
        name = "a"
        port = listener.getsockname()[1]

    port = free_port()
    lbproxy(
        vs_config(
            port,
            [Backend],
            # no health check: the backend serves one connection, the proxied one
            extra="accept_proxy: true\nsend_proxy: v1\nallow: [192.0.2.0/24]\n"
            "health_check: {type: none}",
        )
    )
    header = proxy_protocol.encode_v2(("192.0.2.7", 4000), ("198.51.100.1", 443))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(header + b"hello")
        assert s.recv(10) == b"ok"
    thread.join(5)
    listener.close()
    assert seen[0].startswith(b"PROXY TCP4 192.0.2.7 127.0.0.1 4000 ")
    assert seen[0].endswith(b"\r\nhello")


def test_accept_proxy_without_header_is_dropped(name_servers, lbproxy):
    servers = name_servers("a")
    port = free_port()
    lbproxy(vs_config(port, servers, extra="accept_proxy: true\nconnect_timeout: 300ms"))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert s.recv(100) == b""


def test_ipv6_listener(name_servers, lbproxy):
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    servers = name_servers("a")
    port = free_port("::1")
    config = vs_config(port, servers).replace(f"127.0.0.1:{port}", f"'[::1]:{port}'")
    lbproxy(config)
    assert ask_name(port, host="::1") == "a"
