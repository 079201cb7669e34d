"""The comparison's figures over rounds: medians, ranges and ratios to HAProxy, the
tables printed at the end and issue 7's goals."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from common import print_table

# --------------------------------------------------------------------- summary

# metric key -> (label, measurement, field, higher is better, format)
METRICS = [
    ("ka_rps", "keep-alive req/s", "keepalive", "rps", "{:,.0f}"),
    ("ka_p50", "keep-alive p50 ms", "keepalive", "p50_ms", "{:.2f}"),
    ("ka_p99", "keep-alive p99 ms", "keepalive", "p99_ms", "{:.2f}"),
    ("nc_rps", "new conn/s", "newconn", "rps", "{:,.0f}"),
    ("nc_p99", "new-conn p99 ms", "newconn", "p99_ms", "{:.2f}"),
    ("bulk", "bulk Gbit/s (iperf3)", "bulk", "gbps", "{:.2f}"),
    ("http1m", "1 MiB GET Gbit/s", "http1m", "gbps", "{:.2f}"),
    ("idle_kb", "kB per idle conn", "idle", "kb_per_conn", "{:.1f}"),
]
PER_CORE = [
    ("ka_rps", "keep-alive req/s per core", "keepalive", "rps", "{:,.0f}"),
    ("nc_rps", "new conn/s per core", "newconn", "rps", "{:,.0f}"),
    ("bulk", "bulk Gbit/s per core", "bulk", "gbps", "{:.2f}"),
    ("http1m", "1 MiB GET Gbit/s per core", "http1m", "gbps", "{:.2f}"),
]
COST = [
    ("ka_cost", "CPU us per keep-alive req", "keepalive", "cpu_us_per_req", "{:.1f}"),
    ("nc_cost", "CPU us per new conn", "newconn", "cpu_us_per_req", "{:.1f}"),
    ("nc_user", "user us per new conn", "newconn", "user_us_per_req", "{:.1f}"),
    ("nc_sys", "system us per new conn", "newconn", "sys_us_per_req", "{:.1f}"),
    ("bulk_cost", "CPU s per GB (bulk)", "bulk", "cpu_s_per_gb", "{:.2f}"),
]
UTIL = [
    ("keepalive", "keep-alive"),
    ("newconn", "new-conn"),
    ("bulk", "bulk"),
    ("http1m", "1 MiB GET"),
]


def value(run: dict, meas: str, field: str, per_core: bool = False) -> float | None:
    m = run.get(meas)
    if not m or m.get(field) is None:
        return None
    v = m[field]
    if per_core:
        util = m.get("util")
        if not util or util < 0.02:
            return None
        v = v / util
    return v


def summarize(rounds: list[dict[str, dict]], names: list[str]) -> dict[str, Any]:
    """Median and range over rounds of each figure, and per-round ratios to HAProxy."""
    summary: dict[str, Any] = {}
    for name in names:
        s: dict[str, Any] = {}
        for key, _, meas, field, _ in METRICS:
            vals = [
                v for r in rounds if name in r if (v := value(r[name], meas, field)) is not None
            ]
            s[key] = _stats(vals)
        for key, _, meas, field, _ in PER_CORE:
            vals = [
                v
                for r in rounds
                if name in r
                if (v := value(r[name], meas, field, True)) is not None
            ]
            s[key + "_per_core"] = _stats(vals)
        for key, _, meas, field, _ in COST:
            vals = [
                v for r in rounds if name in r if (v := value(r[name], meas, field)) is not None
            ]
            s[key] = _stats(vals)
        for meas, _ in UTIL:
            vals = [
                r[name][meas]["util"]
                for r in rounds
                if name in r and meas in r[name] and "util" in r[name][meas]
            ]
            s[meas + "_util"] = _stats(vals)
        # ratios to HAProxy, computed within each round, then summarised
        for base in ("haproxy", "haproxy-splice"):
            for key, _, meas, field, _ in METRICS:
                for per_core in (False, True):
                    ratios = []
                    for r in rounds:
                        if name in r and base in r:
                            a = value(r[name], meas, field, per_core)
                            b = value(r[base], meas, field, per_core)
                            if a is not None and b:
                                ratios.append(a / b)
                    s[f"{key}{'_per_core' if per_core else ''}_vs_{base}"] = _stats(ratios)
        summary[name] = s
    return summary


def _stats(vals: list[float]) -> dict[str, float] | None:
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def _fmt(st: dict | None, fmt: str, ranges: bool) -> str:
    if not st:
        return "-"
    text = fmt.format(st["median"])
    if ranges and st["n"] > 1 and st["min"] != st["max"]:
        text += f" ({fmt.format(st['min'])}–{fmt.format(st['max'])})"
    return text


def report(
    summary: dict[str, Any], names: list[str], ranges: bool, scheds: dict | None = None
) -> dict[str, Any]:
    print_table(
        "Absolute figures (median over rounds; range in brackets)",
        ["proxy", *[label for _, label, *_ in METRICS]],
        [[n, *[_fmt(summary[n][k], f, ranges) for k, _, _, _, f in METRICS]] for n in names],
    )
    print_table(
        "Per proxy core (figure / proxy CPU utilisation)",
        ["proxy", *[label for _, label, *_ in PER_CORE]],
        [
            [n, *[_fmt(summary[n][k + "_per_core"], f, ranges) for k, _, _, _, f in PER_CORE]]
            for n in names
            if n != "direct"
        ],
    )
    print_table(
        "Proxy CPU: utilisation of its core during each measurement, and cost per unit",
        ["proxy", *[f"util {u}" for _, u in UTIL], *[label for _, label, *_ in COST]],
        [
            [
                n,
                *[_fmt(summary[n][m + "_util"], "{:.2f}", ranges) for m, _ in UTIL],
                *[_fmt(summary[n][k], f, ranges) for k, _, _, _, f in COST],
            ]
            for n in names
            if n != "direct"
        ],
    )
    base = "haproxy"
    if any(summary[n].get(f"ka_rps_vs_{base}") for n in names):
        cols = [
            ("ka_rps", "keep-alive"),
            ("ka_rps_per_core", "keep-alive/core"),
            ("nc_rps", "new conn"),
            ("nc_rps_per_core", "new conn/core"),
            ("bulk", "bulk"),
            ("bulk_per_core", "bulk/core"),
            ("http1m", "1 MiB GET"),
            ("idle_kb", "idle kB"),
        ]
        print_table(
            "Ratios to HAProxy (mode tcp, nbthread 1) in the same round",
            ["proxy", *[c for _, c in cols]],
            [
                [n, *[_fmt(summary[n].get(f"{k}_vs_{base}"), "{:.2f}", ranges) for k, _ in cols]]
                for n in names
                if n != "direct"
            ],
        )
    goals = goals_for(summary, scheds)
    if goals:
        print_table(
            "Issue 7 goals (lbproxy)",
            ["goal", "measured", "met"],
            [[g["goal"], g["measured"], "yes" if g["met"] else "NO"] for g in goals],
        )
    return {"goals": goals}


def goals_for(summary: dict[str, Any], scheds: dict | None = None) -> list[dict[str, Any]]:
    lb = summary.get("lbproxy")
    goals: list[dict[str, Any]] = []
    if scheds:
        worst = (0.0, "")
        for name, per_n in scheds["results"].items():
            sizes = sorted(per_n, key=int)
            for wl in ("short", "held"):
                ratio = per_n[sizes[-1]][wl] / per_n[sizes[0]][wl]
                worst = max(worst, (ratio, f"{name} {wl}"))
        goals.append(
            {
                "goal": f"scheduler at n={int(sizes[-1]):,} within 2x of n={int(sizes[0]):,}",
                "measured": f"worst {worst[0]:.2f}x ({worst[1]})",
                "value": worst[0],
                "met": worst[0] <= 2.0,
            }
        )
    if not lb:
        return goals

    def add(goal: str, st: dict | None, ok: Callable[[float], bool], fmt: str) -> None:
        if st:
            goals.append(
                {
                    "goal": goal,
                    "measured": fmt.format(st["median"]),
                    "value": st["median"],
                    "met": ok(st["median"]),
                }
            )

    add(
        "bulk >= 0.9x HAProxy with splice (iperf3)",
        lb.get("bulk_vs_haproxy-splice"),
        lambda v: v >= 0.9,
        "{:.2f}x",
    )
    add(
        "keep-alive req/s >= 0.6x HAProxy",
        lb.get("ka_rps_vs_haproxy"),
        lambda v: v >= 0.6,
        "{:.2f}x",
    )
    add(
        "new conn/s per core >= 0.5x HAProxy",
        lb.get("nc_rps_per_core_vs_haproxy"),
        lambda v: v >= 0.5,
        "{:.2f}x",
    )
    add("<= 5 kB per idle connection", lb.get("idle_kb"), lambda v: v <= 5, "{:.1f} kB")
    return goals


def print_schedulers(data: dict[str, Any] | None) -> None:
    if not data:
        return
    rows = []
    sizes = None
    for name, per_n in data["results"].items():
        sizes = sorted(per_n, key=int)
        for wl in ("short", "held"):
            f = [per_n[n][wl] for n in sizes]
            ratio = f[-1] / f[0]
            rows.append(
                [
                    name,
                    wl,
                    *[f"{x:,.0f}" for x in f],
                    f"{ratio:.2f}x",
                    "yes" if ratio <= 2 else "NO",
                ]
            )
    assert sizes is not None
    print_table(
        "Scheduler: ns per connection (pick + take + drop)",
        [
            "scheduler",
            "workload",
            *[f"n={int(n):,}" for n in sizes],
            f"{int(sizes[-1]):,} / {int(sizes[0]):,}",
            "<= 2x",
        ],
        rows,
        left=2,
    )
