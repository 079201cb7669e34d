"""The exception barrier: a bug in one connection, check or poll ends that unit only --
closed, its lease given back, counted in lbproxy_internal_errors_total{where} -- and the
rest goes on.

In-process runs with real loopback sockets; the bug is injected by patching one
function to raise on one call.
"""

from __future__ import annotations

import functools
import itertools

import trio

from lbproxy.admin.metrics import LbproxyCollector
from lbproxy.config.reader import load
from lbproxy.control import checks
from lbproxy.core.pool import Pool
from lbproxy.net.barrier import internal_errors
from lbproxy.runtime.server import Server
from tests.integration.harness import NameServer, free_port, vs_config


class Injected(Exception):
    """The bug we inject."""


def raising_on(original, call: int):
    """`original`, except that its `call`-th call raises Injected."""
    calls = itertools.count(1)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if next(calls) == call:
            raise Injected(f"injected on call {call}")
        return original(*args, **kwargs)

    return wrapper


def internal_errors_metric(server: Server, where: str) -> float:
    for family in LbproxyCollector(server).collect():
        if family.name == "lbproxy_internal_errors":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels["where"] == where:
                    return sample.value
    raise AssertionError("no lbproxy_internal_errors_total")


async def greeting(port: int) -> bytes:
    """What the proxy sends first on a new connection (b"" if it closed it)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        with trio.fail_after(5):
            data = b""
            while not data.endswith(b"\n"):
                chunk = await stream.receive_some(100)
                if not chunk:
                    break
                data += chunk
            return data
    finally:
        await stream.aclose()


def run_proxy(tmp_path, body, extra: str = "") -> None:
    path = tmp_path / "lbproxy.yaml"
    with NameServer("a") as a:
        port = free_port()
        path.write_text(vs_config(port, [a], "rr", extra))

        async def main():
            server = Server(load([str(path)]), [str(path)])
            async with trio.open_nursery() as nursery:
                with trio.fail_after(20):
                    await nursery.start(functools.partial(server.serve, handle_signals=False))
                    await body(server, port)
                    server.stop()

        trio.run(main)


def test_a_pick_raising_ends_that_connection_only(tmp_path, monkeypatch):
    monkeypatch.setattr(Pool, "pick", raising_on(Pool.pick, 3))

    async def body(server, port):
        answers = [await greeting(port) for _ in range(10)]
        assert answers[2] == b""  # the 3rd: closed
        assert answers[:2] + answers[3:] == [b"a\n"] * 9
        await trio.sleep(0.2)
        pool = server.pools()[0]
        assert pool.active == 0 and pool.clients == 0  # no lease, no count left behind
        assert internal_errors().counts["connection"] == 1
        assert internal_errors_metric(server, "connection") == 1

    run_proxy(tmp_path, body)


def test_an_end_callback_raising_ends_that_connection_only(tmp_path, monkeypatch):
    # The lease's return, in the end's counting (the handler's _pumped for an established
    # connection, the one that ends it, or _ended): a bug there, on the 3rd connection.
    monkeypatch.setattr(Pool, "drop", raising_on(Pool.drop, 3))

    async def body(server, port):
        answers = [await greeting(port) for _ in range(10)]
        assert answers == [b"a\n"] * 10
        await trio.sleep(0.2)
        pool = server.pools()[0]
        assert pool.active == 0 and pool.clients == 0  # the lease was given back
        assert internal_errors_metric(server, "connection_end") == 1
        assert internal_errors_metric(server, "connection") == 0
        assert await greeting(port) == b"a\n"  # and the next one is served

    run_proxy(tmp_path, body)


def test_a_check_raising_counts_and_checking_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(checks, "probe", raising_on(checks.probe, 2))

    async def body(server, port):
        rs = server.pools()[0].servers[0]
        with trio.fail_after(10):
            while rs.counters.health_checks["ok"] < 3:
                await trio.sleep(0.05)
        assert internal_errors_metric(server, "check") == 1
        assert await greeting(port) == b"a\n"

    run_proxy(
        tmp_path,
        body,
        "health_check: {type: tcp, interval: 0.1s, timeout: 0.5s, rise: 1, fall: 3}",
    )
