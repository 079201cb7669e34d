"""Helpers of the documentation tests."""

from __future__ import annotations

import re
from pathlib import Path

from lbproxy.admin.metric_families import FAMILIES

ROOT = Path(__file__).resolve().parents[2]


def metric_families() -> set[str]:
    """Every family lbproxy serves, from the one table (admin/metric_families.py), and any
    family built outside it."""
    families = {f.name + "_total" if f.kind == "counter" else f.name for f in FAMILIES.values()}
    for source in (ROOT / "lbproxy").rglob("*.py"):
        text = source.read_text()
        for kind, name in re.findall(r"(\w+)MetricFamily\(\s*\"(lbproxy_\w+)\"", text):
            families.add(name + "_total" if kind == "Counter" else name)
    return families
