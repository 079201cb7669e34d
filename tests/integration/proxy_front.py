"""A loopback server that requires a PROXY protocol header, as a real server behind a
`send_proxy` virtual server does (HAProxy's `accept-proxy`, nginx's `proxy_protocol`).

    front = ProxyFront(backend=redis.port)     # listens on front.port
    front.headers        # every header received, as read: Header(version, command, ...)
    front.refused        # connections closed because they did not begin with a header
    front.stop()

Each connection must begin with a complete, valid header (v1 or v2, read here by the
specification, independently of lbproxy's own parser); one that does not is closed at
once, as such servers do, and counted in `refused`. After the header, whatever follows
is relayed both ways to the real server at `backend` (a redis-server, an SMTP server, a
TLS server: the TLS handshake passes through), so the check talks to the real thing.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
import struct
import threading
from dataclasses import dataclass

V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
_V1 = re.compile(rb"PROXY (TCP4|TCP6) ([0-9a-fA-F.:]+) ([0-9a-fA-F.:]+) (\d{1,5}) (\d{1,5})\r\n")


@dataclass(frozen=True)
class Header:
    version: int  # 1 or 2
    command: str  # "PROXY" or "LOCAL" (v1 is always PROXY)
    source: tuple[str, int] | None  # None: no address (v2 LOCAL)
    destination: tuple[str, int] | None
    peer: tuple[str, int]  # the connection's real peer, to compare with `source`


class _BadHeader(Exception):
    pass


def _read_exactly(sock: socket.socket, count: int, have: bytes) -> bytes:
    while len(have) < count:
        chunk = sock.recv(count - len(have))
        if not chunk:
            raise _BadHeader("closed within the header")
        have += chunk
    return have


def read_header(sock: socket.socket, peer: tuple[str, int]) -> tuple[Header, bytes]:
    """The header the connection begins with, and the bytes after it already read;
    refused as soon as the first bytes cannot begin one (as HAProxy does)."""
    first = b""
    while len(first) < 16:
        if not (V2_SIGNATURE.startswith(first[:12]) or first[:6] == b"PROXY "[: len(first)]):
            raise _BadHeader(f"no PROXY header: {first!r}")
        if first.startswith(b"PROXY "):
            break
        chunk = sock.recv(16 - len(first))
        if not chunk:
            raise _BadHeader("closed within the header")
        first += chunk
    if first.startswith(V2_SIGNATURE):
        ver_cmd, family, length = struct.unpack("!BBH", first[12:16])
        if ver_cmd >> 4 != 2 or ver_cmd & 0x0F not in (0, 1):
            raise _BadHeader(f"bad v2 version/command {ver_cmd:#x}")
        block = _read_exactly(sock, 16 + length, first)[16:]
        if ver_cmd & 0x0F == 0:
            return Header(2, "LOCAL", None, None, peer), b""
        if family != 0x11 or length < 12:
            raise _BadHeader(f"v2 PROXY family {family:#x} is not TCP4")
        src, dst, sport, dport = struct.unpack("!4s4sHH", block[:12])
        source = (str(ipaddress.IPv4Address(src)), sport)
        destination = (str(ipaddress.IPv4Address(dst)), dport)
        return Header(2, "PROXY", source, destination, peer), b""
    if not first.startswith(b"PROXY "):
        raise _BadHeader(f"no PROXY header: {first!r}")
    data = first
    while b"\r\n" not in data:
        if len(data) >= 107:
            raise _BadHeader("a v1 line longer than 107 bytes")
        chunk = sock.recv(107 - len(data))
        if not chunk:
            raise _BadHeader("closed within the header")
        data += chunk
    end = data.index(b"\r\n") + 2
    match = _V1.fullmatch(data[:end])
    if match is None:
        raise _BadHeader(f"bad v1 line {data[:end]!r}")
    proto, src, dst, sport, dport = match.groups()
    kind = ipaddress.IPv4Address if proto == b"TCP4" else ipaddress.IPv6Address
    source = (str(kind(src.decode())), int(sport))
    destination = (str(kind(dst.decode())), int(dport))
    return Header(1, "PROXY", source, destination, peer), data[end:]


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


class ProxyFront:
    def __init__(self, backend: int) -> None:
        self.backend = backend
        self.headers: list[Header] = []
        self.refused: list[str] = []  # why each refused connection was closed
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                conn, peer = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self._open.append(conn)
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _serve(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        conn.settimeout(10)
        with conn:
            try:
                header, rest = read_header(conn, peer[:2])
            except (_BadHeader, OSError) as exc:
                self.refused.append(str(exc))
                return
            self.headers.append(header)
            try:
                upstream = socket.create_connection(("127.0.0.1", self.backend), timeout=10)
            except OSError:
                return
            with upstream:
                with self._lock:
                    self._open.append(upstream)
                if rest:
                    upstream.sendall(rest)
                back = threading.Thread(target=_pump, args=(upstream, conn), daemon=True)
                back.start()
                _pump(conn, upstream)
                back.join(10)

    def stop(self) -> None:
        self._stopped = True
        self.listener.close()
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
