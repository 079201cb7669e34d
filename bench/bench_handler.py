"""CPU and Python calls per new connection through the handler, A/B in one process.

    .venv/bin/python bench/bench_handler.py --base DIR [--connections 4000]
    .venv/bin/python bench/bench_handler.py --base . --per-source   # what per_source costs

For a change to lbproxy/dataplane/connection.py (issue 22's lifecycle) on a machine
too busy for `scripts/bench --syscalls` to tell 3 % apart: this process loads the
handler module twice, this tree's and `--base`'s (e.g. `git archive main lbproxy | tar
-x -C DIR`; everything else is this tree's), and serves connections through the two
alternately (ABBA order), so load on the machine falls on both alike. Each connection
is made here, accepted here, handed to `Handler.accept` as the accept loop does (a
non-blocking descriptor), accepted by a "real server" socket and closed on both sides;
two checkpoints let the reactor see the ends. Measured per connection: the thread CPU
time (user + system, CLOCK_THREAD_CPUTIME_ID) of `Handler.accept` and of the two
checkpoints -- admission, pick, connect, pump start, the pump's end and `end()` -- and,
in a second pass under `sys.setprofile`, the Python and C calls made there. A warm-up
resolves the address first. Medians are printed; results go to
docs/development/benchmark-journal.md by hand.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import importlib.util
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import trio
from common import ROOT, entry

from lbproxy.config.model import (
    Address,
    HealthCheckConfig,
    PerSourceConfig,
    RealServerConfig,
    VirtualServerConfig,
)
from lbproxy.core.pool import Pool
from lbproxy.dataplane.virtual_server import VirtualServer

WARM_UP = 200
MODULE = "lbproxy/dataplane/connection.py"


def load(name: str, root: Path):
    spec = importlib.util.spec_from_file_location(name, root / MODULE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, required=True, help="a source tree to compare with")
    p.add_argument("--connections", type=int, default=4000, help="per tree (default 4000)")
    p.add_argument(
        "--per-source",
        action="store_true",
        help="this tree's virtual server has per_source: {max_connections: 100000, rate:"
        " 1000000} (with --base . : what per_source costs a connection)",
    )
    args = p.parse_args()
    modules = {"base": load("connection_base", args.base), "this": load("connection_this", ROOT)}
    n = args.connections
    per_source = (
        PerSourceConfig(max_connections=100_000, rate=1_000_000) if args.per_source else None
    )
    cpu: dict[str, list[float]] = {k: [] for k in modules}
    calls: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in modules}

    async def run() -> None:
        real = socket.create_server(("127.0.0.1", 0), backlog=4096)
        real.setblocking(False)
        front = socket.create_server(("127.0.0.1", 0), backlog=4096)
        handlers = {}
        for key, module in modules.items():
            config = VirtualServerConfig(
                name=key,
                listen=(Address("127.0.0.1", 1),),
                real_servers=(RealServerConfig("a", Address("127.0.0.1", real.getsockname()[1])),),
                scheduler="rr",
                health_check=HealthCheckConfig(type="none"),
                per_source=per_source if key == "this" else None,
            )
            handlers[key] = module.Handler(VirtualServer(Pool(config, trio.current_time())))
        async with trio.open_nursery() as nursery:
            for profiled in (False, True):
                for i in range(2 * (WARM_UP + n)):
                    key = "base" if (i // 2) % 2 == i % 2 else "this"  # ABBA
                    counted = i >= 2 * WARM_UP
                    counter = calls[key]

                    def profile(frame, event, arg, counter=counter) -> None:
                        if event == "call" or event == "c_call":
                            counter[event] += 1

                    client = socket.socket()
                    client.setblocking(False)
                    client.connect_ex(front.getsockname())
                    fd, peer = front._accept()
                    fcntl.fcntl(fd, fcntl.F_SETFL, os.O_NONBLOCK)
                    if profiled and counted:
                        sys.setprofile(profile)
                    t0 = time.thread_time()
                    handlers[key].accept(fd, peer, nursery.start_soon)
                    t1 = time.thread_time()
                    sys.setprofile(None)
                    while True:  # the warm-up's first connect waits for the resolve
                        try:
                            server, _ = real.accept()
                            break
                        except BlockingIOError:
                            await trio.sleep(0.001)
                    client.close()
                    server.close()
                    if profiled and counted:
                        sys.setprofile(profile)
                    t2 = time.thread_time()
                    await trio.sleep(0)
                    await trio.sleep(0)
                    t3 = time.thread_time()
                    sys.setprofile(None)
                    if counted and not profiled:
                        cpu[key].append(t1 - t0 + t3 - t2)
            with trio.fail_after(10):
                while any(h.pool.clients for h in handlers.values()):
                    await trio.sleep(0.01)
            for h in handlers.values():  # its guardian task ends (a tree without: none)
                getattr(h, "retire", lambda: None)()
        real.close()
        front.close()

    trio.run(run)
    for key, root in (("base", args.base), ("this", ROOT)):
        c = calls[key]
        print(
            f"{key} ({root}): {statistics.median(cpu[key]) * 1e6:.1f} us thread CPU, "
            f"{c['call'] / n:.1f} Python calls, {c['c_call'] / n:.1f} C calls per connection"
        )
    base, this = statistics.median(cpu["base"]), statistics.median(cpu["this"])
    print(f"this / base: {this / base:.3f} ({n} connections each, load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    entry(main)
