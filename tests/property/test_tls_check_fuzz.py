"""Fuzz the TLS and HTTPS health checks (lbproxy/control/check_tls.py, checks.py's `_http`)
with what a hostile server may send, on real loopback sockets: whatever comes back
instead of a ServerHello, and whatever comes after a real handshake instead of an HTTP
answer, the check ends within its timeout with a result and a short one-line reason a
log can carry; it never raises, and it is healthy only for the answer it asked for."""

from __future__ import annotations

import re
import ssl

import pytest
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lbproxy.config.model import Address, HealthCheckConfig
from lbproxy.control.checks import BODY_LIMIT, body_matches, probe
from tests.integration.tls_servers import Certificates, server_context
from tests.tools import requires

pytestmark = requires("openssl", package="openssl")

TIMEOUT = 0.5
REASON_LIMIT = 300  # characters: a reason is one short log line


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    return Certificates(tmp_path_factory.mktemp("certs")).signed("fuzz", "127.0.0.1")


async def _serve_once(listener: trio.SocketListener, answer, tls: ssl.SSLContext | None, hold):
    stream = await listener.accept()
    async with stream:
        if tls is not None:
            stream = trio.SSLStream(stream, tls, server_side=True, https_compatible=True)
            try:
                await stream.do_handshake()
                await stream.receive_some(4096)  # the request
            except trio.BrokenResourceError:
                return
        else:
            await stream.receive_some(4096)  # the ClientHello
        try:
            await stream.send_all(answer)
            if hold:  # keep it open: the check's timeout ends it
                await stream.receive_some(4096)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


def _run(check: HealthCheckConfig, answer: bytes, hold: bool, tls: ssl.SSLContext | None):
    async def main():
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve_once, listeners[0], answer, tls, hold)
            # the check bounds itself by its timeout; this only keeps a bug from hanging
            with trio.fail_after(TIMEOUT * 20):
                outcome = await probe(Address("127.0.0.1", port), check)
            nursery.cancel_scope.cancel()
        await listeners[0].aclose()
        return outcome

    return trio.run(main)


def _short_line(reason: str) -> bool:
    return len(reason) <= REASON_LIMIT and all(0x20 <= ord(char) < 0x7F for char in reason)


tls_records = st.builds(
    lambda kind, version, body: bytes([kind]) + version + len(body).to_bytes(2, "big") + body,
    st.sampled_from([0x14, 0x15, 0x16, 0x17, 0x18, 0x00, 0xFF]),
    st.sampled_from([b"\x03\x01", b"\x03\x03", b"\x03\x04", b"\x00\x00", b"\xfe\xfd"]),
    st.binary(max_size=64),
)
server_hellos = st.one_of(
    st.binary(max_size=300),
    st.lists(tls_records, min_size=1, max_size=4).map(b"".join),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answer=server_hellos, hold=st.booleans())
@example(answer=b"\x15\x03\x03\x00\x02\x02\x28", hold=False)  # alert handshake_failure
@example(answer=b"SSH-2.0-OpenSSH_9.2\r\n", hold=True)
def test_any_answer_to_a_client_hello_fails_with_a_tls_reason(answer, hold):
    check = HealthCheckConfig(type="tls", timeout=TIMEOUT, alpn=("h2",))
    result, reason = _run(check, answer, hold, tls=None)
    assert result in ("fail", "timeout"), reason
    assert reason.startswith("tls: "), reason
    assert _short_line(reason), reason


status_lines = st.one_of(
    st.sampled_from(
        [b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 503 Unavailable\r\n", b"HTTP/1.0 200 \r\n"]
    ),
    st.binary(max_size=80),
)
headers = st.lists(
    st.one_of(
        st.sampled_from(
            [
                b"Content-Length: 7\r\n",
                b"Content-Length: 100000\r\n",
                b"Content-Length: x\r\n",
                b"Transfer-Encoding: chunked\r\n",
                b"Connection: close\r\n",
            ]
        ),
        st.binary(max_size=40).map(lambda value: b"X: " + value + b"\r\n"),
    ),
    max_size=4,
).map(b"".join)
bodies = st.one_of(
    st.sampled_from([b"running", b"7\r\nrunning\r\n0\r\n\r\n", b"", b"x" * 5000 + b"running"]),
    st.binary(max_size=200),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(status=status_lines, head=headers, body=bodies, hold=st.booleans())
@example(status=b"HTTP/1.1 200 OK\r\n", head=b"Content-Length: 7\r\n", body=b"running", hold=True)
def test_any_https_answer_is_healthy_only_when_it_is_the_expected_one(
    certificate, status, head, body, hold
):
    answer = status + head + b"\r\n" + body
    check = HealthCheckConfig(type="http", tls=True, timeout=TIMEOUT, expect_body="running")
    result, reason = _run(check, answer, hold, tls=server_context(certificate))
    assert result in ("ok", "fail", "timeout")
    if result == "ok":
        assert reason == ""
        assert re.match(rb"HTTP/1\.[01] 200 ", answer), answer
        assert b"running" in body
    else:
        assert reason.startswith(("http check: ", "tls: ")), reason
        assert _short_line(reason), reason


@given(st.binary(max_size=BODY_LIMIT + 100), st.sampled_from(["running", "^ok", "r.n", "\\d+"]))
def test_expect_body_is_searched_in_the_first_4_kib_only(body, pattern):
    found = body_matches(pattern, body)
    head = body[:BODY_LIMIT].decode("utf-8", errors="replace")
    assert found == (re.search(pattern, head) is not None)
    padded = body[:BODY_LIMIT].ljust(BODY_LIMIT, b" ")  # nothing past 4 KiB counts:
    assert body_matches(pattern, padded + b"running") == body_matches(pattern, padded)
    if pattern == "running" and len(body) <= BODY_LIMIT - 7:
        assert body_matches(pattern, body + b"running")
