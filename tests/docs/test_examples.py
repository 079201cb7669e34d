"""Every example in the documentation works as shown (conventions: docs/development.md,
"Examples in the documentation"):

- every YAML block that is a configuration (top-level `virtual_servers` or `global`) passes
  `lbproxy check`; one marked `<!-- fragment -->` (keys of one virtual server, or a list of
  virtual servers) does once completed with a name, an address and a real server where it
  has none; `<!-- fragment: global -->` holds keys of `global`; every other YAML block is
  marked `<!-- not-config -->`, saying what it is;
- every CLI sample (`$ lbproxy ...` in a block, `lbproxy ...` in a sh block) parses: its
  command exists and takes those options and arguments;
- the samples that run offline (`check`, `simulate`, `schema`, `--help`, `--version`) on
  files the repository has or the page defines (a YAML block whose first line is
  `# NAME.yaml`: the file is the lines after it; or `$ cat NAME` and what it prints)
  run, exit as the sample shows, and print every line the sample shows (`...` stands
  for lines left out; spaces are not compared).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from lbproxy.cli import main
from tests.docs.examples import (
    Block,
    Sample,
    blocks,
    included,
    is_configuration,
    only_comments,
    samples,
    yaml_blocks,
)
from tests.docs.support import ROOT

DEFAULT_SERVER = {"name": "a", "address": "127.0.0.1:18081"}
OFFLINE = ("check", "simulate", "schema")
CLI_REFERENCE = ROOT / "docs" / "reference" / "cli.md"


def _id(item: Block | Sample) -> str:
    block = item if isinstance(item, Block) else item.block
    return f"{block.page.relative_to(ROOT)}:{item.line}"


def _virtual_server(keys: dict, index: int) -> dict:
    vs = {"name": f"example{index}", "listen": f"127.0.0.1:{18080 + 2 * index}"}
    vs.update(keys)
    if "real_servers" not in vs and "discovery" not in vs:
        vs["real_servers"] = [DEFAULT_SERVER]
    return vs


def _minimal() -> dict:
    return {"virtual_servers": [_virtual_server({}, 0)]}


def _files(block: Block) -> list[tuple[str, str]]:
    """The configuration files `lbproxy check` is to read for `block`."""
    if is_configuration(block):
        document = yaml.safe_load(block.text)
        if "virtual_servers" in document:
            return [("example.yaml", block.text)]
        return [("example.yaml", block.text), ("vs.yaml", yaml.safe_dump(_minimal()))]
    document = yaml.safe_load(block.text)
    context = yaml.safe_load(block.about) if block.about.startswith("{") else {}
    if block.about == "global":
        return [("example.yaml", yaml.safe_dump({"global": document, **_minimal()}))]
    entries = document if isinstance(document, list) else [document]
    virtual_servers = [_virtual_server({**context, **keys}, i) for i, keys in enumerate(entries)]
    return [("example.yaml", yaml.safe_dump({"virtual_servers": virtual_servers}))]


# What an example can only fail on a host that lacks the files and accounts it names
# (/etc/lbproxy/admin.token, a user `lbproxy`): the example is right, the host is not set up.
HOST_ONLY = re.compile(
    r"No such file or directory|does not exist|no (user|group) '[^']*' on this system"
)


def _problems(files: list[tuple[str, str]], folder: Path) -> list[str]:
    """`lbproxy check`'s problems with the files, but those of this host."""
    paths = []
    for name, text in files:
        (folder / name).write_text(text)
        paths.append(str(folder / name))
    result = CliRunner().invoke(main, ["check", *paths])
    if result.exit_code == 0:
        return []
    problems = [line for line in result.output.splitlines() if re.match(r"/\S+:\d+: ", line)]
    assert problems, result.output  # exit 2 names every problem with FILE:LINE
    return [line for line in problems if not HOST_ONLY.search(line)]


CONFIGURATIONS = [
    block
    for block in yaml_blocks()
    if block.mark != "not-config" and not included(block) and not only_comments(block)
]


def test_every_yaml_block_is_a_configuration_or_marked():
    unmarked = [
        block.where
        for block in yaml_blocks()
        if not block.mark
        and not included(block)
        and not only_comments(block)
        and not is_configuration(block)
    ]
    assert unmarked == [], "mark each <!-- fragment --> or <!-- not-config -->"
    assert len(CONFIGURATIONS) >= 30


@pytest.mark.parametrize("block", CONFIGURATIONS, ids=_id)
def test_every_configuration_block_passes_check(block, tmp_path):
    problems = _problems(_files(block), tmp_path)
    assert problems == [], f"{block.where}:\n{block.text}"


SAMPLES = samples()


def _command(argv: list[str]) -> tuple[str, click.Command | None, list[str]]:
    if not argv or argv[0].startswith("-"):
        return "", main, argv
    return argv[0], main.get_command(click.Context(main), argv[0]), argv[1:]


def test_the_samples_are_found():
    commands = {_command(sample.argv)[0] for sample in SAMPLES}
    assert {"check", "simulate", "status", "drain", "explain"} <= commands
    assert len(SAMPLES) >= 40


@pytest.mark.parametrize("sample", SAMPLES, ids=_id)
def test_every_cli_sample_parses(sample):
    name, command, args = _command(sample.argv)
    where = f"{_id(sample)}: lbproxy {' '.join(sample.argv)}"
    assert command is not None, f"{where}: no command {name!r}"
    if "--help" in args or "-h" in args or "--version" in args:
        return  # eager options: ran by test_offline_samples_run
    try:
        command.make_context(f"lbproxy {name}".strip(), list(args))
    except click.ClickException as exc:
        pytest.fail(f"{where}: {exc.format_message()}")


def _page_files(block: Block) -> dict[str, str]:
    """The files a page defines: YAML blocks whose first line is `# NAME.yaml` (the
    file is the lines after that one), and `$ cat NAME` in a block (the lines it prints)."""
    files = {}
    for other in blocks([block.page]):
        lines = other.text.splitlines()
        if other.lang in ("yaml", "yml") and lines:
            match = re.fullmatch(r"#\s*([\w.-]+\.ya?ml)\s*", lines[0].strip())
            if match:  # the file is what follows its name
                files[match.group(1)] = "\n".join(lines[1:]) + "\n"
        for index, line in enumerate(lines):
            match = re.fullmatch(r"\$ cat ([\w.-]+)", line.strip())
            if match:
                shown = []
                for after in lines[index + 1 :]:
                    if after.startswith("$ "):
                        break
                    shown.append(after)
                files[match.group(1)] = "\n".join(shown) + "\n"
    return files


def _runnable(sample: Sample) -> bool:
    name, _, args = _command(sample.argv)
    if name == "" or "--help" in args or "-h" in args:
        return True
    if name not in OFFLINE:
        return False
    defined = _page_files(sample.block)
    paths = [arg for arg in args if arg.endswith((".yaml", ".yml", "/")) or "/" in arg]
    return all((ROOT / path).exists() or path in defined for path in paths)


OFFLINE_SAMPLES = [sample for sample in SAMPLES if _runnable(sample)]


def _words(line: str) -> str:
    return " ".join(line.split())


@pytest.mark.parametrize("sample", OFFLINE_SAMPLES, ids=_id)
def test_offline_samples_run(sample, tmp_path, monkeypatch):
    for name, text in _page_files(sample.block).items():
        (tmp_path / name).write_text(text)
    for entry in ("configs", "contrib"):
        (tmp_path / entry).symlink_to(ROOT / entry)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "80")
    result = CliRunner().invoke(main, sample.argv, terminal_width=80)
    where = f"{_id(sample)}: lbproxy {' '.join(sample.argv)}"
    output = [_words(line) for line in result.output.splitlines()]
    shown = [_words(line) for line in sample.output if line.strip() and line.strip() != "..."]
    invalid = any(re.match(r"\S+:\d+: ", line) for line in shown)
    expected_exit = 2 if invalid else 0
    assert result.exit_code == expected_exit, f"{where}\n{result.output}"
    missing = [line for line in shown if line not in output]
    assert missing == [], (
        f"{where}: not printed:\n" + "\n".join(missing) + f"\n---\n{result.output}"
    )


def test_the_samples_cover_the_offline_commands():
    ran = {_command(sample.argv)[0] for sample in OFFLINE_SAMPLES}
    assert {"check", "simulate"} <= ran, ran
    assert os.sep == "/"


def _commands() -> list[str]:
    return ["", *sorted(main.list_commands(click.Context(main)))]


@pytest.mark.parametrize("name", _commands())
def test_every_help_fits_the_width_the_cli_reference_says(name):
    """docs/reference/cli.md: `--help` fits N columns, whatever the terminal's width."""
    claim = re.search(r"`lbproxy COMMAND --help` fit (\d+) columns", CLI_REFERENCE.read_text())
    assert claim, "the CLI reference says how wide --help is"
    width = int(claim.group(1))
    for terminal in (80, 200):
        args = [name, "--help"] if name else ["--help"]
        result = CliRunner().invoke(main, args, env={"COLUMNS": str(terminal)})
        assert result.exit_code == 0, result.output
        wide = [line for line in result.output.splitlines() if len(line) > width]
        assert wide == [], f"lbproxy {name} --help on a {terminal}-column terminal"
        assert "Examples:" in result.output  # "... and end with examples"
