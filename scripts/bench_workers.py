"""CPU per new connection with `workers: 1` against `workers: 2` (issue 15's last goal).

    .venv/bin/python scripts/bench_workers.py [--rounds 3] [--seconds 4]

nginx answers `ok` on loopback; lbproxy (`rr`, no checks, no admin endpoint) runs in
front of it with 1 and then 2 workers; wrk opens new connections (`Connection: close`,
20 at a time). Each round adds up utime + stime of every lbproxy process (supervisor and
workers, from /proc) over the run and divides by the requests wrk counted: "as efficient
per core" means the same CPU per connection. Nothing is pinned: wrk and nginx share the
two cores, so read the rate as a side figure. Needs wrk and nginx (scripts/bench installs
them as root). Every process started is stopped by PID; loopback only.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    children = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout.split()
    return [pid] + [p for child in children for p in process_tree(int(child))]


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICK


def wait_port(port: int, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on 127.0.0.1:{port}")


def measure(workdir: Path, backend: int, workers: int, rounds: int, seconds: int) -> list:
    port = free_port()
    config = workdir / f"lbproxy-{workers}.yaml"
    config.write_text(
        "global:\n  admin: {listen: none}\n"
        f"  workers: {workers}\n"
        "virtual_servers:\n  - name: web\n"
        f"    listen: 127.0.0.1:{port}\n"
        "    scheduler: rr\n    health_check: {type: none}\n"
        f"    real_servers:\n      - {{name: n, address: 127.0.0.1:{backend}}}\n"
    )
    proxy = subprocess.Popen(
        [sys.executable, "-m", "lbproxy", "run", str(config), "--log-level", "warning"],
        cwd=ROOT,
    )
    results = []
    try:
        wait_port(port)
        time.sleep(1)  # every worker up
        pids = process_tree(proxy.pid)
        for _ in range(rounds):
            before = cpu_seconds(pids)
            out = subprocess.run(
                [
                    "wrk",
                    "-t1",
                    "-c20",
                    f"-d{seconds}s",
                    "-H",
                    "Connection: close",
                    f"http://127.0.0.1:{port}/",
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            used = cpu_seconds(pids) - before
            requests = int(re.search(r"(\d+) requests in", out).group(1))
            results.append((requests / seconds, used / requests * 1e6, os.getloadavg()[0]))
    finally:
        proxy.send_signal(signal.SIGTERM)
        proxy.wait(30)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=4)
    args = parser.parse_args()
    for tool in ("wrk", "nginx"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is missing (scripts/bench installs it as root)")
    with tempfile.TemporaryDirectory(prefix="lbproxy-workers-") as tmp:
        workdir = Path(tmp)
        backend = free_port()
        (workdir / "nginx.conf").write_text(
            "worker_processes 1;\ndaemon off;\n"
            f"pid {workdir}/nginx.pid;\nerror_log {workdir}/nginx.err;\n"
            "events { worker_connections 4096; }\n"
            "http { access_log off; server { listen 127.0.0.1:%d; "
            'location / { return 200 "ok\\n"; } } }\n' % backend
        )
        nginx = subprocess.Popen(["nginx", "-c", str(workdir / "nginx.conf"), "-p", tmp])
        try:
            wait_port(backend)
            for workers in (1, 2):
                for rate, us, load in measure(workdir, backend, workers, args.rounds, args.seconds):
                    print(
                        f"workers {workers}: {us:4.0f} us CPU per connection (all lbproxy "
                        f"processes), {rate:,.0f} connections/s, load average {load:.2f}"
                    )
        finally:
            nginx.terminate()
            nginx.wait(10)


if __name__ == "__main__":
    main()
