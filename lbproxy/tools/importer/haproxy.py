"""haproxy's configuration as lbproxy's (see translation.py for what a translator fills)."""

from __future__ import annotations

from pathlib import Path

from lbproxy.tools.importer.translation import Mapping, Translation

# The migration guide's rows for haproxy, in the order the guide lists them.
DIRECTIVES: tuple[Mapping, ...] = ()


def translate(path: Path) -> Translation:
    raise NotImplementedError("haproxy import")
