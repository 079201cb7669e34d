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
import socket

import pytest
import trio

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
