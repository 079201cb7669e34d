"""The five-minute tour of docs/getting-started.md, run as written against a real
`lbproxy demo`, on what a fresh Debian has: every command of the tour's shell blocks runs
with a PATH holding only python3, bash's builtins and coreutils' grep (no nc, no curl),
and does what the tour says."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.integration.demo_process import NAMES, Demo, dwd_line
from tests.integration.harness import ROOT, get_json, run_cli, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

GUIDE = ROOT / "docs" / "getting-started.md"
# What a fresh Debian with lbproxy's venv has; the tour may use nothing else.
FRESH = ("python3", "grep")


def tour_commands() -> list[str]:
    """The command lines of the tour's ```sh blocks, in order."""
    text = GUIDE.read_text()
    tour = text[text.index("## A five-minute tour") :]
    tour = tour[: tour.index("\n## ", 1)]
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", tour, re.S):
        commands += [line.strip() for line in block.splitlines() if line.strip()]
    return commands


def active(admin_port: int) -> int:
    """Connections open through the demo's virtual servers now."""
    document = get_json(admin_port, "/api/v1/virtual-servers")
    return sum(
        server["active_connections"]
        for vs in document["virtual_servers"]
        for server in vs["real_servers"]
    )


def test_the_tour_uses_only_what_a_fresh_debian_has():
    commands = tour_commands()
    assert "scripts/demo" in commands and len(commands) >= 8, commands
    for command in commands:
        for part in command.split("|"):
            program = part.split()[0]
            assert program in ("scripts/demo", ".venv/bin/lbproxy", "echo", *FRESH), command
    # `lbproxy demo --help` and what the demo prints suggest nothing else either
    assert not re.search(r"^\s*nc ", run_cli("demo", "--help").stdout, re.M)


def test_every_tour_command_runs_against_the_demo(tmp_path):
    path = tmp_path / "bin"
    path.mkdir()
    for program in FRESH:
        found = shutil.which(program, path="/usr/bin:/bin")
        assert found, program
        (path / program).symlink_to(found)
    lbproxy = Path(sys.executable).with_name("lbproxy")
    demo = Demo(duration=60)
    try:
        admin_port = int(demo.dashboard.rstrip("/").rsplit(":", 1)[1])
        outputs = []
        for command in tour_commands():
            if command == "scripts/demo":
                continue  # running: `demo`
            # As a reader between two steps: the last step's connections have ended
            # (their closes reached the proxy), so wlc's split is the tour's.
            wait_for(lambda: active(admin_port) == 0, 20, "no connection left open")
            line = (
                command.replace("8080", str(demo.port))
                .replace("9100", str(admin_port))
                .replace("CONTROL_PORT", str(demo.control_port))
                .replace(".venv/bin/lbproxy", str(lbproxy))
            )
            result = subprocess.run(
                ["/bin/bash", "-c", line],
                input="\n",  # the held connections' `input()`
                capture_output=True,
                text=True,
                cwd=ROOT,
                env={"PATH": str(path), "HOME": os.environ.get("HOME", "/root")},
                timeout=60,
            )
            assert result.returncode == 0, (command, result.stdout, result.stderr)
            outputs.append((command, result.stdout))
        # 1: one connection, answered by the server wlc picked
        first = outputs[0][1].strip()
        assert first in NAMES, outputs[0]
        # 2: twelve held connections split 2, 4, 6 by the weights 1, 2, 3
        held = Counter(outputs[1][1].split())
        assert held == {"alpha": 2, "bravo": 4, "charlie": 6}, outputs[1]
        metrics = next(out for command, out in outputs if "/metrics" in command)
        assert "lbproxy_active_connections" in metrics
        # 4: the control port took `bravo 80`; demo-dwd's weight follows
        demo.wait_for(dwd_line("bravo", 80), timeout=20)
        # What the demo itself suggests (its python3 lines and bash's /dev/tcp) works
        # as printed, with the same PATH: `bravo 70` this time.
        suggested = re.findall(
            r"^(?:Try:)?\s+(python3 -c .*|echo '\w+ \d+' > /dev/tcp/\S+)", demo.output, re.M
        )
        assert len(suggested) == 3, demo.output
        for line in suggested:
            wait_for(lambda: active(admin_port) == 0, 20, "no connection left open")
            result = subprocess.run(
                ["/bin/bash", "-c", line.replace("bravo 80", "bravo 70")],
                capture_output=True,
                text=True,
                env={"PATH": str(path)},
                timeout=60,
            )
            assert result.returncode == 0, (line, result.stdout, result.stderr)
            if line.startswith("python3"):
                assert set(result.stdout.split()) <= set(NAMES) and result.stdout.strip()
        demo.wait_for(dwd_line("bravo", 70), timeout=20)
    finally:
        demo.stop()
