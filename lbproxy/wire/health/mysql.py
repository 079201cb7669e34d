"""`mysql`: MySQL's and MariaDB's connection phase.

PURE. Packets are a 3-byte little-endian length, a sequence number and the payload.
The server speaks first:

    initial handshake   payload[0] = 10 (protocol 10), the server version (a C string),
                        a connection id, auth data, capabilities...: healthy without
                        `user`; with `user` we answer with a HandshakeResponse41 for
                        that user without a password and read on
    ERR                 payload[0] = 0xFF, a 2-byte code, [`#` and a 5-character
                        SQLSTATE], the message: `mysql: ERR 1040: Too many connections`
    OK                  payload[0] = 0x00 (after our response): healthy; we send
                        COM_QUIT
    auth switch         payload[0] = 0xFE: the user has another authentication method
                        (MySQL 8's caching_sha2_password): answered once with the same
                        empty password; asked again, or for more (0x01): the user needs
                        a password, and the check fails

Without `user`, the server sees a client that leaves before logging in; MySQL counts
those per host (`max_connect_errors`), so a check with a `user` is the one to use.
"""

from __future__ import annotations

import struct

from lbproxy.wire.health.exchange import NEED_MORE, Exchange, Step, Verdict, excerpt, printable

PROTOCOL_10 = 10
CLIENT_LONG_PASSWORD = 0x1
CLIENT_PROTOCOL_41 = 0x200
CLIENT_SECURE_CONNECTION = 0x8000
CLIENT_PLUGIN_AUTH = 0x80000
CAPABILITIES = (
    CLIENT_LONG_PASSWORD | CLIENT_PROTOCOL_41 | CLIENT_SECURE_CONNECTION | CLIENT_PLUGIN_AUTH
)
MAX_PACKET = 16 * 1024 * 1024
UTF8MB4 = 45
PLUGIN = b"mysql_native_password"
COM_QUIT = b"\x01\x00\x00\x00\x01"  # length 1, sequence 0, COM_QUIT


def packet(sequence: int, payload: bytes) -> bytes:
    return struct.pack("<I", len(payload))[:3] + bytes([sequence & 0xFF]) + payload


def handshake_response(user: str, sequence: int) -> bytes:
    payload = (
        struct.pack("<IIB", CAPABILITIES, MAX_PACKET, UTF8MB4)
        + b"\0" * 23
        + user.encode()
        + b"\0"
        + b"\0"  # auth response length 0: no password
        + PLUGIN
        + b"\0"
    )
    return packet(sequence, payload)


def err_reason(payload: bytes) -> str:
    if len(payload) < 3:
        return "ERR (malformed)"
    (code,) = struct.unpack_from("<H", payload, 1)
    message = payload[3:]
    if message[:1] == b"#" and len(message) >= 6:
        message = message[6:]
    return f"ERR {code}: {printable(message)}"


class MysqlExchange(Exchange):
    name = "mysql"

    def __init__(self, user: str | None = None) -> None:
        self.user = user
        self.buffer = bytearray()
        self.greeted = False
        self.switched = False  # an AuthSwitchRequest was answered
        self.seen = 0

    def received(self, data: bytes) -> Step:
        self.buffer += data
        self.seen += len(data)
        if len(self.buffer) < 4:
            return NEED_MORE
        length = int.from_bytes(self.buffer[:3], "little")
        sequence = self.buffer[3]
        if len(self.buffer) < 4 + length:
            return NEED_MORE
        payload = bytes(self.buffer[4 : 4 + length])
        del self.buffer[: 4 + length]
        if not payload:
            return self.failed("an empty packet")
        if payload[0] == 0xFF:
            return self.failed(err_reason(payload))
        if not self.greeted:
            return self._greeting(payload, sequence)
        if payload[0] == 0x00:
            return self.done(COM_QUIT)
        if payload[0] == 0xFE and not self.switched:
            # The user's authentication method is another (MySQL 8's
            # caching_sha2_password): answer it with the same empty password, once.
            self.switched = True
            return Step(packet(sequence + 1, b""))
        if payload[0] in (0xFE, 0x01):  # asked again, or for more: a password is needed
            return self.failed(f"user {self.user} needs a password")
        return self.failed(f"not an answer to the login: {excerpt(payload)}")

    def _greeting(self, payload: bytes, sequence: int) -> Step:
        if payload[0] != PROTOCOL_10:
            return self.failed(f"not a protocol 10 handshake: {excerpt(payload)}")
        version_end = payload.find(b"\0", 1)
        # then connection id (4), auth data (8), filler (1), capabilities (2)
        if version_end < 0 or len(payload) < version_end + 1 + 4 + 8 + 1 + 2:
            return self.failed(f"a truncated handshake: {excerpt(payload)}")
        self.greeted = True
        if self.user is None:
            return self.done()
        return Step(handshake_response(self.user, sequence + 1))

    def closed(self) -> Verdict:
        if self.seen == 0:
            return self.fail("the server closed without a handshake")
        if not self.greeted:
            return self.fail(f"the server closed during its handshake ({self.seen} bytes)")
        return self.fail("the server closed before answering the login")
