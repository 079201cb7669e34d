"""lbproxy.net.accept.accept_loop on a real loopback socket: what the owner is handed,
a re-pointed owner, the barrier, and the end when the socket closes."""

from __future__ import annotations

import fcntl
import logging
import os
import socket

import trio

from lbproxy.net.accept import AcceptErrors, accept_loop
from lbproxy.net.barrier import internal_errors

log = logging.getLogger("test.accept")


def listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


class Owner:
    """Records (name, non-blocking?, peer) and closes each descriptor."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool, tuple]] = []
        self.accept_client = self.first
        self.got = trio.Event()

    def _note(self, name: str, fd: int, peer: tuple) -> None:
        nonblocking = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK)
        self.seen.append((name, nonblocking, peer))
        os.close(fd)
        self.got.set()

    def first(self, fd: int, peer: tuple, spawn) -> None:
        self._note("first", fd, peer)
        self.accept_client = self.second  # as a reload re-routes a listener

    def second(self, fd: int, peer: tuple, spawn) -> None:
        self._note("second", fd, peer)


async def connect(port: int) -> tuple:
    client = trio.socket.socket()
    await client.connect(("127.0.0.1", port))
    name = client.getsockname()
    client.close()
    return name


def test_each_client_goes_non_blocking_to_the_owner_read_afresh_each_time():
    async def main() -> None:
        sock = listening()
        owner = Owner()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept_loop, sock, owner, nursery.start_soon, AcceptErrors("t", log))
            peers = []
            for _ in range(2):
                owner.got = trio.Event()
                peers.append(await connect(sock.getsockname()[1]))
                with trio.fail_after(5):
                    await owner.got.wait()
            nursery.cancel_scope.cancel()
        sock.close()
        assert owner.seen == [("first", True, peers[0]), ("second", True, peers[1])]

    trio.run(main)


def test_an_exception_in_the_owner_is_counted_and_the_loop_goes_on():
    async def main() -> None:
        sock = listening()
        owner = Owner()
        calls = []

        def broken(fd: int, peer: tuple, spawn) -> None:
            calls.append(peer)
            os.close(fd)
            owner.accept_client = owner.second
            raise RuntimeError("a bug in one client's handling")

        owner.accept_client = broken
        before = internal_errors().counts["accept"]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept_loop, sock, owner, nursery.start_soon, AcceptErrors("t", log))
            await connect(sock.getsockname()[1])
            peer = await connect(sock.getsockname()[1])
            with trio.fail_after(5):
                await owner.got.wait()
            nursery.cancel_scope.cancel()
        sock.close()
        assert len(calls) == 1
        assert owner.seen == [("second", True, peer)]
        assert internal_errors().counts["accept"] == before + 1

    trio.run(main)


def test_the_loop_ends_when_its_socket_is_closed():
    async def main() -> None:
        sock = listening()
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    accept_loop, sock, Owner(), nursery.start_soon, AcceptErrors("t", log)
                )
                await trio.sleep(0.05)  # the loop waits on the empty backlog
                trio.lowlevel.notify_closing(sock)
                sock.close()
        # the nursery exited: the loop returned by itself

    trio.run(main)
