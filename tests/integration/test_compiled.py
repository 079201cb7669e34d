"""The compiled connection path (issue 26, lbproxy/net/_cpump.c) and its pure twin.

The accept4 tests need the C extension (built by `pip install -e .`). The others run on
whichever path this process uses -- compiled by default, pure under LBPROXY_PURE=1
(scripts/test runs this file both ways): a bug met while moving bytes ends that
connection only, counted by the exception barrier, and the reactor serves the others.
Real loopback TCP sockets; the bug is a flow whose byte counter raises.
"""

from __future__ import annotations

import fcntl
import os
import resource
import socket

import pytest
import trio
import trio.testing

from lbproxy.net import compiled
from lbproxy.net import pump as pump_module
from lbproxy.net.barrier import internal_errors
from lbproxy.net.pump import Flow, pump
from tests.integration.harness import compiled_path_expected

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


class FaultyFlow(Flow):
    """A flow whose client -> server counter raises once it would pass `fail_at`."""

    __slots__ = ("_in", "fail_at")

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        super().__init__()

    @property  # type: ignore[override]
    def bytes_in(self) -> int:
        return self._in

    @bytes_in.setter
    def bytes_in(self, value: int) -> None:
        if value > self.fail_at:
            raise Injected(f"bytes_in {value}")
        self._in = value


def test_a_bug_while_moving_bytes_ends_that_connection_only():
    async def main():
        errors_before = internal_errors().counts["pump"]
        bad_client, bad_proxy_side = tcp_pair()
        bad_server_side, bad_server = tcp_pair()
        good_client, good_proxy_side = tcp_pair()
        good_server_side, good_server = tcp_pair()
        sockets = [bad_client, bad_proxy_side, bad_server_side, bad_server]
        sockets += [good_client, good_proxy_side, good_server_side, good_server]
        for s in sockets:
            s.setblocking(False)
        try:
            trio_socket = trio.socket.from_stdlib_socket
            results: dict[str, object] = {}

            async def run(name, a, b, flow):
                try:
                    results[name] = await pump(trio_socket(a), trio_socket(b), flow)
                except Injected as exc:
                    results[name] = exc

            good_flow = Flow()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "bad", bad_proxy_side, bad_server_side, FaultyFlow(3))
                nursery.start_soon(run, "good", good_proxy_side, good_server_side, good_flow)
                await trio.sleep(0.05)
                bad_client.send(b"0123456789")  # 10 > 3: the counter raises
                good_client.send(b"ping")
                with trio.fail_after(5):
                    await trio.lowlevel.wait_readable(good_server)
                    assert good_server.recv(10) == b"ping"
                    while "bad" not in results:
                        await trio.sleep(0.01)
                # the other connection still works, both ways, after the bug
                good_server.send(b"pong")
                with trio.fail_after(5):
                    await trio.lowlevel.wait_readable(good_client)
                    assert good_client.recv(10) == b"pong"
                good_client.shutdown(socket.SHUT_WR)
                good_server.shutdown(socket.SHUT_WR)
            assert isinstance(results["bad"], Injected)
            assert results["good"] == "closed"
            assert (good_flow.bytes_in, good_flow.bytes_out) == (4, 4)
            assert internal_errors().counts["pump"] == errors_before + 1
        finally:
            for s in sockets:
                s.close()

    trio.run(main)


def test_the_path_in_use_is_the_one_the_environment_asks_for():
    expected = "compiled" if compiled_path_expected() else "pure"
    assert expected == compiled.IMPLEMENTATION
    assert (compiled.cpump is not None) == (expected == "compiled")


# ------------------------------------------- one pump object per connection (issue 26)

IMPLEMENTATIONS = [
    pytest.param("compiled", marks=needs_c),
    pytest.param("pure"),
]


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which pump new_pump() makes: "pure" hides the C extension from pump.py."""
    if request.param == "pure":
        monkeypatch.setattr(pump_module, "cpump", None)
    return str(request.param)


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_new_pump_is_one_c_object_on_the_compiled_path(implementation):
    async def main():
        client, proxy_client = tcp_pair()
        proxy_server, server = tcp_pair()
        try:
            p = pump_module.new_pump(
                proxy_client.detach(), proxy_server.detach(), Flow(), close_sockets=True
            )
            if implementation == "compiled":
                assert type(p) is compiled.cpump.Pump
            else:
                assert type(p) is pump_module.Pump
            p.close()
            assert _closed(p.client_fd) and _closed(p.server_fd)
        finally:
            for s in (client, server):
                s.close()

    trio.run(main)


def test_start_preamble_fins_and_end_call_on_end_once_with_both_descriptors_closed(
    implementation,
):
    """What moved into C: the start (both descriptors watched, the preamble written
    first and not counted), the two FINs, the close and one on_end -- the same on both."""

    async def main():
        client, proxy_client = tcp_pair()
        proxy_server, server = tcp_pair()
        fds = (proxy_client.detach(), proxy_server.detach())
        ended = []
        try:
            flow = Flow(30.0)
            p = pump_module.new_pump(
                *fds,
                flow,
                preamble=b"PROXY UNKNOWN\r\n",
                initial_client_bytes=b"early ",
                close_sockets=True,
            )
            p.on_end = lambda q: ended.append((q.outcome, _closed(fds[0]), _closed(fds[1])))
            p.start()
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
            with trio.fail_after(5):
                while not ended:
                    await trio.sleep(0.01)
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
        pairs = []
        for _ in range(2):
            client, proxy_client = tcp_pair()
            proxy_server, server = tcp_pair()
            pairs.append((client, server, proxy_client.detach(), proxy_server.detach()))
        ended = []

        def bad(_):
            raise Injected("on_end")

        try:
            pumps = []
            for i, (_, _, a, b) in enumerate(pairs):
                p = pump_module.new_pump(a, b, Flow(), close_sockets=True)
                p.on_end = bad if i == 0 else ended.append
                p.start()
                pumps.append(p)
            for client, server, _, _ in pairs:
                client.shutdown(socket.SHUT_WR)
                server.shutdown(socket.SHUT_WR)
            with trio.fail_after(5):
                while not ended or pumps[0].outcome is None:
                    await trio.sleep(0.01)
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
            client, proxy_client = tcp_pair()
            proxy_server, server = tcp_pair()
            keep += [client, server]
            flow = Flow(0.2 if how == "idle" else 30.0)
            p = pump_module.new_pump(
                proxy_client.detach(), proxy_server.detach(), flow, close_sockets=True
            )
            p.on_end = lambda q: outcomes.append(q.outcome)
            p.start()
            if how == "close":
                flow.close()
        try:
            with trio.fail_after(5):
                while len(outcomes) < 2:
                    await trio.sleep(0.01)
            assert outcomes == ["cancelled", "idle_timeout"]
        finally:
            for s in keep:
                s.close()

    trio.run(main)


# ------------------------------- the flow's counters, whatever the flow's class (issue 26)
#
# The C pump writes a Flow's bytes_in / bytes_out / last_activity straight into its
# __slots__ when the class lets the generic attribute path do exactly that; these flows
# do not, or stop doing so halfway, and must still see every byte counted.


class PropertyFlow(Flow):
    """bytes_in and bytes_out are properties over other slots (a subclass may do so)."""

    __slots__ = ("_in", "_out", "writes")

    def __init__(self) -> None:
        self.writes = 0
        super().__init__()

    @property
    def bytes_in(self) -> int:
        return self._in

    @bytes_in.setter
    def bytes_in(self, value: int) -> None:
        self.writes += 1
        self._in = value

    @property
    def bytes_out(self) -> int:
        return self._out

    @bytes_out.setter
    def bytes_out(self, value: int) -> None:
        self.writes += 1
        self._out = value


class SetattrFlow(Flow):
    """A __setattr__ that sees every assignment, then makes it."""

    __slots__ = ("seen",)
    seen: dict[str, int]

    def __init__(self) -> None:
        object.__setattr__(self, "seen", {})
        super().__init__()

    def __setattr__(self, name: str, value: object) -> None:
        self.seen[name] = self.seen.get(name, 0) + 1
        super().__setattr__(name, value)


class DictFlow(Flow):
    """No __slots__ of its own: instances have a __dict__, the counters stay slots."""


class LateFlow(Flow):
    """Gains a bytes_in property once a pump has counted into its slot (see below)."""

    __slots__ = ("_late_in",)
    _late_in: int


UP = [b"a" * 100, b"b" * 5000, b"c" * 40000]  # the last is more than COPY_CHUNK: spliced
DOWN = [b"x" * 300, b"y" * 30000, b"z" * 7]


async def _pump_both_ways(flow: Flow) -> object:
    """UP from the client to the server and DOWN back, a chunk at a time, through one
    pump (new_pump: the C one on the compiled path); then both ends shut. Its outcome,
    or the exception pump() raised."""
    client, proxy_client = tcp_pair()
    proxy_server, server = tcp_pair()
    ends = [client, proxy_client, proxy_server, server]
    for s in ends:
        s.setblocking(False)
    trio_socket = trio.socket.from_stdlib_socket
    a, b = trio_socket(client), trio_socket(server)
    outcome: list[object] = []

    async def run(cancel_scope: trio.CancelScope) -> None:
        try:
            outcome.append(await pump(trio_socket(proxy_client), trio_socket(proxy_server), flow))
        except Exception as exc:  # what pump() raised: the outcome, and the end of it
            outcome.append(exc)
            cancel_scope.cancel()

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
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, nursery.cancel_scope)
                await trio.sleep(0.02)
                for up, down in zip(UP, DOWN, strict=True):
                    await relay(a, b, up)
                    await relay(b, a, down)
                a.shutdown(socket.SHUT_WR)
                b.shutdown(socket.SHUT_WR)
    finally:
        a.close()
        b.close()
        for s in ends:
            s.close()
    return outcome[0]


@pytest.mark.parametrize("flow_type", [Flow, PropertyFlow, SetattrFlow, DictFlow])
def test_every_byte_is_counted_whatever_the_flows_class(implementation, flow_type):
    async def main():
        flow = flow_type()
        started = trio.current_time()
        assert await _pump_both_ways(flow) == "closed"
        assert flow.bytes_in == sum(map(len, UP))
        assert flow.bytes_out == sum(map(len, DOWN))
        assert type(flow.bytes_in) is int and type(flow.bytes_out) is int
        assert started <= flow.last_activity <= trio.current_time()
        if isinstance(flow, PropertyFlow):  # each chunk went through the setters
            assert flow.writes >= 2 + len(UP) + len(DOWN)
        if isinstance(flow, SetattrFlow):  # and through __setattr__
            assert flow.seen["bytes_in"] >= 1 + len(UP)
            assert flow.seen["bytes_out"] >= 1 + len(DOWN)
            assert flow.seen["last_activity"] >= 1 + len(UP) + len(DOWN)

    trio.run(main)


def test_a_flow_class_changed_after_pumping_is_counted_the_new_way(implementation):
    """A class whose counter slot a pump has used, then given a bytes_in property: the
    next pump counts through the property (the C pump's layout of the class is stale
    and must not be used)."""
    writes: list[int] = []

    def get_in(self: LateFlow) -> int:
        return self._late_in

    def set_in(self: LateFlow, value: int) -> None:
        writes.append(value)
        self._late_in = value

    async def main():
        first = LateFlow()
        assert await _pump_both_ways(first) == "closed"
        assert first.bytes_in == sum(map(len, UP))
        LateFlow.bytes_in = property(get_in, set_in)
        try:
            second = LateFlow()
            assert await _pump_both_ways(second) == "closed"
            assert second.bytes_in == sum(map(len, UP))
            assert writes[0] == 0 and writes[-1] == sum(map(len, UP))
            assert len(writes) >= 1 + len(UP)
            assert second.bytes_out == sum(map(len, DOWN))
        finally:
            del LateFlow.bytes_in  # Flow's slot again, for whoever runs next

    trio.run(main)


def test_an_unset_counter_ends_that_connection_with_attribute_error(implementation):
    """A flow whose bytes_in slot was deleted: the first chunk's count raises
    AttributeError (as `flow.bytes_in += n` does), the barrier ends that connection and
    counts it; the process goes on."""

    async def main():
        errors_before = internal_errors().counts["pump"]
        flow = Flow()
        del flow.bytes_in
        outcome = await _pump_both_ways(flow)
        assert isinstance(outcome, AttributeError) and "bytes_in" in str(outcome)
        assert flow.bytes_out == 0  # nothing came back: the connection ended
        assert internal_errors().counts["pump"] == errors_before + 1

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
    """The reactor finds a descriptor's pump by its number (the C side keeps one int per
    number, kept after the pump ends): pumps on numbers past 2,000, then two more on the
    same numbers once the first ones closed them, each move their own bytes."""
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
                flow = Flow(30.0)
                ended: list[object] = []
                p = pump_module.new_pump(fds[0], fds[1], flow, close_sockets=True)
                p.on_end = lambda q, ended=ended: ended.append(q.outcome)
                p.start()
                pumps.append((client, server, flow, ended, f"{round_}.{i}".encode()))
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
                for _, _, flow, ended, tag in pumps:
                    assert ended == ["closed"]
                    assert (flow.bytes_in, flow.bytes_out) == (3 + len(tag), 5 + len(tag))
                assert all(_closed(fd) for fd in numbers)  # free for the next round
            finally:
                for client, server, *_ in pumps:
                    client.close()
                    server.close()


@needs_c
def test_the_c_clock_reads_the_runs_clock():
    """_cpump.Clock (the connection handler's clock): trio's SystemClock computed in C,
    the same clock as current_time(); any other clock (MockClock) called through."""
    clock_type = compiled.cpump.Clock

    async def system():
        current_time = trio.lowlevel.current_clock().current_time
        clock = clock_type(current_time)
        assert clock.native == 1
        readings = []
        for _ in range(100):
            readings += [current_time(), clock()]
        assert readings == sorted(readings)  # one monotonic clock, interleaved
        assert all(type(r) is float for r in readings)

    async def mock():
        clock = clock_type(trio.lowlevel.current_clock().current_time)
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


@needs_c
def test_a_c_pump_given_its_reactor_serves_as_one_that_looks_it_up():
    """The handler passes the run's reactor to the C pump (no RunVar lookup per
    connection): the pump is the same reactor's and moves the bytes."""

    async def main():
        client, proxy_client = tcp_pair()
        proxy_server, server = tcp_pair()
        reactor = pump_module._reactor()
        ended = []
        try:
            p = compiled.cpump.Pump(
                proxy_client.detach(), proxy_server.detach(), Flow(), b"", 0, True, True, reactor
            )
            assert p.reactor is reactor
            p.on_end = ended.append
            p.start()
            client.sendall(b"ping")
            client.shutdown(socket.SHUT_WR)
            server.shutdown(socket.SHUT_WR)
            with trio.fail_after(5):
                while not ended:
                    await trio.sleep(0.01)
            assert p.outcome == "closed" and p.flow.bytes_in == 4
            assert server.recv(100) == b"ping"  # moved by the reactor before it ended
        finally:
            client.close()
            server.close()

    trio.run(main)


def test_a_last_activity_read_keeps_its_value_while_the_pump_goes_on(implementation):
    """The C pump stores each chunk's time in the flow's last_activity, reusing the float
    there when nothing else holds it; one that Python code read is its own: it keeps
    its value while later chunks move the flow's on."""

    async def main():
        client, proxy_client = tcp_pair()
        proxy_server, server = tcp_pair()
        flow = Flow(30.0)
        p = pump_module.new_pump(
            proxy_client.detach(), proxy_server.detach(), flow, close_sockets=True
        )
        p.start()
        try:
            held = []
            with trio.fail_after(5):
                for i in range(4):
                    client.sendall(b"tick")
                    await trio.lowlevel.wait_readable(server)
                    assert server.recv(100) == b"tick"
                    if i % 2:  # every other chunk's time, held on to
                        held.append((flow.last_activity, repr(flow.last_activity)))
                    await trio.sleep(0.01)
            assert [repr(value) for value, _ in held] == [text for _, text in held]
            assert held[0][0] < held[1][0] == flow.last_activity
            assert flow.bytes_in == 16
        finally:
            p.close()
            for s in (client, server):
                s.close()

    trio.run(main)
