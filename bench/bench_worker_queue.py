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

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WRK = ["wrk", "-t1", "-c20", "-d4s", "-H", "Connection: close"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workers_of(pid: int) -> list[str]:
    tasks = Path(f"/proc/{pid}/task")
    return [k for t in tasks.iterdir() for k in (t / "children").read_text().split()]


def cpu(pids: list[str]) -> tuple[int, int]:
    """utime and stime (ticks) of `pids` together."""
    user = system = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        user, system = user + int(fields[11]), system + int(fields[12])
    return user, system


def wait_ready(port: int) -> None:
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(b"GET / HTTP/1.0\r\n\r\n")
                if c.recv(100):
                    return
        except OSError:
            time.sleep(0.1)


def measure(root: str, tmp: Path) -> None:
    nginx_port, port = free_port(), free_port()
    (tmp / "nginx.conf").write_text(
        f"daemon off; worker_processes 1; error_log {tmp}/e.log; pid {tmp}/n.pid;\n"
        "events {} http { access_log off; "
        f"server {{ listen 127.0.0.1:{nginx_port}; location / {{ return 200 ok; }} }} }}\n"
    )
    (tmp / "lb.yaml").write_text(
        "global:\n  admin: {listen: none}\n  workers: 2\nvirtual_servers:\n"
        f"  - name: web\n    listen: 127.0.0.1:{port}\n    scheduler: rr\n"
        "    health_check: {type: none}\n"
        f"    real_servers:\n      - {{name: n, address: 127.0.0.1:{nginx_port}}}\n"
    )
    nginx = subprocess.Popen(["nginx", "-c", str(tmp / "nginx.conf"), "-p", str(tmp)])
    command = [sys.executable, "-m", "lbproxy", "run", str(tmp / "lb.yaml")]
    lb = subprocess.Popen([*command, "--log-level", "warning"], cwd=root)
    try:
        time.sleep(3)
        wait_ready(port)
        time.sleep(3)  # both workers up
        kids = workers_of(lb.pid)
        assert len(kids) == 2, kids
        tick = os.sysconf("SC_CLK_TCK")
        for _ in range(2):
            before = cpu(kids)
            out = subprocess.run(
                [*WRK, f"http://127.0.0.1:{port}/"], capture_output=True, text=True
            )
            after = cpu(kids)
            n = int(re.search(r"(\d+) requests", out.stdout).group(1))
            user, system = ((after[i] - before[i]) / tick / n * 1e6 for i in (0, 1))
            print(
                f"no tracer: {n} connections, {user:.0f} us user + {system:.0f} us system"
                f" per connection; load {os.getloadavg()[0]:.1f}"
            )
        trace = tmp / "strace.txt"
        pids = [arg for k in kids for arg in ("-p", k)]
        strace = subprocess.Popen(["strace", "-c", "-f", "-o", str(trace), *pids])
        time.sleep(1)
        subprocess.run([*WRK, f"http://127.0.0.1:{port}/"], capture_output=True)
        strace.send_signal(signal.SIGINT)
        strace.wait(10)
        rows = {}
        for line in trace.read_text().splitlines():
            m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(\d+)?\s*(\w+)$", line)
            if m:
                rows[m.group(3)] = (int(m.group(1)), int(m.group(2) or 0))
        calls, errors = rows.get("accept4", (0, 0))
        accepted = calls - errors
        print(f"under strace: {accepted} connections accepted")
        for name in ("accept4", "epoll_wait", "epoll_ctl"):
            c, e = rows.get(name, (0, 0))
            print(f"  {name:12s} {c / accepted:6.2f} per connection ({e / accepted:.2f} errors)")
        print(f"  {'all calls':12s} {sum(c for c, _ in rows.values()) / accepted:6.2f}")
    finally:
        for process in (lb, nginx):
            process.send_signal(signal.SIGTERM)
        lb.wait(20)
        nginx.wait(10)


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else str(ROOT)
    with tempfile.TemporaryDirectory(prefix="lbproxy-bench-") as tmp:
        measure(root, Path(tmp))


if __name__ == "__main__":
    main()
