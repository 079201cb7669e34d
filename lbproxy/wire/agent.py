"""The agent check's answer: HAProxy's agent-check line (SPEC §22), sans-io.

PURE: bytes in, a verdict out; no sockets, no clock.

An agent answers one line, ended by LF or by its close (a CR before the LF is dropped).
A line longer than `LINE_LIMIT` bytes is a bad answer and is not parsed: the reader stops
reading there (`line_of`), so nothing an agent sends grows memory.

The line is words separated by spaces, tabs or commas, in any order, case-insensitive;
text after `#` is the reason, for the operator:

    NN%          the agent weight: the share of the weight the scheduler uses (0..256)
    maxconn:N    the real server's max_connections (0: unlimited)
    ready, up    clear the agent's drain or maint; `up` also ends its `down`
    drain        no new connections
    maint        no new connections (established ones continue, as with drain)
    down, fail, stopped
                 health down, with the reason

A word outside this list, a percentage above 256 or a line with no word makes the whole
answer bad (`BadAnswer`): it changes nothing. Of two words of one kind the last counts
("drain ready" is ready), as HAProxy reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LINE_LIMIT = 512  # bytes of a line, without its LF (and CR)
MAX_PERCENT = 256
MAX_CONNECTIONS = 2**31 - 1  # a larger `maxconn:` is a bad answer
REASON_LIMIT = 200  # characters of the reason kept (after control characters go)

READY, DRAIN, MAINT = "ready", "drain", "maint"
DOWN_WORDS = ("down", "fail", "stopped")

_SEPARATORS = re.compile(r"[ \t,]+")
_PERCENT = re.compile(r"([0-9]{1,10})%")
_MAXCONN = re.compile(r"maxconn:([0-9]{1,10})")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


@dataclass(frozen=True, slots=True)
class AgentAnswer:
    """What one good answer says; None: the answer did not say it."""

    weight_percent: int | None = None
    max_connections: int | None = None
    admin: str | None = None  # ready | drain | maint (`up` says ready too)
    health: str | None = None  # "up", or the down word said: down | fail | stopped
    reason: str = ""


@dataclass(frozen=True, slots=True)
class BadAnswer:
    """An answer that changes nothing; `why` says what was wrong, for the log."""

    why: str


def line_of(received: bytes, closed: bool) -> bytes | BadAnswer | None:
    """The agent's line out of what it sent so far.

    Returns the line (without CR LF) once it is complete (an LF, or the agent closed:
    b"" when it sent nothing), a BadAnswer once it is longer than LINE_LIMIT, None while
    more is needed. The caller never needs to read more than LINE_LIMIT + 2 bytes.
    """
    end = received.find(b"\n", 0, LINE_LIMIT + 2)
    if end >= 0:
        line = received[:end]
    elif closed:
        line = received
    else:
        line = received[: LINE_LIMIT + 2]
        if len(line) <= LINE_LIMIT + 1:  # an LF (after a CR) may still come
            return None
    if line.endswith(b"\r"):
        line = line[:-1]
    if len(line) > LINE_LIMIT:
        return BadAnswer(f"a line longer than {LINE_LIMIT} bytes")
    return bytes(line)


def parse(line: bytes) -> AgentAnswer | BadAnswer:
    """What the agent's `line` (as `line_of` returns it) says."""
    if len(line) > LINE_LIMIT:
        return BadAnswer(f"a line longer than {LINE_LIMIT} bytes")
    words_part, sharp, reason_part = line.partition(b"#")
    try:
        text = words_part.decode("ascii")
    except UnicodeDecodeError:
        return BadAnswer("a word that is not ASCII")
    reason = ""
    if sharp:
        reason = _CONTROL.sub(" ", reason_part.decode("utf-8", errors="replace")).strip()
        reason = reason[:REASON_LIMIT]
    words = [word for word in _SEPARATORS.split(text.strip(" \t,\r")) if word]
    if not words:
        return BadAnswer("no word")
    weight = max_connections = admin = health = None
    for word in (word.lower() for word in words):
        if match := _PERCENT.fullmatch(word):
            weight = int(match.group(1))
            if weight > MAX_PERCENT:
                return BadAnswer(f"weight {weight}% above {MAX_PERCENT}%")
        elif match := _MAXCONN.fullmatch(word):
            max_connections = int(match.group(1))
            if max_connections > MAX_CONNECTIONS:
                return BadAnswer(f"maxconn:{max_connections} above {MAX_CONNECTIONS}")
        elif word in (READY, DRAIN, MAINT):
            admin = word
        elif word == "up":
            admin, health = READY, "up"
        elif word in DOWN_WORDS:
            health = word
        else:
            return BadAnswer(f"unknown word {_shown(word)}")
    return AgentAnswer(weight, max_connections, admin, health, reason)


def _shown(word: str, limit: int = 40) -> str:
    """A word for a log line: quoted, control characters escaped, cut at `limit`."""
    text = word if len(word) <= limit else word[: limit - 3] + "..."
    return repr(text)


def describe(answer: AgentAnswer) -> str:
    """The answer as a line again, in a canonical form ("50% maxconn:10 drain # why")."""
    words = []
    if answer.weight_percent is not None:
        words.append(f"{answer.weight_percent}%")
    if answer.max_connections is not None:
        words.append(f"maxconn:{answer.max_connections}")
    if answer.health == "up":
        words.append("up")
    if answer.admin is not None and not (answer.health == "up" and answer.admin == READY):
        words.append(answer.admin)
    if answer.health not in (None, "up"):
        words.append(answer.health)  # a down word
    line = " ".join(words)
    return f"{line} # {answer.reason}" if answer.reason else line
