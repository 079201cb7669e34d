"""tests/tools.py: a program CI installs makes a test fail under CI=true, skip elsewhere."""

import pytest

from tests import tools

ABSENT = "lbproxy-no-such-program"


def test_a_missing_program_skips_a_test_on_a_developers_machine(monkeypatch):
    monkeypatch.setattr(tools, "IN_CI", False)
    with pytest.raises(pytest.skip.Exception, match=f"{ABSENT} is not installed"):
        tools.need(ABSENT, "some-package")


def test_a_missing_program_fails_a_test_in_ci(monkeypatch):
    monkeypatch.setattr(tools, "IN_CI", True)
    with pytest.raises(pytest.fail.Exception, match="CI installs it"):
        tools.need(ABSENT, "some-package")
