#!/usr/bin/env python3
"""What SNI routing costs per new connection: lbproxy's CPU time, next to plain TCP.

    .venv/bin/python bench/bench_sni.py               # 5 rounds of 3000 connections
    .venv/bin/python bench/bench_sni.py --connections 1000 --rounds 3

One `lbproxy run` with two listen addresses in front of the same echo server (another
process): a plain one (one virtual server, no `sni`) and an SNI one (two virtual
servers, one with `sni: [api.example.com]`, so every client is pre-read and routed).
Every client sends the same real TLS ClientHello (made by Python's ssl with
server_hostname api.example.com, ~500 bytes), reads it back and closes, from a few
client threads. The figure is lbproxy's own CPU time (utime + stime from /proc) per
connection; rounds alternate plain and SNI so that drift in the machine's load hits
both. docs/benchmarks.md has the results.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")

ECHO = textwrap.dedent(
    """
    import socket, sys, threading
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


def client_hello() -> bytes:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="api.example.com")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


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


def run_clients(port: int, hello: bytes, total: int, threads: int) -> float:
    """`total` connections from `threads` threads; returns the wall time."""
    per_thread = total // threads

    def work() -> None:
        for _ in range(per_thread):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                c.sendall(hello)
                got = 0
                while got < len(hello):
                    chunk = c.recv(65536)
                    if not chunk:
                        raise RuntimeError("closed early")
                    got += len(chunk)

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
    args = parser.parse_args()

    hello = client_hello()
    echo = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
    proxy = None
    try:
        echo_port = int(echo.stdout.readline())
        plain, sni = free_port(), free_port()
        rs = f"[{{name: echo, address: 127.0.0.1:{echo_port}}}]"
        config = textwrap.dedent(
            f"""\
            global: {{admin: {{listen: none}}}}
            virtual_servers:
              - {{name: plain, listen: 127.0.0.1:{plain}, scheduler: rr,
                 health_check: {{type: none}}, real_servers: {rs}}}
              - {{name: api, listen: 127.0.0.1:{sni}, sni: [api.example.com], scheduler: rr,
                 health_check: {{type: none}}, real_servers: {rs}}}
              - {{name: other, listen: 127.0.0.1:{sni}, scheduler: rr,
                 health_check: {{type: none}}, real_servers: {rs}}}
            """
        )
        work = Path(tempfile.mkdtemp(prefix="lbproxy-bench-sni-"))
        (work / "lbproxy.yaml").write_text(config)
        log = open(work / "lbproxy.log", "wb")  # noqa: SIM115 - closed with the process
        proxy = subprocess.Popen(
            [sys.executable, "-m", "lbproxy", "run", str(work / "lbproxy.yaml")],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        wait_port(plain)
        wait_port(sni)
        run_clients(plain, hello, 300, args.threads)  # warm up both paths
        run_clients(sni, hello, 300, args.threads)
        results: dict[str, list[float]] = {"plain": [], "sni": []}
        for _ in range(args.rounds):
            for name, port in (("plain", plain), ("sni", sni)):
                before = cpu_ticks(proxy.pid)
                wall = run_clients(port, hello, args.connections, args.threads)
                used = (cpu_ticks(proxy.pid) - before) / CLK_TCK
                n = args.connections // args.threads * args.threads
                results[name].append(used / n * 1e6)
                print(f"{name:5}  {used / n * 1e6:7.1f} us CPU/conn  {n / wall:7.0f} conn/s")
        medians = {name: statistics.median(values) for name, values in results.items()}
        print(
            f"median: plain {medians['plain']:.1f} us, sni {medians['sni']:.1f} us, "
            f"SNI routing +{medians['sni'] - medians['plain']:.1f} us per new connection "
            f"({len(hello)}-byte ClientHello, {args.rounds} rounds of {args.connections})"
        )
    finally:
        for proc in (proxy, echo):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
