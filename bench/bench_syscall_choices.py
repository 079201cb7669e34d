"""Two system-call choices on the connection path, measured (issue 26; not a test).

    .venv/bin/python bench/bench_syscall_choices.py [--rounds 5] [--n 20000]

1. accept: ``accept4(SOCK_NONBLOCK)`` (the compiled path, lbproxy.net._cpump.accept)
   against ``accept`` + ``fcntl(F_SETFL, O_NONBLOCK)`` (the pure path: socket._accept
   and one fcntl, as HAProxy does). Each operation: a loopback client connects, the
   listener accepts, both close. The difference is what the choice saves.
2. the first small chunks: ``splice`` socket -> pipe -> socket against ``recv_into`` +
   ``send`` through a buffer (HAProxy's splice-auto copies small chunks rather than
   splicing them), for a request-sized chunk (100 bytes) and a response-sized one
   (1,000): one chunk written into a loopback connection, moved by the method onto a
   second connection, read at the far end.

CPU time of this process (user and system, getrusage) per operation, methods
alternating within each round, median of the rounds. The endpoints' own work is the same
for both methods of a pair; only the difference is the method's. A shared machine moves
the absolute figures: compare within a round.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import socket
import statistics

from common import entry, own_cpu, tcp_pair

from lbproxy.net import compiled

FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK


def timed(fn, n: int) -> tuple[float, float]:
    u0, s0 = own_cpu()
    fn(n)
    u1, s1 = own_cpu()
    return (u1 - u0) / n * 1e6, (s1 - s0) / n * 1e6


def accept_variants(listener: socket.socket):
    fd = listener.fileno()
    address = listener.getsockname()

    def fcntl_way(n: int) -> None:
        accept = listener._accept
        for _ in range(n):
            c = socket.socket()
            c.connect(address)
            client, _ = accept()
            fcntl.fcntl(client, fcntl.F_SETFL, os.O_NONBLOCK)
            os.close(client)
            c.close()

    def accept4_way(n: int) -> None:
        accept = compiled.cpump.accept
        for _ in range(n):
            c = socket.socket()
            c.connect(address)
            client, _ = accept(fd)
            os.close(client)
            c.close()

    return {"accept + fcntl": fcntl_way, "accept4(SOCK_NONBLOCK)": accept4_way}


def chunk_variants(size: int):
    # writer -> src ... (moved by the method) ... dst -> reader
    writer, src = tcp_pair(nodelay=True)
    dst, reader = tcp_pair(nodelay=True)
    payload = b"x" * size
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    buf = memoryview(bytearray(1 << 18))
    sfd, dfd = src.fileno(), dst.fileno()

    def splice_way(n: int) -> None:
        for _ in range(n):
            writer.send(payload)
            m = os.splice(sfd, w, 1 << 24)  # blocking socket: waits for the chunk
            os.splice(r, dfd, m, flags=FLAGS)
            reader.recv(65536)

    def copy_way(n: int) -> None:
        recv_into, send = src.recv_into, dst.send
        for _ in range(n):
            writer.send(payload)
            m = recv_into(buf)
            send(buf[:m])
            reader.recv(65536)

    close = [writer, src, dst, reader]
    return {"splice": splice_way, "recv_into + send": copy_way}, close, (r, w)


def report(title: str, results: dict[str, list[tuple[float, float]]]) -> None:
    print(f"\n{title}")
    print(f"{'method':26s} {'user us/op':>11s} {'system us/op':>13s} {'total':>8s}")
    for name, rows in results.items():
        u = statistics.median(x[0] for x in rows)
        s = statistics.median(x[1] for x in rows)
        print(f"{name:26s} {u:11.2f} {s:13.2f} {u + s:8.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=20000)
    a = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; {a.rounds} rounds of {a.n}")
    if compiled.cpump is not None:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(4096)
            variants = accept_variants(listener)
            results: dict[str, list] = {k: [] for k in variants}
            for _ in range(a.rounds):
                for name, fn in variants.items():
                    results[name].append(timed(fn, a.n // 4))
            report("accept, per connection (client connect + accept + both closes)", results)
    else:
        print("accept4: the C extension is not built (or LBPROXY_PURE is set)")
    for size in (100, 1000):
        variants, close, pipe = chunk_variants(size)
        results = {k: [] for k in variants}
        try:
            for _ in range(a.rounds):
                for name, fn in variants.items():
                    results[name].append(timed(fn, a.n))
        finally:
            for s in close:
                s.close()
            os.close(pipe[0])
            os.close(pipe[1])
        report(f"a {size}-byte chunk moved (plus the endpoints' send and recv)", results)


if __name__ == "__main__":
    entry(main)
