"""Frames with descriptors over a Unix stream socket: the sendmsg and recvmsg calls with
SCM_RIGHTS for the framing of lbproxy/wire/fd_frames.py (which says what goes into each
call and which frame a received descriptor belongs to).

    send(sock, body, fds), receive(sock, reader)
                  on a blocking socket: before a process's event loop runs, after it
                  ends, or from a thread (an upgrade's hand-over)
    Channel       the same in trio, on a trio socket

The receiving side reserves room for SCM_MAX_FD descriptors in each recvmsg, the most
one sendmsg carries; a receive cut short by the descriptor limit (MSG_CTRUNC: the kernel
closed the rest) is a FrameError, as is a hostile frame. On a FrameError and at end of
file, the descriptors received and not handed out in a frame are closed here.
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
from collections.abc import Iterable, Sequence
from typing import Any

import trio

from lbproxy.wire.fd_frames import SCM_MAX_FD, Frame, FrameError, FrameReader, sendmsg_calls

RECEIVE_BYTES = 1 << 16
ANCILLARY_BYTES = socket.CMSG_SPACE(SCM_MAX_FD * array.array("i").itemsize)


def _rights(fds: Sequence[int]) -> list[tuple[int, int, bytes]]:
    if not fds:
        return []
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]


def _received_fds(ancdata: Iterable[tuple[int, int, bytes]], flags: int) -> list[int]:
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if flags & socket.MSG_CTRUNC:
        raise FrameError("descriptors were lost on the way (the descriptor limit?)", fds)
    return list(fds)


def close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _feed(reader: FrameReader, data: bytes, ancdata: Any, flags: int) -> None:
    """One recvmsg's return into `reader`; on a FrameError, the descriptors received and
    not handed out are closed, and so is the reader."""
    try:
        reader.feed(data, _received_fds(ancdata, flags))
    except FrameError as exc:
        close_all([*exc.fds, *reader.close()])
        exc.fds = []
        raise


# -- blocking ---------------------------------------------------------------------------


def send(sock: socket.socket, body: bytes, fds: Sequence[int] = ()) -> None:
    """One frame on a blocking socket."""
    for data, batch in sendmsg_calls(body, fds):
        sent = sock.sendmsg([data], _rights(batch)) if batch else 0
        sock.sendall(data[sent:])


def receive(sock: socket.socket, reader: FrameReader) -> Frame | None:
    """The next frame on a blocking socket; None at end of file (a frame cut short by
    it is dropped, its descriptors closed). `reader` keeps what came beyond the frame."""
    while (received := reader.pop()) is None:
        data, ancdata, flags, _ = sock.recvmsg(RECEIVE_BYTES, ANCILLARY_BYTES)
        if not data:
            close_all(reader.close())
            return None
        _feed(reader, data, ancdata, flags)
    return received


# -- trio -------------------------------------------------------------------------------


class Channel:
    """Frames on a trio socket: one task may receive while others send (sends one
    after the other, so frames never interleave)."""

    def __init__(self, sock: trio.socket.SocketType, reader: FrameReader | None = None) -> None:
        self.sock = sock
        self.reader = reader if reader is not None else FrameReader()
        self._sending = trio.Lock()

    async def send(self, body: bytes, fds: Sequence[int] = ()) -> None:
        async with self._sending:
            for data, batch in sendmsg_calls(body, fds):
                if batch:
                    sent = await self.sock.sendmsg([data], _rights(batch))
                    data = data[sent:]
                while data:
                    data = data[await self.sock.send(data) :]

    async def receive(self) -> Frame | None:
        """The next frame; None at end of file (as `receive`)."""
        while (received := self.reader.pop()) is None:
            data, ancdata, flags, _ = await self.sock.recvmsg(RECEIVE_BYTES, ANCILLARY_BYTES)
            if not data:
                close_all(self.reader.close())
                return None
            _feed(self.reader, data, ancdata, flags)
        return received

    def close(self) -> None:
        close_all(self.reader.close())
        self.sock.close()
