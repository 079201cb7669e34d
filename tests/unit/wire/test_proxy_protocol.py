"""PROXY protocol v1/v2 encoding and parsing, checked against the HAProxy spec's layout
(https://www.haproxy.org/download/2.9/doc/proxy-protocol.txt, sections 2.1 and 2.2)."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest

from lbproxy.wire.proxy_protocol import (
    V1_MAX_LENGTH,
    V2_SIGNATURE,
    ParseResult,
    ProxyProtocolError,
    encode,
    encode_v1,
    encode_v2,
    health_check_header,
    parse,
)

SIG = b"\x0d\x0a\x0d\x0a\x00\x0d\x0a\x51\x55\x49\x54\x0a"  # spec 2.2, byte by byte

V4 = (("192.168.0.1", 56324), ("192.168.0.11", 443))
V6 = (("2001:db8::1", 40000), ("2001:db8::ff", 8443, 0, 0))  # 4-tuples as getpeername gives


def test_module_is_pure() -> None:
    code = "import sys, lbproxy.wire.proxy_protocol; assert 'trio' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------- v1


@pytest.mark.parametrize(
    ("src", "dst", "line"),
    [
        (*V4, b"PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n"),  # the spec's example
        (*V6, b"PROXY TCP6 2001:db8::1 2001:db8::ff 40000 8443\r\n"),
        (
            ("0.0.0.0", 0),
            ("255.255.255.255", 65535),
            b"PROXY TCP4 0.0.0.0 255.255.255.255 0 65535\r\n",
        ),
        # canonical (compressed, lower case) IPv6, scope id dropped
        (
            ("2001:0DB8:0:0:0:0:0:1", 1),
            ("fe80::1%eth0", 2),
            b"PROXY TCP6 2001:db8::1 fe80::1 1 2\r\n",
        ),
        # IPv4-mapped client on a dual-stack listener, IPv4 destination: unmapped to TCP4
        (("::ffff:10.0.0.1", 5), ("10.0.0.2", 80), b"PROXY TCP4 10.0.0.1 10.0.0.2 5 80\r\n"),
        # families that cannot be reconciled: the short UNKNOWN form
        (("10.0.0.1", 5), ("2001:db8::1", 80), b"PROXY UNKNOWN\r\n"),
    ],
)
def test_encode_v1_exact(src: tuple, dst: tuple, line: bytes) -> None:
    assert encode_v1(src, dst) == line
    assert encode("v1", src, dst) == line


def test_v1_worst_case_fits_max_length() -> None:
    full = "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"
    line = encode_v1((full, 65535), (full, 65535))
    assert len(line) == 104  # the spec's TCP6 maximum
    assert V1_MAX_LENGTH == 107


@pytest.mark.parametrize(("src", "dst"), [V4, V6])
def test_v1_round_trip(src: tuple, dst: tuple) -> None:
    header = encode_v1(src, dst)
    assert parse(header) == ParseResult(1, src[:2], dst[:2], len(header))


def test_v1_unknown_forms() -> None:
    assert parse(b"PROXY UNKNOWN\r\n") == ParseResult(1, None, None, 15)
    # "the receiver must ignore anything presented before the CRLF"
    line = b"PROXY UNKNOWN whatever 1.2.3.4 x y\r\n"
    assert parse(line + b"GET /") == ParseResult(1, None, None, len(line))


def test_v1_trailing_payload_preserved() -> None:
    header = encode_v1(*V4)
    data = header + b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    result = parse(data)
    assert result is not None
    assert data[result.consumed :] == b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize("cut", range(0, 47))
def test_v1_incomplete_is_none(cut: int) -> None:
    header = b"PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n"
    assert len(header) == 47
    assert parse(header[:cut]) is None


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\n",
        b"proxy TCP4 1.2.3.4 5.6.7.8 1 2\r\n",  # case matters
        b"PROXY\r\n",
        b"PROXY TCP5 1.2.3.4 5.6.7.8 1 2\r\n",
        b"PROXY TCP4  1.2.3.4 5.6.7.8 1 2\r\n",  # two spaces
        b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2 \r\n",  # trailing space
        b"PROXY TCP4 1.2.3.4 5.6.7.8 1\r\n",  # missing field
        b"PROXY TCP4 01.2.3.4 5.6.7.8 1 2\r\n",  # leading zero in an address
        b"PROXY TCP4 1.2.3.4 5.6.7.8 01 2\r\n",  # leading zero in a port
        b"PROXY TCP4 1.2.3.4 5.6.7.8 1 65536\r\n",  # port out of range
        b"PROXY TCP4 1.2.3.4 5.6.7.8 -1 2\r\n",
        b"PROXY TCP4 1.2.3.256 5.6.7.8 1 2\r\n",
        b"PROXY TCP4 ::1 ::1 1 2\r\n",  # family mismatch
        b"PROXY TCP6 1.2.3.4 5.6.7.8 1 2\r\n",
        b"PROXY TCP6 fe80::1%eth0 ::1 1 2\r\n",  # no scope ids in the format
        b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\n",  # bare LF
        b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\r\r\n",  # stray CR
        b"PROXY TCP4 1.2.3.4\r5.6.7.8 1 2",  # lone CR mid-line
        b"PROXY TCP4 1.2.3.4 5.6.7.8 \xb9 2\r\n",  # non-ASCII digit
        b"PROXY UNKNOWN" + b" " * 100,  # no CRLF within 107 bytes
        b"PROXY UNKNOWN " + b"x" * 92 + b"\r\n",  # 108 bytes: one too many
    ],
)
def test_v1_garbage_raises(data: bytes) -> None:
    with pytest.raises(ProxyProtocolError):
        parse(data)


def test_v1_exactly_max_length_accepted() -> None:
    line = b"PROXY UNKNOWN " + b"x" * 91 + b"\r\n"
    assert len(line) == V1_MAX_LENGTH
    assert parse(line) == ParseResult(1, None, None, 107)


# ------------------------------------------------------------------------------- v2


def test_v2_ipv4_layout() -> None:
    header = encode_v2(*V4)
    assert V2_SIGNATURE == SIG
    assert header[:12] == SIG
    assert header[12] == 0x21  # version 2, command PROXY
    assert header[13] == 0x11  # AF_INET, STREAM
    assert struct.unpack("!H", header[14:16]) == (12,)  # 2*4 + 2*2
    assert len(header) == 16 + 12
    assert header[16:20] == bytes([192, 168, 0, 1])
    assert header[20:24] == bytes([192, 168, 0, 11])
    assert header[24:28] == struct.pack("!HH", 56324, 443)
    assert encode("v2", *V4) == header


def test_v2_ipv6_layout() -> None:
    header = encode_v2(*V6)
    assert header[:12] == SIG
    assert header[12] == 0x21
    assert header[13] == 0x21  # AF_INET6, STREAM
    assert struct.unpack("!H", header[14:16]) == (36,)  # 2*16 + 2*2
    assert len(header) == 16 + 36
    assert header[16:32] == bytes.fromhex("20010db8000000000000000000000001")
    assert header[32:48] == bytes.fromhex("20010db80000000000000000000000ff")
    assert header[48:52] == struct.pack("!HH", 40000, 8443)


def test_v2_mixed_families_is_local_unspec() -> None:
    header = encode_v2(("10.0.0.1", 5), ("2001:db8::1", 80))
    assert header == SIG + b"\x20\x00\x00\x00"
    assert parse(header) == ParseResult(2, None, None, 16)


@pytest.mark.parametrize(("src", "dst"), [V4, V6])
def test_v2_round_trip_with_payload(src: tuple, dst: tuple) -> None:
    header = encode_v2(src, dst)
    payload = b"\x00\x01binary\r\n\r\n payload"
    result = parse(header + payload)
    assert result == ParseResult(2, src[:2], dst[:2], len(header))
    assert (header + payload)[result.consumed :] == payload


def test_v2_tlvs_skipped() -> None:
    tlvs = bytes([0x01, 0x00, 0x02]) + b"h2" + bytes([0x04, 0x00, 0x03]) + b"abc"  # ALPN, NOOP
    addr = bytes([10, 0, 0, 1, 10, 0, 0, 2]) + struct.pack("!HH", 1234, 80)
    header = SIG + b"\x21\x11" + struct.pack("!H", len(addr) + len(tlvs)) + addr + tlvs
    result = parse(header + b"payload")
    assert result == ParseResult(2, ("10.0.0.1", 1234), ("10.0.0.2", 80), len(header))


def test_v2_local_with_address_block_is_skipped() -> None:
    # "Receivers MUST always consider this field to skip the appropriate number of bytes
    # and must not assume zero is presented for LOCAL connections."
    block = bytes(12)
    header = SIG + b"\x20\x11" + struct.pack("!H", 12) + block
    assert parse(header + b"x") == ParseResult(2, None, None, 28)


@pytest.mark.parametrize("fam", [0x00, 0x12, 0x22, 0x31, 0x32])
def test_v2_families_we_do_not_proxy_fall_back_to_unspec(fam: int) -> None:
    block = bytes(216)
    header = SIG + bytes([0x21, fam]) + struct.pack("!H", len(block)) + block
    assert parse(header) == ParseResult(2, None, None, len(header))


@pytest.mark.parametrize("header", [encode_v2(*V4), encode_v2(*V6)])
def test_v2_incomplete_is_none(header: bytes) -> None:
    for cut in range(len(header)):
        assert parse(header[:cut]) is None, cut


@pytest.mark.parametrize(
    "data",
    [
        SIG[:5] + b"X",  # breaks the signature early
        SIG[:11] + b"\x00" + b"\x21\x11\x00\x0c",
        SIG + b"\x11\x11\x00\x0c" + bytes(12),  # version 1 in a v2 header
        SIG + b"\x31\x11\x00\x0c" + bytes(12),  # version 3
        SIG + b"\x22\x11\x00\x0c" + bytes(12),  # command 2
        SIG + b"\x21\x41\x00\x0c" + bytes(12),  # family 4
        SIG + b"\x21\x13\x00\x0c" + bytes(12),  # transport 3
        SIG + b"\x21\x11\x00\x08" + bytes(8),  # TCP4 block too short
        SIG + b"\x21\x21\x00\x0c" + bytes(12),  # TCP6 block too short
    ],
)
def test_v2_garbage_raises(data: bytes) -> None:
    with pytest.raises(ProxyProtocolError):
        parse(data)


# ---------------------------------------------------------------------------- misc


def test_empty_input_needs_more() -> None:
    assert parse(b"") is None


def test_encode_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        encode_v1(("not-an-ip", 1), ("1.2.3.4", 2))
    with pytest.raises(ValueError):
        encode_v2(("1.2.3.4", 70000), ("1.2.3.4", 2))
    with pytest.raises(ValueError):
        encode("v3", *V4)  # type: ignore[arg-type]


def test_parse_accepts_bytearray_and_memoryview() -> None:
    header = encode_v1(*V4)
    assert parse(bytearray(header)) == parse(memoryview(header)) == parse(header)


def test_a_health_checks_header_is_haproxys() -> None:
    """v1: the check connection's own addresses; v2: LOCAL, family UNSPEC, no address
    block (the 16 bytes HAProxy's checks send), which a receiver reads as "use the
    connection's real addresses"."""
    local, peer = ("127.0.0.1", 40001), ("127.0.0.1", 6379)
    assert (
        health_check_header("v1", local, peer) == b"PROXY TCP4 127.0.0.1 127.0.0.1 40001 6379\r\n"
    )
    v2 = health_check_header("v2", local, peer)
    assert v2 == SIG + b"\x20\x00\x00\x00"
    assert parse(v2) == ParseResult(2, None, None, 16)
    with pytest.raises(ValueError):
        health_check_header("v3", local, peer)
