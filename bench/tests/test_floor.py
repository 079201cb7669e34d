"""bench/floor, issue 26's measurement of the floor under a connection's CPU: an lbproxy
started with it (a real process, as scripts/bench starts it) serves connections through
the floor, not through the lifecycle -- so the figures the benchmark journal
(docs/development/benchmark-journal.md) gives for it are figures of the floor."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from lbproxy.net import compiled
from tests.integration.harness import NameServer, ask_name, free_port, vs_config, wait_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(compiled.cpump is None, reason="the floor needs the C path")


def connections_counted(admin: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5).read()
    m = re.search(
        rb'^lbproxy_connections_total\{real_server="a",virtual_server="web"\} (\S+)$', text, re.M
    )
    assert m is not None, text[:2000]
    return float(m.group(1))


def start(tmp_path: Path, port: int, admin: int, server: NameServer, floor: str | None):
    path = tmp_path / "lbproxy.yaml"
    text = vs_config(port, [server], "rr").replace(
        "admin: {listen: none}", f"admin: {{listen: '127.0.0.1:{admin}'}}"
    )
    path.write_text(text)
    env = dict(os.environ)
    env.pop("LBPROXY_FLOOR", None)
    if floor is not None:
        env.update(PYTHONPATH=str(ROOT / "bench" / "floor"), LBPROXY_FLOOR=floor)
    return subprocess.Popen(
        [sys.executable, "-m", "lbproxy", "run", str(path), "--log-level", "warning"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


@pytest.mark.parametrize("floor", ["decisions", "c-only", None])
def test_the_floor_serves_connections_without_the_lifecycle(tmp_path, floor):
    with NameServer("a") as a:
        port, admin = free_port(), free_port()
        proc = start(tmp_path, port, admin, a, floor)
        try:
            wait_port(admin)
            wait_port(port)
            # The first connections (wait_port's, this one) may go the normal way, which
            # resolves the server's address for the floor.
            assert ask_name(port) == "a"
            assert [ask_name(port) for _ in range(20)] == ["a"] * 20
            counted = connections_counted(admin)
        finally:
            proc.terminate()
            out = proc.communicate(timeout=10)[0]
    # The lifecycle counts every connection (22, or 21 if wait_port's closed before its
    # connect); a floor counts none of its own, only those first ones.
    if floor is None:
        assert counted >= 21, out
    else:
        assert counted <= 2, out


def test_an_unknown_floor_is_refused(tmp_path):
    with NameServer("a") as a:
        proc = start(tmp_path, free_port(), free_port(), a, "fast")
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode != 0
    assert b"LBPROXY_FLOOR='fast': decisions or c-only" in out
