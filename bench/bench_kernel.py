"""Where a proxy's system time goes: ``scripts/bench --kernel`` (issue 26; not a test).

For each proxy (default lbproxy and HAProxy) under the new-connection load of
``scripts/bench --syscalls`` (wrk, ``Connection: close``, ``--conns`` at a time; several
values, e.g. ``--conns 2,20``, compare a light load with a saturating one):

1. without a profiler: connections per second per proxy core and the CPU per connection,
   user and system (utime, stime from /proc/PID/stat, as ``--syscalls``);
2. under ``perf record -g`` (Linux perf, kernel and user stacks, attached to the proxy):
   the share of the samples in user space and in the kernel, and the kernel's time by
   system call (the inclusive time of each ``__x64_sys_*`` entry) and in
   ``sock_def_readable`` -- waking whoever waits on a socket the call made readable: on
   loopback a proxy's ``connect`` and ``send`` run the peer's receive path, and wake the
   real server or the client on the other core. Each share times the CPU per connection
   of the profiled window gives microseconds per connection.

perf samples with a timer (2,999 Hz): the shares, not the rates, are what it measures.
In a VM without a PMU, interrupts-off code is charged to where interrupts come back on
(``_raw_spin_unlock_irqrestore``), which is why the wake-up is read inclusively from
``sock_def_readable`` and not from the function where the samples land. perf comes from
Debian (``apt-get install linux-perf``).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

from bench_syscalls import untraced
from common import Processes, attached, save_result
from harness import Bench, traced_bench
from peers import Proxy, tool_versions

#: Kernel functions read inclusively (perf report --children), by the row they give.
ENTRIES = {
    "connect": "__x64_sys_connect",
    "close": "__x64_sys_close",
    "sendto": "__x64_sys_sendto",
    "writev (nginx's sends)": "do_writev",
    "tcp_sendmsg (every send, whatever call)": "tcp_sendmsg",
    "recvfrom": "__x64_sys_recvfrom",
    "epoll_wait": "__x64_sys_epoll_wait",
    "epoll_ctl": "__x64_sys_epoll_ctl",
    "accept4": "__x64_sys_accept4",
    "of which waking a peer (sock_def_readable)": "sock_def_readable",
}


def perf_shares(data: Path) -> dict[str, float]:
    """Inclusive shares (0-1) of ENTRIES and of user space in one perf.data file."""
    report = subprocess.run(
        ["perf", "report", "-i", str(data), "--children", "--sort", "sym", "--stdio", "-g", "none"],
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    shares: dict[str, float] = {}
    for line in report.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+[\d.]+%\s+\[k\]\s+(\S+)", line)
        if m:
            for row, symbol in ENTRIES.items():
                if m.group(2) == symbol:
                    shares[row] = float(m.group(1)) / 100
    dsos = subprocess.run(
        [
            "perf",
            "report",
            "-i",
            str(data),
            "--no-children",
            "--sort",
            "dso",
            "--stdio",
            "-g",
            "none",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    kernel = 0.0
    for line in dsos.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+\[kernel", line)
        if m:
            kernel += float(m.group(1)) / 100
    shares["user space"] = 1 - kernel
    shares["kernel"] = kernel
    return shares


def profiled(bench: Bench, proxy: Proxy, port: int, conns: int, seconds: float, work: Path) -> dict:
    assert proxy.proc is not None
    data = work / f"perf-{proxy.name}-{conns}.data"

    perf = ["perf", "record", "-F", "2999", "-g", "-o", str(data), "-p", str(proxy.proc.pid)]

    def body() -> dict[str, Any]:
        with attached(perf, settle=0.5, timeout=60):
            return bench.wrk(port, "/small", conns, seconds, close=True)

    m = bench.window(proxy, body)
    n = max(1, m.get("requests") or 1)
    cpu_us = m["cpu_s"] / n * 1e6
    shares = perf_shares(data)
    return {
        "cpu_us": round(cpu_us, 1),
        "us": {row: round(share * cpu_us, 2) for row, share in shares.items()},
    }


def run(args: Any, procs: Processes, work: Path) -> dict[str, Any]:
    bench, proxies = traced_bench(args, procs, work, "perf", "linux-perf")
    out: dict[str, Any] = {}
    for conns in args.conns:
        for proxy in proxies:
            key = f"{proxy.name} -c{conns}"
            print(f"{key} ...", flush=True)
            http, _ = bench.start_proxy(proxy)
            try:
                bench.wrk(http, "/small", conns, 1, close=True)  # warm-up
                out[key] = untraced(bench, proxy, http, args.duration, conns)
                out[key]["perf"] = profiled(bench, proxy, http, conns, args.duration, work)
            finally:
                bench.stop_proxy(proxy)
    report(out)
    save_result(args.out, "kernel", {"versions": tool_versions(), "results": out})
    return out


def report(out: dict[str, Any]) -> None:
    keys = list(out)
    width = max(12, *(len(k) for k in keys))
    print("\nper new connection, microseconds of CPU (perf's shares x the profiled CPU)")
    print(f"{'':44}" + "".join(f"{k:>{width + 2}}" for k in keys))

    def row(label: str, values: list[Any]) -> None:
        print(f"{label:44}" + "".join(f"{'-' if v is None else v:>{width + 2}}" for v in values))

    row("connections/s per proxy core", [out[k]["per_core"] for k in keys])
    row(
        "user / system CPU, unprofiled (us)",
        [f"{out[k]['user_us']} / {out[k]['sys_us']}" for k in keys],
    )
    row("CPU while profiled (us)", [out[k]["perf"]["cpu_us"] for k in keys])
    for label in ["user space", "kernel", *ENTRIES]:
        row(f"  {label}", [out[k]["perf"]["us"].get(label) for k in keys])
