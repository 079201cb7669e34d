"""`lbproxy demo` as a real process, for the tests of the demo and of the tour that
docs/getting-started.md walks through."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pytest

from tests.integration.harness import ROOT

NAMES = ("alpha", "bravo", "charlie")
VALUES = {"alpha": 30, "bravo": 20, "charlie": 10}  # what the demo's agents report at first
OID = "1.3.6.1.4.1.2021.10.1.5.1"
FIRST_LINE = re.compile(r"lbproxy demo: connect to 127\.0\.0\.1:(\d+)\n")


class Demo:
    """A running `lbproxy demo --port 0`: its ports, and its stdout line by line as it
    comes (a thread reads it, so a test can wait for a line while the demo runs)."""

    def __init__(self, duration: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lbproxy", "demo", "--port", "0", "--duration", str(duration)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()  # flushed by the demo before anything else
        match = FIRST_LINE.fullmatch(first)
        if match is None:
            self.stop()
            pytest.fail(f"unexpected first line {first!r}\nstderr: {self.proc.stderr.read()}")
        self.port = int(match.group(1))
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._done = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.wait_for(r"Ctrl-C stops everything\.")  # the end of the intro
        # The second line, before anything else the demo says: the dashboard's URL.
        dashboard = re.fullmatch(r"dashboard: (http://127\.0\.0\.1:\d+/)", self.lines[0])
        assert dashboard, self.lines[:2]
        self.dashboard = dashboard.group(1)
        self.dwd_port = int(self.search(r"lbproxy demo: demo-dwd .* on 127\.0\.0\.1:(\d+)"))
        self.control_port = int(
            self.search(r"lbproxy demo: change a reported value: .* > /dev/tcp/127\.0\.0\.1/(\d+)")
        )
        self.agents = {
            m.group(1): int(m.group(2))
            for m in re.finditer(
                r"^  (\w+)\s+127\.0\.0\.1:\d+\s+agent 127\.0\.0\.1:(\d+)", self.output, re.M
            )
        }

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._done = True
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def search(self, pattern: str) -> str:
        match = re.search(pattern, self.output, re.M)
        assert match is not None, (pattern, self.output)
        return match.group(1)

    def wait_for(self, pattern: str, start: int = 0, timeout: float = 10.0) -> re.Match:
        """The first line from `start` on that matches `pattern` (waiting for it)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines[start:]:
                    match = re.search(pattern, line)
                    if match:
                        return match
                start = len(self.lines)
                left = deadline - time.monotonic()
                if self._done or left <= 0:
                    pytest.fail(f"no line matching {pattern!r}:\n" + "\n".join(self.lines))
                self._changed.wait(left)

    def finish(self, timeout: float) -> tuple[int, str, str]:
        """Wait for the exit; returns the exit code, stdout after the first line, stderr."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"the demo did not exit\nstdout: {self.output}")
        self._reader.join(5)
        return self.proc.returncode, self.output + "\n", self.proc.stderr.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


def dwd_line(name: str, value: int) -> str:
    """A plain line of demo-dwd showing `name` reporting `value`, polled and in effect."""
    return (
        rf"^\[\s*\d+s\] demo-dwd\s+{name}\s.*\ssnmp {value}\s+dynamic {value}\s+effective {value}\s"
    )
