"""The interface every protocol check implements, and what they share.

An `Exchange` is one check's conversation with a server, as a state machine fed with the
bytes the server sends:

    exchange = PgsqlExchange(user="lbproxy", database="lbproxy")
    stream.send(exchange.opening())          # may be b"": the server speaks first
    loop:
        step = exchange.received(chunk)      # each chunk as it arrives, in order
        stream.send(step.send)               # may be b""
        if step.verdict: done                # ok, or failed with a reason
    on close before a verdict: exchange.closed() is the verdict

The runner (lbproxy/control/checks.py) feeds at most `ANSWER_LIMIT` bytes in all: an
exchange may keep what it was given, and so never holds more than that. A verdict's
`send` is sent once more after it, best effort (a Terminate, a QUIT), then the stream is
closed. Every reason is a sentence a person reads, starting with the check's type
(`pgsql: FATAL: the database system is starting up`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

ANSWER_LIMIT = 16 * 1024  # bytes of a server's answers one check reads, at most
EXCERPT_LIMIT = 60  # characters of received bytes quoted in a reason

# How `excerpt` writes bytes that would be ambiguous or invisible in a log line.
_ESCAPES = {"\r": "\\r", "\n": "\\n", "\t": "\\t", "\\": "\\\\", '"': '\\"'}


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    reason: str = ""  # why it failed; empty when ok


@dataclass(frozen=True, slots=True)
class Step:
    """What the runner does after a chunk: send `send`, then stop if `verdict` is set."""

    send: bytes = b""
    verdict: Verdict | None = None


NEED_MORE = Step()


class Exchange(abc.ABC):
    """One check's conversation (module header)."""

    name: str = ""  # the check's type, the first word of every reason

    def opening(self) -> bytes:
        """What to send once connected; b"" when the server speaks first."""
        return b""

    @abc.abstractmethod
    def received(self, data: bytes) -> Step:
        """The next bytes from the server (never empty)."""

    def closed(self) -> Verdict:
        """The server closed before a verdict."""
        return self.fail("the server closed before answering")

    def fail(self, reason: str) -> Verdict:
        return Verdict(False, f"{self.name}: {reason}")

    def done(self, send: bytes = b"") -> Step:
        return Step(send, Verdict(True))

    def failed(self, reason: str, send: bytes = b"") -> Step:
        return Step(send, self.fail(reason))


def excerpt(data: bytes) -> str:
    r"""What a server sent, for a reason: its length and its first bytes, quoted,
    escaped (\r \n \t \\ \" and \xHH for other non-printable bytes) and cut at
    EXCERPT_LIMIT characters (never inside an escape), "..." marking the cut."""
    pieces: list[str] = []
    length = 0
    for byte in data:
        char = chr(byte)
        if char in _ESCAPES:
            piece = _ESCAPES[char]
        elif 0x20 <= byte < 0x7F:
            piece = char
        else:
            piece = f"\\x{byte:02x}"
        if length + len(piece) > EXCERPT_LIMIT:
            pieces.append("...")
            break
        pieces.append(piece)
        length += len(piece)
    count = f"{len(data)} byte{'' if len(data) == 1 else 's'}"
    return f'{count} "{"".join(pieces)}"'


def printable(text: bytes, limit: int = 200) -> str:
    """A server's own message (an error text), as one printable line of at most `limit`
    characters: other bytes become `?`, so a hostile server cannot forge log lines."""
    decoded = text.decode("utf-8", errors="replace")
    clean = "".join(c if c.isprintable() else "?" for c in decoded).strip()
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."
