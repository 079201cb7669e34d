"""Frames with descriptors on a real Unix socketpair (lbproxy/net/fd_channel.py): blocking
and in trio, frames sent back to back before any is read, more descriptors than one
sendmsg carries, and no descriptor left open by a frame cut short or refused."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import trio

from lbproxy.net import fd_channel
from lbproxy.net.fd_channel import Channel
from lbproxy.wire.fd_frames import MAX_BODY, SCM_MAX_FD, Frame, FrameError, FrameReader


@contextmanager
def pipes(n: int) -> Iterator[list[tuple[int, int]]]:
    made = [os.pipe() for _ in range(n)]
    try:
        yield made
    finally:
        for read_end, write_end in made:
            os.close(read_end)
            os.close(write_end)


def same_pipes(received: list[int], sent: list[tuple[int, int]]) -> bool:
    """Each received descriptor is a write end of the pipe at its place (then closed)."""
    try:
        for fd, (read_end, _) in zip(received, sent, strict=True):
            os.write(fd, b"!")
            if os.read(read_end, 1) != b"!":
                return False
        return True
    finally:
        for fd in received:
            os.close(fd)


def writer_left(read_end: int) -> bool:
    """True while some descriptor of the pipe's write end is open in this process."""
    os.set_blocking(read_end, False)
    try:
        return os.read(read_end, 1) != b""  # b"": end of file, every write end closed
    except BlockingIOError:
        return True


# Three frames sent back to back before the receiver reads any: the descriptors of each
# must come out with it, wherever the kernel cuts the bytes.
BIG = b"x" * 300_000  # larger than the socket buffer: the sender blocks meanwhile


def test_frames_sent_back_to_back_keep_their_own_descriptors():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with pipes(2 * SCM_MAX_FD + 10) as many, pipes(3) as few, ours, theirs:
        frames = [
            (BIG, []),
            (b"many", [w for _, w in many]),
            (b"", []),
            (b"few" * 1000, [w for _, w in few]),
        ]

        def send_all() -> None:
            for body, fds in frames:
                fd_channel.send(ours, body, fds)

        sender = threading.Thread(target=send_all)
        sender.start()
        reader = FrameReader()
        received = [fd_channel.receive(theirs, reader) for _ in frames]
        sender.join(10)
        assert [r.body for r in received if r is not None] == [body for body, _ in frames]
        assert received[0].fds == received[2].fds == []
        assert same_pipes(received[1].fds, many)
        assert same_pipes(received[3].fds, few)
        ours.close()
        assert fd_channel.receive(theirs, reader) is None  # the end


def test_a_trio_channel_sends_and_receives_the_same_frames():
    async def main() -> list[Frame | None]:
        left, right = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sender, receiver = Channel(left), Channel(right)
        got: list[Frame | None] = []
        async with trio.open_nursery() as nursery:

            async def receive() -> None:
                for _ in range(3):
                    got.append(await receiver.receive())

            nursery.start_soon(receive)
            await sender.send(b"one", [w for _, w in many])
            await sender.send(BIG)
            await sender.send(b"three", [w for _, w in few])
        sender.close()
        got.append(await receiver.receive())
        receiver.close()
        return got

    with pipes(SCM_MAX_FD + 1) as many, pipes(1) as few:
        one, two, three, end = trio.run(main)
        assert (one.body, two.body, three.body, end) == (b"one", BIG, b"three", None)
        assert same_pipes(one.fds, many) and two.fds == [] and same_pipes(three.fds, few)


def sent_and_dropped(first_bytes: bytes, end: bool) -> bool:
    """Send `first_bytes` with a copy of a pipe's write end, then (with `end`) the end of
    file; receive. True when the receiver closed the copy it got."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    read_end, write_end = os.pipe()
    try:
        copy = os.dup(write_end)
        socket.send_fds(ours, [first_bytes], [copy])
        os.close(copy)
        if end:
            ours.close()
            assert fd_channel.receive(theirs, FrameReader()) is None
        else:
            with pytest.raises(FrameError):
                fd_channel.receive(theirs, FrameReader())
        os.close(write_end)
        return not writer_left(read_end)
    finally:
        os.close(read_end)
        ours.close()
        theirs.close()


def test_descriptors_of_a_frame_cut_short_by_the_end_are_closed():
    assert sent_and_dropped(b"\x00\x00\x00\x10{", end=True)  # 16 bytes announced, 1 sent


def test_a_refused_frame_closes_its_descriptors_and_raises():
    assert sent_and_dropped((MAX_BODY + 1).to_bytes(4, "big"), end=False)
