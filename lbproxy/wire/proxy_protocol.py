"""PROXY protocol v1 and v2: encode a header for a real server, parse one from upstream.

PURE: no trio, no sockets, no clock. The byte layouts follow HAProxy's specification,
https://www.haproxy.org/download/2.9/doc/proxy-protocol.txt (sections 2.1 and 2.2):

v1, one US-ASCII line of at most 107 bytes including the CRLF::

    PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\\r\\n
    PROXY TCP6 <src6> <dst6> <sport> <dport>\\r\\n
    PROXY UNKNOWN[ <anything>]\\r\\n

v2, binary, always ``16 + length`` bytes::

    offset  size  field
    0       12    signature \\x0D\\x0A\\x0D\\x0A\\x00\\x0D\\x0A\\x51\\x55\\x49\\x54\\x0A
    12      1     version (high nibble, always 2) | command (0 LOCAL, 1 PROXY)
    13      1     family (0 UNSPEC, 1 INET, 2 INET6, 3 UNIX) | transport (0 UNSPEC,
                  1 STREAM, 2 DGRAM)
    14      2     length of what follows, network order
    16      ...   TCP4: src(4) dst(4) sport(2) dport(2) = 12 bytes
                  TCP6: src(16) dst(16) sport(2) dport(2) = 36 bytes
                  then optional TLVs up to ``length``, which we skip

Parsing is strict where the specification says "must" (exactly one space, no leading
zeros, CRLF and never a lone CR or LF, version 2, known command/family/transport) and
lenient where it allows it: ``UNKNOWN`` ignores the rest of its line, v2 ``LOCAL``
ignores its address block, and the valid v2 families we do not proxy (UDP, UNIX) fall
back to the UNSPEC meaning (the spec: a receiver "automatically falls back to the UNSPEC
mode for the valid combinations above that it does not support"). In all those cases
:attr:`ParseResult.source` is ``None`` and the caller uses the real connection's peer.

Addresses are ``(host, port)`` tuples as the socket module returns them; extra items
(IPv6 flowinfo, scope id) are ignored, and a scope suffix ``%eth0`` is dropped because
the header format has no room for it.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "V1_MAX_LENGTH",
    "V2_SIGNATURE",
    "ParseResult",
    "ProxyProtocolError",
    "encode",
    "encode_v1",
    "encode_v2",
    "header_length",
    "health_check_header",
    "parse",
]

V1_PREFIX = b"PROXY "
V1_MAX_LENGTH = 107  # "PROXY UNKNOWN <v6> <v6> 65535 65535\r\n", the spec's worst case
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V2_HEADER = struct.Struct("!12sBBH")  # signature, ver_cmd, fam, len
V2_ADDR4 = struct.Struct("!4s4sHH")
V2_ADDR6 = struct.Struct("!16s16sHH")

_V2_VERSION = 0x20
_V2_CMD_LOCAL = 0x0
_V2_CMD_PROXY = 0x1
_V2_TCP4 = 0x11
_V2_TCP6 = 0x21
# LOCAL, family UNSPEC, no address block: "the connection endpoints are the sender and
# the receiver" (a proxy's own connection, as a health check's)
_V2_LOCAL = V2_HEADER.pack(V2_SIGNATURE, _V2_VERSION | _V2_CMD_LOCAL, 0x00, 0)
# Valid family/transport bytes we accept but do not turn into an address (UNSPEC mode).
_V2_FALLBACK_FAMILIES = frozenset({0x00, 0x01, 0x02, 0x10, 0x12, 0x20, 0x22, 0x30, 0x31, 0x32})

Address = tuple[str, int]
_IP = ipaddress.IPv4Address | ipaddress.IPv6Address
# A socket address as Python gives it: (host, port), or (host, port, flow, scope) for IPv6.
SockAddr = tuple[Any, ...]


class ProxyProtocolError(ValueError):
    """The bytes are not a valid PROXY protocol header; the connection must be dropped."""


@dataclass(frozen=True, slots=True)
class ParseResult:
    """A complete header.

    ``source``/``destination`` are ``None`` for v1 ``UNKNOWN``, v2 ``LOCAL`` and v2
    families we do not proxy: the caller then uses the real connection's addresses.
    ``consumed`` is the header length; ``data[consumed:]`` is payload to forward.
    """

    version: Literal[1, 2]
    source: Address | None
    destination: Address | None
    consumed: int


# ---------------------------------------------------------------------------- encode


def _ip(addr: SockAddr) -> _IP:
    host = str(addr[0]).split("%", 1)[0]  # drop an IPv6 scope id: no field carries it
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"not an IP address: {addr[0]!r}") from None


def _port(addr: SockAddr) -> int:
    port = addr[1]
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"not a TCP port: {port!r}")
    return port


def _pair(src: SockAddr, dst: SockAddr) -> tuple[_IP, _IP] | None:
    """Both addresses in one family, or None when they cannot share one.

    A dual-stack listener reports IPv4 clients as IPv4-mapped IPv6 (``::ffff:a.b.c.d``);
    when the other end is plain IPv4 we unmap it, so the real server still gets TCP4
    rather than UNKNOWN.
    """
    a, b = _ip(src), _ip(dst)
    if a.version != b.version:
        if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
            a = a.ipv4_mapped
        elif isinstance(b, ipaddress.IPv6Address) and b.ipv4_mapped is not None:
            b = b.ipv4_mapped
        else:
            return None
    return a, b


def encode_v1(src: SockAddr, dst: SockAddr) -> bytes:
    """The v1 line for a connection from ``src`` to ``dst``; ``PROXY UNKNOWN`` when the
    two addresses are of different families (the spec's short form)."""
    sport, dport = _port(src), _port(dst)
    pair = _pair(src, dst)
    if pair is None:
        return b"PROXY UNKNOWN\r\n"
    a, b = pair
    proto = "TCP4" if a.version == 4 else "TCP6"
    # str() of an ipaddress object is the canonical form the spec asks for: no leading
    # zeros in IPv4, RFC 5952 compressed IPv6.
    return f"PROXY {proto} {a} {b} {sport} {dport}\r\n".encode("ascii")


def encode_v2(src: SockAddr, dst: SockAddr) -> bytes:
    """The v2 header (command PROXY, TCP4 or TCP6, no TLVs); LOCAL/UNSPEC with an empty
    address block when the two addresses are of different families."""
    sport, dport = _port(src), _port(dst)
    pair = _pair(src, dst)
    if pair is None:
        return _V2_LOCAL
    a, b = pair
    if a.version == 4:
        fam, block = _V2_TCP4, V2_ADDR4.pack(a.packed, b.packed, sport, dport)
    else:
        fam, block = _V2_TCP6, V2_ADDR6.pack(a.packed, b.packed, sport, dport)
    return V2_HEADER.pack(V2_SIGNATURE, _V2_VERSION | _V2_CMD_PROXY, fam, len(block)) + block


def health_check_header(version: str, local: SockAddr, peer: SockAddr) -> bytes:
    """The header a health check opens its connection with, as HAProxy's checks send it:
    v1, the check connection's own addresses (``local`` to ``peer``; v1 has no way to
    say "no client"); v2, the LOCAL command with no address block, which the
    specification (section 2.2) gives for "health-checks": a connection the proxy opened
    itself, for which the receiver uses the connection's real addresses."""
    if version == "v1":
        return encode_v1(local, peer)
    if version == "v2":
        return _V2_LOCAL
    raise ValueError(f"unknown PROXY protocol version: {version!r}")


def encode(version: Literal["v1", "v2"], src: SockAddr, dst: SockAddr) -> bytes:
    """``encode_v1`` or ``encode_v2`` by the configuration's ``send_proxy`` value."""
    if version == "v1":
        return encode_v1(src, dst)
    if version == "v2":
        return encode_v2(src, dst)
    raise ValueError(f"unknown PROXY protocol version: {version!r}")


# ----------------------------------------------------------------------------- parse


def header_length(data: bytes | bytearray | memoryview) -> int | None:
    """The length of the header that ``data`` begins, once its first bytes tell it: v2
    after its fixed 16 bytes (16 + the length they announce), v1 once its line ends;
    ``None`` until then (read more: for v2, no more than 16 bytes, then exactly what is
    announced). Raises :class:`ProxyProtocolError` as soon as the bytes cannot be a
    header. Looks at no more than the first 107 bytes, however long ``data`` is, so a
    reader that calls it after every segment does linear work in all."""
    first = data[:1]
    if first == V2_SIGNATURE[:1]:
        head = bytes(data[: V2_HEADER.size])
        if len(head) < V2_HEADER.size:
            if V2_SIGNATURE.startswith(head[:12]):
                return None
            raise ProxyProtocolError("not a PROXY protocol v2 header")
        return V2_HEADER.size + _v2_fixed(head)[2]
    if first == V1_PREFIX[:1]:
        head = bytes(data[:V1_MAX_LENGTH])
        lf = _v1_line_end(head)
        return None if lf is None else lf + 1
    if not first:
        return None
    raise ProxyProtocolError("not a PROXY protocol header")


def parse(data: bytes | bytearray | memoryview) -> ParseResult | None:
    """Parse the header at the start of ``data``.

    Returns ``None`` while ``data`` is a valid but incomplete beginning of a header (read
    more and call again with everything received so far), a :class:`ParseResult` once it
    is complete, and raises :class:`ProxyProtocolError` as soon as the bytes cannot be a
    header. Bytes after the header are not looked at (nor copied: a v1 line is looked
    for in the first 107 bytes, a v2 header copied once its announced length is there).
    """
    first = data[:1]
    if first == V2_SIGNATURE[:1]:
        return _parse_v2(data)
    if first == V1_PREFIX[:1]:
        return _parse_v1(bytes(data[:V1_MAX_LENGTH]))
    if not first:
        return None
    raise ProxyProtocolError("not a PROXY protocol header")


def _v1_line_end(head: bytes) -> int | None:
    """Where the v1 line in `head` (at most its first 107 bytes) ends: the index of its
    LF; None while it may still end later; raises when it cannot be a v1 line."""
    if not head.startswith(V1_PREFIX):
        if V1_PREFIX.startswith(head):
            return None
        raise ProxyProtocolError("not a PROXY protocol v1 header")
    lf = head.find(b"\n")
    if lf < 0:
        if b"\r" in head[:-1] or len(head) == V1_MAX_LENGTH:
            raise ProxyProtocolError("PROXY v1 line has no CRLF within 107 bytes")
        return None
    if head[lf - 1 : lf] != b"\r" or b"\r" in head[: lf - 1]:
        raise ProxyProtocolError("PROXY v1 line must end with CRLF, and only there")
    return lf


def _parse_v1(head: bytes) -> ParseResult | None:
    lf = _v1_line_end(head)
    if lf is None:
        return None
    line = head[: lf - 1]
    consumed = lf + 1

    fields = line.split(b" ")
    if fields[1] == b"UNKNOWN":
        # The spec: "the receiver must ignore anything presented before the CRLF".
        return ParseResult(1, None, None, consumed)
    if len(fields) != 6 or fields[1] not in (b"TCP4", b"TCP6"):
        raise ProxyProtocolError(f"malformed PROXY v1 line: {line!r}")
    want = ipaddress.IPv4Address if fields[1] == b"TCP4" else ipaddress.IPv6Address
    src = _v1_address(want, fields[2], fields[4])
    dst = _v1_address(want, fields[3], fields[5])
    return ParseResult(1, src, dst, consumed)


def _v1_address(
    want: type[ipaddress.IPv4Address] | type[ipaddress.IPv6Address], host: bytes, port: bytes
) -> Address:
    try:
        # ipaddress rejects IPv4 leading zeros (octal confusion, as the spec warns), and
        # we reject IPv6 scope ids, which the format does not have.
        if b"%" in host:
            raise ValueError
        ip = want(host.decode("ascii"))
    except ValueError:
        raise ProxyProtocolError(f"bad address in PROXY v1 line: {host!r}") from None
    # bytes.isdigit() is ASCII-only; "0" is the one number allowed to start with 0.
    if not port.isdigit() or len(port) > 5 or (port[:1] == b"0" and port != b"0"):
        raise ProxyProtocolError(f"bad port in PROXY v1 line: {port!r}")
    value = int(port)
    if value > 65535:
        raise ProxyProtocolError(f"bad port in PROXY v1 line: {port!r}")
    return str(ip), value


def _v2_fixed(head: bytes) -> tuple[int, int, int]:
    """The command, family and length of a v2 header's fixed 16 bytes (`head`),
    checked: raises when they cannot begin a header."""
    signature, ver_cmd, fam, length = V2_HEADER.unpack_from(head)
    if signature != V2_SIGNATURE:
        raise ProxyProtocolError("not a PROXY protocol v2 header")
    if ver_cmd & 0xF0 != _V2_VERSION:
        raise ProxyProtocolError(f"PROXY v2: unsupported version {ver_cmd >> 4}")
    command = ver_cmd & 0x0F
    if command not in (_V2_CMD_LOCAL, _V2_CMD_PROXY):
        raise ProxyProtocolError(f"PROXY v2: unknown command {command}")
    if fam not in (_V2_TCP4, _V2_TCP6) and fam not in _V2_FALLBACK_FAMILIES:
        raise ProxyProtocolError(f"PROXY v2: unknown family/transport 0x{fam:02x}")
    return command, fam, length


def _parse_v2(data: bytes | bytearray | memoryview) -> ParseResult | None:
    head = bytes(data[: V2_HEADER.size])
    if len(head) < V2_HEADER.size:
        if V2_SIGNATURE.startswith(head[:12]):
            return None
        raise ProxyProtocolError("not a PROXY protocol v2 header")
    command, fam, length = _v2_fixed(head)
    consumed = V2_HEADER.size + length
    if len(data) < consumed:
        return None
    # LOCAL: "discard the protocol block including the family"; the length still counts.
    if command == _V2_CMD_LOCAL or fam not in (_V2_TCP4, _V2_TCP6):
        return ParseResult(2, None, None, consumed)
    layout, cls = (
        (V2_ADDR4, ipaddress.IPv4Address) if fam == _V2_TCP4 else (V2_ADDR6, ipaddress.IPv6Address)
    )
    if length < layout.size:
        raise ProxyProtocolError(f"PROXY v2: address block of {length} bytes is too short")
    # Anything after the addresses, up to `length`, is TLVs: skipped, not validated (and
    # not copied: the addresses are unpacked where they are).
    src, dst, sport, dport = layout.unpack_from(data, V2_HEADER.size)
    return ParseResult(2, (str(cls(src)), sport), (str(cls(dst)), dport), consumed)
