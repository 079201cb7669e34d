"""Read an incoming PROXY protocol header (``accept_proxy``) off a trio socket.

The parsing is pure and lives in :mod:`lbproxy.wire.proxy_protocol`; this module only feeds it
bytes. We recv() and hand back what arrived behind the header instead of peeking
(MSG_PEEK) so as to consume exactly the header: a peek cannot wait for "more" bytes
(the socket stays readable while anything is queued, so waiting would spin), and the
leftover costs the caller nothing: ``pump(..., initial_client_bytes=leftover)`` writes it
to the real server first.

The caller bounds the wait (SPEC: the header must arrive within ``connect_timeout``)::

    with trio.fail_after(vs.connect_timeout):
        source, leftover = await read_proxy_header(client)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lbproxy.wire.proxy_protocol import (
    V1_MAX_LENGTH,
    V2_SIGNATURE,
    ProxyProtocolError,
    header_length,
    parse,
)

if TYPE_CHECKING:
    from trio.socket import SocketType

__all__ = ["read_proxy_header"]

log = logging.getLogger("lbproxy.proxy_header_io")

# The first read: a v1 line is at most 107 bytes and most v2 headers are 28 or 52, so one
# small read usually takes the whole header (and what the client sent behind it).
_READ_SIZE = 4096
# A v2 header's fixed part, which announces the length of the rest.
_V2_FIXED = 16


async def read_proxy_header(sock: SocketType) -> tuple[tuple[str, int] | None, bytes]:
    """Read one PROXY v1 or v2 header from ``sock``.

    Returns ``(source, leftover)``: ``source`` is the original client ``(host, port)``,
    or None when the header says to use the real connection's peer (v1 UNKNOWN, v2
    LOCAL or a family we do not proxy); ``leftover`` holds the bytes that came after the
    header in the first read, to be forwarded to the real server first.

    After the first read, each read asks only for what the header still lacks: up to
    its fixed 16 bytes for v2, then exactly the length they announce, or up to the 107
    bytes a v1 line may take. Each byte is copied into the buffer once and the header is
    parsed once, so a header that arrives a byte per segment costs linear work, not a
    parse of everything so far per segment.

    Raises :class:`ProxyProtocolError` for an invalid header or when the connection
    closes before the header is complete, and ``OSError`` for socket errors.
    """
    data = bytearray()
    want = _READ_SIZE
    while True:
        chunk = await sock.recv(want)
        if not chunk:
            raise ProxyProtocolError("connection closed before the PROXY header was complete")
        data += chunk
        length = header_length(data)
        if length is None:  # v2 before its fixed part, or a v1 line not ended yet
            want = (_V2_FIXED if data[0] == V2_SIGNATURE[0] else V1_MAX_LENGTH) - len(data)
            continue
        if len(data) < length:
            want = length - len(data)
            continue
        result = parse(memoryview(data)[:length])
        if result is None:  # cannot be: header_length saw it complete
            raise ProxyProtocolError("incomplete PROXY header")
        return result.source, bytes(data[length:])
