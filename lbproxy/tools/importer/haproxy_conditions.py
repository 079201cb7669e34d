"""The conditions of HAProxy's `.if` and `.elif` lines, evaluated as HAProxy 2.6 does
(src/cfgcond.c, the argument lists of src/arg.c's `make_arg_list`).

The condition is the line's words (quotes and variables already resolved) joined by one
space. It is empty (false), or terms joined by `&&` (binding tighter) and `||`; a term
is `!` any number of times before an integer (as C's `strtol` reads one: `0x1f`, `017`,
`-3`; 0 is false), `( EXPR )` or a predicate with its arguments in parentheses.

`defined`, `streq` and `strneq` are exact here. The others ask about the HAProxy binary
(`feature`, `version_atleast`, `version_before`, `openssl_version_atleast`,
`openssl_version_before`, `ssllib_name_startswith`): lbproxy is not HAProxy, so they are
unknown, and a term that is unknown keeps `&&` and `||` unknown unless the other side
decides (`0 && feature(X)` is false, `1 || feature(X)` true). Pure; never raises."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Unknown:
    """What only HAProxy itself could tell (the predicates that decide it)."""

    predicates: tuple[str, ...]


@dataclass(frozen=True)
class Malformed:
    """A condition HAProxy refuses (it does not start): why."""

    message: str


Value = bool | Unknown

# the predicates and how many arguments each takes (all strings)
_EXACT = {"defined": 1, "streq": 2, "strneq": 2}
_ABOUT_HAPROXY = {
    "feature": 1,
    "version_atleast": 1,
    "version_before": 1,
    "openssl_version_atleast": 1,
    "openssl_version_before": 1,
    "ssllib_name_startswith": 1,
}
_INTEGER = re.compile(r"[+-]?(?:0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)")
_MAX_DEPTH = 1024  # HAProxy's MAX_CFG_RECURSION


class _Refused(Exception):
    pass


def evaluate(condition: str, env: Mapping[str, str]) -> Value | Malformed:
    """True or False as HAProxy decides, Unknown, or Malformed (HAProxy's error)."""
    if not condition:
        return False
    reader = _Reader(condition, env)
    try:
        value = reader.expression(_MAX_DEPTH)
        reader.spaces()
        if reader.at < len(condition):
            raise _Refused(
                f"unexpected character '{condition[reader.at]}' at the end of conditional "
                f"expression '{condition}'"
            )
    except _Refused as e:
        return Malformed(str(e))
    except RecursionError:
        return Malformed(f"unparsable conditional expression '{condition}'")
    return value


def _and(left: Value, right: Value) -> Value:
    if left is False or right is False:
        return False
    if left is True and right is True:
        return True
    return _unknown(left, right)


def _or(left: Value, right: Value) -> Value:
    if left is True or right is True:
        return True
    if left is False and right is False:
        return False
    return _unknown(left, right)


def _unknown(*values: Value) -> Unknown:
    names: list[str] = []
    for value in values:
        if isinstance(value, Unknown):
            names.extend(name for name in value.predicates if name not in names)
    return Unknown(tuple(names))


class _Reader:
    def __init__(self, text: str, env: Mapping[str, str]):
        self.text = text
        self.env = env
        self.at = 0

    def spaces(self) -> None:
        while self.at < len(self.text) and self.text[self.at] in " \t":
            self.at += 1

    def expression(self, depth: int) -> Value:
        """Terms joined by `&&`, those joined by `||`."""
        value = self.conjunction(depth - 1)
        self.spaces()
        if self.text.startswith("||", self.at):
            self.at += 2
            self.spaces()
            value = _or(value, self.expression(depth - 1))
        return value

    def conjunction(self, depth: int) -> Value:
        if depth <= 0 or self.at >= len(self.text):
            raise _Refused(f"unparsable conditional sub-expression '{self.text[self.at :]}'")
        value = self.term(depth - 1)
        self.spaces()
        if self.text.startswith("&&", self.at):
            self.at += 2
            self.spaces()
            value = _and(value, self.conjunction(depth - 1))
        return value

    def term(self, depth: int) -> Value:
        start = self.at
        self.spaces()
        if self.at >= len(self.text) or depth <= 0:
            raise _Refused(f"unparsable conditional expression '{self.text[start:]}'")
        negated = False
        while self.at < len(self.text) and self.text[self.at] == "!":
            negated = not negated
            self.at += 1
            self.spaces()
        value = self.positive_term(depth, start)
        if negated and isinstance(value, bool):
            return not value
        return value

    def positive_term(self, depth: int, start: int) -> Value:
        number = _INTEGER.match(self.text, self.at)
        if number:
            self.at = number.end()
            return _integer(number.group()) != 0
        if self.at < len(self.text) and self.text[self.at] == "(":
            self.at += 1
            self.spaces()
            value = self.expression(depth - 1)
            self.spaces()
            if self.at >= len(self.text) or self.text[self.at] != ")":
                raise _Refused(f"expected ')' after conditional expression '{self.text[start:]}'")
            self.at += 1
            self.spaces()
            return value
        name = re.match(r"[^ (]*", self.text[self.at :])
        word = name.group() if name else ""
        count = _EXACT.get(word) or _ABOUT_HAPROXY.get(word)
        if count is None:
            raise _Refused(f"unparsable conditional expression '{self.text[start:]}'")
        self.at += len(word)
        args = self.arguments(word, count)
        if word == "defined":
            return args[0] in self.env
        if word == "streq":
            return args[0] == args[1]
        if word == "strneq":
            return args[0] != args[1]
        return Unknown((f"{word}({args[0]})",))

    def arguments(self, predicate: str, count: int) -> list[str]:
        """`(A,B)` as make_arg_list reads string arguments: quotes and `\\` escapes,
        `,` and `)` end one outside quotes; exactly `count` of them, then `)`."""
        text = self.text
        if self.at >= len(text) or text[self.at] != "(":
            if count == 1:
                return [""]  # make_arg_list: no parentheses is one empty argument
            raise _Refused(
                f"missing arguments (got 0/{count}), type 'string' expected in argument 0 "
                f"of predicate '{predicate}' used in conditional expression"
            )
        self.at += 1
        args: list[str] = []
        while len(args) < count:
            out: list[str] = []
            squote = dquote = False
            while self.at < len(text):
                c = text[self.at]
                if c == '"' and not squote:
                    dquote = not dquote
                elif c == "'" and not dquote:
                    squote = not squote
                elif c == "\\" and not squote:
                    following = text[self.at + 1 : self.at + 2]
                    if not following:
                        raise _Refused(
                            f"unmatched quote or escape in argument {len(args) + 1} of "
                            f"predicate '{predicate}' used in conditional expression"
                        )
                    if following in "\\ \"'":
                        out.append(following)
                        self.at += 1
                    elif following in "rnt":
                        out.append({"r": "\r", "n": "\n", "t": "\t"}[following])
                        self.at += 1
                    else:
                        out.append(c)
                elif not squote and not dquote and c in ",)":
                    break
                else:
                    out.append(c)
                self.at += 1
            args.append("".join(out))
            if self.at >= len(text) or text[self.at] == ")" or len(args) >= count:
                break
            self.at += 1  # the comma
        if len(args) < count:
            raise _Refused(
                f"missing arguments (got {len(args)}/{count}), type 'string' expected in "
                f"argument {len(args)} of predicate '{predicate}' used in conditional "
                "expression"
            )
        if self.at >= len(text) or text[self.at] != ")":
            rest = text[self.at :]
            raise _Refused(
                (f"expected ')' before '{rest}'" if rest else "expected ')'")
                + f" in argument {count} of predicate '{predicate}' used in conditional "
                "expression"
            )
        self.at += 1
        return args


def _integer(text: str) -> int:
    digits = text.lstrip("+-")
    sign = -1 if text.startswith("-") else 1
    if digits[:2] in ("0x", "0X"):
        return sign * int(digits[2:], 16)
    if digits.startswith("0"):
        return sign * int(digits, 8)
    return sign * int(digits)
