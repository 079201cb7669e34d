"""What every benchmark needs: its processes (started in their own session, stopped by
PID), free ports and waiting for them, the CPU and memory of processes from /proc, and
plain-text tables."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchError(Exception):
    """Something the run cannot go on without (a peer that does not start, ...)."""


# --------------------------------------------------------------------- processes


class Processes:
    """Every process this run started, stopped by PID in reverse order, whatever happens.

    Each child gets its own session (``start_new_session``), so a Ctrl-C in the terminal
    reaches this script only; the ``finally`` around the run then stops the children
    itself: SIGTERM, up to 5 s, then SIGKILL. Nothing is ever stopped by name.
    """

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], log: Path, **kwargs: Any) -> subprocess.Popen:
        out = log.open("wb")
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **kwargs,
            )
        except OSError as exc:
            raise BenchError(f"cannot start {name}: {exc}") from None
        finally:
            out.close()
        self.procs.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen, timeout: float = 5.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(5)
        self.procs = [(n, p) for n, p in self.procs if p is not proc]

    def stop_all(self) -> None:
        for _, proc in reversed(list(self.procs)):
            with contextlib.suppress(Exception):
                self.stop(proc)


@contextlib.contextmanager
def attached(argv: list[str], settle: float, timeout: float = 30.0) -> Iterator[None]:
    """Run a tracer or profiler that attaches to a process (strace -p, perf record -p)
    around the block: started, given `settle` seconds to attach, then SIGINT (detach
    and write its output), waited for up to `timeout` seconds, killed if it hangs."""
    tracer = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        time.sleep(settle)
        yield
    finally:
        tracer.send_signal(signal.SIGINT)
        try:
            tracer.wait(timeout)
        except subprocess.TimeoutExpired:
            tracer.kill()
            tracer.wait(5)


def run_client(argv: list[str], timeout: float) -> str:
    """Run a load generator to completion (bounded) and return its standard output."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait(5)
        raise
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise BenchError(f"{argv[0]} exited with {proc.returncode}: {text.strip()[-400:]}")
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"exited with {proc.returncode}: {_tail(log)}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise BenchError(f"port {port} not open after {timeout}s: {_tail(log)}")


def _tail(path: Path, n: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip() or "(no output)"
    except OSError:
        return "(no log)"


# --------------------------------------------------------------------------- /proc


def cpu_ticks(pids: list[int]) -> int:
    return sum(cpu_split(pids))


def cpu_split(pids: list[int]) -> tuple[int, int]:
    """(user, system) CPU ticks of `pids`, all threads, from /proc/PID/stat."""
    user = system = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            user += int(fields[11])  # utime
            system += int(fields[12])  # stime
    return user, system


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise BenchError(f"no VmRSS for pid {pid}")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_times() -> dict[int, dict[str, int]]:
    """Per CPU, jiffies since boot from /proc/stat: task time (user, nice, system),
    interrupt time (irq, softirq: mostly the loopback network stack, not charged to any
    process in /proc/PID/stat when the kernel accounts IRQ time separately), steal, total.
    """
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3].isdigit():
            name, *vals = line.split()
            v = [int(x) for x in vals]
            out[int(name[3:])] = {
                "task": v[0] + v[1] + v[2],
                "irq": v[5] + v[6],
                "steal": v[7],
                "total": sum(v[:8]),  # guest time is already counted in user
            }
    return out


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def print_table(title: str, head: list[str], rows: list[list[str]], left: int = 1) -> None:
    """A plain-text table: the first `left` columns left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    print(f"\n{title}")
    print(line(head))
    print("-" * len(line(head)))
    for r in rows:
        print(line(r))


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Bound the whole run: SIGALRM raises, and the finally clauses stop everything."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise BenchError(f"the run exceeded --max-time {seconds}s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
