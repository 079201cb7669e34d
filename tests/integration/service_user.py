"""lbproxy as another user: a Python that `nobody` can run, and folders it can read.

The test's own Python lives under /root (mode 0700): once lbproxy drops to `nobody` it
could no more start a worker or the new process of an upgrade from it. So these tests
run lbproxy from a virtual environment of Debian's /usr/bin/python3 in a folder every
user can read, with lbproxy installed in it (not editable: the source tree is under
/root too) from a copy of this checkout. It is built once per source state and shared
by every test, every pytest-xdist worker and later runs: the folder's name is a hash of
the sources, and a lock lets one process build it while the others wait.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.integration.harness import ROOT

SYSTEM_PYTHON = Path("/usr/bin/python3")
CACHE = Path(tempfile.gettempdir()) / "lbproxy-test-python"
SOURCES = ("pyproject.toml", "setup.py", "README.md", "lbproxy")
UNUSED = 86400.0  # seconds after which another source state's build is removed
SKIP = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")


def _fingerprint() -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for file in files:
            if "__pycache__" in file.parts or file.suffix == ".so":
                continue
            digest.update(str(file.relative_to(ROOT)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]


def _run(*command: str | Path, cwd: Path | None = None) -> None:
    result = subprocess.run(
        [str(part) for part in command],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=cwd,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
    )
    assert result.returncode == 0, f"{command}: {result.stdout[-2000:]}{result.stderr[-2000:]}"


def _build(where: Path) -> None:
    source = where / "src"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=SKIP)
        else:
            source.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / name)
    _run(SYSTEM_PYTHON, "-m", "venv", where / "venv")
    # The versions this checkout's own environment runs, so pip's cache serves them.
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    constraints = where / "constraints.txt"
    constraints.write_text(frozen)
    pip = (where / "venv" / "bin" / "python", "-m", "pip", "--disable-pip-version-check")
    _run(*pip, "install", "--quiet", "-c", constraints, source)
    shutil.rmtree(source, ignore_errors=True)


def _prune(keep: Path) -> None:
    """Builds of other source states not used for a day (each is ~100 MB)."""
    for other in CACHE.iterdir():
        ready = other / "ready"
        stale = ready.exists() and time.time() - ready.stat().st_mtime > UNUSED
        if other.is_dir() and other != keep and stale:
            shutil.rmtree(other, ignore_errors=True)


def service_python() -> Path:
    """The Python (of a venv nobody can read and run) with this checkout's lbproxy."""
    if not SYSTEM_PYTHON.exists():
        pytest.skip(f"{SYSTEM_PYTHON} is missing")
    where = CACHE / _fingerprint()
    python = where / "venv" / "bin" / "python"
    CACHE.mkdir(mode=0o755, exist_ok=True)
    os.chmod(CACHE, 0o755)
    with open(CACHE / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (where / "ready").exists():
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir(mode=0o755)
            try:
                _build(where)
            except BaseException:
                shutil.rmtree(where, ignore_errors=True)
                raise
            subprocess.run(["chmod", "-R", "a+rX", str(where)], check=True)
        (where / "ready").touch()  # used now
        _prune(where)
    return python


def readable_folder(prefix: str = "lbproxy-as-nobody-") -> Path:
    """A new folder under /tmp that every user can enter and read (mode 0755)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    folder.chmod(0o755)
    return folder


def nobody() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody on this machine")


def status_ids(pid: int) -> dict[str, list[int]]:
    """/proc/PID/status's Uid, Gid and Groups lines, as numbers (CapPrm, CapEff and
    CapAmb as one number each)."""
    ids: dict[str, list[int]] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "Groups"):
            ids[key] = [int(v) for v in value.split()]
        elif key in ("CapPrm", "CapEff", "CapAmb"):
            ids[key] = [int(value.strip(), 16)]
    return ids


def children(pid: int) -> list[int]:
    """The processes `pid` started (its threads' children included)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text() if (task / "children").exists() else ""
        found.extend(int(p) for p in text.split())
    return found
