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

docs/development/benchmark-journal.md has the results.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

from common import (
    Processes,
    cpu_seconds,
    entry,
    free_port,
    in_threads,
    need,
    percentile,
    round_trip,
    start_echo,
    start_lbproxy,
    wait_for,
    wait_port,
)

from lbproxy.admin.client import connect
from lbproxy.wire.proxy_protocol import encode_v1


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
                round_trip(port, header + b"x", 1)  # the proxy passes on the byte only

        return in_threads(work, threads)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--changes", type=int, default=200)
    args = parser.parse_args()
    redis_server = need("redis-server")
    with (
        tempfile.TemporaryDirectory(prefix="lbproxy-bench-cluster-") as folder,
        Processes() as procs,
    ):
        work = Path(folder)
        redis_port = free_port()
        redis_argv = [redis_server, "--port", str(redis_port), "--bind", "127.0.0.1"]
        redis_argv += ["--save", "", "--appendonly", "no", "--dir", str(work)]
        redis = procs.start("redis-server", redis_argv, work / "redis.log")
        echo_port = start_echo(procs)
        wait_port(redis_port, redis)
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
            proc = start_lbproxy(procs, work, config, name=name, log_level=None)
            instances[name] = (proc.pid, port, admin)
            for listen in (port, admin):
                wait_port(listen, proc, work / f"{name}.log")
        clients = Clients()
        for name in ("alone", "member"):  # warm up
            clients.run(instances[name][1], 300, args.threads)

        results: dict[str, list[tuple[float, float]]] = {"alone": [], "member": [], "peer": []}
        rates, catch_up = [], []
        peer_pid, _, peer_admin = instances["peer"]
        for _ in range(args.rounds):
            for name in ("alone", "member"):
                pid, port, _ = instances[name]
                before, peer_before = cpu_seconds([pid]), cpu_seconds([peer_pid])
                had = entries(peer_admin)
                wall = clients.run(port, args.connections, args.threads)
                ended = time.monotonic()
                n = args.connections // args.threads * args.threads
                if name == "member":
                    wait_for(lambda had=had, n=n: entries(peer_admin) >= had + n, 30, 0.005)
                    catch_up.append(time.monotonic() - ended)
                    rates.append(n / wall)
                    time.sleep(0.2)  # let the peer finish before its CPU is read
                    after = cpu_seconds([peer_pid])
                    results["peer"].append(
                        tuple((a - b) / n * 1e6 for a, b in zip(after, peer_before, strict=True))
                    )
                after = cpu_seconds([pid])
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
            if not wait_for(lambda w=weight: get(peer_url)["weight"]["static"] == w, 5, 0):
                raise RuntimeError("the change did not arrive")
            delays.append(time.monotonic() - started)
        p50, p99 = percentile(delays, 50), percentile(delays, 99)
        print(f"change to effect: p50 {1000 * p50:.1f} ms, p99 {1000 * p99:.1f} ms, "
              f"max {1000 * max(delays):.1f} ms over {len(delays)} changes (PATCH round trip "
              f"and the polling GETs included)")  # fmt: skip
    return 0


if __name__ == "__main__":
    entry(main)
