"""scripts/test says what it does as it goes (a line per step) and, at the end, how long
the run and each of its phases took."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def stand_in_venv(folder: Path) -> Path:
    """A stand-in for the virtual environment: its python runs this one, except that
    `pip install` (which would reinstall the checkout under the other tests) only says
    it was asked."""
    venv = folder / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$1 $2" = "-m pip" ]; then echo "pip: $*" >&2; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    return venv


def test_a_line_per_step_and_the_times_at_the_end(tmp_path):
    venv = stand_in_venv(tmp_path)
    result = subprocess.run(
        ["bash", "scripts/test", "tests/unit/test_tools.py", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env={
            **os.environ,
            "VENV": str(venv),
            "LBPROXY_TEST_JOBS": "0",
            "LBPROXY_TEST_NO_APT": "1",  # never install Debian packages from a test
        },
        capture_output=True,
        text=True,
        timeout=110,
    )
    err = result.stderr
    assert result.returncode == 0, (result.stdout, err)
    assert "2 passed" in result.stdout
    assert f"==> pip install -e .[test] into {venv}" in err
    assert "==> pytest tests/unit/test_tools.py" in err
    assert err.index("==> pip install") < err.index("==> pytest")
    total = re.search(r"scripts/test: took (\d+)s \(wall time\):\n((?:\s+\d+s  .*\n)+)", err)
    assert total, err
    phases = re.findall(r"^\s+(\d+)s  (.*)$", total.group(2), re.M)
    assert [name for _, name in phases] == [
        f"pip install -e .[test] into {venv}",
        "pytest tests/unit/test_tools.py -q -p no:cacheprovider",
    ]
    assert sum(int(seconds) for seconds, _ in phases) <= int(total.group(1)) + 1


def test_a_failing_run_still_says_how_long_and_keeps_its_exit_code(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(
        f'#!/bin/sh\nif [ "$1 $2" = "-m pip" ]; then exit 0; fi\nexec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    result = subprocess.run(
        ["bash", "scripts/test", "tests/unit/no_such_test.py", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env={**os.environ, "VENV": str(venv), "LBPROXY_TEST_JOBS": "0", "LBPROXY_TEST_NO_APT": "1"},
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 4, result  # pytest's "file not found"
    assert re.search(r"scripts/test: took \d+s \(wall time\)", result.stderr), result.stderr


def test_it_names_the_debian_packages_before_apt_get_runs(tmp_path):
    """zsh and fish made to look missing, as root, with apt-get a stand-in that says
    how it was called (bash reads BASH_ENV's functions before the script)."""
    venv = stand_in_venv(tmp_path)
    env_file = tmp_path / "bash_env"
    env_file.write_text(
        "id() { echo 0; }\n"
        'command() { case "$2" in zsh|fish) return 1;; esac; builtin command "$@"; }\n'
        'apt-get() { echo "apt-get called: $*"; }\n'
    )
    result = subprocess.run(
        ["bash", "scripts/test", "tests/unit/test_tools.py", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env={**os.environ, "VENV": str(venv), "LBPROXY_TEST_JOBS": "0", "BASH_ENV": str(env_file)},
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result
    out = result.stdout
    said = out.index("scripts/test: installing 2 Debian package(s) the tests use, as root")
    assert "none is needed to run lbproxy" in out
    # each with why the tests want it
    assert out.index("  zsh              shell completion, as a zsh user has it\n") > said
    assert out.index("  fish             shell completion, as a fish user has it\n") > said
    update = out.index("apt-get called: update -q")
    install = out.index("apt-get called: install -y -q --no-install-recommends")
    assert said < update < install
    assert "zsh fish" in out[install:].splitlines()[0]
    assert "==> apt-get update" in result.stderr and "==> apt-get install zsh fish" in result.stderr
    phases = result.stderr[result.stderr.index("wall time") :]
    assert "apt-get install zsh fish" in phases
