"""How long `lbproxy upgrade` takes, and what it costs new connections (issue 23).

    .venv/bin/python bench/bench_upgrade.py [--idle 1000] [--rounds 3] [--drain 2]

An echo server (a child process of this script, asyncio) behind one `lbproxy run` (rr,
no checks, the admin endpoint on). Each round:

1. `--idle` connections are opened through the proxy and each echoes one byte, so all
   are established in the running (old) process; they stay idle.
2. A client loop opens new connections one after another (connect, 1 byte echoed,
   close) and records each one's latency, for `--window` seconds: once without an
   upgrade, then once with `POST /api/v1/upgrade` sent after the first second.
3. Times, from the POST: the answer (the new process is ready and the old one has stopped
   accepting), the old process's exit. The idle connections stay open, so the old
   process exits only at `global.drain_timeout` (`--drain`), closing them: what an
   upgrade costs with long-lived clients. Then the idle clients are closed.

Every latency sample counts, none is dropped: a refused or reset connection is counted
and reported (there should be none). Bounded: rounds x (2 windows + drain + start);
every process started is stopped by PID; loopback only.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lbproxy.admin.client import connect  # noqa: E402

ECHO = """
import asyncio, sys
async def echo(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    writer.close()
async def main():
    server = await asyncio.start_server(echo, "127.0.0.1", int(sys.argv[1]), backlog=4096)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Loop:
    """New connections one after another; each one's latency (seconds), or a failure."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Loop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.perf_counter()
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
                    s.sendall(b"x")
                    if s.recv(1) != b"x":
                        self.failures.append("no echo")
                        continue
            except OSError as exc:
                self.failures.append(type(exc).__name__)
                continue
            self.latencies.append(time.perf_counter() - began)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def upgrade(admin: int) -> dict:
    """`lbproxy upgrade`'s request, through the admin socket (over TCP a change needs
    the token)."""
    client = connect(f"http://127.0.0.1:{admin}")
    client.timeout = 120.0
    return client.upgrade([])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drain", type=float, default=2.0, help="global.drain_timeout (s)")
    parser.add_argument("--window", type=float, default=6.0, help="seconds per loop window")
    args = parser.parse_args()

    backend, port, admin = free_port(), free_port(), free_port()
    tmp = Path(tempfile.mkdtemp(prefix="lbproxy-bench-upgrade-"))
    config = tmp / "lbproxy.yaml"
    config.write_text(
        "global:\n"
        f"  admin: {{listen: 127.0.0.1:{admin}}}\n"
        f"  drain_timeout: {args.drain}s\n"
        "virtual_servers:\n"
        "  - name: web\n"
        f"    listen: 127.0.0.1:{port}\n"
        "    scheduler: rr\n"
        "    real_servers:\n"
        f"      - {{name: echo, address: 127.0.0.1:{backend}}}\n"
    )
    log = open(tmp / "lbproxy.log", "wb")  # noqa: SIM115 - closed at the end
    echo = subprocess.Popen([sys.executable, "-c", ECHO, str(backend)])
    first = subprocess.Popen(
        [sys.executable, "-m", "lbproxy", "run", str(config), "--log-level", "warning"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    pids = [first.pid]
    results = []
    try:
        wait_port(backend)
        wait_port(port)
        wait_port(admin)
        for n in range(args.rounds):
            idle = []
            for _ in range(args.idle):
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall(b"i")
                assert s.recv(1) == b"i"
                idle.append(s)
            baseline = Loop(port).start()
            time.sleep(args.window)
            baseline.stop()
            during = Loop(port).start()
            time.sleep(1.0)
            old = pids[-1]
            began = time.perf_counter()
            answer = upgrade(admin)
            ready = time.perf_counter() - began
            pids.append(answer["pid"])
            while alive(old) and time.perf_counter() - began < args.drain + 60:
                time.sleep(0.005)
            exited = time.perf_counter() - began
            time.sleep(max(0.0, args.window - 1.0 - exited))
            during.stop()
            for s in idle:
                s.close()
            results.append((baseline, during, ready, exited))
            print(
                f"round {n + 1}: ready {ready * 1000:.0f} ms, old exited {exited * 1000:.0f} ms;"
                f" p99 {percentile(baseline.latencies, 99) * 1000:.2f} ms without,"
                f" {percentile(during.latencies, 99) * 1000:.2f} ms with;"
                f" failures {len(baseline.failures) + len(during.failures)}",
                flush=True,
            )
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGTERM)
        for pid in pids:
            deadline = time.monotonic() + args.drain + 10
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        first.wait(5)
        echo.terminate()
        echo.wait(5)
        log.close()

    def ms(values: list[float]) -> str:
        low, mid, high = (v * 1000 for v in (min(values), statistics.median(values), max(values)))
        return f"{mid:.0f} ms ({low:.0f}-{high:.0f})"

    base = [x for r in results for x in r[0].latencies]
    during = [x for r in results for x in r[1].latencies]
    failures = sum(len(r[0].failures) + len(r[1].failures) for r in results)
    print()
    print(f"{args.rounds} rounds, {args.idle} idle connections, drain_timeout {args.drain:g}s")
    print(f"  POST -> new process ready, old stopped accepting: {ms([r[2] for r in results])}")
    print(f"  POST -> old process exited:                       {ms([r[3] for r in results])}")
    for name, values in (("without an upgrade", base), ("with an upgrade", during)):
        print(
            f"  new-connection latency {name}: n={len(values)}"
            f" p50 {percentile(values, 50) * 1000:.2f} ms"
            f" p99 {percentile(values, 99) * 1000:.2f} ms max {max(values) * 1000:.2f} ms"
        )
    print(f"  refused, reset or no echo: {failures}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
