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

from lbproxy.wire.proxy_protocol import ProxyProtocolError, parse

if TYPE_CHECKING:
    from trio.socket import SocketType

__all__ = ["read_proxy_header"]

log = logging.getLogger("lbproxy.proxy_header_io")

# A v1 line is at most 107 bytes and most v2 headers are 28 or 52, so one small read
# usually takes the whole header; a v2 header with large TLVs just takes more reads.
_READ_SIZE = 4096


async def read_proxy_header(sock: SocketType) -> tuple[tuple[str, int] | None, bytes]:
    """Read one PROXY v1 or v2 header from ``sock``.

    Returns ``(source, leftover)``: ``source`` is the original client ``(host, port)``,
    or None when the header says to use the real connection's peer (v1 UNKNOWN, v2
    LOCAL or a family we do not proxy); ``leftover`` holds the bytes that came after the
    header in the same reads, to be forwarded to the real server first.

    Raises :class:`ProxyProtocolError` for an invalid header or when the connection
    closes before the header is complete, and ``OSError`` for socket errors.
    """
    data = bytearray()
    while True:
        chunk = await sock.recv(_READ_SIZE)
        if not chunk:
            raise ProxyProtocolError("connection closed before the PROXY header was complete")
        data += chunk
        result = parse(data)
        if result is not None:
            return result.source, bytes(data[result.consumed :])
