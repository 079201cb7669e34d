"""Packaging as a user meets it (SPEC §20): `python -m build` makes an sdist and a wheel;
each installs into a fresh virtual environment (pip) or with pipx, outside the source
tree, and the installed `lbproxy` runs its demo with the dashboard page inside; the
version comes from lbproxy/__init__.py alone; click's shell completion works in bash,
zsh and fish; every command's help fits 80 columns and shows an example."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
import venv
from pathlib import Path

import pytest

import lbproxy
from tests import tools
from tests.integration.harness import ROOT

pytestmark = pytest.mark.integration

LBPROXY = Path(sys.executable).with_name("lbproxy")
COMMANDS = [
    "run", "check", "schema", "simulate", "demo", "status",
    "set-weight", "drain", "enable", "disable", "reload",
]  # fmt: skip
# No PYTHONPATH, no source tree: only what was installed.
CLEAN_ENV = {
    k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LBPROXY_PURE")
}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    # From a copy of the tree: a build writes lbproxy.egg-info beside the sources, and
    # parallel test workers building at once must not share (or touch) the clone's.
    source = tmp_path_factory.mktemp("source") / "lbproxy"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "site", "dist", "build", "*.egg-info", "__pycache__", ".*cache"
        ),
    )
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = out.glob("lbproxy-*.whl")
    (sdist,) = out.glob("lbproxy-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def _fresh_venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(where)
    return where / "bin"


def _pip_install(bin_dir: Path, artifact: Path) -> None:
    result = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "install", "--quiet", str(artifact)],
        capture_output=True,
        text=True,
        timeout=600,
        env=CLEAN_ENV,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _runs_the_demo_with_its_dashboard(lbproxy_bin: Path, cwd: Path) -> None:
    """`lbproxy demo` from the installed copy: the dashboard page comes from the package."""
    version = subprocess.run(
        [str(lbproxy_bin), "--version"], capture_output=True, text=True, cwd=cwd, env=CLEAN_ENV
    )
    # gcc and the Python headers are here: pip built the C connection path
    assert version.stdout.splitlines() == [
        f"lbproxy, version {lbproxy.__version__}",
        "connection path: compiled (lbproxy.net._cpump)",
    ]
    proc = subprocess.Popen(
        [str(lbproxy_bin), "demo", "--port", "0", "--duration", "20"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=CLEAN_ENV,
    )
    try:
        assert proc.stdout is not None
        first, second = proc.stdout.readline(), proc.stdout.readline()
        assert re.fullmatch(r"lbproxy demo: connect to 127\.0\.0\.1:\d+\n", first), first
        url = re.fullmatch(r"dashboard: (http://127\.0\.0\.1:\d+/)\n", second)
        assert url, second
        with urllib.request.urlopen(url.group(1), timeout=10) as answer:
            page = answer.read()
        assert answer.status == 200 and b"<title>" in page
        assert page == (ROOT / "lbproxy" / "admin" / "dashboard.html").read_bytes()
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == 0


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_pip_installs_the_artifact_in_a_fresh_venv_and_it_runs_the_demo(dist, kind, tmp_path):
    bin_dir = _fresh_venv(tmp_path / "venv")
    _pip_install(bin_dir, dist[kind])
    where = subprocess.run(
        [str(bin_dir / "python"), "-c", "import lbproxy; print(lbproxy.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=CLEAN_ENV,
    )
    assert where.stdout.startswith(str(tmp_path / "venv")), where.stdout  # not the tree
    _runs_the_demo_with_its_dashboard(bin_dir / "lbproxy", tmp_path)


@pytest.mark.timeout(900)
def test_pipx_installs_the_wheel_and_it_runs_the_demo(dist, tmp_path):
    env = {
        **CLEAN_ENV,
        "PIPX_HOME": str(tmp_path / "pipx"),
        "PIPX_BIN_DIR": str(tmp_path / "bin"),
        "PIPX_MAN_DIR": str(tmp_path / "man"),
    }
    result = subprocess.run(
        [sys.executable, "-m", "pipx", "install", str(dist["wheel"])],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    _runs_the_demo_with_its_dashboard(tmp_path / "bin" / "lbproxy", tmp_path)


def test_the_version_is_written_in_one_place():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lbproxy.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", lbproxy.__version__)


# -- shell completion (click's) ---------------------------------------------------------


def _shell_env() -> dict[str, str]:
    return {**CLEAN_ENV, "PATH": f"{LBPROXY.parent}{os.pathsep}{os.environ['PATH']}"}


def test_bash_completion_completes_commands_and_options():
    script = (
        'eval "$(_LBPROXY_COMPLETE=bash_source lbproxy)"; '
        "COMP_WORDS=(lbproxy dr); COMP_CWORD=1; _lbproxy_completion lbproxy; "
        'printf "%s\\n" "${COMPREPLY[@]}"; '
        "COMPREPLY=(); COMP_WORDS=(lbproxy status --js); COMP_CWORD=2; "
        "_lbproxy_completion lbproxy; "
        'printf "%s\\n" "${COMPREPLY[@]}"'
    )
    result = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env=_shell_env(), timeout=60
    )
    assert result.stdout.split() == ["drain", "--json"], result.stderr


@tools.requires("fish", package="fish")
def test_fish_completion_completes_commands():
    script = "_LBPROXY_COMPLETE=fish_source lbproxy | source; complete -C 'lbproxy dr'"
    result = subprocess.run(
        ["fish", "--no-config", "-c", script],
        capture_output=True,
        text=True,
        env=_shell_env(),
        timeout=60,
    )
    assert [line.split("\t")[0] for line in result.stdout.splitlines()] == ["drain"], (
        result.stdout + result.stderr
    )


@tools.requires("zsh", package="zsh")
def test_zsh_completion_registers_and_answers():
    # The completion widget needs an interactive line editor; what can be checked from a
    # script: the generated function loads under compinit and is registered for lbproxy,
    # and it asks lbproxy with the zsh protocol, whose answer is checked below.
    script = (
        "autoload -U compinit && compinit -u -D; "
        'eval "$(_LBPROXY_COMPLETE=zsh_source lbproxy)"; print -r -- $_comps[lbproxy]'
    )
    result = subprocess.run(
        ["zsh", "-f", "-c", script], capture_output=True, text=True, env=_shell_env(), timeout=60
    )
    assert result.stdout.strip() == "_lbproxy_completion", result.stderr
    answer = subprocess.run(
        [str(LBPROXY)],
        capture_output=True,
        text=True,
        env={**_shell_env(), "_LBPROXY_COMPLETE": "zsh_complete", "COMP_WORDS": "lbproxy dr",
             "COMP_CWORD": "1"},
        timeout=60,
    )  # fmt: skip
    assert answer.stdout.splitlines()[:2] == ["plain", "drain"], answer.stdout


# -- help -------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_fits_80_columns_and_shows_an_example(command):
    args = [str(LBPROXY), *([command] if command else []), "--help"]
    for columns in ("80", "200"):
        result = subprocess.run(
            args, capture_output=True, text=True, env={**CLEAN_ENV, "COLUMNS": columns}
        )
        assert result.returncode == 0, result.stderr
        too_wide = [line for line in result.stdout.splitlines() if len(line) > 80]
        assert too_wide == [], too_wide
        examples = result.stdout.split("Examples:\n", 1)
        assert len(examples) == 2, result.stdout
        assert examples[1].lstrip().startswith("lbproxy "), examples[1]
