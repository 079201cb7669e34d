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
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from common import (
    Processes,
    alive,
    entry,
    free_port,
    percentile,
    round_trip,
    start_echo,
    start_lbproxy,
    stop_pid,
    wait_for,
    wait_port,
)

from lbproxy.admin.client import connect


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
                round_trip(self.port, b"x", 1)
            except OSError as exc:
                self.failures.append(type(exc).__name__)
                continue
            self.latencies.append(time.perf_counter() - began)


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

    port, admin = free_port(), free_port()
    results = []
    with (
        tempfile.TemporaryDirectory(prefix="lbproxy-bench-upgrade-") as folder,
        Processes() as procs,
    ):
        work = Path(folder)
        backend = start_echo(procs)
        config = (
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
        first = start_lbproxy(procs, work, config)
        pids = [first.pid]
        try:
            wait_port(port, first, work / "lbproxy.log")
            wait_port(admin, first, work / "lbproxy.log")
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
                wait_for(lambda old=old: not alive(old), args.drain + 60, 0.005)
                exited = time.perf_counter() - began
                time.sleep(max(0.0, args.window - 1.0 - exited))
                during.stop()
                for s in idle:
                    s.close()
                results.append((baseline, during, ready, exited))
                print(
                    f"round {n + 1}: ready {ready * 1000:.0f} ms,"
                    f" old exited {exited * 1000:.0f} ms;"
                    f" p99 {percentile(baseline.latencies, 99) * 1000:.2f} ms without,"
                    f" {percentile(during.latencies, 99) * 1000:.2f} ms with;"
                    f" failures {len(baseline.failures) + len(during.failures)}",
                    flush=True,
                )
        finally:
            # the upgrades' processes are not this script's children: stopped by PID
            for pid in pids[1:]:
                stop_pid(pid, args.drain + 10)

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
    entry(main)
