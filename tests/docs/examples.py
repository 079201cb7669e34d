"""The examples in the documentation (README.md and docs/**/*.md), as the docs tests read
them: YAML blocks and command lines. The conventions are in docs/development.md
("Examples in the documentation")."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.docs.support import ROOT

PAGES = [
    ROOT / "README.md",
    *sorted(
        page
        for page in (ROOT / "docs").rglob("*.md")
        # the front page is the README (test_site); the journals record what was, not what is
        if page.name != "index.md" and page.parent.name != "development"
    ),
]

FENCE = re.compile(
    r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.S | re.M
)
MARK = re.compile(r"<!--\s*(fragment|not-config)\b(?P<about>[^>]*)-->\s*\n\s*$")
# A CLI sample: a line `$ lbproxy ...` in any block, or `lbproxy ...` starting a line of
# a sh block (`.venv/bin/lbproxy` and `python -m lbproxy` too).
COMMAND = re.compile(r"^(?:\$ )?(?:\.venv/bin/|python3? -m )?lbproxy(?: .*)?$")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence
    lang: str
    text: str  # without the block's own indentation
    mark: str  # "fragment", "not-config" or ""
    about: str  # what follows the mark's word

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(pages: list[Path] = PAGES) -> list[Block]:
    found = []
    for page in pages:
        text = page.read_text()
        for match in FENCE.finditer(text):
            indent = len(match.group("indent"))
            body = "\n".join(line[indent:] for line in match.group("body").splitlines())
            before = text[: match.start()]
            mark = MARK.search(before[-200:])
            found.append(
                Block(
                    page,
                    before.count("\n") + 1,
                    match.group("lang"),
                    body + "\n",
                    mark.group(1) if mark else "",
                    mark.group("about").strip().lstrip(":").strip() if mark else "",
                )
            )
    return found


def yaml_blocks() -> list[Block]:
    return [block for block in blocks() if block.lang in ("yaml", "yml")]


def is_configuration(block: Block) -> bool:
    """A whole configuration file: top-level `virtual_servers` or `global`."""
    if block.text.lstrip().startswith("--8<--"):
        return False  # a file of the repository, included (configs/ are checked as files)
    document = yaml.safe_load(block.text)
    return isinstance(document, dict) and bool({"virtual_servers", "global"} & set(document))


def only_comments(block: Block) -> bool:
    """A block of comments only, such as the schema line a file starts with."""
    return yaml.safe_load(block.text) is None


def included(block: Block) -> bool:
    return block.text.lstrip().startswith("--8<--")


@dataclass
class Sample:
    block: Block
    line: int
    argv: list[str]  # after `lbproxy`
    output: list[str]  # the lines shown after it, up to the next command


def samples() -> list[Sample]:
    found = []
    for block in blocks():
        if block.lang not in ("", "sh", "console", "text", "shell"):
            continue
        lines = block.text.splitlines()
        for index, raw in enumerate(lines):
            line = raw.strip()
            prompted = line.startswith("$ ")  # its output follows
            if block.lang != "sh" and not prompted:
                continue
            if not COMMAND.match(line):
                continue
            following = index + 1  # a line ending in a backslash goes on on the next
            while line.endswith("\\") and following < len(lines):
                line = line[:-1] + " " + lines[following].strip()
                following += 1
            # lbproxy's own words never hold a pipe: what follows one is another program's
            words = shlex.split(line.removeprefix("$ ").split(" | ")[0], comments=True)
            # the command ends at a pipe or a redirection
            for end, word in enumerate(words):
                if word in ("|", "&&", ";", ">", "2>&1") or word.startswith((">", "|")):
                    words = words[:end]
                    break
            start = next(i for i, word in enumerate(words) if word.endswith("lbproxy"))
            words = words[start + 1 :]
            output = []
            for after in lines[following : len(lines) if prompted else following]:
                if after.startswith("$ "):
                    break
                output.append(after)
            found.append(Sample(block, block.line + 1 + index, words, output))
    return found
