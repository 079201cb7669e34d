"""What importing another balancer's configuration produces, whichever balancer it is:
lbproxy's configuration as data, the directives left behind (each with its FILE:LINE),
and the migration table the docs' guide is generated from.

A translator (haproxy.py, nginx.py) reads its own grammar and fills a `Translation`;
this module turns one into the YAML `lbproxy import` prints. Pure: no I/O but the
caller's text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

Source = Literal["haproxy", "nginx"]

SCHEMA_COMMENT = "# yaml-language-server: $schema=lbproxy.schema.json"


@dataclass(frozen=True)
class Untranslated:
    """A directive (or a whole section, named once at its start) not carried over; or,
    with `note`, what the import decided there that a reader should know (a variable
    that is not set, a conditional block left out as the original leaves it out)."""

    file: str
    line: int
    what: str
    note: bool = False

    def __str__(self) -> str:
        if self.note:
            return f"{self.file}:{self.line}: {self.what}"
        return f"{self.file}:{self.line}: not translated: {self.what}"


@dataclass
class Translation:
    """lbproxy's configuration as the YAML writes it: `settings` are the top-level keys
    other than `virtual_servers` (admin, ...), each virtual server a mapping in the key
    order a person would write. `translated` counts the directives carried over; none
    means the import failed (exit 2)."""

    source: Source
    path: str
    virtual_servers: list[dict[str, Any]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    untranslated: list[Untranslated] = field(default_factory=list)
    translated: int = 0

    def skip(self, file: str, line: int, what: str) -> None:
        self.untranslated.append(Untranslated(file, line, what))


@dataclass(frozen=True)
class Mapping:
    """One row of the migration guide: a directive of `source` and what it becomes.
    `lbproxy` is empty when it is not translated; `note` says why or how."""

    source: Source
    directive: str
    lbproxy: str
    note: str = ""


def to_yaml(translation: Translation) -> str:
    """The configuration `lbproxy import` prints: the schema comment, where it came from,
    then the keys. Deterministic: the same translation gives the same bytes."""
    document: dict[str, Any] = dict(translation.settings)
    document["virtual_servers"] = translation.virtual_servers
    body = yaml.safe_dump(document, sort_keys=False, default_flow_style=False, width=88)
    header = [
        SCHEMA_COMMENT,
        f"# Imported from {translation.source}: {translation.path}",
        f"# {translation.translated} directives translated, "
        f"{sum(not left.note for left in translation.untranslated)} not (listed on stderr by "
        "`lbproxy import`).",
        "",
    ]
    return "\n".join(header) + body


def guess_source(text: str) -> Source | None:
    """HAProxy's sections or nginx's blocks, from the text alone: nginx writes
    `name {` blocks and ends directives with `;`, HAProxy neither."""
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        word = line.split()[0]
        if word in (
            "global",
            "defaults",
            "frontend",
            "backend",
            "listen",
            "peers",
            "resolvers",
            "userlist",
            "program",
            "cache",
            "ring",
            "mailers",
        ):
            return "haproxy"
        if line.endswith(("{", ";")) or word in ("stream", "events", "http", "upstream"):
            return "nginx"
    return None
