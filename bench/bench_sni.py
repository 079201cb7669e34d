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
both. docs/development/benchmark-journal.md has the results.
"""

from __future__ import annotations

import argparse
import contextlib
import ssl
import statistics
import tempfile
import textwrap
from pathlib import Path

from common import (
    Processes,
    cpu_seconds,
    entry,
    free_port,
    in_threads,
    round_trip,
    start_echo,
    start_lbproxy,
    wait_port,
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


def run_clients(port: int, hello: bytes, total: int, threads: int) -> float:
    """`total` connections from `threads` threads; returns the wall time."""
    per_thread = total // threads

    def work() -> None:
        for _ in range(per_thread):
            round_trip(port, hello, len(hello))

    return in_threads(work, threads)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()

    hello = client_hello()
    with tempfile.TemporaryDirectory(prefix="lbproxy-bench-sni-") as folder, Processes() as procs:
        echo_port = start_echo(procs)
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
        work = Path(folder)
        proxy = start_lbproxy(procs, work, config, log_level=None)
        wait_port(plain, proxy, work / "lbproxy.log")
        wait_port(sni, proxy, work / "lbproxy.log")
        run_clients(plain, hello, 300, args.threads)  # warm up both paths
        run_clients(sni, hello, 300, args.threads)
        results: dict[str, list[float]] = {"plain": [], "sni": []}
        for _ in range(args.rounds):
            for name, port in (("plain", plain), ("sni", sni)):
                before = sum(cpu_seconds([proxy.pid]))
                wall = run_clients(port, hello, args.connections, args.threads)
                used = sum(cpu_seconds([proxy.pid])) - before
                n = args.connections // args.threads * args.threads
                results[name].append(used / n * 1e6)
                print(f"{name:5}  {used / n * 1e6:7.1f} us CPU/conn  {n / wall:7.0f} conn/s")
        medians = {name: statistics.median(values) for name, values in results.items()}
        print(
            f"median: plain {medians['plain']:.1f} us, sni {medians['sni']:.1f} us, "
            f"SNI routing +{medians['sni'] - medians['plain']:.1f} us per new connection "
            f"({len(hello)}-byte ClientHello, {args.rounds} rounds of {args.connections})"
        )
    return 0


if __name__ == "__main__":
    entry(main)
