"""Locator answers per second per core: DNS (UDP) and HTTP (`GET .../locate`, keep-alive).

    .venv/bin/python bench/bench_locator.py [--seconds 5] [--servers 10] [--window 32]
    scripts/bench --locator ...           (the same)

Starts one `lbproxy run` (locator only: a `listen: none` virtual server, `least-load`
with `load_source: report`, N real servers that have all reported a load) pinned to CPU 0
with taskset when there are two or more CPUs, and drives it from this process, pinned to
CPU 1: a bounded load generator that keeps `--window` queries (UDP) or connections
(HTTP, one request at a time each, keep-alive) outstanding for `--seconds` seconds or
`--max` answers, whichever ends first. Every answer is a real locate (one scheduler pick,
counted, plus the message); the generator only checks that it is an answer.

Reported: answers per second of wall time, and per CPU-second of the lbproxy process
(utime + stime from /proc) -- "per core" -- with the 1-minute load average beside it.
`--seconds 60 --max 10000` makes each measurement a bounded number of answers instead.
`http /healthz` is the same HTTP load on a route that does nothing: the HTTP server's own
cost per request (lbproxy/admin/http_server.py), the ceiling of HTTP locate. The share of the CPU
spent in the kernel (stime) is printed beside each figure. Everything listens on
127.0.0.1; the process is stopped by PID at the end. Results go to
docs/development/benchmark-journal.md by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import tempfile
import time
import urllib.request
from functools import partial
from pathlib import Path

import dns.message
from common import (
    BenchError,
    Processes,
    can_pin,
    cpu_seconds,
    entry,
    free_port,
    start_lbproxy,
    tail,
    taskset,
    wait_for,
)

from lbproxy.admin.client import connect

LOCATE_PATH = "/api/v1/virtual-servers/db/locate"


def start(procs: Processes, servers: int, admin_port: int, dns_port: int, work: Path):
    lines = [
        "global:",
        f"  admin: {{listen: 127.0.0.1:{admin_port}}}",
        "  locator:",
        # One source asks everything: the per-source rate limit (100 answers a second by
        # default) would measure itself, not the locator.
        f"    dns: {{listen: 127.0.0.1:{dns_port}, zone: lb.internal.,",
        "          rate_limit: {responses_per_second: 0}}",
        "virtual_servers:",
        "  - name: db",
        "    listen: none",
        "    scheduler: least-load",
        "    load_source: report",
        "    health_check: {type: none}",
        "    real_servers:",
    ]
    lines += [f"      - {{name: s{i}, address: 127.0.0.1:{20000 + i}}}" for i in range(servers)]
    pin = None
    if (os.cpu_count() or 1) >= 2 and can_pin({0, 1}):
        pin = taskset(0)
        os.sched_setaffinity(0, {1})
    proc = start_lbproxy(procs, work, "\n".join(lines) + "\n", name="locator", prefix=pin)

    def ready() -> bool:
        if proc.poll() is not None:
            raise BenchError(f"lbproxy exited: {tail(work / 'locator.log')}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/readyz", timeout=1):
                return True
        except OSError:
            return False

    if not wait_for(ready, 15):
        raise BenchError(f"lbproxy not ready after 15 s: {tail(work / 'locator.log')}")
    for i in range(servers):  # every server reports: the pick is a real least-load pick
        # through the admin socket: over TCP a change needs the token
        connect(f"http://127.0.0.1:{admin_port}").request(
            "PUT",
            f"/api/v1/virtual-servers/db/real-servers/s{i}/load",
            {"load": 0.01 * i, "per_connection": 0.001},
        )
    return proc


def bench_dns(port: int, seconds: float, window: int, limit: int) -> int:
    """Answers received; `window` queries kept in flight over one UDP socket."""
    wire = dns.message.make_query("_db._tcp.lb.internal.", "SRV").to_wire()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(("127.0.0.1", port))
        sock.settimeout(0.2)
        answered = sent = 0
        deadline = time.monotonic() + seconds
        while sent < window:
            sock.send(wire)
            sent += 1
        while time.monotonic() < deadline and answered < limit:
            try:
                sock.recv(4096)
            except TimeoutError:  # lost under load: refill the window
                for _ in range(window - (sent - answered)):
                    sock.send(wire)
                    sent += 1
                sent = answered + window
                continue
            answered += 1
            sock.send(wire)
            sent += 1
    return answered


def bench_http(port: int, seconds: float, window: int, limit: int, path: str = LOCATE_PATH) -> int:
    """Responses received over `window` keep-alive connections, one request in flight each."""
    # The admin endpoint answers to its address (a Host it does not know gets 421).
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    selector = selectors.DefaultSelector()
    buffers: dict[socket.socket, bytearray] = {}

    def connect() -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        sock.send(request)
        buffers[sock] = bytearray()
        selector.register(sock, selectors.EVENT_READ)

    for _ in range(window):
        connect()
    answered = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline and answered < limit:
            for key, _ in selector.select(0.5):
                sock = key.fileobj
                data = sock.recv(65536)  # type: ignore[union-attr]
                if not data:  # the endpoint closed it (it does not recycle connections)
                    selector.unregister(sock)
                    del buffers[sock]  # type: ignore[arg-type]
                    sock.close()  # type: ignore[union-attr]
                    connect()
                    continue
                buffer = buffers[sock]  # type: ignore[index]
                buffer += data
                while True:
                    head_end = buffer.find(b"\r\n\r\n")
                    if head_end < 0:
                        break
                    head = bytes(buffer[:head_end]).lower()
                    length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
                    total = head_end + 4 + length
                    if len(buffer) < total:
                        break
                    if not head.startswith(b"http/1.1 200"):
                        raise SystemExit(f"unexpected answer: {bytes(buffer[:total])!r}")
                    del buffer[:total]
                    answered += 1
                    sock.send(request)  # type: ignore[union-attr]
    finally:
        for sock in buffers:
            selector.unregister(sock)
            sock.close()
    return answered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument("--servers", type=int, default=10, help="real servers in the pool")
    parser.add_argument("--window", type=int, default=32, help="queries/connections in flight")
    parser.add_argument("--max", type=int, default=500_000, help="answers, at most")
    args = parser.parse_args()
    admin_port, dns_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as folder, Processes() as procs:
        proc = start(procs, args.servers, admin_port, dns_port, Path(folder))
        results = {}
        healthz = partial(bench_http, path="/healthz")  # the HTTP server's own floor
        for name, run, port in (
            ("dns", bench_dns, dns_port),
            ("http", bench_http, admin_port),
            ("http /healthz", healthz, admin_port),
        ):
            (user0, system0), wall0 = cpu_seconds([proc.pid]), time.monotonic()
            answered = run(port, args.seconds, args.window, args.max)
            user, system = cpu_seconds([proc.pid])
            user, system = user - user0, system - system0
            wall, cpu = time.monotonic() - wall0, user + system
            results[name] = {
                "answers": answered,
                "per_second": round(answered / wall),
                "per_cpu_second": round(answered / cpu) if cpu else None,
                "lbproxy_cpu": round(cpu / wall, 2),
                "system_share": round(system / cpu, 2) if cpu else None,
                "load_average": round(os.getloadavg()[0], 2),  # the machine is shared
            }
            print(
                f"{name:13} {answered:8d} answers in {wall:.1f} s: "
                f"{answered / wall:8.0f}/s, {answered / cpu if cpu else 0:8.0f} per "
                f"lbproxy CPU-second (lbproxy at {cpu / wall:.0%} of a core, "
                f"{system / cpu if cpu else 0:.0%} of it system, "
                f"load average {os.getloadavg()[0]:.2f})"
            )
        print(json.dumps(results))


if __name__ == "__main__":
    entry(main)
