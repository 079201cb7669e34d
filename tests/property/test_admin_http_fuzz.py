"""Fuzz the admin endpoint's HTTP server (lbproxy/admin/http_server.py) through a real
`lbproxy run`, over loopback TCP and over its admin Unix socket (SPEC §21): any bytes,
split anywhere, get answers or a close, never a 500, a hang or a crash, and the endpoint
keeps serving others."""

from __future__ import annotations

import re
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.harness import (
    HTTP_SERVER_TOKEN,
    Lbproxies,
    admin_socket_path,
    free_port,
    http_server_config,
    http_server_healthy,
)

pytestmark = pytest.mark.integration

METHODS = [
    b"GET",
    b"HEAD",
    b"OPTIONS",
    b"PUT",
    b"PATCH",
    b"POST",
    b"DELETE",
    b"CONNECT",
    b"G\x00T",
    b"",
]
TARGETS = [
    b"/healthz",
    b"/readyz",
    b"/api/v1/virtual-servers/db/locate?current=a",
    b"/api/v1/virtual-servers/db/real-servers/a/load",
    b"/api/v1/virtual-servers/db/real-servers/b",
    b"/api/v1/virtual-servers/%64b",
    b"/api/v1/reload",
    b"*",
    b"http://t/healthz",
    b"/%ff%00%",
    b"/a b",
    b"",
]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x", b"http/1.1", b""]
HEADERS = [
    b"Host: 127.0.0.1",
    b"Host: rebound.example",  # DNS rebinding: 421 (SPEC §16)
    b"Content-Length: 13",
    b"Content-Length: 0",
    b"Content-Length: -1",
    b"Content-Length: 99999999999999999999",
    b"Content-Length: 3, 4",
    b"Transfer-Encoding: chunked",
    b"Transfer-Encoding: gzip",
    b"Expect: 100-continue",
    b"Connection: close",
    b"Connection: keep-alive",
    b"Upgrade: h2c",
    b"X-Lbproxy-Client: 1.2.3.4 99",
    b"Origin: http://elsewhere",
    b"Authorization: Bearer " + HTTP_SERVER_TOKEN.encode(),  # a change over TCP needs it
    b"Authorization: Bearer wrong",
    b"Authorization: Basic eDp5",
    b"X: " + b"y" * 200,
    b": no name",
    b"Bad Name: x",
    b"\x00: \x01",
    b" folded",
]
BODIES = [b"", b'{"load": 0.1}', b'{"weight": 1}', b"5\r\nhello\r\n0\r\n\r\n", b"ffffff\r\n"]


@st.composite
def request_bytes(draw) -> bytes:
    line = b" ".join(
        [
            draw(st.sampled_from(METHODS)),
            draw(st.sampled_from(TARGETS)),
            draw(st.sampled_from(VERSIONS)),
        ]
    )
    headers = draw(st.lists(st.sampled_from(HEADERS), max_size=5))
    body = draw(st.sampled_from(BODIES) | st.binary(max_size=40))
    return line + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


@st.composite
def streams(draw) -> tuple[bytes, list[int]]:
    """A few requests, near-valid or not, maybe mangled; and where to split them."""
    data = b"".join(
        draw(st.lists(request_bytes() | st.binary(max_size=80), min_size=1, max_size=3))
    )
    for position, value in draw(
        st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=3)
    ):
        if position < len(data):
            data = data[:position] + bytes([value]) + data[position + 1 :]
    splits = sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=4))))
    return data, splits


STATUS = re.compile(rb"HTTP/1\.1 (\d{3}) ")
EXPECTED = {
    b"100",
    b"200",
    b"204",
    b"400",
    b"401",
    b"403",
    b"404",
    b"405",
    b"413",
    b"414",
    b"421",
    b"431",
    b"501",
    b"503",
    b"505",
}


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    port = free_port()
    folder = tmp_path_factory.mktemp("admin-fuzz")
    proxies = Lbproxies(folder)
    proxy = proxies(http_server_config(f"127.0.0.1:{port}", folder), [port])
    yield proxy, port
    proxies.stop_all()
    log = proxy.log()
    assert "Traceback" not in log and " ERROR " not in log, log


def connect(port: int, transport: str) -> socket.socket:
    """To the TCP endpoint, or to its admin socket (no token needed there)."""
    if transport == "tcp":
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(admin_socket_path(port))
    return s


@pytest.mark.parametrize("transport", ["tcp", "unix"])
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(stream=streams())
def test_any_bytes_get_answers_or_a_close_and_others_are_served(endpoint, transport, stream):
    proxy, port = endpoint
    data, splits = stream
    with connect(port, transport) as s:
        start = 0
        try:
            for end in [*splits, len(data)]:
                s.sendall(data[start:end])
                start = end
            s.shutdown(socket.SHUT_WR)  # so every request ends: answered, or closed
        except OSError:  # EPIPE, ECONNRESET, ENOTCONN: refused and closed already
            pass
        received = b""
        try:
            while chunk := s.recv(65536):  # a hang would time out (5 s): a failure
                received += chunk
        except ConnectionResetError:
            pass
    if received:
        assert received.startswith(b"HTTP/1.1 "), received[:100]
    assert set(STATUS.findall(received)) <= EXPECTED, received[:300]
    assert proxy.proc.poll() is None
    assert http_server_healthy(port)
