"""`pgsql`: PostgreSQL's startup handshake (protocol 3.0).

PURE. We send a StartupMessage for `user` and `database`; the server answers with
messages of one type byte and a 4-byte length (itself included):

    R  AuthenticationRequest: code 0 (Ok), or a request for a password (3 cleartext,
       5 MD5, 10 SASL ...): a server that asks is up and accepting -> healthy
    S  ParameterStatus, K  BackendKeyData, N  NoticeResponse: read on
    Z  ReadyForQuery (trust authentication, after R Ok) -> healthy; we send Terminate
    E  ErrorResponse: fields of a code byte and a C string; the check fails with the
       severity, the message and its detail if any: `pgsql: FATAL: the database
       system is starting up`, `pgsql: FATAL: the database system is not accepting
       connections (Hot standby mode is disabled.)`

Anything else is not PostgreSQL speaking and fails with what arrived.
"""

from __future__ import annotations

import struct

from lbproxy.wire.health.exchange import NEED_MORE, Exchange, Step, Verdict, excerpt, printable

PROTOCOL_3 = 196608  # 3 << 16
APPLICATION_NAME = "lbproxy-health-check"
TERMINATE = b"X\x00\x00\x00\x04"
_KNOWN = frozenset(b"RSKNZE")
AUTH_OK = 0


def startup_message(user: str, database: str) -> bytes:
    params = b""
    for key, value in (
        ("user", user),
        ("database", database),
        ("application_name", APPLICATION_NAME),
    ):
        params += key.encode() + b"\0" + value.encode() + b"\0"
    body = struct.pack("!I", PROTOCOL_3) + params + b"\0"
    return struct.pack("!I", len(body) + 4) + body


def error_fields(body: bytes) -> dict[str, str]:
    """An ErrorResponse's fields by their code letter (S severity, M message, C code...)."""
    fields: dict[str, str] = {}
    for part in body.split(b"\0"):
        if part:
            fields.setdefault(chr(part[0]), printable(part[1:]))
    return fields


class PgsqlExchange(Exchange):
    name = "pgsql"

    def __init__(self, user: str, database: str) -> None:
        self.user = user
        self.database = database
        self.buffer = bytearray()
        self.seen = 0  # bytes received in all, for the reasons

    def opening(self) -> bytes:
        return startup_message(self.user, self.database)

    def received(self, data: bytes) -> Step:
        self.buffer += data
        self.seen += len(data)
        while len(self.buffer) >= 5:
            kind = self.buffer[0]
            (length,) = struct.unpack_from("!I", self.buffer, 1)
            if kind not in _KNOWN or length < 4:
                return self.failed(f"not a PostgreSQL answer: {excerpt(bytes(self.buffer))}")
            if len(self.buffer) < 1 + length:
                return NEED_MORE
            body = bytes(self.buffer[5 : 1 + length])
            del self.buffer[: 1 + length]
            step = self._message(kind, body)
            if step is not None:
                return step
        if self.buffer and self.buffer[0] not in _KNOWN:
            return self.failed(f"not a PostgreSQL answer: {excerpt(bytes(self.buffer))}")
        return NEED_MORE

    def _message(self, kind: int, body: bytes) -> Step | None:
        if kind == ord("E"):
            fields = error_fields(body)
            severity = fields.get("V") or fields.get("S") or "ERROR"
            message = fields.get("M") or "(no message)"
            detail = f" ({fields['D']})" if fields.get("D") else ""
            return self.failed(f"{severity}: {message}{detail}")
        if kind == ord("R"):
            if len(body) < 4:
                return self.failed("a malformed AuthenticationRequest")
            (code,) = struct.unpack_from("!I", body)
            if code != AUTH_OK:
                return self.done()  # it asks for a password: up and accepting
            return None
        if kind == ord("Z"):
            return self.done(TERMINATE)
        return None  # S, K, N: read on

    def closed(self) -> Verdict:
        if self.seen == 0:
            return self.fail("the server closed without answering")
        return self.fail(f"the server closed after {self.seen} bytes, before ReadyForQuery")
