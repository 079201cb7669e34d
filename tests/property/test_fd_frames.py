"""Frames with descriptors (lbproxy/wire/fd_frames.py) under any input.

Whatever `sendmsg_calls` sends comes out of a FrameReader as the same frames with the
same descriptors, however a Unix stream socket cuts the bytes (a model of Linux's
receive queue below: one buffer per send call, a recvmsg stops after the one whose
descriptors it returns). Hostile bytes and descriptors are FrameErrors, never another
exception, and every descriptor fed in comes out exactly once: in a frame, in the error,
or from `close()` (so the I/O side can close it)."""

from __future__ import annotations

from collections import deque
from itertools import count

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lbproxy.wire.fd_frames import (
    HEADER,
    MAX_BODY,
    MAX_FDS,
    SCM_MAX_FD,
    Frame,
    FrameError,
    FrameReader,
    decode_document,
    encode_document,
    frame,
    sendmsg_calls,
)


class ReceiveQueue:
    """A Unix stream socket's receive queue as Linux keeps it: one buffer per send call,
    its descriptors with it. A recvmsg takes bytes across buffers and stops after the
    first one that carried descriptors (unix_stream_read_generic); with `glue` False it
    also stops before one (an older or stricter kernel), which the reader must take too.
    """

    def __init__(self) -> None:
        self.buffers: deque[tuple[bytearray, list[int]]] = deque()

    def send(self, data: bytes, fds: list[int]) -> None:
        self.buffers.append((bytearray(data), list(fds)))

    def recvmsg(self, size: int, glue: bool) -> tuple[bytes, list[int]]:
        out = bytearray()
        while self.buffers and len(out) < size:
            data, fds = self.buffers[0]
            if fds and out and not glue:
                break
            taken = data[: size - len(out)]
            out += taken
            del data[: len(taken)]
            received, fds[:] = list(fds), []
            if not data:
                self.buffers.popleft()
            if received:
                return bytes(out), received
        return bytes(out), []


fd_numbers = count(1000)
bodies = st.binary(max_size=600)
frames_in = st.lists(st.tuples(bodies, st.integers(0, 2 * SCM_MAX_FD + 7)), max_size=6)


@settings(max_examples=300, deadline=None)
@given(frames_in, st.data())
@example([(b"", SCM_MAX_FD * 4)], None)  # an empty body: 4 header bytes carry 4 batches
def test_what_is_sent_is_received_as_the_same_frames_and_descriptors(sent, data):
    queue = ReceiveQueue()
    expected = []
    for body, fd_count in sent:
        fds = [next(fd_numbers) for _ in range(fd_count)]
        expected.append(Frame(body, fds))
        for chunk, batch in sendmsg_calls(body, fds):
            assert len(batch) <= SCM_MAX_FD
            assert chunk or not batch  # descriptors always ride on a byte
            # sendmsg may take only part of the bytes: the rest goes on without them
            taken = data.draw(st.integers(1, len(chunk))) if data and chunk else len(chunk)
            queue.send(chunk[:taken], batch)
            if chunk[taken:]:
                queue.send(chunk[taken:], [])
    reader = FrameReader()
    received = []
    while queue.buffers:
        size = data.draw(st.integers(1, 700)) if data else 1 << 16
        glue = data.draw(st.booleans()) if data else True
        reader.feed(*queue.recvmsg(size, glue))
        while (one := reader.pop()) is not None:
            received.append(one)
    assert received == expected
    assert not reader.partial and reader.close() == []


@given(bodies, st.lists(st.integers(0, 1 << 20), max_size=3 * SCM_MAX_FD))
def test_the_calls_of_one_frame_hold_its_bytes_and_descriptors_in_order(body, fds):
    calls = sendmsg_calls(body, fds)
    assert b"".join(chunk for chunk, _ in calls) == frame(body)
    assert [fd for _, batch in calls for fd in batch] == fds
    assert all(len(batch) <= SCM_MAX_FD for _, batch in calls)
    assert len(calls) == max(1, -(-len(fds) // SCM_MAX_FD))


lengths = st.one_of(
    st.integers(0, 64),
    st.integers(MAX_BODY - 1, MAX_BODY + 1),
    st.integers(0, (1 << 32) - 1),
).map(lambda n: n.to_bytes(HEADER, "big"))
pieces = st.one_of(st.binary(max_size=40), lengths, bodies.map(frame))
feeds = st.lists(st.tuples(st.lists(pieces, max_size=4), st.integers(0, 300)), max_size=12)


@settings(max_examples=500, deadline=None)
@given(feeds)
@example([([(MAX_BODY + 1).to_bytes(4, "big")], 3)])
@example([([b"\x00\x00\x00\x01"], 2), ([b"x\x00\x00"], 1), ([], 5)])
def test_hostile_bytes_and_descriptors_are_frame_errors_and_no_descriptor_is_lost(feed):
    reader = FrameReader()
    fed: list[int] = []
    out: list[int] = []
    for parts, fd_count in feed:
        fds = [next(fd_numbers) for _ in range(fd_count)]
        fed += fds
        try:
            reader.feed(b"".join(parts), fds)
        except FrameError as exc:
            out += exc.fds
        while (one := reader.pop()) is not None:
            assert len(one.body) <= MAX_BODY and len(one.fds) <= MAX_FDS
            out += one.fds
    out += reader.close()
    assert sorted(out) == sorted(fed)  # each one handed out once, none made up


def test_a_length_over_the_limit_is_refused_before_its_body_arrives():
    reader = FrameReader()
    with pytest.raises(FrameError, match="over"):
        reader.feed((MAX_BODY + 1).to_bytes(HEADER, "big"), [7, 8])
    with pytest.raises(FrameError) as refused:  # closed: nothing more is taken
        reader.feed(frame(b"{}"), [9])
    assert refused.value.fds == [9]
    with pytest.raises(FrameError):
        frame(b"x" * (MAX_BODY + 1))


def test_more_descriptors_than_the_limit_for_one_frame_are_refused():
    reader = FrameReader()
    reader.feed(b"\x00\x00\x00\x05{", list(range(MAX_FDS)))
    with pytest.raises(FrameError, match="descriptors") as refused:
        reader.feed(b"}", [MAX_FDS])
    assert sorted(refused.value.fds) == list(range(MAX_FDS + 1))
    with pytest.raises(FrameError):
        sendmsg_calls(b"{}", list(range(MAX_FDS + 1)))


def test_descriptors_without_bytes_are_refused():
    with pytest.raises(FrameError) as refused:
        FrameReader().feed(b"", [3])
    assert refused.value.fds == [3]


@given(st.binary(max_size=200) | st.text(max_size=100).map(str.encode))
@example(b"[" * 100_000)
@example(b'"a string"')
@example(b"\xff\xfe{}")
def test_a_body_is_a_document_or_a_frame_error(body):
    try:
        document = decode_document(body)
    except FrameError:
        return
    assert isinstance(document, dict)
    assert decode_document(encode_document(document)) == document
