"""Where a new connection's CPU goes: ``scripts/bench --syscalls`` (issue 15).

For each proxy (default lbproxy and HAProxy, ``nbthread 1``), with the same real server,
configuration and cores as the benchmark, under the same new-connection load (wrk,
``Connection: close``: every request is a new TCP connection through the proxy):

1. without any tracer: new connections per second, the proxy's utilisation of its core,
   and its CPU per connection split into **user** and **system** time (utime and stime
   of all its threads, from /proc/PID/stat, over the whole measurement, divided by the
   requests wrk completed); repeated ``--rounds`` times, proxies alternating;
2. under ``strace -c -f -p PID`` (attached to the running proxy, all threads): the
   number of system calls of each name per connection, the divisor being the number of
   connections the proxy *accepted* while traced (successful ``accept``/``accept4``
   calls, an exact count, not wrk's estimate). strace slows the proxy a lot; the counts
   per connection, not the rates, are what this measures.

These two figures are robust to other load on the machine (CPU time is charged to the
process that used it, and a count of calls does not depend on speed), unlike the rates:
the load average is printed with every figure so a reader can judge the rest.
strace comes from Debian (``apt-get install strace``); scripts/bench installs it as
root when ``--syscalls`` is given.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from common import (
    BenchError,
    Processes,
    attached,
    loadavg,
    parse_strace_summary,
    print_table,
    save_result,
)
from harness import Bench, traced_bench
from peers import Proxy, tool_versions

#: wrk connections for the new-connection load (issue 15 measured with -c20).
CONNS = 20


def traced(bench: Bench, proxy: Proxy, port: int, seconds: float, work: Path) -> dict:
    """System calls by name per accepted connection, under new-connection load."""
    assert proxy.proc is not None
    target = work / f"strace-{proxy.name}.txt"
    strace = ["strace", "-c", "-f", "-q", "-o", str(target), "-p", str(proxy.proc.pid)]
    with attached(strace, settle=1.0):  # 1 s: attached to every thread
        load = bench.wrk(port, "/small", CONNS, seconds, close=True)
    calls = parse_strace_summary(target.read_text())
    accepted = sum(
        c["calls"] - c["errors"] for name, c in calls.items() if name in ("accept", "accept4")
    )
    if not accepted:
        raise BenchError(f"{proxy.name}: no accepted connection seen by strace")
    per_conn = {
        name: {
            "calls": round(c["calls"] / accepted, 2),
            "errors": round(c["errors"] / accepted, 2),
        }
        for name, c in calls.items()
    }
    return {
        "accepted": accepted,
        "wrk_requests": load.get("requests"),
        "per_conn": per_conn,
        "total_per_conn": round(sum(c["calls"] for c in calls.values()) / accepted, 2),
        "loadavg": loadavg(),
    }


def untraced(bench: Bench, proxy: Proxy, port: int, seconds: float, conns: int = CONNS) -> dict:
    """New conn/s and CPU per connection, user and system, without a tracer."""
    m = bench.measured(proxy, lambda: bench.wrk(port, "/small", conns, seconds, close=True))
    n = max(1, m.get("requests") or 1)
    util = m.get("util") or 0.0
    return {
        "rps": m["rps"],
        "p99_ms": m.get("p99_ms"),
        "util": util,
        "per_core": round(m["rps"] / util) if util > 0.02 else None,
        "user_us": round(m["cpu_user_s"] / n * 1e6, 1),
        "sys_us": round(m["cpu_sys_s"] / n * 1e6, 1),
        "cpu_us": round(m["cpu_s"] / n * 1e6, 1),
        "others": m.get("others"),
        "loadavg": loadavg(),
    }


def run(args: Any, procs: Processes, work: Path) -> dict[str, Any]:
    bench, proxies = traced_bench(args, procs, work, "strace", "strace")
    d = args.duration
    out: dict[str, Any] = {p.name: {"runs": [], "strace": []} for p in proxies}
    for r in range(args.rounds):
        order = proxies if r % 2 == 0 else list(reversed(proxies))
        for proxy in order:
            print(f"round {r + 1}/{args.rounds}: {proxy.name} ...", flush=True)
            http, _ = bench.start_proxy(proxy)
            try:
                bench.wrk(http, "/small", CONNS, 1, close=True)  # warm-up
                out[proxy.name]["runs"].append(untraced(bench, proxy, http, d))
                out[proxy.name]["strace"].append(traced(bench, proxy, http, d, work))
            finally:
                bench.stop_proxy(proxy)
    report(out)
    save_result(args.out, "syscalls", {"versions": tool_versions(), "conns": CONNS, "results": out})
    return out


def _median(vals: list[float | None]) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def _range(vals: list[float], fmt: str) -> str:
    text = fmt.format(statistics.median(vals))
    if len(vals) > 1:
        text += f" ({fmt.format(min(vals))}–{fmt.format(max(vals))})"
    return text


def report(out: dict[str, Any]) -> None:
    names = list(out)
    rows = []
    for name in names:
        runs, traces = out[name]["runs"], out[name]["strace"]
        if not runs:
            continue
        loads = [r["loadavg"][0] for r in runs]
        rows.append(
            [
                name,
                _range([r["rps"] for r in runs], "{:,.0f}"),
                _range([r["per_core"] or 0 for r in runs], "{:,.0f}"),
                _range([r["p99_ms"] or 0 for r in runs], "{:.1f}"),
                _range([r["user_us"] for r in runs], "{:.1f}"),
                _range([r["sys_us"] for r in runs], "{:.1f}"),
                _range([t["total_per_conn"] for t in traces], "{:.1f}"),
                _range(loads, "{:.1f}"),
            ]
        )
    print_table(
        f"New connections (wrk -c{CONNS}, Connection: close; median (min–max) of rounds)",
        [
            "proxy",
            "new conn/s",
            "per proxy core",
            "p99 ms",
            "user us/conn",
            "system us/conn",
            "syscalls/conn",
            "loadavg 1m",
        ],
        rows,
    )
    per_name: dict[str, dict[str, float]] = {}
    for name in names:
        traces = out[name]["strace"]
        for call in {c for t in traces for c in t["per_conn"]}:
            v = _median([t["per_conn"].get(call, {}).get("calls", 0.0) for t in traces])
            per_name.setdefault(call, {})[name] = v or 0.0
    first = names[0]
    calls = sorted(per_name, key=lambda c: (-per_name[c].get(first, 0.0), c))
    rows = [
        [c, *[f"{per_name[c].get(n, 0.0):.2f}" for n in names]]
        for c in calls
        if max(per_name[c].values()) >= 0.01
    ]
    totals = [_median([t["total_per_conn"] for t in out[n]["strace"]]) or 0.0 for n in names]
    rows.append(["total", *[f"{v:.2f}" for v in totals]])
    print_table(
        "System calls per accepted connection (strace -c -f -p PID; median of rounds)",
        ["syscall", *names],
        rows,
    )
