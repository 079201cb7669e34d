"""`workers: 2`: CPU and system calls per new connection with the supervisor's shared
listening sockets (issue 23 item 3), against an older tree (SO_REUSEPORT per worker).

    .venv/bin/python bench/bench_worker_queue.py [ROOT]

ROOT (default: this tree) is the lbproxy tree to run (`git archive COMMIT | tar -x -C
DIR` gives an older one). nginx answers `ok` on loopback; lbproxy (`workers: 2`, `rr`, no
checks, no admin endpoint) in front of it; wrk -c20 with `Connection: close`, so every
request is a new connection. Printed: twice, without a tracer, the user and system CPU
of both workers (/proc/PID/stat) per connection wrk completed; then, under `strace -c
-f` on both workers, the calls of each name per connection the workers *accepted*
(successful accept4), with their errors (an accept4 that lost the race ends in EAGAIN).
Rates and CPU depend on the machine's load (printed); the counts do not. Bounded: about
25 seconds; every process started is stopped by PID; loopback only.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from common import (
    ROOT,
    BenchError,
    Processes,
    attached,
    cpu_seconds,
    descendants,
    entry,
    free_port,
    need,
    parse_strace_summary,
    start_lbproxy,
    start_nginx,
    wait_for,
    wait_port,
    wrk,
)

CONFIG = """\
global:
  admin: {{listen: none}}
  workers: 2
virtual_servers:
  - name: web
    listen: 127.0.0.1:{port}
    scheduler: rr
    health_check: {{type: none}}
    real_servers:
      - {{name: n, address: 127.0.0.1:{backend}}}
"""


def measure(root: Path, work: Path) -> None:
    need("strace")
    with Processes() as procs:
        backend, _ = start_nginx(procs, work)
        port = free_port()
        lb = start_lbproxy(procs, work, CONFIG.format(port=port, backend=backend), root=root)
        wait_port(port, lb, work / "lbproxy.log")
        if not wait_for(lambda: len(descendants(lb.pid)) == 2, 20):
            raise BenchError(f"not two workers: {descendants(lb.pid)}")
        kids = descendants(lb.pid)
        wrk(port, "/", 20, 1, close=True)  # warm-up: both workers accept
        for _ in range(2):
            user0, system0 = cpu_seconds(kids)
            n = wrk(port, "/", 20, 4, close=True)["requests"]
            user1, system1 = cpu_seconds(kids)
            user, system = ((user1 - user0) / n * 1e6, (system1 - system0) / n * 1e6)
            print(
                f"no tracer: {n} connections, {user:.0f} us user + {system:.0f} us system"
                f" per connection; load {os.getloadavg()[0]:.1f}"
            )
        trace = work / "strace.txt"
        pids = [arg for k in kids for arg in ("-p", str(k))]
        with attached(["strace", "-c", "-f", "-o", str(trace), *pids], settle=1.0, timeout=10):
            wrk(port, "/", 20, 4, close=True)
    rows = parse_strace_summary(trace.read_text())
    calls, errors = (rows.get("accept4", {}).get(k, 0) for k in ("calls", "errors"))
    accepted = calls - errors
    print(f"under strace: {accepted} connections accepted")
    for name in ("accept4", "epoll_wait", "epoll_ctl"):
        c, e = (rows.get(name, {}).get(k, 0) for k in ("calls", "errors"))
        print(f"  {name:12s} {c / accepted:6.2f} per connection ({e / accepted:.2f} errors)")
    print(f"  {'all calls':12s} {sum(r['calls'] for r in rows.values()) / accepted:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "root", nargs="?", type=Path, default=ROOT, help="the lbproxy tree to run (default: this)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lbproxy-bench-") as tmp:
        measure(args.root, Path(tmp))


if __name__ == "__main__":
    entry(main)
