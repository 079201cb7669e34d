"""Helpers of the configuration tests: write a file, load it, read its problems."""

from __future__ import annotations

import textwrap
from pathlib import Path

import jsonschema
import pytest

from lbproxy.config import schema
from lbproxy.config.model import ConfigError
from lbproxy.config.reader import load


def write(folder: Path, name: str, text: str) -> str:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def problems(paths: list[str]) -> list[str]:
    """The `FILE:LINE: message` lines `load` reports, in its order."""
    with pytest.raises(ConfigError) as info:
        load(paths)
    return [str(problem) for problem in info.value.problems]


def messages(paths: list[str]) -> list[str]:
    """The problems without `FILE:LINE: `, for tests about the wording."""
    with pytest.raises(ConfigError) as info:
        load(paths)
    return [problem.message for problem in info.value.problems]


def schema_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(schema.json_schema())
