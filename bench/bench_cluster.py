#!/usr/bin/env python3
"""What `global.cluster` costs (SPEC §18), measured against a real redis-server.

    flock /tmp/lbproxy-bench.lock .venv/bin/python bench/bench_cluster.py
    ... bench/bench_cluster.py --connections 2000 --rounds 3 --changes 100

Three lbproxy processes in front of one echo server, each with `persistence` and
`accept_proxy` (every client sends a PROXY v1 header with a source address of its own, so
every connection makes a new persistence entry, the case that writes to Redis most):
`alone` (no cluster), `member` (clustered) and `peer` (clustered, receiving what
`member` shares). Three figures:

1. CPU per new connection: lbproxy's own utime and stime (/proc/PID/stat) per
   connection, `alone` and `member` loaded in alternate rounds, so that drift in the
   machine's load hits both; the peer's CPU while it applies the member's entries too.
2. Entries replicated per second: the rate of those connections (each one an entry
   written and published by the member, received and applied by the peer), and how long
   after the last connection the peer held every entry.
3. Time from a change to its effect: a PATCH of a weight on `member`, then the peer's
   API polled until it shows it; p50 and p99 over --changes changes.

docs/benchmarks.md has the results.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")
sys.path.insert(0, str(ROOT))

from lbproxy.admin.client import connect  # noqa: E402
from lbproxy.wire.proxy_protocol import encode_v1  # noqa: E402

ECHO = textwrap.dedent(
    """
    import socket, threading
    s = socket.create_server(("127.0.0.1", 0), backlog=1024)
    print(s.getsockname()[1], flush=True)
    def serve(c):
        with c:
            while data := c.recv(65536):
                c.sendall(data)
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK  # utime, stime


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


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def patch(url: str, body: dict) -> None:
    """Through the admin socket of the endpoint `url` names (over TCP a change needs
    the token), as `lbproxy set-weight` sends it."""
    parts = urllib.parse.urlsplit(url)
    connect(f"http://127.0.0.1:{parts.port}").request("PATCH", parts.path, body)


def entries(admin: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("lbproxy_persistence_entries{"):
                return int(float(line.rsplit(" ", 1)[1]))
    return 0


class Clients:
    """Connections with PROXY headers of ever new source addresses, from a few threads."""

    def __init__(self) -> None:
        self.next = 0
        self.lock = threading.Lock()

    def source(self) -> tuple[str, int]:
        with self.lock:
            n = self.next
            self.next += 1
        return (f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}", 40000 + n % 20000)

    def run(self, port: int, total: int, threads: int) -> float:
        per_thread = total // threads

        def work() -> None:
            for _ in range(per_thread):
                header = encode_v1(self.source(), ("127.0.0.1", port))
                with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                    c.sendall(header + b"x")
                    if c.recv(10) != b"x":
                        raise RuntimeError("no echo")

        workers = [threading.Thread(target=work) for _ in range(threads)]
        started = time.monotonic()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--changes", type=int, default=200)
    args = parser.parse_args()
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        print("redis-server is not installed", file=sys.stderr)
        return 1

    work = Path(tempfile.mkdtemp(prefix="lbproxy-bench-cluster-"))
    processes: list[subprocess.Popen] = []
    try:
        redis_port = free_port()
        processes.append(subprocess.Popen(
            [redis_server, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(work)],
            stdout=subprocess.DEVNULL,
        ))  # fmt: skip
        echo = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
        processes.append(echo)
        echo_port = int(echo.stdout.readline())
        wait_port(redis_port)
        instances = {}
        key = work / "cluster.key"
        key.write_text(secrets.token_hex(32) + "\n")
        key.chmod(0o600)
        for name, clustered in (("alone", False), ("member", True), ("peer", True)):
            port, admin = free_port(), free_port()
            cluster = (
                f"  cluster: {{key_file: {key}, "
                f"redis: {{url: 'redis://127.0.0.1:{redis_port}/0', name: {name}}}}}\n"
                if clustered
                else ""
            )
            config = (
                f"global:\n  admin: {{listen: 127.0.0.1:{admin}}}\n{cluster}"
                f"virtual_servers:\n"
                f"  - {{name: web, listen: 127.0.0.1:{port}, scheduler: rr, accept_proxy: true,\n"
                f"     persistence: {{timeout: 5m, max_entries: 1000000}},\n"
                f"     health_check: {{type: none}},\n"
                f"     real_servers: [{{name: a, address: 127.0.0.1:{echo_port}}},\n"
                f"                    {{name: b, address: 127.0.0.1:{echo_port}}}]}}\n"
            )
            path = work / f"{name}.yaml"
            path.write_text(config)
            log = open(work / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
            proc = subprocess.Popen(
                [sys.executable, "-m", "lbproxy", "run", str(path)],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
            )  # fmt: skip
            processes.append(proc)
            instances[name] = (proc.pid, port, admin)
        for _, port, admin in instances.values():
            wait_port(port)
            wait_port(admin)
        clients = Clients()
        for name in ("alone", "member"):  # warm up
            clients.run(instances[name][1], 300, args.threads)

        results: dict[str, list[tuple[float, float]]] = {"alone": [], "member": [], "peer": []}
        rates, catch_up = [], []
        peer_pid, _, peer_admin = instances["peer"]
        for _ in range(args.rounds):
            for name in ("alone", "member"):
                pid, port, _ = instances[name]
                before, peer_before = cpu(pid), cpu(peer_pid)
                had = entries(peer_admin)
                wall = clients.run(port, args.connections, args.threads)
                ended = time.monotonic()
                n = args.connections // args.threads * args.threads
                if name == "member":
                    while entries(peer_admin) < had + n and time.monotonic() - ended < 30:
                        time.sleep(0.005)
                    catch_up.append(time.monotonic() - ended)
                    rates.append(n / wall)
                    time.sleep(0.2)  # let the peer finish before its CPU is read
                    after = cpu(peer_pid)
                    results["peer"].append(
                        tuple((a - b) / n * 1e6 for a, b in zip(after, peer_before, strict=True))
                    )
                after = cpu(pid)
                user, system = ((a - b) / n * 1e6 for a, b in zip(after, before, strict=True))
                results[name].append((user, system))
                total = user + system
                print(f"{name:6}  user {user:6.1f} us  system {system:6.1f} us  "
                      f"total {total:6.1f} us per connection  {n / wall:6.0f} conn/s")  # fmt: skip
        print()
        for name, values in results.items():
            users = statistics.median(v[0] for v in values)
            systems = statistics.median(v[1] for v in values)
            print(f"median {name:6}: user {users:.1f} us, system {systems:.1f} us, "
                  f"total {users + systems:.1f} us per connection")  # fmt: skip
        alone = statistics.median(sum(v) for v in results["alone"])
        member = statistics.median(sum(v) for v in results["member"])
        print(f"cluster costs {100 * (member / alone - 1):+.1f} % CPU per new connection")
        print(f"entries replicated: {statistics.median(rates):.0f}/s per instance (the "
              f"connection rate); the peer held all of them {1000 * max(catch_up):.0f} ms "
              f"after the last connection at worst")  # fmt: skip

        # 3. from a change on one instance to its effect on another
        member_url = f"http://127.0.0.1:{instances['member'][2]}"
        peer_url = f"http://127.0.0.1:{peer_admin}/api/v1/virtual-servers/web/real-servers/a"
        delays = []
        for i in range(args.changes):
            weight = 2 + i % 50
            started = time.monotonic()
            patch(f"{member_url}/api/v1/virtual-servers/web/real-servers/a", {"weight": weight})
            while get(peer_url)["weight"]["static"] != weight:
                if time.monotonic() - started > 5:
                    raise RuntimeError("the change did not arrive")
            delays.append(time.monotonic() - started)
        delays.sort()
        p50 = delays[len(delays) // 2]
        p99 = delays[min(len(delays) - 1, int(len(delays) * 0.99))]
        print(f"change to effect: p50 {1000 * p50:.1f} ms, p99 {1000 * p99:.1f} ms, "
              f"max {1000 * delays[-1]:.1f} ms over {len(delays)} changes (PATCH round trip "
              f"and the polling GETs included)")  # fmt: skip
    finally:
        for proc in reversed(processes):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
