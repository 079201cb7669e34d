"""One definition, three faces: `lbproxy check`, `lbproxy schema` and the reference page.

The reader's tables (lbproxy/config/tables.py) are the definition. These tests hold the
model's dataclasses to them key for key, the committed reference page and schema file to
what the code writes now, every shipped configuration to the schema, and bad input to
being refused by the schema and by `check` alike.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from lbproxy.config import reference, schema
from lbproxy.config.model import ConfigError
from lbproxy.config.reader import load
from lbproxy.config.tables import SECTIONS, walk
from tests.unit.config.support import schema_validator

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
# Fields of the model that are not keys of their section: where a value was read, what
# the reader computes, and the nested sections (their own tables).
NOT_KEYS = {"line", "file", "discovered", "files", "global_"}


def test_the_schema_is_a_valid_draft_2020_12_schema():
    document = schema.json_schema()
    assert document["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(document)


@pytest.mark.parametrize("path, section", [p for p in walk() if p[1].model is not None])
def test_every_key_is_a_field_of_the_model_and_every_field_a_key(path, section):
    fields = {f.name for f in dataclasses.fields(section.model)} - NOT_KEYS
    keys = set(section.fields) | set(section.sections)
    if section.option_models:  # a scheduler's own keys are fields of its Options
        fields -= {"options"}
        for model in set(section.option_models.values()):
            fields |= {f.name for f in dataclasses.fields(model)}
    if path.endswith("real_servers[].snmp"):
        keys = set(section.fields)  # overrides of the virtual server's block
        fields -= set(section.sections)
    if path.endswith("real_servers[].agent_check"):
        fields &= {"port", "address"}  # a real server overrides only where its agent is
    assert keys == fields, f"{path}: keys and model fields differ"


def test_every_key_and_section_says_what_it_means():
    """A key added without `.about(...)` would be a blank line in the reference."""
    for path, section in walk():
        assert section.description, path or "the top level"
        for key, converter in section.fields.items():
            assert converter.description, f"{path}.{key}: add .about('what it means')"


def test_the_committed_reference_page_is_what_the_definition_writes():
    page = (ROOT / reference.PAGE).read_text()
    assert page == reference.markdown(), "run: python -m lbproxy.config.reference"


def test_the_committed_schema_file_is_what_lbproxy_schema_prints():
    committed = (ROOT / "docs" / "lbproxy.schema.json").read_text()
    assert committed == schema.dumps(), "run: lbproxy schema > docs/lbproxy.schema.json"


def _reference_keys() -> set[str]:
    """`section.key` for every row of the reference page's key tables."""
    keys, section = set(), None
    for line in (ROOT / reference.PAGE).read_text().splitlines():
        if heading := re.match(r"^## `([^`]+)` \{#", line):
            section = heading[1]
        elif line.startswith("## "):  # prose (the access log's fields are no keys)
            section = None
        elif section and (row := re.match(r"^\| `(\w+)` \|", line)):
            keys.add(f"{section}.{row[1]}")
    return keys


def _definition_keys() -> set[str]:
    return {f"{path}.{key}" for path, section in walk() if path for key in section.fields}


def _schema_keys() -> set[str]:
    found = set()

    def visit(node, path):
        for key, prop in node.get("properties", {}).items():
            where = f"{path}.{key}" if path else key
            options = prop.get("anyOf", [prop])
            objects = [o for o in options if o.get("type") == "object"]
            lists = [o for o in options if o.get("type") == "array" and "type" in o["items"]]
            if objects:
                visit(objects[0], where)
            elif lists and lists[0]["items"]["type"] == "object":
                visit(lists[0]["items"], where + "[]")
            else:
                found.add(where)

    visit(schema.json_schema(), "")
    return found


def test_the_reference_the_schema_and_check_know_the_same_keys():
    keys = _definition_keys()
    assert "virtual_servers[].real_servers[].weight" in keys
    assert "global.locator.dns.zone" in keys
    assert _reference_keys() == keys
    assert _schema_keys() == keys


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_configuration_validates_and_names_the_schema(path):
    text = path.read_text()
    first = text.splitlines()[0]
    match = re.fullmatch(r"# yaml-language-server: \$schema=(\S+)", first)
    assert match, f"{path.name} must start with the yaml-language-server line"
    assert (path.parent / match[1]).resolve() == ROOT / "docs" / "lbproxy.schema.json"
    errors = list(schema_validator().iter_errors(yaml.safe_load(text)))
    assert errors == [], [e.message for e in errors]


VALID = """\
virtual_servers:
  - name: web
    listen: 127.0.0.1:8080
    real_servers:
      - {name: a, address: 127.0.0.1:9001}
"""

# (what is wrong, a line to add to the virtual server or its first real server)
BAD = [
    ("misspelt key", "    lisen: 127.0.0.1:8081"),
    ("misspelt nested key", "    health_check: {intervall: 2s}"),
    ("misspelt real-server key", "      - {name: b, address: 127.0.0.1:9002, wieght: 2}"),
    ("wrong type", "    quiesce: sometimes"),
    ("wrong type, number as text", "    retries: two"),
    ("wrong type, a list", "    connect_timeout: [3s]"),
    ("out of range", "      - {name: b, address: 127.0.0.1:9002, weight: 70000}"),
    ("out of range, negative", "    retries: -1"),
    ("out of range, zero duration", "    connect_timeout: 0s"),
    ("out of range, smoothing", "    snmp: {smoothing: 1.5}"),
    ("not a choice", "    send_proxy: v3"),
    ("unknown scheduler", "    scheduler: wlcc"),
    ("maglev key on wlc", "    table_size: 65537"),
    ("conditioning on rr", "    scheduler: rr\n    conditioning: {interval: 1s}"),
    ("slow_start on rr", "    scheduler: rr\n    slow_start: 10s"),
    ("quiesce on lc", "    scheduler: lc\n    quiesce: true"),
    ("throttle without a limit", "    throttle: {interval: 1s}"),
    ("send_expect without expect", "    health_check: {type: send_expect, send: PING}"),
    ("SRV with a port", "    discovery: {dns: {name: _a._tcp.example, port: 80}}"),
    ("A without a port", "    discovery: {dns: {name: web.example, type: A}}"),
]


def _with(line: str) -> str:
    if line.startswith("      - "):
        return VALID + line + "\n"
    head, tail = VALID.split("    real_servers:\n")
    return head + line + "\n    real_servers:\n" + tail


@pytest.mark.parametrize("what, line", BAD, ids=[what for what, _ in BAD])
def test_bad_input_is_refused_by_the_schema_and_by_check_alike(tmp_path, what, line):
    text = _with(line)
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError):
        load([config])
    assert not schema_validator().is_valid(yaml.safe_load(text)), f"schema accepts {what}"


def test_the_valid_base_is_accepted_by_both(tmp_path):
    config = tmp_path / "good.yaml"
    config.write_text(VALID)
    load([config])
    assert schema_validator().is_valid(yaml.safe_load(VALID))


GOOD = [
    "    scheduler: maglev\n    table_size: 65537\n    hash_key: source_port",
    "    conditioning: {interval: 1s}",  # the default scheduler wlc has a load
    "    health_check:",
    "    throttle: {max_rate: 10}",
    "    discovery: {dns: {name: web.example, type: a, port: 80}}",
    "    connect_timeout: 250ms\n    idle_timeout: 1.5\n    slow_start: 0",
    "    scheduler: maglev\n    slow_start: 10s",
]


@pytest.mark.parametrize("line", GOOD)
def test_good_input_is_accepted_by_both(tmp_path, line):
    text = _with(line)
    config = tmp_path / "good.yaml"
    config.write_text(text)
    load([config])
    errors = list(schema_validator().iter_errors(yaml.safe_load(text)))
    assert errors == [], [e.message for e in errors]


def test_lbproxy_schema_prints_the_schema(tmp_path):
    from click.testing import CliRunner

    from lbproxy.cli import main

    result = CliRunner().invoke(main, ["schema"])
    assert result.exit_code == 0
    assert json.loads(result.output) == schema.json_schema()
    assert set(json.loads(result.output)["properties"]) == set(SECTIONS.sections)


def test_the_scheduler_options_follow_the_registry():
    """What the reference says each scheduler reads is what the schedulers declare."""
    from lbproxy.config.tables import SNMP_SCHEDULERS, UNCONDITIONED_SCHEDULERS
    from lbproxy.core import schedulers

    vs = SECTIONS.sections["virtual_servers"]
    names = schedulers.available()
    resets = {n for n in names if schedulers.get(n).quiesce_resets}
    assert set(vs.fields["quiesce"].read_by) == resets
    dynamic = {n for n in names if schedulers.get(n).dynamic_weights}
    assert set(SNMP_SCHEDULERS) == dynamic <= set(vs.sections["snmp"].read_by)
    conditioned = set(vs.sections["conditioning"].only)
    assert conditioned | set(UNCONDITIONED_SCHEDULERS) == set(names)
    assert not conditioned & set(UNCONDITIONED_SCHEDULERS)
    for key in ("table_size", "hash_key"):
        assert vs.fields[key].only == ("maglev",)
