"""Fuzz the PROXY header reader (`accept_proxy`: lbproxy/dataplane/proxy_header_io.py over
lbproxy/wire/proxy_protocol.py) with any bytes in any segments: it agrees with the parser
run on the whole input, reads nothing of the client's data beyond the first read, and
never raises anything but ProxyProtocolError."""

from __future__ import annotations

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from lbproxy.dataplane.proxy_header_io import read_proxy_header
from lbproxy.wire.proxy_protocol import (
    V1_MAX_LENGTH,
    V2_SIGNATURE,
    ProxyProtocolError,
    encode_v1,
    encode_v2,
    parse,
)

ip4 = st.tuples(*[st.integers(0, 255)] * 4).map(lambda t: ".".join(map(str, t)))
port = st.integers(0, 65535)


@st.composite
def headers(draw) -> bytes:
    """A valid header (v1, v2, v2 with TLVs, LOCAL) or its mutation, then payload."""
    source, destination = (draw(ip4), draw(port)), (draw(ip4), draw(port))
    kind = draw(st.sampled_from(["v1", "v2", "tlv", "local", "junk"]))
    if kind == "v1":
        header = encode_v1(source, destination)
    elif kind == "v2":
        header = encode_v2(source, destination)
    elif kind == "tlv":
        base = encode_v2(source, destination)
        tlvs = draw(st.binary(max_size=600))
        header = base[:14] + (len(base) - 16 + len(tlvs)).to_bytes(2, "big") + base[16:] + tlvs
    elif kind == "local":
        body = draw(st.binary(max_size=40))
        header = V2_SIGNATURE + b"\x20\x00" + len(body).to_bytes(2, "big") + body
    else:
        header = draw(st.sampled_from([b"PROXY ", V2_SIGNATURE, b""])) + draw(
            st.binary(max_size=120)
        )
    if draw(st.booleans()) and header:  # one byte changed: often no longer a header
        at = draw(st.integers(0, len(header) - 1))
        header = header[:at] + bytes([draw(st.integers(0, 255))]) + header[at + 1 :]
    return header + draw(st.binary(max_size=64))


class Segments:
    """A stream that hands out `data` cut at the given sizes (cycled), then EOF."""

    def __init__(self, data: bytes, cuts: list[int]) -> None:
        self.data, self.cuts, self.at, self.calls = data, cuts, 0, 0

    async def recv(self, n: int) -> bytes:
        assert n >= 1
        await trio.lowlevel.checkpoint()
        size = min(n, self.cuts[self.calls % len(self.cuts)])
        self.calls += 1
        chunk = self.data[self.at : self.at + size]
        self.at += len(chunk)
        return chunk


@settings(max_examples=300, deadline=None)
@given(headers(), st.lists(st.integers(1, 64), min_size=1, max_size=8))
def test_any_bytes_in_any_segments_read_as_the_parser_reads_them_whole(data, cuts):
    stream = Segments(data, cuts)

    async def main():
        return await read_proxy_header(stream)  # type: ignore[arg-type]

    try:
        whole = parse(data)
    except ProxyProtocolError:
        whole = "invalid"
    try:
        source, leftover = trio.run(main)
    except ProxyProtocolError:
        assert whole in ("invalid", None)  # not a header, or cut short by EOF
        return
    assert whole not in ("invalid", None)
    assert source == whole.source
    consumed = whole.consumed
    assert data[consumed : stream.at] == leftover  # the bytes behind the header, in order
    # Past the first read, a v2 reader takes nothing beyond the header (it knows its
    # length), a v1 reader nothing beyond the 107 bytes a line may take.
    first_read = min(cuts[0], 4096)
    bound = consumed if whole.version == 2 else V1_MAX_LENGTH
    assert stream.at <= max(bound, first_read)
