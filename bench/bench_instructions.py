"""User-space instructions per new connection, under callgrind (issue 26; not a test).

    .venv/bin/python bench/bench_instructions.py [--connections 1000] [--modes compiled,pure]
    .venv/bin/python bench/bench_instructions.py --keep-alive [--requests 3000]
    .venv/bin/python bench/bench_instructions.py --lbproxy-extra 'per_source: {rate: 100}'

CPU time per connection is what the benchmark reports (scripts/bench --syscalls), but
on a shared 2-core virtual machine it moves with the other jobs (steal and cache time
are charged to whoever runs). An instruction count does not: lbproxy runs under
valgrind's callgrind, which counts every user-space instruction it executes (the kernel's
are not counted). The same configuration as scripts/bench (one virtual server, rr, one
nginx real server), one client connection at a time (GET /small, Connection: close),
WARM connections then WARM + N; the difference divided by N is the instructions of one
connection, start-up and shut-down cancelled out. --keep-alive measures a request on one
keep-alive connection instead (GET /small, WARM requests then WARM + N). For each mode:
compiled (the C extension) and pure (LBPROXY_PURE=1). A keep-alive request's count moves
a little from run to run (how many batches and trio rounds a request takes depends on
when the peers answer): compare medians of a few runs. callgrind's own slowdown (~50x)
does not change the count. Needs valgrind and nginx (Debian: apt-get install valgrind
nginx).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import tempfile
from pathlib import Path

from common import (
    Processes,
    callgrind,
    callgrind_count,
    entry,
    free_port,
    path_env,
    start_lbproxy,
    start_nginx,
    wait_port,
)
from peers import lbproxy_conf

WARM = 200
REQUEST = b"GET /small HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n"
KEEP_ALIVE_REQUEST = b"GET /small HTTP/1.1\r\nHost: bench\r\n\r\n"


def connections(port: int, n: int) -> None:
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(REQUEST)
            while s.recv(65536):
                pass


def keep_alive(port: int, n: int) -> None:
    """n requests, one after the other, on one connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        for _ in range(n):
            s.sendall(KEEP_ALIVE_REQUEST)
            got = b""
            while b"\r\n\r\n" not in got:
                got += s.recv(65536)
            head, _, body = got.partition(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            while len(body) < length:
                body += s.recv(65536)


def instructions(
    procs: Processes,
    work: Path,
    server_port: int,
    n: int,
    mode: str,
    client=connections,
    extra: str = "",
) -> int:
    """Ir of one lbproxy run under callgrind that serves `n` connections."""
    port = free_port()
    name = f"lbproxy-{mode}-{n}"
    prefix = callgrind(work / f"callgrind.{mode}.{n}")
    config = lbproxy_conf([(port, server_port)], extra)
    proc = start_lbproxy(
        procs, work, config, name=name, prefix=prefix, log_level=None, env=path_env(mode)
    )
    try:
        wait_port(port, proc, work / f"{name}.log", timeout=300)
        client(port, n)
    finally:
        procs.stop(proc, timeout=300)
    return callgrind_count((work / f"{name}.log").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--modes", default="compiled,pure")
    p.add_argument("--keep-alive", action="store_true", help="per keep-alive request")
    p.add_argument("--requests", type=int, default=3000, help="with --keep-alive")
    p.add_argument(
        "--lbproxy-extra",
        default="",
        metavar="YAML",
        help="keys added to the virtual server, e.g. 'per_source: {max_connections: 100000}'",
    )
    p.add_argument(
        "--keep", type=Path, help="copy the callgrind files here (for callgrind_annotate)"
    )
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="lbproxy-ir-") as tmp, Processes() as procs:
        work = Path(tmp)
        server_port, _ = start_nginx(procs, work)
        client, n, what = connections, a.connections, "connection"
        if a.keep_alive:
            client, n, what = keep_alive, a.requests, "keep-alive request"
        for mode in a.modes.split(","):
            extra = a.lbproxy_extra
            base = instructions(procs, work, server_port, WARM, mode, client, extra)
            full = instructions(procs, work, server_port, WARM + n, mode, client, extra)
            per = (full - base) / n
            if a.keep is not None:
                a.keep.mkdir(parents=True, exist_ok=True)
                for f in work.glob(f"callgrind.{mode}.*"):
                    shutil.copy(f, a.keep / f.name)
            print(f"{mode:9s} {per:12,.0f} instructions per {what} (user space)")


if __name__ == "__main__":
    entry(main)
