"""Throughput check for lbproxy.net.pump over loopback (not a test).

    .venv/bin/python bench/pump_bench.py [--size-mb 1024] [--both] [--mode splice|fallback|all]

The pump runs in this process under trio. A helper process (this script with
``--endpoints``) plays the client and the real server with plain blocking sockets and
1 MiB buffers, so the endpoints cost little and sit on the other core. The client sends
SIZE bytes (and with ``--both`` the server sends SIZE bytes back at the same time), each
side half-closes when done; the figure is bytes moved by the pump / wall time of the pump.
"""

from __future__ import annotations

import argparse
import math
import socket
import subprocess
import sys
import threading
import time

from common import entry

CHUNK = 1 << 20


def _send(sock: socket.socket, size: int) -> None:
    block = memoryview(bytes(range(256)) * (CHUNK // 256))
    left = size
    while left:
        n = sock.send(block[: min(left, CHUNK)])
        left -= n
    sock.shutdown(socket.SHUT_WR)


def _drain(sock: socket.socket, out: list[int]) -> None:
    buf = bytearray(CHUNK)
    total = 0
    while n := sock.recv_into(buf):
        total += n
    out.append(total)


def endpoints(pump_port: int, size: int, both: bool) -> None:
    """The helper process: a sink/source 'real server' and a source/sink 'client'."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    got_server: list[int] = []
    got_client: list[int] = []

    def server() -> None:
        conn, _ = listener.accept()
        with conn:
            t = threading.Thread(target=_send, args=(conn, size)) if both else None
            if t:
                t.start()
            else:
                conn.shutdown(socket.SHUT_WR)
            _drain(conn, got_server)
            if t:
                t.join()

    def client() -> None:
        with socket.create_connection(("127.0.0.1", pump_port)) as conn:
            t = threading.Thread(target=_drain, args=(conn, got_client))
            t.start()
            _send(conn, size)
            t.join()

    threads = [threading.Thread(target=server), threading.Thread(target=client)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got_server == [size], got_server
    assert got_client == [size if both else 0], got_client


def run_one(size: int, both: bool, use_splice: bool) -> tuple[float, float, int, str]:
    import trio

    from lbproxy.net import pump as pump_mod

    async def main() -> tuple[float, float, int, str]:
        lst = trio.socket.socket()
        await lst.bind(("127.0.0.1", 0))
        lst.listen()
        cmd = [sys.executable, __file__, "--endpoints", str(lst.getsockname()[1]), str(size)]
        proc = subprocess.Popen([*cmd, "--both"] if both else cmd, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        sink_port = int(await trio.to_thread.run_sync(proc.stdout.readline))
        client, _ = await lst.accept()
        server = trio.socket.socket()
        await server.connect(("127.0.0.1", sink_port))
        done = trio.Event()
        t0, c0 = time.perf_counter(), time.process_time()
        p = pump_mod.reactor().open(
            client.detach(), server.detach(), b"", math.inf, lambda _: done.set(), 0, use_splice
        )
        await done.wait()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        lst.close()
        assert await trio.to_thread.run_sync(proc.wait) == 0
        return dt, cpu, p.bytes_in + p.bytes_out, str(p.outcome)

    return trio.run(main)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--both", action="store_true", help="both directions at once")
    ap.add_argument("--mode", choices=["splice", "fallback", "all"], default="all")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--endpoints", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.endpoints:
        endpoints(args.endpoints[0], args.endpoints[1], args.both)
        return
    size = args.size_mb << 20
    modes = ["splice", "fallback"] if args.mode == "all" else [args.mode]
    for mode in modes:
        for _ in range(args.repeat):
            dt, cpu, moved, outcome = run_one(size, args.both, mode == "splice")
            way = "both ways" if args.both else "one way"
            print(
                f"{mode:8s} {moved / 1e6:6.0f} MB {way:9s} in {dt:5.2f} s: "
                f"{moved / dt / 1e6:6.0f} MB/s, pump process CPU {cpu / (moved / 1e9):5.2f} s/GB"
                f" ({outcome})"
            )


if __name__ == "__main__":
    entry(main)
