"""The configuration's JSON Schema (draft 2020-12), for `lbproxy schema` and editors.

PURE. Built from the tables `lbproxy check` reads (tables.SECTIONS): every key with its
converter's schema fragment, its description and default; `additionalProperties: false`
everywhere, as unknown keys are errors; the required keys and the rules across keys
(maglev-only keys, a conditioning scheduler, a throttle limit) that the reader checks.
Checks across files (port clashes, duplicate names, one `global:`) are `check`'s alone.
"""

from __future__ import annotations

import json
from typing import Any

from lbproxy.config.defaults import json_default
from lbproxy.config.tables import SECTIONS, Section
from lbproxy.core.schedulers import DEFAULT as DEFAULT_SCHEDULER


def json_schema() -> dict[str, Any]:
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "lbproxy configuration",
        "description": SECTIONS.description,
    }
    schema.update(_object(SECTIONS))
    return schema


def dumps() -> str:
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


def _object(section: Section) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for key, converter in section.fields.items():
        prop = converter.schema
        if converter.description:
            prop["description"] = converter.description
        default = json_default(section, key)
        if default is not None:
            prop["default"] = default
        properties[key] = prop
    for key, child in section.sections.items():
        body = _object(child)
        body["description"] = child.description
        if child.many:
            properties[key] = {"anyOf": [{"type": "null"}, {"type": "array", "items": body}]}
        else:  # `health_check:` with nothing under it means every default
            properties[key] = {"anyOf": [{"type": "null"}, body]}
    result: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if section.required:
        result["required"] = list(section.required)
    rules = list(section.rules)
    for key, other in section.required_unless.items():
        rules.append({"if": {"required": [other]}, "else": {"required": [key]}})
    for key, converter in section.fields.items():
        if converter.only:
            rules.append(_only(converter.only, {"properties": {key: False}}))
    for key, child in section.sections.items():
        if child.only:
            rules.append(_only(child.only, {"properties": {key: False}}))
    if rules:
        result["allOf"] = rules
    return result


def _only(schedulers: tuple[str, ...], forbid: dict[str, Any]) -> dict[str, Any]:
    """`forbid` applies unless the virtual server's scheduler is one of `schedulers`."""
    named = {"properties": {"scheduler": {"enum": list(schedulers)}}, "required": ["scheduler"]}
    if DEFAULT_SCHEDULER in schedulers:  # no `scheduler:` key means the default: allowed
        other = {
            "properties": {"scheduler": {"not": {"enum": list(schedulers)}}},
            "required": ["scheduler"],
        }
        return {"if": other, "then": forbid}
    return {"if": named, "else": forbid}
