"""The machine a benchmark runs on, and its noise: what it is, how fast its cores run
before and after, and what other processes took meanwhile (from /proc)."""

from __future__ import annotations

import collections
import contextlib
import os
import platform
import resource
import statistics
import time
from pathlib import Path
from typing import Any

from common import CLK_TCK, loadavg

PF_KTHREAD = 0x00200000


def process_ticks() -> dict[int, tuple[str, int, bool]]:
    """Every process: (name, utime + stime ticks, is a kernel thread), from /proc."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            raw = Path(f"/proc/{entry.name}/stat").read_text()
            comm = raw[raw.index("(") + 1 : raw.rindex(")")]
            fields = raw.rsplit(")", 1)[1].split()
            kthread = bool(int(fields[6]) & PF_KTHREAD)
            out[int(entry.name)] = (comm, int(fields[11]) + int(fields[12]), kthread)
    return out


def others_between(
    a: dict[int, tuple[str, int, bool]],
    b: dict[int, tuple[str, int, bool]],
    exclude: set[int],
    seconds: float,
) -> tuple[float, float, list[dict]]:
    """CPU (in cores) used between two snapshots by other user processes and by kernel
    threads (ksoftirqd, kworker: mostly network work, ours included), and the busiest
    other processes. Processes that started and ended in between are not seen."""
    users: list[dict] = []
    kernel = 0.0
    for pid, (comm, ticks, kthread) in b.items():
        if pid in exclude or pid not in a:
            continue
        used = (ticks - a[pid][1]) / CLK_TCK / seconds
        if used <= 0:
            continue
        if kthread:
            kernel += used
        else:
            users.append({"pid": pid, "comm": comm, "cpu": round(used, 3)})
    users.sort(key=lambda p: -p["cpu"])
    return sum(p["cpu"] for p in users), kernel, users


def busy_processes(sample: float = 1.0, exclude: set[int] = frozenset()) -> list[dict]:
    """Processes that used CPU during `sample` seconds (other machine load), busiest first."""
    a = process_ticks()
    time.sleep(sample)
    _, _, users = others_between(a, process_ticks(), set(exclude), sample)
    busy = []
    for p in users:
        if p["cpu"] >= 0.02:
            with contextlib.suppress(OSError):
                raw = Path(f"/proc/{p['pid']}/cmdline").read_bytes()
                p["cmd"] = raw.replace(b"\0", b" ").decode(errors="replace")[:100]
            busy.append(p)
    return busy


def cpu_loop_ms(core: int, rounds: int = 5) -> list[float]:
    """Time a fixed pure-Python loop on `core` (the machine-speed probe)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            acc = 0
            for i in range(1_000_000):
                acc ^= i * 7
            times.append((time.perf_counter() - t0) * 1000)
        return times
    finally:
        os.sched_setaffinity(0, before)


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "kernel": platform.release(),
        "mem_total_kb": int(mem),
        "hypervisor": "yes" if "hypervisor" in Path("/proc/cpuinfo").read_text() else "no",
        "nofile_limit": resource.getrlimit(resource.RLIMIT_NOFILE),
    }


def noise_probe(cores: list[int], rounds: int) -> dict[str, Any]:
    return {
        "loadavg": loadavg(),
        "cpu_loop_ms": {str(c): [round(x, 2) for x in cpu_loop_ms(c, rounds)] for c in cores},
    }


def wait_for_quiet(limit: float, threshold: float, exclude: set[int]) -> list[dict]:
    """Wait (up to `limit` s) until other processes use less than `threshold` CPUs."""
    deadline = time.monotonic() + limit
    while True:
        busy = busy_processes(2.0, exclude)
        total = sum(p["cpu"] for p in busy)
        if total < threshold or time.monotonic() >= deadline:
            return busy
        print(
            f"waiting for a quieter machine: other processes use {total:.2f} CPUs "
            f"({', '.join(p['comm'] for p in busy[:3])})",
            flush=True,
        )
        time.sleep(8)


def noise_summary(result: dict[str, Any], rounds: list[dict[str, dict]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "loadavg_before": result["noise_before"]["loadavg"],
        "loadavg_after": result["noise_after"]["loadavg"],
        "cpu_loop": {},
    }
    for core in result["noise_before"]["cpu_loop_ms"]:
        before = result["noise_before"]["cpu_loop_ms"][core]
        after = result["noise_after"]["cpu_loop_ms"][core]
        allv = before + after
        out["cpu_loop"][core] = {
            "before_ms": round(statistics.median(before), 2),
            "after_ms": round(statistics.median(after), 2),
            "spread": round((max(allv) - min(allv)) / min(allv), 3),
        }

    def collect(key: str) -> list[float]:
        return [
            m[key]
            for r in rounds
            for res in r.values()
            for m in res.values()
            if isinstance(m, dict) and m.get(key) is not None
        ]

    for key in ("others", "others_proxy_core", "kernel_threads", "steal"):
        vals = collect(key)
        out[key] = (
            {"median": round(statistics.median(vals), 3), "max": round(max(vals), 3)}
            if vals
            else None
        )
    out["repeated_measurements"] = sum(int(a) - 1 for a in collect("attempts"))
    names = collections.Counter(
        name.split(":")[0] for name in (x for top in collect("others_top") for x in top)
    )
    out["other_processes_seen"] = [name for name, _ in names.most_common(5)]
    return out


def print_noise(noise: dict[str, Any]) -> None:
    print("\nMachine noise")
    print(f"  loadavg before {noise['loadavg_before']}, after {noise['loadavg_after']}")
    for core, st in noise["cpu_loop"].items():
        print(
            f"  CPU loop on core {core}: {st['before_ms']} ms before, {st['after_ms']} ms after, "
            f"spread {st['spread'] * 100:.1f}% (max-min over min, 10 samples)"
        )
    o, k, st = noise["others"], noise["kernel_threads"], noise["steal"]
    if o:
        print(
            f"  other processes during measurements: median {o['median'] * 100:.1f}%, "
            f"max {o['max'] * 100:.1f}% of a core"
            + (f" ({', '.join(noise['other_processes_seen'])})" if o["max"] else "")
        )
        pc = noise.get("others_proxy_core")
        if pc:
            print(
                f"  unexplained load on the proxy core (short-lived processes): median "
                f"{pc['median'] * 100:.1f}%, max {pc['max'] * 100:.1f}%"
            )
        print(f"  measurements repeated because of that: {noise['repeated_measurements']}")
    if k:
        print(
            f"  kernel threads (softirq, workers): median {k['median'] * 100:.1f}%, "
            f"max {k['max'] * 100:.1f}% of a core; steal max {st['max'] * 100:.1f}%"
        )
