"""The programs the suite runs beside lbproxy (Debian packages that scripts/test installs).

On a developer's machine a test whose program is missing skips, naming the package. Under
`CI=true` it fails instead: CI installs every one of them, so a skip there would only hide
a broken install and let the suite pass without testing what it names.
"""

from __future__ import annotations

import os
import shutil

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def find(program: str) -> str | None:
    """The program's path: on PATH, or in /usr/sbin (snmpd and dnsmasq live there and
    /usr/sbin is not on every user's PATH)."""
    found = shutil.which(program)
    if found is None and os.access(f"/usr/sbin/{program}", os.X_OK):
        found = f"/usr/sbin/{program}"
    return found


def missing(program: str, package: str) -> None:
    """Skip the running test (fail it under CI=true): `program` is not installed."""
    message = f"{program} is not installed (Debian package {package}; scripts/test installs it)"
    if IN_CI:
        pytest.fail(f"{message}, and CI installs it", pytrace=False)
    pytest.skip(message)


def need(program: str, package: str) -> str:
    """The program's path, or skip (fail under CI=true) when it is not installed."""
    found = find(program)
    if found is None:
        missing(program, package)
    assert found is not None
    return found


def requires(*programs: str, package: str) -> pytest.MarkDecorator:
    """A mark: the test needs these programs (see `need`); tests/conftest.py applies it."""
    return pytest.mark.requires_tool(*programs, package=package)
