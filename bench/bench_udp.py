"""lbproxy's UDP virtual server against nginx stream UDP, in one run (issue 25).

    .venv/bin/python bench/bench_udp.py [--duration 5] [--window 32] [--idle 5000]
    .venv/bin/python bench/bench_udp.py --generator dnsperf   # dnsperf against dnsmasq
    scripts/bench --udp [...]                                   # the same, by scripts/bench

Python standard library only; every party is its own process. The real server is a UDP
echo (a process of this script); the load is an equivalent of dnsperf's closed loop:
`--window` datagrams of 64 bytes in flight over 32 client sockets, each answered one
for one (lbproxy `udp: {responses: 1}`, nginx `proxy_responses 1`), for `--duration`
seconds. With `--generator dnsperf` the real server is a dnsmasq answering A queries
from a hosts file and the load is `dnsperf -c 32 -q WINDOW -l DURATION` (Debian packages
dnsperf and dnsmasq-base), which reports queries per second and the average and maximum
latency (no percentiles). Measured per proxy, with one worker each:

datagrams/s   answered requests per wall second, and per CPU-second of the proxy
              (utime + stime from /proc/PID/stat): "per proxy core"
p50/p99       request-to-answer latency seen by the generator, ms
idle          `--idle` client addresses each open one session and stay silent
              (`responses: none`, nginx without proxy_responses); the proxy's VmRSS
              after minus before, / sessions (user-space memory: socket buffers are
              kernel memory and not in RSS)

--syscalls    instead of the time figures: each proxy's system calls per answered
              datagram, by name, under `strace -c -f` during the same load (a count, which
              the machine's other load does not move)

The machine's other load moves every figure; run both proxies in the same run and
compare the ratio, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import re
import selectors
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (
    BenchError,
    Processes,
    cpu_seconds,
    entry,
    free_port,
    need,
    nginx_preamble,
    percentile,
    rss_kb,
    run_client,
    start_lbproxy,
)
from peers import NGINX_STREAM_MODULE

UDP_ECHO = """
import socket, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
sock.bind(("127.0.0.1", int(sys.argv[1])))
buf = bytearray(65536)
while True:
    n, peer = sock.recvfrom_into(buf)
    sock.sendto(memoryview(buf)[:n], peer)
"""


def udp_port() -> int:
    return free_port(socket.SOCK_DGRAM)


def dns_query(name: str) -> bytes:
    """A DNS query for `name` A (id 0x2525, recursion desired): an echo answers it too."""
    qname = b"".join(bytes([len(label)]) + label.encode() for label in name.split(".")) + b"\0"
    return struct.pack(">HHHHHH", 0x2525, 0x0100, 1, 0, 0, 0) + qname + b"\0\1\0\1"


def wait_answering(port: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(0.2)
    for _ in range(100):
        s.sendto(dns_query("b0.bench.test"), ("127.0.0.1", port))
        try:
            s.recvfrom(100)
            return
        except TimeoutError:
            continue
    raise RuntimeError(f"nothing answers on {port}")


def load(port: int, duration: float, window: int) -> tuple[int, float, float]:
    """Closed loop: `window` requests in flight, one reply each; (answered, p50, p99)."""
    socks = []
    for _ in range(32):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setblocking(False)
        s.connect(("127.0.0.1", port))
        socks.append(s)
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    sent_at: dict[socket.socket, list[float]] = {s: [] for s in socks}
    payload = b"q" * 64
    latencies = []
    for i in range(window):
        s = socks[i % len(socks)]
        s.send(payload)
        sent_at[s].append(time.perf_counter())
    end = time.perf_counter() + duration
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        events = sel.select(0.5)
        if not events:  # a lost datagram: send a new one in its place
            s = socks[0]
            s.send(payload)
            sent_at[s].append(time.perf_counter())
            continue
        for key, _ in events:
            s = key.fileobj
            while True:
                try:
                    s.recv(65536)
                except BlockingIOError:
                    break
                now = time.perf_counter()
                if sent_at[s]:
                    latencies.append(now - sent_at[s].pop(0))
                s.send(payload)
                sent_at[s].append(now)
    for s in socks:
        s.close()
    return len(latencies), percentile(latencies, 50) * 1000, percentile(latencies, 99) * 1000


NAMES = 100  # b0.bench.test .. b99.bench.test, each with one A record


def dnsmasq(procs: Processes, work: Path, port: int) -> subprocess.Popen:
    """A real dnsmasq on 127.0.0.1:port answering A queries for NAMES names from a file."""
    hosts = work / "bench.hosts"
    hosts.write_text("".join(f"192.0.2.{i % 250 + 1} b{i}.bench.test\n" for i in range(NAMES)))
    argv = [
        need("dnsmasq", "dnsmasq-base"),
        "--no-daemon",
        f"--port={port}",
        "--listen-address=127.0.0.1",
        "--bind-interfaces",
        "--no-resolv",
        "--no-hosts",
        "--local=/test/",
        f"--addn-hosts={hosts}",
        f"--pid-file={work / 'dnsmasq.pid'}",
        f"--user={getpass.getuser()}",
    ]
    return procs.start("dnsmasq", argv, work / "dnsmasq.log")  # says why if it does not answer


def dnsperf(work: Path, port: int, duration: float, window: int) -> tuple[int, float, float]:
    """dnsperf's closed loop through the proxy; (queries completed, avg ms, max ms)."""
    queries = work / "queries.txt"
    queries.write_text("".join(f"b{i}.bench.test A\n" for i in range(NAMES)))
    target = ["-s", "127.0.0.1", "-p", str(port), "-d", str(queries)]
    command = ["dnsperf", *target, "-l", f"{duration:g}", "-c", "32", "-q", str(window), "-t", "2"]
    out = run_client(command, timeout=duration + 30)
    completed = re.search(r"Queries completed:\s+(\d+)", out)
    latency = re.search(r"Average Latency \(s\):\s+([\d.]+) \(min [\d.]+, max ([\d.]+)\)", out)
    if completed is None or latency is None:
        raise RuntimeError(f"dnsperf said:\n{out}")
    return int(completed.group(1)), float(latency.group(1)) * 1000, float(latency.group(2)) * 1000


def idle_sessions(pid: int, port: int, count: int) -> float:
    before = rss_kb(pid)
    socks = []
    for _ in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.sendto(b"hello", ("127.0.0.1", port))
        socks.append(s)
    time.sleep(1.0)
    answered = 0
    for s in socks:  # answered once: its session is open
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.recv(100)
            answered += 1
    print(f"  {answered}/{count} idle sessions answered", file=sys.stderr)
    after = rss_kb(pid)
    for s in socks:
        s.close()
    return (after - before) * 1024 / count


def traced(
    work: Path, pid: int, port: int, args, resolver
) -> tuple[int, float, list[tuple[int, str]]]:
    """The load under `strace -c -f` attached to the proxy and its children: (answered,
    system calls per answered datagram, [(count, name)] most first)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    out = work / f"strace-{port}"
    attach = [a for p in (pid, *map(int, children)) for a in ("-p", str(p))]
    tracer = subprocess.Popen([need("strace"), "-c", "-f", "-o", str(out), *attach])
    try:
        time.sleep(1.0)  # attached (strace -c prints nothing to wait for)
        if resolver is None:
            answered = load(port, args.duration, args.window)[0]
        else:
            answered = dnsperf(work, port, args.duration, args.window)[0]
    finally:
        tracer.send_signal(2)  # SIGINT: strace detaches and writes its summary
        tracer.wait(30)
    calls = []
    for line in out.read_text().splitlines():
        m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)$", line)
        if m and m[2] != "total":
            calls.append((int(m[1]), m[2]))
    calls.sort(reverse=True)
    return answered, sum(n for n, _ in calls) / max(answered, 1), calls


def lbproxy(
    procs: Processes, work: Path, port: int, upstream: int, responses: str
) -> subprocess.Popen:
    config = (
        "global: {admin: {listen: none}, drain_timeout: 1s}\n"
        "virtual_servers:\n  - name: bench\n    protocol: udp\n"
        f"    listen: 127.0.0.1:{port}\n    scheduler: rr\n"
        f"    udp: {{responses: {responses}, max_sessions: 100000,"
        " max_sessions_per_source: 100000}\n"
        f"    real_servers:\n      - {{name: a, address: 127.0.0.1:{upstream}}}\n"
    )
    return start_lbproxy(procs, work, config, name=f"lbproxy-{port}")


def nginx(
    procs: Processes, work: Path, port: int, upstream: int, responses: str
) -> subprocess.Popen:
    t = work / f"nginx-{port}"
    t.mkdir()
    answers = f"proxy_responses {responses};" if responses != "none" else ""
    (t / "nginx.conf").write_text(
        f"load_module {NGINX_STREAM_MODULE};{nginx_preamble(t, 20000)}\n"
        f"stream {{ server {{ listen 127.0.0.1:{port} udp; proxy_pass 127.0.0.1:{upstream};"
        f" {answers} proxy_timeout 30s; }} }}\n"
    )
    argv = [need("nginx"), "-c", str(t / "nginx.conf"), "-p", str(t)]
    return procs.start(f"nginx-{port}", argv, t / "nginx.log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--idle", type=int, default=5000)
    parser.add_argument(
        "--generator",
        choices=("python", "dnsperf"),
        default="python",
        help="python: the closed loop against a UDP echo (p50/p99); dnsperf: dnsperf "
        "against a real dnsmasq (average/maximum latency)",
    )
    parser.add_argument(
        "--syscalls",
        action="store_true",
        help="instead: system calls per datagram by name, under strace -c (a count, "
        "steadier than time on a busy machine)",
    )
    args = parser.parse_args()
    if args.syscalls:
        need("strace")
    if args.generator == "dnsperf":
        need("dnsperf")
        need("dnsmasq", "dnsmasq-base")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, Processes() as procs:
        work = Path(tmp)
        upstream = udp_port()  # the echo: the idle sessions' server, and the load's by default
        procs.start("udp-echo", [sys.executable, "-c", UDP_ECHO, str(upstream)])
        resolver = None
        busy_upstream = upstream
        if args.generator == "dnsperf":
            busy_upstream = udp_port()
            resolver = dnsmasq(procs, work, busy_upstream)
            try:
                wait_answering(busy_upstream)
            except RuntimeError as exc:
                said = (work / "dnsmasq.log").read_text(errors="replace").strip()
                raise BenchError(
                    f"dnsmasq: {exc} (exit status {resolver.poll()}): {said}"
                ) from None
        for name, start in (("lbproxy", lbproxy), ("nginx", nginx)):
            port, idle_port = udp_port(), udp_port()
            busy = start(procs, work, port, busy_upstream, "1")
            idle = start(procs, work, idle_port, upstream, "none")
            try:
                wait_answering(port)
                wait_answering(idle_port)
                if args.syscalls:
                    rows.append((name, *traced(work, busy.pid, port, args, resolver)))
                    continue
                (user0, system0), t0 = cpu_seconds([busy.pid]), time.perf_counter()
                if resolver is None:
                    answered, lat1, lat2 = load(port, args.duration, args.window)
                else:
                    answered, lat1, lat2 = dnsperf(work, port, args.duration, args.window)
                (user1, system1), wall = cpu_seconds([busy.pid]), time.perf_counter() - t0
                user, system = user1 - user0, system1 - system0
                cpu_s = user + system
                per_session = idle_sessions(idle.pid, idle_port, args.idle)
                rate, per_cpu, util = answered / wall, answered / cpu_s, cpu_s / wall
                split = (1e6 * user / answered, 1e6 * system / answered)  # µs per datagram
                rows.append((name, rate, per_cpu, util, lat1, lat2, per_session, *split))
            finally:
                for proc in (busy, idle):
                    procs.stop(proc, 10)
    if args.syscalls:
        print(f"generator: {args.generator}")
        for name, answered, per, calls in rows:
            top = ", ".join(
                f"{call} {n / answered:.2f}" for n, call in calls if n >= answered / 100
            )
            print(f"{name:8} {answered:8d} datagrams  {per:6.2f} system calls each: {top}")
        return
    latencies = "p50 ms  p99 ms" if resolver is None else "avg ms  max ms"
    print(f"generator: {args.generator}")
    print(
        f"proxy     dgram/s  per CPU-s  util  {latencies}  B/idle session  user/system us per dgram"
    )
    for name, rate, per_cpu, util, p50, p99, per_session, user_us, system_us in rows:
        print(
            f"{name:8} {rate:8.0f} {per_cpu:10.0f} {util:5.2f} {p50:7.2f} {p99:7.2f}"
            f" {per_session:15.0f}  {user_us:10.2f} / {system_us:.2f}"
        )


if __name__ == "__main__":
    entry(main)
