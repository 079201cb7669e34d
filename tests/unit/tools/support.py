"""Helpers shared by the importer tests."""

from __future__ import annotations


def has_key(document: dict, dotted: str) -> bool:
    """Whether `document` holds the key path `dotted` as the migration guide writes it
    (`virtual_servers[].real_servers[].weight`: `[]` walks each item of a list)."""
    nodes: list = [document]
    for part in dotted.split("."):
        key, many = (part[:-2], True) if part.endswith("[]") else (part, False)
        found = []
        for node in nodes:
            if isinstance(node, dict) and key in node:
                found.extend(node[key] if many else [node[key]])
        nodes = found
    return bool(nodes)
