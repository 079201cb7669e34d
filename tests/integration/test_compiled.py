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
