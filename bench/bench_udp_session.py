"""Python calls and CPU per UDP session through the compiled relay, in one process.

    .venv/bin/python bench/bench_udp_session.py [--sessions 3000]

A UDP virtual server's datagrams are relayed in C (lbproxy/net/_cpump_udp.h); Python is
called twice per session: when a client address opens one (`CompiledUdpRelay._on_open`:
the ACL, the caps, the scheduler's pick and take) and at its end (`_on_end`: the
accounts). With `responses: 1` (DNS's pattern, and `scripts/bench --udp`'s) every
datagram opens a session, so those two calls are most of lbproxy's user time per
datagram. This serves `--sessions` sessions, each from a client socket of its own,
through a relay to a UDP echo (a process of its own), one at a time, and prints per
session:

- the Python calls made in the two callbacks, by function (under `sys.setprofile`: exact
  whatever the load);
- the thread CPU time spent in them (CLOCK_THREAD_CPUTIME_ID, median of five passes),
  the C relay's `session()` included (its socket, connect and epoll_ctl), less what the
  clock reads themselves cost (measured first: a read is a system call). One session at
  a time runs with cold caches, so this is more than the same work costs under load;
  the calls are the figure to compare.

With `--callgrind`, the user-space instructions per session in the two callbacks
instead, exact whatever the load: the benchmark runs again under valgrind's callgrind,
which counts only inside `operator.call` (a C function of the standard library that
the callbacks are made through there, and that nothing else here calls).

Run it from another source tree's root to compare (`cd TREE && /work/main/.venv/bin/python
bench/bench_udp_session.py`, the tree's extension built with `python setup.py build_ext
--inplace`). Results go to docs/development/benchmark-journal.md by hand.
"""

from __future__ import annotations

import argparse
import collections
import operator
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import trio
from common import BenchError, entry, need

from lbproxy.config.model import (
    Address,
    HealthCheckConfig,
    RealServerConfig,
    UdpConfig,
    VirtualServerConfig,
)
from lbproxy.core.pool import Pool
from lbproxy.dataplane.udp import CompiledUdpRelay, udp_relay

ECHO = """
import os, socket
s = socket.socket(fileno=int(os.environ["FD"]))
while True:
    data, peer = s.recvfrom(65536)
    s.sendto(data, peer)
"""
PASSES = 5  # timed passes; the profiled one comes after them


def clock_read_ns() -> float:
    """What one time.thread_time_ns() costs here (median of five runs of 20,000)."""
    runs = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(20_000):
            time.thread_time_ns()
        runs.append((time.perf_counter_ns() - t0) / 20_000)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=3000, help="per pass (default 3000)")
    p.add_argument(
        "--callgrind", action="store_true", help="instructions per session, under callgrind"
    )
    p.add_argument("--counted", action="store_true", help=argparse.SUPPRESS)  # callgrind's run
    args = p.parse_args()
    if args.callgrind:
        return instructions(args.sessions)
    n = args.sessions
    callbacks = [0]  # thread CPU ns in _on_open and _on_end
    ended = [0]
    calls: collections.Counter[str] = collections.Counter()
    profiling = [False]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls[frame.f_code.co_qualname] += 1
        elif event == "c_call":
            calls["(C calls)"] += 1

    opened, closed = CompiledUdpRelay._on_open, CompiledUdpRelay._on_end

    def measured(callback: Any, counts_end: bool) -> Any:
        def call(self: CompiledUdpRelay, *args: Any) -> Any:
            if counts_end:
                ended[0] += 1
            if args_counted:  # callgrind counts inside operator.call only
                return operator.call(callback, self, *args)
            if profiling[0]:
                sys.setprofile(profile)
                try:
                    return callback(self, *args)
                finally:
                    sys.setprofile(None)
            t0 = time.thread_time_ns()
            try:
                return callback(self, *args)
            finally:
                callbacks[0] += time.thread_time_ns() - t0

        return call

    args_counted = args.counted
    CompiledUdpRelay._on_open = measured(opened, False)  # type: ignore[method-assign]
    CompiledUdpRelay._on_end = measured(closed, True)  # type: ignore[method-assign]

    async def run() -> list[float]:
        servers, echoes = [], []
        for _ in range(2):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind(("127.0.0.1", 0))
            servers.append(sock)
            echoes.append(
                subprocess.Popen(
                    [sys.executable, "-c", ECHO],
                    pass_fds=[sock.fileno()],
                    env={"FD": str(sock.fileno())},
                )
            )
        config = VirtualServerConfig(
            name="dns",
            listen=(Address("127.0.0.1", 0),),
            real_servers=tuple(
                RealServerConfig(name, Address("127.0.0.1", sock.getsockname()[1]))
                for name, sock in zip("ab", servers, strict=True)
            ),
            scheduler="rr",
            protocol="udp",
            udp=UdpConfig(responses=1, max_sessions=10**6, max_sessions_per_source=10**6),
            health_check=HealthCheckConfig(type="none"),
        )
        listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        listener.bind(("127.0.0.1", 0))
        listener.setblocking(False)
        relay = udp_relay(Pool(config, trio.current_time()), listener)
        if not isinstance(relay, CompiledUdpRelay):
            sys.exit("bench_udp_session: the compiled path is not built (or LBPROXY_PURE=1)")
        per_session = []
        try:
            async with trio.open_nursery() as nursery:
                address = await nursery.start(relay.serve)
                for pass_ in range(1 if args_counted else PASSES + 1):
                    profiling[0] = pass_ == PASSES
                    callbacks[0] = ended[0] = 0
                    for _ in range(n):
                        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
                            client.bind(("127.0.0.1", 0))
                            before = ended[0]
                            client.sendto(b"q", address)
                            with trio.fail_after(5):
                                while ended[0] == before:  # one session at a time
                                    await trio.sleep(0)
                    if not profiling[0]:
                        per_session.append(callbacks[0] / n)
                nursery.cancel_scope.cancel()
        finally:
            for echo in echoes:
                echo.kill()
                echo.wait()
            for sock in (*servers, listener):
                sock.close()
        return per_session

    read = clock_read_ns()
    per_session = trio.run(run)
    if args_counted:
        return None
    # Each callback's span holds the end of one read and the start of the next: one read.
    spent = (statistics.median(per_session) - 2 * read) / 1000
    print(f"UDP sessions through the compiled relay, {n} a pass, one at a time")
    print(
        f"thread CPU per session in the two callbacks: {spent:.2f} us (median of {PASSES};"
        f" a clock read, {read / 1000:.2f} us, taken off for each)"
    )
    python_calls = sum(v for k, v in calls.items() if k != "(C calls)") / n
    print(f"Python calls per session: {python_calls:.1f}; C calls: {calls['(C calls)'] / n:.1f}")
    for name, count in calls.most_common():
        if name != "(C calls)" and count >= n // 2:
            print(f"  {count / n:5.2f}  {name}")


def instructions(n: int) -> None:
    """This benchmark's sessions again under callgrind, counting inside operator.call."""
    valgrind = need("valgrind")
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "callgrind.out")
        command = [
            valgrind, "--tool=callgrind", "--collect-atstart=no",
            "--toggle-collect=_operator_call", f"--callgrind-out-file={out}",
            sys.executable, __file__, "--sessions", str(n), "--counted",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise BenchError(f"callgrind: {done.stderr.strip()[-500:]}")
        with open(out) as lines:
            total = next(
                int(line.split()[1]) for line in lines if line.startswith(("summary:", "totals:"))
            )
    print(f"UDP sessions through the compiled relay, {n}, one at a time, under callgrind")
    print(f"user-space instructions per session in the two callbacks: {total / n:,.0f}")


if __name__ == "__main__":
    entry(main)
