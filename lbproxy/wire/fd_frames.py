"""Frames with descriptors: the one framing of the Unix channels between lbproxy's own
processes — an upgrade's hand-over (runtime/upgrade.py) and the channel between the
supervisor of `workers: N` and each worker (runtime/workers/protocol.py).

Sans-io: this module says what bytes and descriptors go into each sendmsg and how
received bytes and descriptors become frames; lbproxy/net/fd_channel.py makes the calls.

    frame         4-byte big-endian body length, then the body: a JSON object for a
                  document (`encode_document`, `decode_document`), or bytes the caller
                  chose (a worker's configuration is a pickle)
    descriptors   ride on the frame's bytes (SCM_RIGHTS), at most SCM_MAX_FD per
                  sendmsg: the kernel refuses more in one call (EINVAL). A frame with
                  more goes in several calls: each batch but the last on one byte of the
                  frame, the last with the rest of it (`sendmsg_calls`).

Which frame a descriptor belongs to: a Unix stream socket's recvmsg returns at most one
sendmsg's descriptors, and returns nothing after the bytes they came with (Linux
unix_stream_read_generic stops there), so the descriptors of one recvmsg came with the
last bytes it returned. Every batch rides on bytes of its own frame, so they belong to
the frame that holds the last byte received with them (`FrameReader.feed`).

The peer is lbproxy's own parent or child over a private socketpair, but what arrives is
still checked: a length over MAX_BODY or more than MAX_FDS descriptors for one frame is a
FrameError as soon as it is seen (no buffer is sized by what the peer announces), and
every descriptor received is handed out once, in a frame, in the error or by `close()`,
so none is leaked.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

HEADER = 4  # bytes of the length that starts a frame
SCM_MAX_FD = 253  # descriptors the kernel takes in one sendmsg (include/net/scm.h)
# A hand-over carries the runtime state as JSON text in its JSON document: a state the
# new process takes is at most 64 MiB (wire/state_file.py MAX_BYTES), escaping may double
# it, and a larger one must still reach it (to be refused there, with its warning).
MAX_BODY = 1 << 30
# Descriptors in one frame: an upgrade hands over every listening socket in one; more
# than any configuration lists, still far below a process's descriptor limit.
MAX_FDS = 1 << 16


class FrameError(ValueError):
    """The bytes or descriptors received are not frames of this format. `fds`: the
    descriptors received and not handed out in a frame, for the caller to close."""

    def __init__(self, message: str, fds: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.fds = list(fds)


@dataclass
class Frame:
    body: bytes
    fds: list[int] = field(default_factory=list)


def frame(body: bytes) -> bytes:
    """The frame of `body`: its length, then the body."""
    if len(body) > MAX_BODY:
        raise FrameError(f"a frame body of {len(body)} bytes is over {MAX_BODY}")
    return len(body).to_bytes(HEADER, "big") + body


def sendmsg_calls(body: bytes, fds: Sequence[int] = ()) -> list[tuple[bytes, list[int]]]:
    """The sendmsg calls that send one frame of `body` with `fds`: (bytes, descriptors)
    each, at most SCM_MAX_FD descriptors a call. A call's bytes that sendmsg did not
    take go on without descriptors: the descriptors went with its first byte."""
    if len(fds) > MAX_FDS:
        raise FrameError(f"{len(fds)} descriptors in one frame are over {MAX_FDS}")
    data = frame(body)
    batches = [list(fds[i : i + SCM_MAX_FD]) for i in range(0, len(fds), SCM_MAX_FD)]
    if len(batches) > len(data):  # one byte a batch: MAX_FDS keeps this far away
        raise FrameError(f"{len(fds)} descriptors need a body of {len(batches)} bytes")
    calls: list[tuple[bytes, list[int]]] = []
    for batch in batches[:-1]:
        calls.append((data[:1], batch))
        data = data[1:]
    calls.append((data, batches[-1] if batches else []))
    return calls


class FrameReader:
    """Received bytes and descriptors in, whole frames out (`pop`)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._fds: list[int] = []  # of the frame in progress
        self._frames: deque[Frame] = deque()
        self._closed = False

    def feed(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """What one recvmsg returned: its bytes and the descriptors that came with them.
        FrameError when they cannot be frames; the reader is closed then."""
        if self._closed:
            raise FrameError("the reader is closed (after a bad frame or the end)", fds)
        if not data and fds:  # recvmsg never returns descriptors without a byte
            self._fail("descriptors without bytes", fds)
        self._buffer += data
        completed: list[Frame] = []
        while len(self._buffer) >= HEADER:
            size = int.from_bytes(self._buffer[:HEADER], "big")
            if size > MAX_BODY:
                self._fail(f"a frame of {size} bytes is over {MAX_BODY}", fds, completed)
            if len(self._buffer) < HEADER + size:
                break
            completed.append(Frame(bytes(self._buffer[HEADER : HEADER + size]), self._fds))
            del self._buffer[: HEADER + size]
            self._fds = []
        if fds:  # the frame that holds the last byte received (module header)
            owner = self._fds if self._buffer or not completed else completed[-1].fds
            owner.extend(fds)
            if len(owner) > MAX_FDS:
                self._fail(f"more than {MAX_FDS} descriptors in one frame", (), completed)
        self._frames.extend(completed)

    def pop(self) -> Frame | None:
        """The oldest whole frame not returned yet, or None."""
        return self._frames.popleft() if self._frames else None

    @property
    def partial(self) -> bool:
        """True while a frame has begun and not ended (at end of file: cut short)."""
        return bool(self._buffer)

    def close(self) -> list[int]:
        """Every descriptor received and not returned in a frame (to be closed); the
        reader takes nothing more."""
        self._closed = True
        fds = [fd for pending in self._frames for fd in pending.fds] + self._fds
        self._frames.clear()
        self._fds = []
        self._buffer.clear()
        return fds

    def _fail(self, message: str, fds: Sequence[int], completed: Sequence[Frame] = ()) -> None:
        held = [fd for pending in completed for fd in pending.fds]
        raise FrameError(message, [*held, *self.close(), *fds])


def encode_document(document: dict[str, Any]) -> bytes:
    """A document's body: JSON text."""
    return json.dumps(document).encode()


def decode_document(body: bytes) -> dict[str, Any]:
    """A frame's body as a document: a JSON object, else FrameError."""
    try:
        document = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FrameError(f"a frame is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise FrameError(f"a frame is JSON {type(document).__name__}, not an object")
    return document
