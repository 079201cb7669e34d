"""lbproxy.net.accept's two accept loops on a real loopback socket -- accept_loop (a task
waiting on the socket) and ReactorAcceptor (the data plane's: accepts in the pump
reactor's batches) -- what the owner is handed, a re-pointed owner, the barrier, and
the end when the socket closes."""

from __future__ import annotations

import fcntl
import logging
import os
import select
import socket

import pytest
import trio

from lbproxy.net import pump
from lbproxy.net.accept import AcceptErrors, ReactorAcceptor, accept_loop
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


async def serve_reactor(sock: socket.socket, owner, spawn, errors: AcceptErrors) -> None:
    await ReactorAcceptor(sock, owner, spawn, errors).serve()


LOOPS = pytest.mark.parametrize("loop", [accept_loop, serve_reactor], ids=["task", "reactor"])


async def connect(port: int) -> tuple:
    client = trio.socket.socket()
    await client.connect(("127.0.0.1", port))
    name = client.getsockname()
    client.close()
    return name


@LOOPS
def test_each_client_goes_non_blocking_to_the_owner_read_afresh_each_time(loop):
    async def main() -> None:
        sock = listening()
        owner = Owner()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(loop, sock, owner, nursery.start_soon, AcceptErrors("t", log))
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


@LOOPS
def test_an_exception_in_the_owner_is_counted_and_the_loop_goes_on(loop):
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
            nursery.start_soon(loop, sock, owner, nursery.start_soon, AcceptErrors("t", log))
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


def test_the_reactor_acceptor_stops_at_once_and_leaves_a_shared_socket_alone():
    """stop() before close, as Listener.close() does: the descriptor leaves the reactor's
    set even though its file stays open elsewhere (here a dup; in a worker, the
    supervisor's copy), so a client queued there later is neither accepted nor reported
    -- a closed descriptor left in the set would be reported forever (a busy reactor)."""

    async def main() -> None:
        sock = listening()
        elsewhere = sock.dup()  # the supervisor's copy of a worker's socket
        owner = Owner()
        async with trio.open_nursery() as nursery:
            acceptor = ReactorAcceptor(sock, owner, nursery.start_soon, AcceptErrors("t", log))
            nursery.start_soon(acceptor.serve)
            owner.got = trio.Event()
            await connect(sock.getsockname()[1])
            with trio.fail_after(5):
                await owner.got.wait()  # accepted in the reactor's batch
            reactor = pump.reactor()
            acceptor.stop()
            sock.close()
            with trio.fail_after(5):
                await connect(elsewhere.getsockname()[1])  # queued on the shared file
            await trio.sleep(0.1)  # the reactor's batches would have seen it by now
            # nothing reported for the shared file
            assert select.select([reactor.fileno()], [], [], 0)[0] == []
        # serve() returned by itself after stop(): the nursery exited
        assert len(owner.seen) == 1
        client, _ = elsewhere.accept()  # still there, for the socket's other owner
        client.close()
        elsewhere.close()

    trio.run(main)


def test_the_reactor_acceptor_ends_if_its_socket_was_closed_during_a_back_off():
    """A socket closed behind the acceptor's back while it waited out a failure (not by
    stop()): serve() returns instead of raising out of the listener's task."""

    sock = listening()

    class ClosedDuringBackOff(AcceptErrors):
        __slots__ = ()

        async def failed(self, exc: OSError) -> bool:  # the back-off, during which ...
            sock.close()  # ... someone closes the socket
            return True

    async def main() -> None:
        errors = ClosedDuringBackOff("t", log)
        acceptor = ReactorAcceptor(sock, Owner(), lambda *a: None, errors)
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(acceptor.serve)
                await trio.sleep(0.01)
                acceptor.failure = OSError(24, "Too many open files")
                acceptor.reactor.unlisten(acceptor.fd, acceptor.on_event)
                acceptor.wake.set()  # as on_event does on EMFILE

    trio.run(main)


def test_beyond_max_clients_a_client_is_closed_at_accept_and_refused():
    """The data plane's batch (compiled or pure, whichever runs) with a client count at
    its limit: the client is closed before the owner sees it, and refuse_client(peer) is
    called instead; one below the limit goes to accept_client as before. The count
    itself is the owner's to keep (connection.py): the batch only compares."""
    from lbproxy.net.descriptors import clients as process_count

    count = type(process_count)()  # the same type as the process's, compiled or pure

    class Limited(Owner):
        def __init__(self) -> None:
            super().__init__()
            self.refused: list[tuple] = []

        def refuse_client(self, peer: tuple) -> None:
            self.refused.append(peer)
            self.got.set()

    async def main() -> None:
        sock = listening()
        port = sock.getsockname()[1]
        owner = Limited()
        async with trio.open_nursery() as nursery:
            acceptor = ReactorAcceptor(
                sock, owner, nursery.start_soon, AcceptErrors("t", log), count
            )
            nursery.start_soon(acceptor.serve)
            count.limit, count.open = 2, 2  # full
            raw = socket.create_connection(("127.0.0.1", port))
            with trio.fail_after(5):
                await owner.got.wait()
            assert owner.refused == [raw.getsockname()] and owner.seen == []
            raw.settimeout(5)
            assert raw.recv(10) == b""  # closed at accept, nothing sent
            raw.close()
            count.open = 1  # one left: served
            owner.got = trio.Event()
            peer = await connect(port)
            with trio.fail_after(5):
                await owner.got.wait()
            assert [p for _, _, p in owner.seen] == [peer]
            assert len(owner.refused) == 1
            acceptor.stop()
        sock.close()

    trio.run(main)
