"""send_expect results through a real `lbproxy run` process and real loopback servers.

The rule (docs/concepts/health.md): `timeout` only when nothing at all was received
within `timeout` (or the connect did not complete); `fail` when bytes were received and
`expect` was not found by the time the server closed, 4 KiB were read, or `timeout`
passed. The reason in the log names what was received, escaped, cut at 60 characters.
"""

from __future__ import annotations

import re
import socket

import trio
from hypothesis import given
from hypothesis import strategies as st

from lbproxy.config.model import Address, HealthCheckConfig
from lbproxy.control.checks import EXCERPT_LIMIT, describe_received, probe
from tests.integration.harness import (
    Answering,
    counted,
    free_port,
    metrics,
    sample,
    vs_config,
    wait_for,
    with_admin,
)

CHECK = (
    'health_check: {type: send_expect, send: "PING\\r\\n", expect: "^PONG",'
    " interval: 200ms, timeout: 250ms, rise: 1, fall: 2}"
)


def _wait_log(proxy, pattern: str, timeout: float = 10.0) -> re.Match:
    def found() -> re.Match | None:
        return re.search(pattern, proxy.log())

    return wait_for(found, timeout, f"{pattern!r} in the log", details=proxy.log)


def test_wrong_answer_is_fail_silence_is_timeout(lbproxy):
    servers = [
        Answering("good", b"PONG\r\n"),
        Answering("nope", b"NOPE\r\n"),
        Answering("silent", b""),
    ]
    try:
        port, admin_port = free_port(), free_port()
        proxy = lbproxy(with_admin(vs_config(port, servers, "rr", CHECK), admin_port))
        nope = _wait_log(proxy, r"web/nope is down \((.*)\)\n")
        silent = _wait_log(proxy, r"web/silent is down \((.*)\)\n")
        wrong_answer = "send_expect check: '^PONG' not found in 6 bytes \"NOPE\\r\\n\" within 0.25s"
        assert nope[1] == wrong_answer
        assert silent[1] == "send_expect check: nothing received within 0.25s"

        def checks(name: str) -> float:
            return counted(admin_port, "lbproxy_health_checks_total", real_server=name)

        wait_for(  # a few more checks each
            lambda: all(checks(name) >= 2 for name in ("good", "nope", "silent")),
            what="two checks of each server",
        )
        samples = metrics(admin_port)

        def results(name: str) -> dict[str, float]:
            return {
                result: sample(
                    samples,
                    "lbproxy_health_checks_total",
                    virtual_server="web",
                    real_server=name,
                    result=result,
                )
                for result in ("ok", "fail", "timeout")
            }

        good, wrong, quiet = results("good"), results("nope"), results("silent")
        assert good["ok"] >= 2 and good["fail"] == good["timeout"] == 0, good
        assert wrong["fail"] >= 2 and wrong["ok"] == wrong["timeout"] == 0, wrong
        assert quiet["timeout"] >= 2 and quiet["ok"] == quiet["fail"] == 0, quiet
        assert "web/good is down" not in proxy.log()
        assert all(request == b"PING\r\n" for s in servers for request in s.requests)
    finally:
        for server in servers:
            server.stop()


def _probe(server: Answering | None, check: HealthCheckConfig, port: int = 0):
    address = Address("127.0.0.1", server.port if server else port)

    async def main():
        with trio.fail_after(5):
            return await probe(address, check)

    return trio.run(main)


def test_probe_results_and_reasons():
    check = HealthCheckConfig(type="send_expect", send="PING\\r\\n", expect="^PONG", timeout=0.3)
    servers = {
        "nope": Answering("nope", b"NOPE\r\n"),
        "binary": Answering("binary", b'\x00\xff"\\' + b"x" * 100),
        "big": Answering("big", b"y" * 5000 + b"PONG"),
    }
    try:
        assert _probe(servers["nope"], check) == (
            "fail",
            "send_expect check: '^PONG' not found in 6 bytes \"NOPE\\r\\n\" within 0.3s",
        )
        result, reason = _probe(servers["binary"], check)
        assert result == "fail"
        quoted = '104 bytes "\\x00\\xff\\"\\\\' + "x" * 48 + '..."'
        assert quoted in reason, reason
        result, reason = _probe(servers["big"], check)  # 4 KiB read, no match: fail at once
        assert result == "fail"
        assert reason.startswith("send_expect check: '^PONG' not found in the first 4096 bytes")
        assert '(4096 bytes "yyyy' in reason
    finally:
        for server in servers.values():
            server.stop()
    result, reason = _probe(None, check, free_port())
    assert (result, reason) == ("fail", "send_expect check: connection refused")


def _resolver_says(host: str) -> str:
    """What the system's resolver says of `host` (its text, as getaddrinfo gives it)."""
    try:
        socket.getaddrinfo(host, 80)
    except socket.gaierror as exc:
        return exc.strerror
    raise AssertionError(f"{host} resolved")


def test_a_name_that_does_not_resolve_says_what_the_resolver_said():
    """Not "unknown error -2" (a resolver code read as an errno): the resolver's words,
    for a connect check, a protocol check and a UDP check alike."""
    host = "no-such-host.invalid"  # RFC 6761: never resolves
    said = _resolver_says(host)
    address = Address(host, 6379)
    for check, name in (
        (HealthCheckConfig(), "tcp check"),
        (HealthCheckConfig(type="redis"), "redis"),
        (HealthCheckConfig(type="udp"), "udp check"),
    ):

        async def main(check=check):
            with trio.fail_after(30):
                return await probe(address, check)

        assert trio.run(main) == ("fail", f"{name}: cannot resolve {host}: {said}")


@given(st.binary(max_size=200))
def test_describe_received_is_short_escaped_ascii(data):
    text = describe_received(data)
    count, quoted = text.split(" ", 2)[0], text.split('"', 1)[1][:-1]
    assert int(count) == len(data)
    assert all(0x20 <= ord(char) < 0x7F for char in quoted)
    body = quoted.removesuffix("...")
    assert len(body) <= EXCERPT_LIMIT
    # nothing is cut when it fits, and the cut never splits an escape
    decoded = body.encode().decode("unicode_escape").encode("latin-1")
    assert data.startswith(decoded)
    assert quoted.endswith("...") == (decoded != data)
