"""`smtp`: the greeting, EHLO, QUIT.

PURE. An SMTP reply is one or more lines `CODE-text` ended by one `CODE text` (RFC 5321
§4.2.1). The server speaks first: a 220 greeting (anything else, such as `554 no
service`, fails with the reply); we send `EHLO helo`; a 250 reply is healthy and we send
QUIT, anything else fails: `smtp: EHLO answered 421 too busy`.
"""

from __future__ import annotations

from lbproxy.wire.health.exchange import NEED_MORE, Exchange, Step, Verdict, excerpt, printable

QUIT = b"QUIT\r\n"


class SmtpExchange(Exchange):
    name = "smtp"

    def __init__(self, helo: str) -> None:
        self.helo = helo
        self.buffer = bytearray()
        self.greeted = False
        self.seen = 0

    def received(self, data: bytes) -> Step:
        self.buffer += data
        self.seen += len(data)
        while True:
            end = self.buffer.find(b"\n")
            if end < 0:
                return NEED_MORE
            line = bytes(self.buffer[:end]).rstrip(b"\r")
            del self.buffer[: end + 1]
            if len(line) < 3 or not line[:3].isdigit() or line[3:4] not in (b"", b" ", b"-"):
                return self.failed(f"not an SMTP reply: {excerpt(line)}")
            if line[3:4] == b"-":
                continue  # a line of a multi-line reply: its last one decides
            code, text = line[:3].decode(), printable(line[4:])
            if not self.greeted:
                if code != "220":
                    return self.failed(f"greeting {code} {text}".rstrip())
                self.greeted = True
                if self.buffer:
                    return self.failed(f"spoke before EHLO: {excerpt(bytes(self.buffer))}")
                return Step(f"EHLO {self.helo}\r\n".encode())
            if code != "250":
                return self.failed(f"EHLO answered {code} {text}".rstrip(), QUIT)
            return self.done(QUIT)

    def closed(self) -> Verdict:
        if self.seen == 0:
            return self.fail("the server closed without a greeting")
        if not self.greeted:
            return self.fail("the server closed during its greeting")
        return self.fail("the server closed before answering EHLO")
