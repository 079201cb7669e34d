"""dataplane/proxy_header_io.py: reading a PROXY header off a stream that delivers it in
any segments, with work linear in the header's length (SPEC §21: a v2 header sent a byte
per segment must not be parsed again from the start at every byte).

A memory stream stands for the socket: it hands out at most `segment` bytes per recv and
records what each recv asked for; a spy on the parser records what it was given."""

from __future__ import annotations

import struct

import pytest
import trio

from lbproxy.dataplane import proxy_header_io
from lbproxy.wire import proxy_protocol
from lbproxy.wire.proxy_protocol import V2_SIGNATURE, ProxyProtocolError, encode_v1, encode_v2


class Stream:
    """recv(n) gives at most `segment` bytes (and never more than n), then b"" (EOF)."""

    def __init__(self, data: bytes, segment: int) -> None:
        self.data = data
        self.segment = segment
        self.asked: list[int] = []
        self.given = 0

    async def recv(self, n: int) -> bytes:
        assert n >= 1
        self.asked.append(n)
        await trio.lowlevel.checkpoint()
        chunk = self.data[self.given : self.given + min(n, self.segment)]
        self.given += len(chunk)
        return chunk


def read(data: bytes, segment: int) -> tuple[tuple | None, bytes, Stream]:
    stream = Stream(data, segment)

    async def main():
        return await proxy_header_io.read_proxy_header(stream)  # type: ignore[arg-type]

    source, leftover = trio.run(main)
    return source, leftover, stream


def v2_with_tlvs(source: tuple[str, int], tlv_bytes: int) -> bytes:
    header = encode_v2(source, ("198.51.100.1", 443))
    value = bytes(tlv_bytes - 3)
    tlv = struct.pack("!BH", 0xE0, len(value)) + value
    body = header[16:] + tlv
    return header[:14] + struct.pack("!H", len(body)) + body


@pytest.fixture
def parsed(monkeypatch) -> list[int]:
    """The length of every buffer handed to the parser (parse and header_length)."""
    seen: list[int] = []
    real_parse = proxy_protocol.parse
    real_length = getattr(proxy_protocol, "header_length", None)  # (not on main)

    def parse(data):
        seen.append(len(data))
        return real_parse(data)

    def header_length(data):
        seen.append(min(len(data), proxy_protocol.V1_MAX_LENGTH))  # it looks no further
        assert real_length is not None
        return real_length(data)

    monkeypatch.setattr(proxy_header_io, "parse", parse)
    if real_length is not None:
        monkeypatch.setattr(proxy_header_io, "header_length", header_length)
    return seen


def test_a_v2_header_a_byte_per_segment_costs_linear_work(parsed):
    header = v2_with_tlvs(("192.0.2.7", 4000), 8000)
    size = len(header)
    source, leftover, stream = read(header + b"payload", segment=1)
    assert (source, leftover) == (("192.0.2.7", 4000), b"")
    assert stream.given == size  # not a byte of the payload: it stays in the socket
    # After the fixed 16 bytes, each read asks for exactly what the header still lacks.
    assert stream.asked[16:] == [size - i for i in range(16, size)]
    # The parser was shown each byte a bounded number of times, not once per segment.
    assert sum(parsed) <= 2 * size + 107 * len(stream.asked)
    assert max(parsed) <= size


def test_a_v1_line_a_byte_per_segment(parsed):
    line = encode_v1(("203.0.113.5", 5000), ("198.51.100.1", 443))
    source, leftover, stream = read(line + b"GET /", segment=1)
    assert (source, leftover) == (("203.0.113.5", 5000), b"")
    assert stream.given == len(line)
    assert all(n <= proxy_protocol.V1_MAX_LENGTH for n in stream.asked[1:])
    assert sum(parsed) <= 2 * proxy_protocol.V1_MAX_LENGTH * len(line)


@pytest.mark.parametrize("segment", [1, 2, 7, 16, 17, 4096])
@pytest.mark.parametrize("version", ["v1", "v2", "v2-tlv", "v2-local"])
def test_any_segmentation_gives_the_source_and_the_bytes_behind(segment, version):
    source = ("192.0.2.9", 1234)
    header = {
        "v1": encode_v1(source, ("198.51.100.1", 443)),
        "v2": encode_v2(source, ("198.51.100.1", 443)),
        "v2-tlv": v2_with_tlvs(source, 300),
        "v2-local": V2_SIGNATURE + b"\x20\x00\x00\x05hello",
    }[version]
    payload = b"the client's first bytes"
    got, leftover, stream = read(header + payload, segment)
    assert got == (None if version == "v2-local" else source)
    # what was read beyond the header is handed back, in order
    assert header + leftover == (header + payload)[: stream.given]


def test_the_first_read_takes_a_whole_header_and_what_follows():
    header = encode_v2(("192.0.2.9", 1234), ("198.51.100.1", 443))
    source, leftover, stream = read(header + b"hello", segment=65536)
    assert (source, leftover) == (("192.0.2.9", 1234), b"hello")
    assert len(stream.asked) == 1  # one recv for the common case


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\n",  # not a header
        V2_SIGNATURE + b"\x21\x11\x00\x0c" + bytes(5),  # closed before the announced length
        b"PROXY TCP4 1.2.3.4",  # closed before the line ends
        b"PROXY " + b"x" * 200,  # no CRLF within 107 bytes
        V2_SIGNATURE[:5] + b"X",
    ],
)
def test_bad_or_cut_headers_raise(data):
    with pytest.raises(ProxyProtocolError):
        read(data, segment=1)
