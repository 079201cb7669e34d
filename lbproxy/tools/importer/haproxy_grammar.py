"""HAProxy's configuration grammar, read by hand: no maintained Python library parses
haproxy.cfg (the few on PyPI are unmaintained, template writers, or split lines on
spaces), so this follows HAProxy's own reader (`parse_line` and `readcfgfile` in
src/cfgparse.c).

- A line is words separated by spaces or tabs; `#` outside quotes starts a comment.
- `'...'` is taken as written (no escape inside); `"..."` and unquoted text take the
  escapes `\\ `, `\\#`, `\\\\`, `\\'`, `\\"`, `\\r`, `\\n`, `\\t` and `\\xHH`; quoted and
  unquoted pieces that touch make one word (`a"b c"d` is `ab cd`).
- A line whose first word names a section (`global`, `defaults [NAME] [from NAME]`,
  `frontend|backend|listen NAME [from NAME]`, and HAProxy's other sections) starts it;
  every other line belongs to the section above it.
- Environment variables (`$VAR`, `${VAR}`) are left as written: the import reads the
  file, not the environment it will run in.

Pure: text in, sections and the problems of malformed lines out, every statement with
its file and line number. Nothing here raises on any input."""

from __future__ import annotations

from dataclasses import dataclass, field

# The sections lbproxy's import reads, and HAProxy's others (each named once, at its
# start, as not translated).
PROXY_SECTIONS = ("defaults", "frontend", "backend", "listen")
SECTIONS = (
    "global",
    *PROXY_SECTIONS,
    "peers",
    "resolvers",
    "userlist",
    "mailers",
    "program",
    "cache",
    "ring",
    "http-errors",
    "log-forward",
    "fcgi-app",
    "dynamic-update",
    "crt-store",
    "traces",
)

_ESCAPES = {" ": " ", "#": "#", "\\": "\\", "'": "'", '"': '"', "r": "\r", "n": "\n", "t": "\t"}
_HEX = "0123456789abcdefABCDEF"


@dataclass(frozen=True)
class Statement:
    """One configuration line: its words (quotes and escapes resolved) and where it is."""

    file: str
    line: int
    words: tuple[str, ...]

    @property
    def keyword(self) -> str:
        return self.words[0]

    @property
    def text(self) -> str:
        """The words as one would write them back (for messages)."""
        return " ".join(_shown(word) for word in self.words)


@dataclass
class Section:
    """A section: its kind (`frontend`, ...), name ("" for an unnamed `defaults`), the
    defaults it names with `from`, its header line and the statements under it."""

    kind: str
    name: str
    header: Statement
    source: str | None = None  # `from NAME`
    statements: list[Statement] = field(default_factory=list)


@dataclass(frozen=True)
class Problem:
    """A line that could not be read (an unterminated quote, a bad escape)."""

    file: str
    line: int
    message: str


@dataclass
class Parsed:
    sections: list[Section] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    before_sections: list[Statement] = field(default_factory=list)  # lines no section owns


def _shown(word: str) -> str:
    """A word as one would write it in haproxy.cfg (quoted when it must be)."""
    escaped = word.replace("\\", "\\\\").translate({13: "\\r", 10: "\\n", 9: "\\t"})
    if escaped.isprintable() and word and not any(c in word for c in " #'\""):
        return escaped
    return '"' + escaped.replace('"', '\\"') + '"' if escaped.isprintable() else repr(word)


def split_words(line: str) -> tuple[list[str], str | None]:
    """The words of one line and None, or what is wrong with it (the words so far)."""
    words: list[str] = []
    current: list[str] = []
    in_word = False
    quote: str | None = None
    i = 0
    n = len(line)
    while i < n:
        c = line[i]
        if quote == "'":
            if c == "'":
                quote = None
            else:
                current.append(c)
            i += 1
            continue
        if c == "\\":
            if i + 1 >= n:
                return words, "a backslash ends the line"
            nxt = line[i + 1]
            if nxt == "x":
                digits = line[i + 2 : i + 4]
                if len(digits) != 2 or any(d not in _HEX for d in digits):
                    return words, f"bad escape \\x{digits} (two hex digits expected)"
                current.append(chr(int(digits, 16)))
                in_word = True
                i += 4
                continue
            if nxt in _ESCAPES:
                current.append(_ESCAPES[nxt])
            else:
                current.append("\\" + nxt)  # HAProxy keeps an unknown escape as written
            in_word = True
            i += 2
            continue
        if quote == '"':
            if c == '"':
                quote = None
            else:
                current.append(c)
            i += 1
            continue
        if c in "'\"":
            quote = c
            in_word = True
            i += 1
            continue
        if c == "#":
            break
        if c in " \t\r\n\f\v":
            if in_word:
                words.append("".join(current))
                current = []
                in_word = False
            i += 1
            continue
        current.append(c)
        in_word = True
        i += 1
    if quote is not None:
        return words, f"unmatched quote ({quote})"
    if in_word:
        words.append("".join(current))
    return words, None


def parse(text: str, file: str) -> Parsed:
    """Every section of `text` (the content of `file`) with its statements, in order."""
    parsed = Parsed()
    section: Section | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        words, error = split_words(raw)
        if error is not None:
            parsed.problems.append(Problem(file, number, f"{error}: {raw.strip()[:80]}"))
            continue
        if not words:
            continue
        statement = Statement(file, number, tuple(words))
        if words[0] in SECTIONS:
            section = _section(statement)
            parsed.sections.append(section)
        elif section is None:
            parsed.before_sections.append(statement)
        else:
            section.statements.append(statement)
    return parsed


def _section(header: Statement) -> Section:
    kind, args = header.words[0], list(header.words[1:])
    source = None
    if kind in PROXY_SECTIONS and "from" in args:
        at = args.index("from")
        if at + 1 < len(args):
            source = args[at + 1]
        del args[at : at + 2]
    name = args[0] if args else ""
    return Section(kind, name, header, source)
