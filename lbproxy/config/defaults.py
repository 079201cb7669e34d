"""A key's default, as the model's dataclasses define it, shown to a person or in JSON.

PURE. The default of a key is the default of the dataclass field of the same name in its
section's model (model.py); a converter's `about(default=...)` says it in words where the
field's value is not the whole story (`stale_after`: 3 × interval).
"""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

from lbproxy.config.model import Address
from lbproxy.config.tables import Section

REQUIRED = object()  # a field without a default


def default_value(section: Section, key: str) -> Any:
    """The model's default for `key`, or REQUIRED; None when the section has no model."""
    model = section.option_models.get(key, section.model)
    if model is None:
        return None
    for model_field in dataclasses.fields(model):
        if model_field.name != key:
            continue
        if model_field.default is not dataclasses.MISSING:
            return model_field.default
        if model_field.default_factory is not dataclasses.MISSING:
            return model_field.default_factory()
        return REQUIRED
    raise KeyError(f"{model.__name__} has no field {key!r}")


def _plain(value: Any) -> Any:
    """A default as it would be written in YAML (JSON types)."""
    if isinstance(value, Address | ipaddress.IPv4Network | ipaddress.IPv6Network):
        return str(value)
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value


def json_default(section: Section, key: str) -> Any:
    """The default for the schema's `default`, or None where there is none to write."""
    if section.defaults_from:
        return None  # overrides: the default is the other section's value
    value = default_value(section, key)
    if value is REQUIRED or value is None:
        return None
    if section.fields[key].accepts.startswith("a duration"):
        return duration_text(value)
    return _plain(value)


def duration_text(seconds: float) -> str:
    """30.0 -> '30s', 300.0 -> '5m', 0.25 -> '250ms', 3600.0 -> '1h'."""
    if seconds and seconds % 3600 == 0:
        return f"{seconds / 3600:g}h"
    if seconds and seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    if seconds and seconds < 1:
        return f"{seconds * 1000:g}ms"
    return f"{seconds:g}s"


def default_text(section: Section, key: str) -> str:
    """The default for the reference: `5s`, `[200]`, none, required, or the words."""
    converter = section.fields[key]
    if converter.default is not None:
        return converter.default
    if section.defaults_from:
        return f"the `{section.defaults_from}` value"
    value = default_value(section, key)
    if value is REQUIRED:
        return "required"
    if value is None:
        return "none"
    shown = json_default(section, key)
    if isinstance(shown, bool):
        return f"`{str(shown).lower()}`"
    if isinstance(shown, list):
        return "`[" + ", ".join(_flow(item) for item in shown) + "]`"
    if isinstance(shown, float) and shown.is_integer():
        shown = int(shown)
    return f"`{shown}`"


def _flow(item: Any) -> str:
    text = str(item)
    return f'"{text}"' if ":" in text else text
