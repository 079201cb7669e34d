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
- Environment variables are HAProxy's (2.6, doc/configuration.txt sections 2.3 and 2.4):
  within double quotes, `$VAR`, `${VAR}`, `${VAR-default}` (the default for a variable
  that is not set, not for an empty one), `${VAR[*]}` (one word per space-separated
  value) and the pseudo-variables `${.FILE}`, `${.LINE}`, `${.SECTION}`; `\\$` is a
  dollar. Unquoted or in single quotes a `$` is text, except in an address (bind, the
  server's, `addr`), which HAProxy expands once more after reading the words (`$VAR`,
  `${VAR}` only: its `env_expand`). A variable that is not set is empty, with one note.
  The global `setenv`, `presetenv`, `unsetenv` and `resetenv` change the variables of
  the lines below them, as in HAProxy.
- `.if`/`.elif`/`.else`/`.endif` keep or leave out the lines between them as HAProxy
  decides (conditions.py evaluates them); a block left out is one note, a condition
  only HAProxy itself can decide (`feature()`, `version_atleast()` ...) or a malformed
  one leaves its block out with one problem.

Pure: text and the environment (a mapping) in, sections, the problems of malformed
lines and the notes out, every statement with its file and line number. Nothing here
raises on any input."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from lbproxy.tools.importer.haproxy_conditions import Malformed, Unknown, evaluate

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
    """What the reader says about one line: in `Parsed.problems` what could not be read
    or carried over (an unterminated quote, a condition only HAProxy can decide, an
    `.alert`), in `Parsed.notes` what it decided (a variable not set, a block left out)."""

    file: str
    line: int
    message: str


@dataclass
class Parsed:
    sections: list[Section] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    before_sections: list[Statement] = field(default_factory=list)  # lines no section owns
    notes: list[Problem] = field(default_factory=list)  # said, not failures to translate


def _shown(word: str) -> str:
    """A word as one would write it in haproxy.cfg (quoted when it must be)."""
    escaped = word.replace("\\", "\\\\").translate({13: "\\r", 10: "\\n", 9: "\\t"})
    if escaped.isprintable() and word and not any(c in word for c in " #'\""):
        return escaped
    if not escaped.isprintable():
        return repr(word)
    return '"' + escaped.replace('"', '\\"').replace("$", "\\$") + '"'


Lookup = Callable[[str], "str | None"]


def _no_variables(name: str) -> str | None:
    return None


@dataclass
class Words:
    """One line read: its words, what is wrong with it (None when nothing), and the
    environment variables it uses that are not set (each once, in order)."""

    words: list[str]
    error: str | None = None
    unset: list[str] = field(default_factory=list)


def split_words(line: str, lookup: Lookup | None = None) -> tuple[list[str], str | None]:
    """The words of one line and None, or what is wrong with it (the words so far).
    `lookup(NAME)` is a variable's value, None when it is not set (none is by default)."""
    read = read_words(line, lookup or _no_variables)
    return read.words, read.error


def read_words(line: str, lookup: Lookup) -> Words:
    """`split_words` with the variables that are not set."""
    read = Words([])
    words = read.words
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
                read.error = "a backslash ends the line"
                return read
            nxt = line[i + 1]
            if nxt == "x":
                digits = line[i + 2 : i + 4]
                if len(digits) != 2 or any(d not in _HEX for d in digits):
                    read.error = f"bad escape \\x{digits} (two hex digits expected)"
                    return read
                current.append(chr(int(digits, 16)))
                in_word = True
                i += 4
                continue
            if nxt in _ESCAPES:
                current.append(_ESCAPES[nxt])
            elif nxt == "$" and quote == '"':
                current.append("$")
            else:
                current.append("\\" + nxt)  # HAProxy keeps an unknown escape as written
            in_word = True
            i += 2
            continue
        if quote == '"':
            if c == '"':
                quote = None
                i += 1
            elif c == "$":
                i = _variable(line, i, lookup, read, current)
                if read.error is not None:
                    return read
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
        if c in _SPACES:
            if in_word:
                words.append("".join(current))
                current.clear()
                in_word = False
            i += 1
            continue
        current.append(c)
        in_word = True
        i += 1
    if quote is not None:
        read.error = f"unmatched quote ({quote})"
        return read
    if in_word:
        words.append("".join(current))
    return read


_SPACES = " \t\r\n\f\v"
_PSEUDO_VARIABLES = (".FILE", ".LINE", ".SECTION")


def _variable(line: str, at: int, lookup: Lookup, read: Words, current: list[str]) -> int:
    """`$NAME`, `${NAME}`, `${NAME-default}` or `${NAME[*]}` at `line[at]` (within double
    quotes) into `current` (the word being read; `[*]` ends it at each space of the
    value, starting the next word): where reading goes on."""
    i = at + 1
    brace = i < len(line) and line[i] == "{"
    if brace:
        i += 1
    if i >= len(line) or not (line[i].isascii() and (line[i].isalpha() or line[i] in "_.")):
        read.error = f"forbidden first char in environment variable name at position {i + 1}"
        return i
    start = i
    if line[i] == ".":
        i += 1
    while i < len(line) and line[i].isascii() and (line[i].isalnum() or line[i] == "_"):
        i += 1
    name = line[start:i]
    if name.startswith(".") and name not in _PSEUDO_VARIABLES:
        read.error = f"unknown pseudo-variable {name} at position {start + 1}"
        return i
    value = lookup(name)
    spread = False
    if brace and line.startswith("[", i):
        if not line.startswith("[*]", i):
            read.error = f"truncated or invalid word expansion sequence at position {i + 1}"
            return i
        spread = True
        i += 3
    if brace:
        if line.startswith("-", i):
            close = line.find("}", i)
            if close < 0:
                read.error = f"unmatched brace in environment variable name at position {at + 2}"
                return i
            if value is None:
                value = line[i + 1 : close]
            i = close
        elif not line.startswith("}", i):
            read.error = f"unmatched brace in environment variable name at position {at + 2}"
            return i
        i += 1
    if value is None:
        if name not in read.unset:
            read.unset.append(name)
        return i
    if not spread:
        current.append(value)
        return i
    j = 0
    while j < len(value):
        if value[j] in _SPACES:
            read.words.append("".join(current))
            current.clear()
            while j < len(value) and value[j] in _SPACES:
                j += 1
        else:
            current.append(value[j])
            j += 1
    return i


def expand_address(text: str, lookup: Lookup, unset: list[str]) -> str:
    """An address as HAProxy's `env_expand` reads it once more, whatever the quotes
    were: `$NAME` and `${NAME}` are the variable's value (empty when not set, the name
    added to `unset`); nothing else is special."""
    if "$" not in text:
        return text
    out: list[str] = []
    i = 0
    while i < len(text):
        dollar = text.find("$", i)
        if dollar < 0:
            out.append(text[i:])
            break
        out.append(text[i:dollar])
        start = dollar + 1
        brace = text.startswith("{", start)
        if brace:
            start += 1
        end = start
        while end < len(text) and text[end].isascii() and (text[end].isalnum() or text[end] == "_"):
            end += 1
        name = text[start:end]
        value = lookup(name) if name and not name.startswith(".") else None
        if value is None and name and name not in unset:
            unset.append(name)
        out.append(value or "")
        i = end + 1 if brace and text.startswith("}", end) else end
    return "".join(out)


def parse(text: str, file: str, env: Mapping[str, str] | None = None) -> Parsed:
    """Every section of `text` (the content of `file`) with its statements, in order:
    the lines HAProxy would read with the environment `env` (none by default)."""
    return _Reader(file, dict(env or {})).read(text)


_ADDRESS_OPTIONS = ("addr", "source")  # server options HAProxy reads as addresses
_ENV_DIRECTIVES = ("setenv", "presetenv", "unsetenv", "resetenv")
_MESSAGES = {
    ".diag": "HAProxy's message in diagnostic mode (-dD)",
    ".notice": "HAProxy's notice when it starts",
    ".warning": "HAProxy's warning when it starts (in strict-mode it refuses to start)",
    ".alert": "HAProxy refuses to start here",
}


@dataclass
class _Level:
    """One `.if` ... `.endif` being read: the branch now (its directive's line and text,
    and why it is left out: None when its lines are kept) and what the branches above
    decided (`pending`: none taken yet, `taken`, `unknown`: one lbproxy cannot tell)."""

    line: int
    inside_left_out: bool  # the whole block is in one left out already
    branch_line: int
    branch_text: str
    left_out: str | None = None
    left_out_is_problem: bool = False
    status: str = "pending"
    taken_line: int = 0
    seen_else: bool = False


class _Reader:
    def __init__(self, file: str, env: dict[str, str]):
        self.file = file
        self.env = env
        self.parsed = Parsed()
        self.section: Section | None = None
        self.number = 0
        self.levels: list[_Level] = []

    def lookup(self, name: str) -> str | None:
        if name == ".FILE":
            return self.file
        if name == ".LINE":
            return str(self.number)
        if name == ".SECTION":
            if self.section is None:
                return ""
            return self.section.name or self.section.kind
        return self.env.get(name)

    def problem(self, line: int, message: str) -> None:
        self.parsed.problems.append(Problem(self.file, line, message))

    def note(self, line: int, message: str) -> None:
        self.parsed.notes.append(Problem(self.file, line, message))

    def unset(self, names: list[str]) -> None:
        for name in names:
            self.note(self.number, f"environment variable {name} is not set: empty here")

    @property
    def kept(self) -> bool:
        return not self.levels or (
            self.levels[-1].left_out is None and not self.levels[-1].inside_left_out
        )

    def read(self, text: str) -> Parsed:
        lines = text.splitlines()
        for number, raw in enumerate(lines, start=1):
            self.number = number
            read = read_words(raw, self.lookup)
            if read.error is not None:
                self.problem(number, f"{read.error}: {raw.strip()[:80]}")
                continue
            if not read.words:
                continue
            keyword = read.words[0]
            if keyword in (".if", ".elif", ".else", ".endif"):
                self.conditional(keyword, read, raw.strip()[:80])
            elif self.kept:
                self.unset(read.unset)
                self.statement(read.words)
        for level in reversed(self.levels):
            self.problem(level.line, "this .if has no .endif: HAProxy refuses the file")
            self.end_branch(level, len(lines) + 1)
        return self.parsed

    def statement(self, words: list[str]) -> None:
        keyword = words[0]
        if keyword.startswith("."):
            text = Statement(self.file, self.number, tuple(words)).text
            why = _MESSAGES.get(keyword, "an unknown directive: HAProxy refuses it")
            self.problem(self.number, f"{text} ({why})")
            return
        unset: list[str] = []
        for at in _address_words(words):
            words[at] = expand_address(words[at], self.lookup, unset)
        self.unset(unset)
        statement = Statement(self.file, self.number, tuple(words))
        if keyword in SECTIONS:
            self.section = _section(statement)
            self.parsed.sections.append(self.section)
            return
        if self.section is None:
            self.parsed.before_sections.append(statement)
            return
        if self.section.kind == "global" and keyword in _ENV_DIRECTIVES:
            self.change_env(words)
        self.section.statements.append(statement)

    def change_env(self, words: list[str]) -> None:
        """HAProxy's global setenv, presetenv, unsetenv, resetenv: for the lines below."""
        keyword, args = words[0], words[1:]
        if keyword == "setenv" and len(args) == 2:
            self.env[args[0]] = args[1]
        elif keyword == "presetenv" and len(args) == 2:
            self.env.setdefault(args[0], args[1])
        elif keyword == "unsetenv":
            for name in args:
                self.env.pop(name, None)
        elif keyword == "resetenv":
            self.env = {name: value for name, value in self.env.items() if name in args}

    # .if .elif .else .endif

    def conditional(self, keyword: str, read: Words, written: str) -> None:
        number = self.number
        if keyword == ".if":
            inside = not self.kept
            level = _Level(number, inside, number, written)
            self.levels.append(level)
            if not inside:
                self.unset(read.unset)
                self.decide(level, evaluate(" ".join(read.words[1:]), self.env), number)
            return
        if not self.levels:
            self.problem(number, f"{keyword} without an .if above it: HAProxy refuses the file")
            return
        level = self.levels[-1]
        if keyword in (".else", ".endif") and len(read.words) > 1:
            self.problem(number, f"{written}: HAProxy refuses an argument to {keyword}")
        if keyword != ".endif" and level.seen_else:
            self.problem(number, f"{keyword} after .else: HAProxy refuses the file")
            return
        self.end_branch(level, number)
        if keyword == ".endif":
            self.levels.pop()
            return
        level.branch_line, level.branch_text = number, written
        level.left_out, level.left_out_is_problem = None, False
        level.seen_else = keyword == ".else"
        if level.inside_left_out:
            return
        if keyword == ".else" or level.status == "taken":
            # HAProxy does not evaluate an .elif after a branch it took
            self.decide(level, True, number)
            return
        self.unset(read.unset)
        self.decide(level, evaluate(" ".join(read.words[1:]), self.env), number)

    def decide(self, level: _Level, value: bool | Unknown | Malformed, number: int) -> None:
        """Whether the branch that starts at `number` is kept, and if not why."""
        text = level.branch_text
        problem = True
        if level.status == "taken":
            level.left_out, problem = (
                f"{text} is not taken here (line {level.taken_line} is)",
                False,
            )
        elif value is False:
            level.left_out, problem = f"{text} is false here", False
        elif isinstance(value, Malformed):
            level.left_out = f"{text}: HAProxy refuses it ({value.message})"
        elif isinstance(value, Unknown):
            asked = ", ".join(value.predicates)
            level.left_out = (
                f"{text}: only HAProxy itself can tell {asked} (lbproxy is not HAProxy)"
            )
        elif level.status == "unknown":
            level.left_out = (
                f"{text}: taken only if the branches above it are not, which lbproxy cannot tell"
            )
        else:
            level.status, level.taken_line = "taken", number
            return
        level.left_out_is_problem = problem
        if problem and level.status == "pending":
            level.status = "unknown"

    def end_branch(self, level: _Level, closing: int) -> None:
        """The branch ends at line `closing`: one line if it was left out."""
        if level.left_out is None or level.inside_left_out:
            return
        first, last = level.branch_line + 1, closing - 1
        if first > last:
            span = "an empty block"
        elif first == last:
            span = f"line {first} left out"
        else:
            span = f"lines {first}-{last} left out"
        if level.left_out_is_problem:
            self.problem(level.branch_line, f"{level.left_out}: {span}")
        elif first <= last:
            self.note(level.branch_line, f"{level.left_out}: {span}")


def _address_words(words: list[str]) -> list[int]:
    """Which of a line's words HAProxy reads as addresses (and so expands once more)."""
    keyword = words[0]
    if keyword == "bind" and len(words) > 1:
        return [1]
    if keyword == "listen" and len(words) > 2 and words[2] != "from":
        return [2]
    if keyword in ("server", "default-server"):
        first_option = 3 if keyword == "server" else 1
        found = [2] if keyword == "server" and len(words) > 2 else []
        found += [
            at + 1 for at in range(first_option, len(words) - 1) if words[at] in _ADDRESS_OPTIONS
        ]
        return found
    return []


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
