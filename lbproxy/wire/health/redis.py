"""`redis`: PING, after AUTH when a password is given, then INFO replication for `role`.

PURE. The commands go out at once, as RESP arrays (a password never needs quoting);
the replies come back in order:

    AUTH     +OK, else the check fails with the error: `redis: AUTH: WRONGPASS ...`
    PING     +PONG, else the error: `redis: LOADING Redis is loading the dataset in memory`
    INFO     a bulk string whose `role:` line must be `master` (role: master) or `slave`
             (role: replica): `redis: role:slave, want master`

A reply is a line (`+`, `-`, `:`) or a bulk string (`$N`, then N bytes and CRLF); an
array or anything else is not an answer to these commands and fails.
"""

from __future__ import annotations

from lbproxy.wire.health.exchange import NEED_MORE, Exchange, Step, Verdict, excerpt, printable

# What `role:` names each wanted role (Redis still says "slave" in INFO).
INFO_ROLE = {"master": "master", "replica": "slave"}


def command(*words: bytes) -> bytes:
    out = b"*%d\r\n" % len(words)
    for word in words:
        out += b"$%d\r\n%s\r\n" % (len(word), word)
    return out


class RedisExchange(Exchange):
    name = "redis"

    def __init__(self, password: str | None = None, role: str | None = None) -> None:
        self.commands: list[str] = []
        self.request = b""
        if password is not None:
            self.commands.append("AUTH")
            self.request += command(b"AUTH", password.encode())
        self.commands.append("PING")
        self.request += command(b"PING")
        self.role = role
        if role is not None:
            self.commands.append("INFO")
            self.request += command(b"INFO", b"replication")
        self.buffer = bytearray()
        self.answered = 0  # replies read

    def opening(self) -> bytes:
        return self.request

    def received(self, data: bytes) -> Step:
        self.buffer += data
        while self.commands:
            reply = self._next_reply()
            if reply is None:
                return NEED_MORE
            if isinstance(reply, Verdict):
                return Step(verdict=reply)
            kind, value = reply
            self.answered += 1
            step = self._answer(self.commands.pop(0), kind, value)
            if step is not None:
                return step
        return self.done()

    def _next_reply(self) -> tuple[str, bytes] | Verdict | None:
        """The next whole reply (its type byte and value) taken from the buffer; None:
        not all here yet."""
        end = self.buffer.find(b"\r\n")
        if end < 0:
            if self.buffer and chr(self.buffer[0]) not in "+-:$":
                return self.fail(f"not a Redis answer: {excerpt(bytes(self.buffer))}")
            return None
        kind, line = chr(self.buffer[0]), bytes(self.buffer[1:end])
        if kind in "+-:":
            del self.buffer[: end + 2]
            return kind, line
        if kind == "$" and line.isdigit() and len(line) <= 9:
            size = int(line)
            if len(self.buffer) < end + 2 + size + 2:
                return None
            value = bytes(self.buffer[end + 2 : end + 2 + size])
            del self.buffer[: end + 2 + size + 2]
            return kind, value
        if kind == "$" and line == b"-1":
            del self.buffer[: end + 2]
            return kind, b""
        return self.fail(f"not a Redis answer: {excerpt(bytes(self.buffer))}")

    def _answer(self, command: str, kind: str, value: bytes) -> Step | None:
        if kind == "-":
            where = "AUTH: " if command == "AUTH" else ""
            return self.failed(where + printable(value))
        if command == "AUTH":
            return None
        if command == "PING":
            if (kind, value) != ("+", b"PONG"):
                return self.failed(f"PING answered {excerpt(value)}")
            return None
        role = None
        for line in value.split(b"\n"):
            if line.startswith(b"role:"):
                role = printable(line[5:].strip())
        want = INFO_ROLE[self.role or "master"]
        if role is None:
            return self.failed("INFO replication has no role: line")
        if role != want:
            return self.failed(f"role:{role}, want {self.role}")
        return None

    def closed(self) -> Verdict:
        if not self.buffer and not self.answered:
            return self.fail("the server closed without answering")
        return self.fail("the server closed before answering every command")
