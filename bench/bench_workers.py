"""CPU per new connection with `workers: 1` against `workers: 2` (issue 15's last goal).

    .venv/bin/python bench/bench_workers.py [--rounds 3] [--seconds 4]
    flock /tmp/lbproxy-bench.lock .venv/bin/python bench/bench_workers.py --pin --rounds 6

nginx answers `ok` on loopback; lbproxy (`rr`, no checks, no admin endpoint) runs in
front of it with 1 and 2 workers; wrk opens new connections (`Connection: close`, 20 at a
time). Each round adds up utime + stime of every lbproxy process (supervisor and
workers, from /proc) over the run and divides by the requests wrk counted: "as efficient
per core" means the same CPU per connection (the same connections per CPU-second).

Without `--pin` nothing is pinned: wrk and nginx share the two cores with lbproxy, so
read the rate as a side figure. With `--pin` (what makes the comparison decisive on a
2-core machine) wrk and nginx run on `--load-core` and every lbproxy process --
supervisor and both workers, or the single process -- on `--proxy-core`, so both setups
get exactly one core; lbproxy is started afresh for every round and the rounds
alternate 1, 2, 2, 1, 1, 2, ... so a drift in the machine's load hits both alike. The
table then also splits the CPU by process (the supervisor's share, the workers').

Needs wrk and nginx (scripts/bench installs them as root). Bounded: rounds x (seconds +
a few seconds of start-up); every process started is stopped by PID; loopback only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from common import (
    Processes,
    cpu_seconds,
    descendants,
    entry,
    free_port,
    need,
    start_lbproxy,
    start_nginx,
    taskset,
    wait_for,
    wait_port,
    wrk,
)


def measure(
    procs: Processes,
    work: Path,
    backend: int,
    workers: int,
    seconds: int,
    pin: list[str],
    load: list[str],
    connections: int = 20,
) -> dict:
    """One round: a fresh lbproxy with `workers`, new-connection load, CPU per process."""
    port = free_port()
    config = (
        "global:\n  admin: {listen: none}\n"
        f"  workers: {workers}\n"
        "virtual_servers:\n  - name: web\n"
        f"    listen: 127.0.0.1:{port}\n"
        "    scheduler: rr\n    health_check: {type: none}\n"
        f"    real_servers:\n      - {{name: n, address: 127.0.0.1:{backend}}}\n"
    )
    name = f"lbproxy-{workers}"
    proxy = start_lbproxy(procs, work, config, name=name, prefix=pin)
    try:
        wait_port(port, proxy, work / f"{name}.log")
        expected = 1 if workers == 1 else 1 + workers
        wait_for(lambda: len([proxy.pid, *descendants(proxy.pid)]) == expected, 10)
        pids = [proxy.pid, *descendants(proxy.pid)]
        wrk(port, "/", connections, 1, close=True, pin=load)  # warm-up: every worker up
        before = [sum(cpu_seconds([pid])) for pid in pids]
        split0 = cpu_seconds(pids)
        t0 = time.monotonic()
        requests = wrk(port, "/", connections, seconds, close=True, pin=load)["requests"]
        wall = time.monotonic() - t0
        used = [sum(cpu_seconds([pid])) - b for pid, b in zip(pids, before, strict=True)]
        split1 = cpu_seconds(pids)
    finally:
        procs.stop(proxy, 30)
    total = sum(used)
    return {
        "workers": workers,
        "rate": requests / seconds,
        "us": total / requests * 1e6,
        "user_us": (split1[0] - split0[0]) / requests * 1e6,
        "sys_us": (split1[1] - split0[1]) / requests * 1e6,
        "per_cpu_s": requests / total if total else 0.0,
        "util": total / wall,
        # the supervisor is the first pid; with workers: 1 it is the only process
        "supervisor_us": used[0] / requests * 1e6 if workers > 1 else None,
        "workers_us": sum(used[1:]) / requests * 1e6 if workers > 1 else None,
        "load": os.getloadavg()[0],
    }


def report(results: list[dict]) -> None:
    for workers in (1, 2):
        runs = [r for r in results if r["workers"] == workers]
        if not runs:
            continue
        us = [r["us"] for r in runs]
        per = [r["per_cpu_s"] for r in runs]
        user = statistics.median(r["user_us"] for r in runs)
        system = statistics.median(r["sys_us"] for r in runs)
        line = (
            f"workers {workers}: median {statistics.median(us):4.0f} us CPU per connection "
            f"({min(us):.0f}-{max(us):.0f}; user {user:.0f} + system {system:.0f}), "
            f"{statistics.median(per):,.0f} connections per CPU-second, {len(runs)} rounds"
        )
        if workers > 1:
            sup = statistics.median(r["supervisor_us"] for r in runs)
            wrk = statistics.median(r["workers_us"] for r in runs)
            line += f"; supervisor {sup:.1f} us, workers {wrk:.0f} us"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per setting")
    parser.add_argument("--seconds", type=int, default=4)
    parser.add_argument(
        "--pin",
        action="store_true",
        help="wrk and nginx on --load-core, every lbproxy process on --proxy-core",
    )
    parser.add_argument("--load-core", type=int, default=0)
    parser.add_argument("--proxy-core", type=int, default=1)
    parser.add_argument(
        "--connections", type=int, default=20, help="wrk's concurrent connections (-c)"
    )
    args = parser.parse_args()
    for tool in ("wrk", "nginx", "taskset") if args.pin else ("wrk", "nginx"):
        need(tool, "util-linux" if tool == "taskset" else tool)
    pin = taskset(args.proxy_core) if args.pin else []
    load = taskset(args.load_core) if args.pin else []
    # Alternating (1, 2, 2, 1, ...) when pinned; all of 1 then all of 2 otherwise, as
    # this script always did.
    if args.pin:
        order = [(1, 2) if r % 2 == 0 else (2, 1) for r in range(args.rounds)]
        settings = [w for pair in order for w in pair]
    else:
        settings = [1] * args.rounds + [2] * args.rounds
    results = []
    with tempfile.TemporaryDirectory(prefix="lbproxy-workers-") as tmp, Processes() as procs:
        work = Path(tmp)
        backend, _ = start_nginx(procs, work, load)
        for workers in settings:
            r = measure(procs, work, backend, workers, args.seconds, pin, load, args.connections)
            results.append(r)
            split = ""
            if r["supervisor_us"] is not None:
                split = f" (supervisor {r['supervisor_us']:.1f}, workers {r['workers_us']:.0f})"
            print(
                f"workers {workers}: {r['us']:4.0f} us CPU per connection{split} (all "
                f"lbproxy processes; user {r['user_us']:.0f} + system {r['sys_us']:.0f}), "
                f"{r['rate']:,.0f} connections/s, "
                f"{r['per_cpu_s']:,.0f} per CPU-second, util {r['util']:.2f}, "
                f"load average {r['load']:.2f}",
                flush=True,
            )
    report(results)


if __name__ == "__main__":
    entry(main)
