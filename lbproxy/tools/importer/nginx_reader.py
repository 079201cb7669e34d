"""nginx's configuration grammar: the directives of a file and the files it includes,
each with the file and line it was written on.

The grammar is nginx's own (src/core/ngx_conf_file.c, `ngx_conf_read_token`): words
separated by white space; a directive ends with `;` or opens a block with `{`, closed
by `}`; `'...'` and `"..."` quote a word; a backslash escapes `"`, `'` and `\\` and
writes `\\t`, `\\r`, `\\n` (any other escape is kept as written); `#` at the start of a
word comments out the rest of the line; `${name}` is a variable, not a block.

`include` is expanded where it stands, as nginx does: a relative path is taken from the
directory of the main file (nginx's conf prefix when started with `-c FILE`), a pattern
with `*`, `?` or `[` is a glob whose files are read in name order and which may match
nothing, and a plain path that does not exist is an error. Reading files is the only
I/O here."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# nginx itself has no limit and recurses until it runs out of descriptors.
MAX_INCLUDE_DEPTH = 32


@dataclass(frozen=True)
class Directive:
    """One directive: its name and arguments as nginx reads them (quotes and escapes
    resolved), where it was written, and the directives of its block (None: no block).
    `order` is its place in the whole configuration read front to back, includes
    expanded."""

    name: str
    args: tuple[str, ...]
    file: str
    line: int
    order: int
    block: tuple[Directive, ...] | None = None

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


class NginxSyntaxError(ValueError):
    """A configuration nginx itself would refuse to read: FILE:LINE: message."""

    def __init__(self, file: str, line: int, message: str) -> None:
        super().__init__(f"{file}:{line}: {message}")
        self.file = file
        self.line = line
        self.message = message


@dataclass(frozen=True)
class _Token:
    text: str
    line: int
    quoted: bool  # a quoted ";" or "{" is a word, not punctuation


_ESCAPES = {'"': '"', "'": "'", "\\": "\\", "t": "\t", "r": "\r", "n": "\n"}
_SPACE = " \t\r\n"


def _unescape(raw: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(raw):
        ch = raw[i]
        if ch == "\\" and i + 1 < len(raw) and raw[i + 1] in _ESCAPES:
            out.append(_ESCAPES[raw[i + 1]])
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def tokens(text: str, file: str) -> list[_Token]:
    """The words and punctuation of one file, as nginx splits them."""
    found: list[_Token] = []
    i, line, n = 0, 1, len(text)
    while i < n:
        ch = text[i]
        if ch == "\n":
            line += 1
            i += 1
        elif ch in _SPACE:
            i += 1
        elif ch == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif ch in ";{}":
            found.append(_Token(ch, line, quoted=False))
            i += 1
        elif ch in "\"'":
            start_line = line
            i += 1
            start = i
            while True:
                if i >= n:
                    raise NginxSyntaxError(
                        file, start_line, f"unexpected end of file in a {ch}quoted{ch} word"
                    )
                c = text[i]
                if c == "\\" and i + 1 < n:
                    if text[i + 1] == "\n":
                        line += 1
                    i += 2
                    continue
                if c == "\n":
                    line += 1
                if c == ch:
                    break
                i += 1
            found.append(_Token(_unescape(text[start:i]), start_line, quoted=True))
            i += 1
            if i < n and text[i] not in _SPACE and text[i] not in ";{)":
                raise NginxSyntaxError(file, line, f'unexpected "{text[i]}" after a quoted word')
        else:
            start = i
            variable = False
            while i < n:
                c = text[i]
                if c == "\\" and i + 1 < n and text[i + 1] not in "\n":
                    i += 2
                    variable = False
                    continue
                if c in _SPACE or c == ";" or (c in "{}" and not variable):
                    break
                # `${name}`: the braces belong to the word, as in nginx
                variable = c == "$" or (variable and c != "}")
                i += 1
            found.append(_Token(_unescape(text[start:i]), line, quoted=False))
    return found


class _Reader:
    def __init__(self, main: Path, read_text: Callable[[Path], str]) -> None:
        self.root = main.parent
        self.read_text = read_text
        self.order = 0

    def read(self, path: Path, shown: str, depth: int) -> list[Directive]:
        text = self.read_text(path)
        stream = tokens(text, shown)
        position = 0

        def block(closing: _Token | None) -> list[Directive]:
            nonlocal position
            directives: list[Directive] = []
            words: list[_Token] = []
            while position < len(stream):
                token = stream[position]
                position += 1
                if token.quoted or token.text not in ";{}":
                    words.append(token)
                    continue
                if token.text == "}":
                    if words:
                        raise NginxSyntaxError(
                            shown, token.line, f'unexpected "}}" after "{words[0].text}"'
                        )
                    if closing is None:
                        raise NginxSyntaxError(shown, token.line, 'unexpected "}"')
                    return directives
                if not words:
                    raise NginxSyntaxError(shown, token.line, f'unexpected "{token.text}"')
                first, rest = words[0], tuple(w.text for w in words[1:])
                words = []
                self.order += 1
                order = self.order
                if token.text == "{":
                    inner = block(token)
                    directives.append(
                        Directive(first.text, rest, shown, first.line, order, tuple(inner))
                    )
                elif first.text == "include":
                    directives.extend(self.include(rest, shown, first.line, depth))
                else:
                    directives.append(Directive(first.text, rest, shown, first.line, order))
            last = stream[-1].line if stream else 1
            if words:
                raise NginxSyntaxError(
                    shown, words[-1].line, 'unexpected end of file, expecting ";" or "}"'
                )
            if closing is not None:
                raise NginxSyntaxError(shown, last, 'unexpected end of file, expecting "}"')
            return directives

        return block(None)

    def include(self, args: tuple[str, ...], file: str, line: int, depth: int) -> list[Directive]:
        if len(args) != 1:
            raise NginxSyntaxError(file, line, 'invalid number of arguments in "include"')
        if depth >= MAX_INCLUDE_DEPTH:
            raise NginxSyntaxError(
                file, line, f"includes nested deeper than {MAX_INCLUDE_DEPTH} (a loop?)"
            )
        pattern = args[0]
        full = Path(pattern) if os.path.isabs(pattern) else self.root / pattern
        if glob.has_magic(pattern):
            paths = sorted(Path(p) for p in glob.glob(str(full)) if not os.path.isdir(p))
        else:
            paths = [full]
        directives: list[Directive] = []
        for path in paths:
            shown = str(path)
            try:
                directives.extend(self.read(path, shown, depth + 1))
            except OSError as e:
                raise NginxSyntaxError(
                    file, line, f'include "{pattern}": {e.strerror or e}'
                ) from None
        return directives


def _read_text(path: Path) -> str:
    if path.is_dir():
        raise IsADirectoryError(21, "Is a directory", str(path))
    return path.read_bytes().decode("utf-8", errors="replace")


def read(path: Path, read_text: Callable[[Path], str] = _read_text) -> tuple[Directive, ...]:
    """The directives of the configuration at `path`, includes expanded. Raises
    NginxSyntaxError (FILE:LINE: message) where nginx would refuse it, OSError when
    `path` itself cannot be read."""
    return tuple(_Reader(path, read_text).read(path, str(path), 0))
