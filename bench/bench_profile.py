"""Profile lbproxy under load with py-spy: ``scripts/bench --profile`` (issue 7, hot path).

Starts the same real servers and lbproxy configuration as the benchmark (same cores),
then, for keep-alive load and for new-connection load (wrk, as in the benchmark), first
measures the proxy's CPU time per request / per connection without a profiler, then
records py-spy samples of the proxy twice: a flame graph (SVG) and the raw collapsed
stacks (text, one ``frame;frame;... count`` line per stack), both under
``bench-results/``. It prints the functions with the most samples of their own ("self":
the Python frame that was running, or that was inside a system call, when sampled) and a
breakdown of the samples by phase of a connection's life.

py-spy samples in blocking mode (it pauses the proxy for each sample, ~200 per second),
so the proxy runs somewhat slower while profiled; the shares, not the rates, are what
count. py-spy comes from PyPI (``pip install py-spy``); scripts/bench installs it into
.venv when ``--profile`` is given.
"""

from __future__ import annotations

import collections
import re
import shutil
import time
from pathlib import Path
from typing import Any

from common import ROOT, BenchError, Processes, run_client, wrk_argv
from harness import Bench

# Phase of a sample, by the frames on its stack (first match wins).
PHASES: list[tuple[str, tuple[str, ...]]] = [
    (
        "connect to the real server (socket, connect, wait)",
        (
            "_open (lbproxy/dataplane/connection.py",
            "_start_connect (lbproxy/dataplane/connection.py",
        ),
    ),
    ("pump: FIN passed on (shutdown)", ("_pass_fin", "send_fin")),
    ("pump: waiting for readiness (epoll_ctl, park)", ("wait_readable", "wait_writable")),
    ("pump: copy (splice/recv/send, counters)", ("Direction.move", "Direction.write_out")),
    ("pump: idle deadline (heap, ring)", ("deadlines.py", "Pump.ring")),
    (
        "pump: set-up and tear-down (reactor set, directions, closing both sockets)",
        ("Pump.__init__", "Pump.start", "Pump.close"),
    ),
    (
        "connection end (drop, histogram, access log)",
        ("_pumped (lbproxy/dataplane/connection.py", "end (lbproxy/dataplane/connection.py"),
    ),
    (
        "pump: reactor (epoll_wait(0) per batch, interest changes)",
        ("Pump.on_event", "_Reactor._run"),
    ),
    (
        "pick, take (scheduler)",
        (
            "_connect (lbproxy/dataplane/connection.py",
            "pick (lbproxy/core/pool.py",
            "take (lbproxy/core/pool.py",
        ),
    ),
    (
        # On the compiled path accept() makes the connect itself (one C call, no frame of
        # its own): its kernel time is counted here, not in the connect's phase.
        "handler (admission, ACL, the fast path's own lines and, compiled, its C connect)",
        (
            "_admit (lbproxy/dataplane/connection.py",
            "handle (lbproxy/dataplane/connection.py",
            "accept (lbproxy/dataplane/connection.py",
        ),
    ),
    ("accept loop (accept, the socket object)", ("accept_loop (lbproxy/dataplane/listener.py",)),
    ("trio: epoll_wait and event dispatch", ("get_events", "_epoll_wait", "process_events")),
    ("trio: scheduler (task switches, deadlines)", ("unrolled_run",)),
]


def _frame_name(frame: str) -> str:
    """``func (path/file.py:123)`` -> ``func (path/file.py)``."""
    return re.sub(r":\d+\)$", ")", frame)


def analyse(raw: Path, top: int = 15) -> dict[str, Any]:
    """Self-sample shares per function and per phase from py-spy's raw output."""
    own: collections.Counter[str] = collections.Counter()
    phases: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        own[_frame_name(frames[-1])] += n
        for label, needles in PHASES:
            if any(needle in stack for needle in needles):
                phases[label] += n
                break
        else:
            phases["other"] += n
    total = max(total, 1)
    return {
        "samples": total,
        "self": [(f, round(n / total, 4)) for f, n in own.most_common(top)],
        "phases": [(p, round(n / total, 4)) for p, n in phases.most_common()],
    }


def run(args: Any, procs: Processes, work: Path) -> dict[str, Any]:
    py_spy = ROOT / ".venv" / "bin" / "py-spy"
    if not py_spy.exists():
        found = shutil.which("py-spy")
        if found is None:
            raise BenchError("py-spy is not installed (.venv/bin/pip install py-spy)")
        py_spy = Path(found)
    bench = Bench(args, procs, work)
    bench.start_real_servers()
    proxy = next(p for p in bench.proxies() if p.name == "lbproxy")
    http, _ = bench.start_proxy(proxy)
    assert proxy.proc is not None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    d = args.duration
    out: dict[str, Any] = {}
    try:
        bench.wrk(http, "/small", 50, 1, close=False)  # warm-up
        for label, close in (("keepalive", False), ("newconn", True)):
            m = bench.window(proxy, lambda c=close: bench.wrk(http, "/small", 50, d, close=c))
            us = m["cpu_s"] / max(1, m.get("requests", 1)) * 1e6
            result: dict[str, Any] = {
                "rate": m["rps"],
                "util": m.get("util"),
                "cpu_us_per_request": round(us, 1),
            }
            for fmt, suffix in (("flamegraph", "svg"), ("raw", "txt")):
                target = args.out / f"profile-{label}-{stamp}.{suffix}"
                load = procs.start(
                    "wrk",
                    wrk_argv(http, "/small", 50, d + 3, close, bench.pin_load),
                    work / "wrk.log",
                )
                try:
                    time.sleep(1)
                    run_client(
                        [
                            *bench.pin_load,
                            str(py_spy),
                            "record",
                            "--pid",
                            str(proxy.proc.pid),
                            "-d",
                            str(d),
                            "-r",
                            "200",
                            "-f",
                            fmt,
                            "-o",
                            str(target),
                        ],
                        timeout=d + 60,
                    )
                finally:
                    procs.stop(load)
                result[suffix] = str(target)
            result.update(analyse(Path(result["txt"])))
            out[label] = result
            time.sleep(1)
    finally:
        bench.stop_proxy(proxy)
    for label, result in out.items():
        what = "request" if label == "keepalive" else "connection"
        print(
            f"\n{label}: {result['rate']:,.0f}/s unprofiled, proxy CPU "
            f"{result['cpu_us_per_request']} us per {what} (util {result['util']})"
        )
        print(f"  flame graph {result['svg']}")
        print("  by phase:")
        for phase, share in result["phases"]:
            print(f"    {share * 100:5.1f}%  {phase}")
        print("  top functions (self samples):")
        for frame, share in result["self"]:
            print(f"    {share * 100:5.1f}%  {frame}")
    return out
