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
    "set-weight", "drain", "enable", "disable", "reload", "upgrade",
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


# -- docs/howto/install.md with Debian's own Python ---------------------------------------

INSTALL_PAGE = ROOT / "docs" / "howto" / "install.md"
UNIT = ROOT / "contrib" / "lbproxy.service"
DEBIAN_PYTHON = Path("/usr/bin/python3")
# What a Debian 12 root shell has: Debian's python3 first, none of this machine's others.
DEBIAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def debian_python() -> Path:
    if not (DEBIAN_PYTHON.exists() and Path("/usr/lib/python3.11/ensurepip").is_dir()):
        tools.missing("/usr/bin/python3 with venv", "python3-venv")
    return DEBIAN_PYTHON


def shell_block(heading: str) -> list[str]:
    """The lines of the first ```sh block under `## heading` of the install page."""
    section = INSTALL_PAGE.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def as_user_runs(lines: list[str], tmp_path: Path) -> tuple[list[str], str]:
    """The page's lines as they run here: as root already (no sudo), `apt-get install`
    replaced by a check that those Debian packages are installed (this machine is not
    changed), and the page's folders moved into `tmp_path` (/opt/lbproxy, the build
    environment, /usr/local/bin); everything else as written. Returns the lines and the
    PATH to run them with."""
    moved = {
        "sudo ": "",
        "/opt/lbproxy": str(tmp_path / "opt" / "lbproxy"),
        "/tmp/lbproxy-build": str(tmp_path / "lbproxy-build"),
        "/usr/local/bin/": str(tmp_path / "bin") + "/",
    }
    (tmp_path / "bin").mkdir(exist_ok=True)
    ran = []
    for line in lines:
        if line.startswith("sudo apt-get install "):
            packages = line.split("#")[0].split()[3:]
            line = "dpkg-query --show " + " ".join(packages)
        for old, new in moved.items():
            line = line.replace(old, new)
        ran.append(line)
    return ran, f"{tmp_path / 'bin'}:{DEBIAN_PATH}"


def run_lines(lines: list[str], path: str, cwd: Path, **env: str):
    result = subprocess.run(
        ["sh", "-exc", "\n".join(lines)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=cwd,
        env={**CLEAN_ENV, "PATH": path, **env},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


@pytest.mark.timeout(900)
def test_the_install_page_in_a_venv_of_debians_python_gives_a_working_lbproxy(dist, tmp_path):
    """The page's server steps as a Debian 12 user runs them (PEP 668 refuses a plain
    `pip install`): the venv made by Debian's python3, `pip install lbproxy` with the
    release found beside the package index (the wheel built here; its dependencies come
    from the index pip is configured with), the link on PATH; then what the systemd
    unit runs, from the path the unit names."""
    debian_python()
    lines, path = as_user_runs(
        shell_block("On a server: a virtual environment in /opt/lbproxy"), tmp_path
    )
    assert any(line.startswith(f"python3 -m venv {tmp_path}/opt/lbproxy") for line in lines), lines
    release = f"{dist['wheel'].parent} {os.environ.get('PIP_FIND_LINKS', '')}".strip()
    result = run_lines(lines, path, tmp_path, PIP_FIND_LINKS=release)
    venv_dir = tmp_path / "opt" / "lbproxy"
    base = subprocess.run(
        [str(venv_dir / "bin" / "python"), "-c", "import sys; print(sys.base_prefix)"],
        capture_output=True, text=True, env=CLEAN_ENV, timeout=60,
    )  # fmt: skip
    assert base.stdout.strip() == "/usr"  # Debian's Python, not this machine's own
    # the page's last line, `lbproxy --version`, ran the linked command
    assert result.stdout.splitlines()[-2:] == [
        f"lbproxy, version {lbproxy.__version__}",
        "connection path: compiled (lbproxy.net._cpump)",
    ], result.stdout
    check = subprocess.run(
        ["lbproxy", "check", "configs/rr.yaml"],
        capture_output=True, text=True, cwd=ROOT, env={**CLEAN_ENV, "PATH": path}, timeout=60,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    assert "rr-web" in check.stdout
    # the unit runs lbproxy from that environment
    execs = [line for line in UNIT.read_text().splitlines() if line.startswith("Exec")]
    assert "ExecStartPre=/opt/lbproxy/bin/lbproxy check /etc/lbproxy" in execs
    assert "ExecStart=/opt/lbproxy/bin/lbproxy run /etc/lbproxy" in execs
    if tools.find("systemd-analyze") is not None:
        unit = tmp_path / "lbproxy.service"
        unit.write_text(UNIT.read_text().replace("/opt/lbproxy", str(venv_dir)))
        verify = subprocess.run(
            ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
        )
        assert verify.returncode == 0 and "lbproxy.service" not in verify.stderr, verify.stderr


@pytest.mark.timeout(900)
def test_the_install_page_builds_a_wheel_in_a_clone_and_installs_it(tmp_path):
    """The page's "wheel of your own" steps, in a copy of this tree, with Debian's
    python3: a build environment, `python -m build`, the sdist and the wheel in dist/,
    the wheel installed into the server's environment."""
    clone = tmp_path / "lbproxy"
    shutil.copytree(
        ROOT,
        clone,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "site", "dist", "build", "*.egg-info", "__pycache__", ".*cache",
            "_cpump*.so",
        ),
    )  # fmt: skip
    subprocess.run(
        [str(debian_python()), "-m", "venv", str(tmp_path / "opt" / "lbproxy")],
        check=True, timeout=300, env=CLEAN_ENV,
    )  # fmt: skip
    lines, path = as_user_runs(shell_block("A wheel of your own, from a clone"), tmp_path)
    run_lines(lines, path, clone)
    built = sorted(p.name for p in (clone / "dist").iterdir())
    version = lbproxy.__version__
    assert len(built) == 2 and built[0].startswith(f"lbproxy-{version}-cp311-cp311-linux_")
    assert built[1] == f"lbproxy-{version}.tar.gz"
    installed = subprocess.run(
        [str(tmp_path / "opt" / "lbproxy" / "bin" / "lbproxy"), "--version"],
        capture_output=True, text=True, env=CLEAN_ENV, timeout=60,
    )  # fmt: skip
    assert installed.stdout.splitlines() == [
        f"lbproxy, version {version}",
        "connection path: compiled (lbproxy.net._cpump)",
    ]


@pytest.mark.timeout(900)
def test_without_a_c_compiler_the_sdist_installs_the_pure_path(dist, tmp_path):
    """What the install page says of a machine without gcc: the optional extension
    fails to build, the install succeeds, and lbproxy runs on the pure-Python path."""
    bin_dir = tmp_path / "venv" / "bin"
    subprocess.run(
        [str(debian_python()), "-m", "venv", str(tmp_path / "venv")],
        check=True, timeout=300, env=CLEAN_ENV,
    )  # fmt: skip
    install = subprocess.run(
        [str(bin_dir / "pip"), "install", "--no-cache-dir", str(dist["sdist"])],
        capture_output=True, text=True, timeout=900,
        env={**CLEAN_ENV, "CC": "/bin/false", "PATH": DEBIAN_PATH},
    )  # fmt: skip
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    version = subprocess.run(
        [str(bin_dir / "lbproxy"), "--version"],
        capture_output=True, text=True, env=CLEAN_ENV, timeout=60,
    )  # fmt: skip
    lines = version.stdout.splitlines()
    assert lines[0] == f"lbproxy, version {lbproxy.__version__}"
    assert lines[1].startswith("connection path: pure Python (no compiled extension"), lines


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
