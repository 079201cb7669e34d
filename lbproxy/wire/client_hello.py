"""The server name and ALPN protocols of a TLS ClientHello, read by a bounded state machine
over bytes.

PURE: no trio, no sockets, no clock. The listener (listener.py) feeds it whatever the
client sends, as it arrives, and routes by the result; the bytes themselves go to the
real server unchanged (TLS passthrough: lbproxy never terminates TLS).

The models are nginx's `ngx_stream_ssl_preread_parse_record`
(src/stream/ngx_stream_ssl_preread_module.c: record header, handshake header, skip
fields by their lengths, stop at the server_name extension) and HAProxy's
`smp_fetch_ssl_hello_sni` and `smp_fetch_ssl_hello_alpn` (src/payload.c). The wire
format is RFC 8446 §4.1.2 and §5.1 (TLS 1.3, the same ClientHello layout as TLS
1.0-1.2), RFC 6066 §3 (server_name) and RFC 7301 §3.1
(application_layer_protocol_negotiation).

How it reads, and where it gives up:

- Records: content type 22 (handshake), major version 3, a length of 1..2^14. The
  ClientHello may be split over several records, and any record over several reads;
  only the handshake *payload* is kept, so the work per byte fed is constant.
- The first handshake message must be a ClientHello (type 1) whose body is complete
  within `LIMIT` bytes of input (16 KiB, record headers included).
- The body is parsed once it is complete: version, random, session id (<= 32), cipher
  suites (even, >= 2), compression methods (>= 1), then the extensions, each within its
  declared length; the server_name extension's first host_name entry is the name, and
  the ALPN extension's protocol names (each 1..255 bytes, kept as bytes, in the
  client's order: the only allocation besides the name) are the protocols.
- Anything else -- SSLv2-style hellos (the first byte has its high bit set), plain
  HTTP, random bytes, a wrong length anywhere, a record of another type in the middle,
  more than `LIMIT` bytes without a complete hello -- is `NOT_TLS`; so is a malformed
  ALPN extension (a list length that is not the extension's, an empty list or name, a
  second ALPN extension), as a malformed server_name is. A hello without the
  extensions gives `Hello(None)` (no protocols: `()`). The caller routes NOT_TLS as a
  hello without either: to the address's route for no name and no protocol.

`feed()` never raises on any input; a test fuzzes it with hypothesis.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("lbproxy.client_hello")

LIMIT = 16 * 1024  # bytes of input (SPEC §13: "up to 16 KiB")
_HANDSHAKE = 22
_CLIENT_HELLO = 1
_SERVER_NAME = 0
_HOST_NAME = 0
_ALPN = 16  # application_layer_protocol_negotiation (RFC 7301 §3.1)
_MAX_RECORD = 1 << 14
_RECORD_HEADER = 5


@dataclass(frozen=True, slots=True)
class Hello:
    """A well-formed ClientHello: its server name (lower case, no trailing dot) or None,
    and the ALPN protocol names it offers, in its order of preference (() for none)."""

    server_name: str | None
    alpn: tuple[bytes, ...] = ()


class _NotTLS:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_TLS"


NOT_TLS = _NotTLS()  # the input is not (the start of) a well-formed ClientHello

Result = Hello | _NotTLS | None  # None: need more bytes


class ClientHelloReader:
    """Feed bytes as they arrive; the first non-None result is final."""

    __slots__ = ("_fed", "_header", "_hello_length", "_payload", "_record_left", "result")

    def __init__(self) -> None:
        self._fed = 0  # bytes of input so far
        self._header = b""  # a record header being read (< 5 bytes)
        self._record_left = 0  # payload bytes still to come in the current record
        self._payload = bytearray()  # handshake bytes of every record so far
        self._hello_length: int | None = None  # from the handshake header
        self.result: Result = None

    def feed(self, data: bytes) -> Result:
        if self.result is not None:
            return self.result
        self._fed += len(data)
        view = memoryview(data)
        while view and self.result is None:
            if self._record_left == 0:
                need = _RECORD_HEADER - len(self._header)
                self._header += bytes(view[:need])
                view = view[need:]
                if len(self._header) < _RECORD_HEADER:
                    break
                self._record_left = self._start_record(self._header)
                self._header = b""
                if self._record_left == 0:
                    self.result = NOT_TLS
                    break
            take = view[: self._record_left]
            self._payload += take
            self._record_left -= len(take)
            view = view[len(take) :]
            self._check_payload()
        if self.result is None and self._fed >= LIMIT:
            self.result = NOT_TLS  # 16 KiB and still no complete hello
        return self.result

    def eof(self) -> Result:
        """The client sent nothing more (closed, or the time is up): the final result."""
        if self.result is None:
            self.result = NOT_TLS
        return self.result

    @staticmethod
    def _start_record(header: bytes) -> int:
        """The payload length of a record that may carry the hello, else 0."""
        if header[0] != _HANDSHAKE or header[1] != 3:
            return 0
        length = (header[3] << 8) | header[4]
        return length if 0 < length <= _MAX_RECORD else 0

    def _check_payload(self) -> None:
        payload = self._payload
        if self._hello_length is None:
            if len(payload) < 4:
                return
            if payload[0] != _CLIENT_HELLO:
                self.result = NOT_TLS
                return
            self._hello_length = (payload[1] << 16) | (payload[2] << 8) | payload[3]
            if self._hello_length + 4 + _RECORD_HEADER > LIMIT:
                self.result = NOT_TLS  # could never be complete within the limit
                return
        if len(payload) >= 4 + self._hello_length:
            body = bytes(payload[4 : 4 + self._hello_length])
            self.result = parse_hello_body(body)


def parse_hello_body(body: bytes) -> Hello | _NotTLS:
    """The ClientHello body (after the 4-byte handshake header) -> Hello or NOT_TLS."""
    end = len(body)
    pos = 2 + 32  # legacy_version, random
    if pos + 1 > end:
        return NOT_TLS
    session_id = body[pos]
    pos += 1 + session_id
    if session_id > 32 or pos + 2 > end:
        return NOT_TLS
    suites = (body[pos] << 8) | body[pos + 1]
    pos += 2 + suites
    if suites < 2 or suites % 2 or pos + 1 > end:
        return NOT_TLS
    methods = body[pos]
    pos += 1 + methods
    if methods < 1 or pos > end:
        return NOT_TLS
    if pos == end:
        return Hello(None)  # no extensions at all (allowed before TLS 1.3)
    if pos + 2 > end:
        return NOT_TLS
    extensions_end = pos + 2 + ((body[pos] << 8) | body[pos + 1])
    pos += 2
    if extensions_end != end:
        return NOT_TLS
    name: str | None = None
    seen_name = False
    protocols: tuple[bytes, ...] | None = None  # None: no ALPN extension seen yet
    while pos < extensions_end:
        if pos + 4 > extensions_end:
            return NOT_TLS
        kind = (body[pos] << 8) | body[pos + 1]
        length = (body[pos + 2] << 8) | body[pos + 3]
        pos += 4
        if pos + length > extensions_end:
            return NOT_TLS
        if kind == _SERVER_NAME:
            if seen_name:
                return NOT_TLS  # RFC 8446 §4.2: at most one extension of each type
            seen_name = True
            parsed = _server_name(body, pos, pos + length)
            if parsed is NOT_TLS:
                return NOT_TLS
            name = parsed  # type: ignore[assignment]  # not NOT_TLS (above): mypy narrows no sentinel
        elif kind == _ALPN:
            if protocols is not None:
                return NOT_TLS  # RFC 8446 §4.2: at most one extension of each type
            offered = _protocol_names(body, pos, pos + length)
            if offered is NOT_TLS:
                return NOT_TLS
            protocols = offered  # type: ignore[assignment]  # not NOT_TLS (above)
        pos += length
    return Hello(name, protocols or ())


def _server_name(body: bytes, pos: int, end: int) -> str | _NotTLS | None:
    """RFC 6066 §3: ServerNameList; the first host_name entry, checked and lowered."""
    if pos + 2 > end or pos + 2 + ((body[pos] << 8) | body[pos + 1]) != end:
        return NOT_TLS
    pos += 2
    if pos == end:
        return NOT_TLS  # an empty list
    while pos < end:
        if pos + 3 > end:
            return NOT_TLS
        kind = body[pos]
        length = (body[pos + 1] << 8) | body[pos + 2]
        pos += 3
        if pos + length > end:
            return NOT_TLS
        if kind == _HOST_NAME:
            return _host_name(body[pos : pos + length])
        pos += length
    return None  # no host_name entry: as if there were no extension


def _protocol_names(body: bytes, pos: int, end: int) -> tuple[bytes, ...] | _NotTLS:
    """RFC 7301 §3.1: ProtocolNameList protocol_name_list<2..2^16-1>, each
    ProtocolName<1..2^8-1>: a 2-byte list length equal to the rest of the extension,
    then names of a 1-byte length each. Opaque bytes, compared exactly."""
    if pos + 2 > end or pos + 2 + ((body[pos] << 8) | body[pos + 1]) != end:
        return NOT_TLS
    pos += 2
    if pos == end:
        return NOT_TLS  # an empty list
    names = []
    while pos < end:
        length = body[pos]
        pos += 1
        if length == 0 or pos + length > end:
            return NOT_TLS
        names.append(body[pos : pos + length])
        pos += length
    return tuple(names)


def _host_name(raw: bytes) -> str | _NotTLS:
    # RFC 6066: "HostName" is an ASCII DNS name, without a trailing dot. Letters,
    # digits, '-', '_' (seen in the wild) and dots; nothing that could confuse a lookup.
    if not 0 < len(raw) <= 255:
        return NOT_TLS
    try:
        name = raw.decode("ascii")
    except UnicodeDecodeError:
        return NOT_TLS
    name = name.lower().removesuffix(".")
    if not name or not all(c.isalnum() or c in "-_." for c in name) or ".." in name:
        return NOT_TLS
    return name
