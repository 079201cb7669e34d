"""The compiled connection path (lbproxy/net/_cpump.c) and its pure twin.

The accept4 and clock tests need the C extension (built by `pip install -e .`). The
pump tests run on both implementations of its API (the pure one by making it the one
new reactors use): a bug met while moving bytes ends that connection only, counted by
the exception barrier, and the reactor serves the others; the start, the FINs, the end
and its one on_end; counts on high and reused descriptor numbers. Real loopback TCP
sockets; the bug is a clock that raises once.
"""

from __future__ import annotations

import fcntl
import math
import os
import resource
import shutil
import socket
import subprocess
import sys

import pytest
import trio
import trio.testing

from lbproxy.net import compiled, pure_pump
from lbproxy.net import pump as pump_module
from lbproxy.net import reactor as reactor_module
from lbproxy.net.barrier import internal_errors
from lbproxy.net.pump import Flow
from tests.integration.harness import ROOT, compiled_path_expected

pytestmark = pytest.mark.integration

needs_c = pytest.mark.skipif(compiled.cpump is None, reason="runs on the pure path")


def tcp_pair(family: int = socket.AF_INET) -> tuple[socket.socket, socket.socket]:
    """(connected client, accepted server side), both blocking stdlib sockets."""
    host = "::1" if family == socket.AF_INET6 else "127.0.0.1"
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        listener.bind((host, 0))
        listener.listen(1)
        client = socket.create_connection(listener.getsockname()[:2])
        accepted, _ = listener.accept()
    return client, accepted


@needs_c
@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6], ids=["ipv4", "ipv6"])
def test_accept4_gives_a_nonblocking_descriptor_and_the_address_accept_gives(family):
    host = "::1" if family == socket.AF_INET6 else "127.0.0.1"
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        listener.bind((host, 0))
        listener.listen(2)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # an empty backlog: as socket.accept()
            compiled.cpump.accept(listener.fileno())
        first = socket.create_connection(listener.getsockname()[:2])
        second = socket.create_connection(listener.getsockname()[:2])
        try:
            fd, address = compiled.cpump.accept(listener.fileno())
            reference, reference_address = listener.accept()
            with socket.socket(fileno=fd) as accepted, reference:
                assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
                assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
                assert address == first.getsockname()
                assert type(address) is type(reference_address)
                assert len(address) == len(reference_address)
                first.sendall(b"hello")
                trio.run(trio.lowlevel.wait_readable, fd)
                assert accepted.recv(10) == b"hello"
        finally:
            first.close()
            second.close()


class Injected(Exception):
    """The bug we inject."""


def test_the_path_in_use_is_the_one_the_environment_asks_for():
    expected = "compiled" if compiled_path_expected() else "pure"
    assert expected == compiled.IMPLEMENTATION
    assert (compiled.cpump is not None) == (expected == "compiled")
    assert reactor_module.implementation() is (
        compiled.cpump if expected == "compiled" else pure_pump
    )


# -------------------------------------------------- the pump's API, on both implementations

IMPLEMENTATIONS = [
    pytest.param("compiled", marks=needs_c),
    pytest.param("pure"),
]


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """The implementation whose reactor a new run gets ("pure": the pure one even on
    the compiled path)."""
    impl = compiled.cpump if request.param == "compiled" else pure_pump
    monkeypatch.setattr(reactor_module, "_implementation", impl)
    return impl


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def pump_pair():
    """(client, server, proxy_client_fd, proxy_server_fd): two connected loopback pairs,
    the proxy's sides as plain non-blocking descriptors for a pump."""
    client, proxy_client = tcp_pair()
    proxy_server, server = tcp_pair()
    for s in (proxy_client, proxy_server):
        s.setblocking(False)
    return client, server, proxy_client.detach(), proxy_server.detach()


async def until(condition, timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.01)


def test_the_runs_reactor_is_the_implementations_and_close_closes_both_descriptors(
    implementation,
):
    async def main():
        client, server, a, b = pump_pair()
        try:
            r = pump_module.reactor()
            assert type(r) is implementation.Reactor
            assert pump_module.reactor() is r  # one per run
            ended = []
            p = r.open(a, b, b"", 30.0, ended.append)
            assert p.outcome is None and r.pumps == 1
            p.close()
            assert ended == [p] and p.outcome == "cancelled" and r.pumps == 0
            assert _closed(a) and _closed(b)
            p.close()  # once only
            assert ended == [p]
        finally:
            client.close()
            server.close()

    trio.run(main)


def test_the_end_of_the_run_ends_its_open_pumps(implementation):
    """A pump still open when its trio run ends (its reactor closes with the run) ends
    "cancelled", both descriptors closed, its on_end called: nothing leaks past a run."""
    client, server, a, b = pump_pair()
    ended = []

    async def main():
        pump_module.reactor().open(a, b, b"", 30.0, lambda p: ended.append(p.outcome))
        client.sendall(b"ping")
        with trio.fail_after(5):
            await trio.lowlevel.wait_readable(server)
        assert server.recv(10) == b"ping"

    try:
        trio.run(main)
        assert ended == ["cancelled"]
        assert _closed(a) and _closed(b)
        assert server.recv(10) == b""  # closed, as a pump's end closes: a FIN
    finally:
        client.close()
        server.close()


def test_initial_bytes_fins_and_end_call_on_end_once_with_both_descriptors_closed(
    implementation,
):
    """The start (both descriptors watched, the initial bytes written first, the PROXY
    header among them not counted), the two FINs, the end and one on_end."""

    async def main():
        client, server, a, b = pump_pair()
        ended = []
        try:
            header = b"PROXY UNKNOWN\r\n"
            flow = Flow(30.0)
            p = pump_module.reactor().open(
                a,
                b,
                header + b"early ",
                flow.idle_timeout,
                lambda q: ended.append((q.outcome, _closed(a), _closed(b))),
                len(header),
            )
            flow.pump = p
            assert p.outcome is None and flow.pumping
            client.sendall(b"request")
            client.shutdown(socket.SHUT_WR)
            got = b""
            with trio.fail_after(5):
                while not got.endswith(b"request"):
                    await trio.lowlevel.wait_readable(server)
                    got += server.recv(100)
            assert got == b"PROXY UNKNOWN\r\nearly request"
            server.sendall(b"response")
            server.shutdown(socket.SHUT_WR)
            await until(lambda: ended)
            assert ended == [("closed", True, True)]
            assert client.recv(100) == b"response"
            assert client.recv(100) == b""  # the FIN passed on
            assert (flow.bytes_in, flow.bytes_out) == (len(b"early request"), len(b"response"))
            assert not flow.pumping
        finally:
            for s in (client, server):
                s.close()

    trio.run(main)


def test_an_exception_in_on_end_is_recorded_and_the_reactor_goes_on(implementation):
    """The barrier around the one callback: on_end raising is counted
    (connection_end), the process and the other connections go on."""

    async def main():
        before = internal_errors().counts.get("connection_end", 0)
        pairs = [pump_pair() for _ in range(2)]
        ended = []

        def bad(_):
            raise Injected("on_end")

        try:
            pumps = [
                pump_module.reactor().open(a, b, b"", math.inf, bad if i == 0 else ended.append)
                for i, (_, _, a, b) in enumerate(pairs)
            ]
            for client, server, _, _ in pairs:
                client.shutdown(socket.SHUT_WR)
                server.shutdown(socket.SHUT_WR)
            await until(lambda: ended and pumps[0].outcome is not None)
            assert ended == [pumps[1]]
            assert pumps[0].outcome == pumps[1].outcome == "closed"
            assert internal_errors().counts["connection_end"] == before + 1
            assert all(_closed(fd) for _, _, a, b in pairs for fd in (a, b))
        finally:
            for client, server, _, _ in pairs:
                client.close()
                server.close()

    trio.run(main)


def test_flow_close_and_idle_timeout_end_the_pump(implementation):
    """Flow.close() (the drain, on_down: close) and the idle deadline reach the pump."""

    async def main():
        outcomes = []
        keep = []
        for how in ("close", "idle"):
            client, server, a, b = pump_pair()
            keep += [client, server]
            flow = Flow(0.2 if how == "idle" else 30.0)
            flow.pump = pump_module.reactor().open(
                a, b, b"", flow.idle_timeout, lambda q: outcomes.append(q.outcome)
            )
            if how == "close":
                flow.close()
        try:
            await until(lambda: len(outcomes) == 2)
            assert outcomes == ["cancelled", "idle_timeout"]
        finally:
            for s in keep:
                s.close()

    trio.run(main)


def test_a_bug_while_moving_bytes_ends_that_connection_only(implementation):
    """A failure met while one connection's bytes move (here: the run's clock raising
    once, read as a chunk is counted) ends that connection ("error", the exception in
    pump.error), counted by the barrier in lbproxy_internal_errors_total{where="pump"};
    the reactor goes on serving the others, both ways."""
    fault: list[Exception] = []

    async def main():
        errors_before = internal_errors().counts["pump"]
        current_time = trio.lowlevel.current_clock().current_time

        def clock() -> float:
            if fault:
                raise fault.pop()
            return current_time()

        r = reactor_module.start(implementation, clock)
        bad_client, bad_server, a, b = pump_pair()
        good_client, good_server, c, d = pump_pair()
        ended = []
        try:
            bad = r.open(a, b, b"", 30.0, ended.append)
            good = r.open(c, d, b"", 30.0, ended.append)
            good_client.sendall(b"ping")
            with trio.fail_after(5):
                await trio.lowlevel.wait_readable(good_server)
            assert good_server.recv(10) == b"ping"
            fault.append(Injected("the clock"))
            bad_client.sendall(b"0123456789")
            await until(lambda: bad.outcome is not None)
            assert (bad.outcome, type(bad.error)) == ("error", Injected)
            assert ended == [bad]
            assert internal_errors().counts["pump"] == errors_before + 1
            # the other connection still works, both ways, after the bug
            good_server.sendall(b"pong")
            with trio.fail_after(5):
                await trio.lowlevel.wait_readable(good_client)
            assert good_client.recv(10) == b"pong"
            good_client.shutdown(socket.SHUT_WR)
            good_server.shutdown(socket.SHUT_WR)
            await until(lambda: good.outcome is not None)
            assert good.outcome == "closed" and (good.bytes_in, good.bytes_out) == (4, 4)
        finally:
            for s in (bad_client, bad_server, good_client, good_server):
                s.close()

    trio.run(main)


UP = [b"a" * 100, b"b" * 5000, b"c" * 40000]  # the last is more than COPY_CHUNK: spliced
DOWN = [b"x" * 300, b"y" * 30000, b"z" * 7]


def test_every_byte_is_counted_and_the_time_of_the_last(implementation):
    """UP from the client to the server and DOWN back, a chunk at a time, then both
    ends shut: every byte counted once, as an int, and last_activity within the run."""

    async def main():
        client, server, a, b = pump_pair()
        for s in (client, server):
            s.setblocking(False)
        ts = trio.socket.from_stdlib_socket
        ca, sa = ts(client), ts(server)
        started = trio.current_time()
        p = pump_module.reactor().open(a, b, b"", 30.0, None)

        async def relay(src, dst, chunk: bytes) -> None:
            sent = 0
            while sent < len(chunk):
                sent += await src.send(chunk[sent:])
            got = b""
            while len(got) < len(chunk):
                got += await dst.recv(65536)
            assert got == chunk

        try:
            with trio.fail_after(10):
                for up, down in zip(UP, DOWN, strict=True):
                    await relay(ca, sa, up)
                    await relay(sa, ca, down)
                ca.shutdown(socket.SHUT_WR)
                sa.shutdown(socket.SHUT_WR)
                await until(lambda: p.outcome is not None)
            assert p.outcome == "closed"
            assert (p.bytes_in, p.bytes_out) == (sum(map(len, UP)), sum(map(len, DOWN)))
            assert type(p.bytes_in) is int and type(p.bytes_out) is int
            assert started <= p.last_activity <= trio.current_time()
        finally:
            ca.close()
            sa.close()

    trio.run(main)


def _free_descriptors(count: int, start: int) -> list[int]:
    """`count` descriptor numbers from `start` on that nothing in this process holds."""
    free: list[int] = []
    fd = start
    while len(free) < count:
        if _closed(fd):
            free.append(fd)
        fd += 1
    return free


def test_pumps_on_high_and_reused_descriptor_numbers_get_their_own_events(implementation):
    """The reactor finds a descriptor's pump by its number: pumps on numbers past
    2,000, then two more on the same numbers once the first ones closed them, each move
    their own bytes."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2200:
        pytest.skip(f"RLIMIT_NOFILE {soft}: no descriptor numbers past 2,000")

    async def main():
        numbers = _free_descriptors(4, 2000)
        for round_ in range(2):
            pumps = []
            for i in range(2):
                client, proxy_client = tcp_pair()
                proxy_server, server = tcp_pair()
                fds = numbers[2 * i : 2 * i + 2]
                for fd, s in zip(fds, (proxy_client, proxy_server), strict=True):
                    os.dup2(s.fileno(), fd)
                    os.set_blocking(fd, False)
                    s.close()
                ended: list[object] = []
                p = pump_module.reactor().open(
                    fds[0], fds[1], b"", 30.0, lambda q, ended=ended: ended.append(q.outcome)
                )
                pumps.append((client, server, p, ended, f"{round_}.{i}".encode()))
            try:
                for client, server, _, _, tag in pumps:
                    client.sendall(b"up " + tag)
                    server.sendall(b"down " + tag)
                with trio.fail_after(5):
                    for client, server, _, _, tag in pumps:
                        for end, want in ((server, b"up " + tag), (client, b"down " + tag)):
                            got = b""
                            while len(got) < len(want):
                                await trio.lowlevel.wait_readable(end)
                                got += end.recv(100)
                            assert got == want
                        client.shutdown(socket.SHUT_WR)
                        server.shutdown(socket.SHUT_WR)
                    while not all(ended for _, _, _, ended, _ in pumps):
                        await trio.sleep(0.01)
                for _, _, p, ended, tag in pumps:
                    assert ended == ["closed"]
                    assert (p.bytes_in, p.bytes_out) == (3 + len(tag), 5 + len(tag))
                assert all(_closed(fd) for fd in numbers)  # free for the next round
            finally:
                for client, server, *_ in pumps:
                    client.close()
                    server.close()

    trio.run(main)


@needs_c
def test_the_c_clock_reads_the_runs_clock():
    """The connection handler's clock (pump.run_clock(): _cpump.Clock on the compiled
    path): trio's SystemClock computed in C, the same clock as current_time(); any
    other clock (MockClock) called through."""
    clock_type = compiled.cpump.Clock

    async def system():
        current_time = trio.lowlevel.current_clock().current_time
        clock = pump_module.run_clock()
        assert type(clock) is clock_type and clock.native == 1
        readings = []
        for _ in range(100):
            readings += [current_time(), clock()]
        assert readings == sorted(readings)  # one monotonic clock, interleaved
        assert all(type(r) is float for r in readings)

    async def mock():
        clock = pump_module.run_clock()
        assert clock.native == 0
        await trio.sleep(5)
        assert clock() == trio.current_time() == 5.0

    trio.run(system)
    trio.run(mock, clock=trio.testing.MockClock(autojump_threshold=0))
    other = clock_type(lambda: 0.25)
    assert other.native == 0 and other() == 0.25
    with pytest.raises(TypeError):
        other(1)  # a clock takes no argument
    with pytest.raises(TypeError):
        clock_type(42)


def test_a_last_activity_read_keeps_its_value_while_the_pump_goes_on(implementation):
    """Each chunk's time is the pump's last_activity; a value Python code read is its
    own: it keeps its value while later chunks move the pump's on."""

    async def main():
        client, server, a, b = pump_pair()
        p = pump_module.reactor().open(a, b, b"", 30.0, None)
        try:
            held = []
            with trio.fail_after(5):
                for i in range(4):
                    client.sendall(b"tick")
                    await trio.lowlevel.wait_readable(server)
                    assert server.recv(100) == b"tick"
                    if i % 2:  # every other chunk's time, held on to
                        held.append((p.last_activity, repr(p.last_activity)))
                    await trio.sleep(0.01)
            assert [repr(value) for value, _ in held] == [text for _, text in held]
            assert held[0][0] < held[1][0] == p.last_activity
            assert p.bytes_in == 16
        finally:
            p.close()
            for s in (client, server):
                s.close()

    trio.run(main)


def test_an_extension_built_from_older_source_is_set_aside_for_the_pure_path(tmp_path):
    """An editable install not rebuilt after a pull keeps an old _cpump: it imports, but
    lacks what this source calls. lbproxy runs the pure path and says why, instead of
    failing on a missing name at the first connection. The stale extension here is a
    module of that name with an older interface number, in a copy of the package."""
    copy = tmp_path / "lbproxy"
    shutil.copytree(ROOT / "lbproxy", copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (copy / "net" / "_cpump.py").write_text(f"C_API = {compiled.C_API - 1}\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("LBPROXY_PURE", None)
    out = subprocess.run(
        [sys.executable, "-m", "lbproxy", "--version"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1] == (
        "connection path: pure Python (the compiled extension is stale (interface "
        f"{compiled.C_API - 1}, this source's {compiled.C_API}): rebuild it with "
        "pip install -e .)"
    )
