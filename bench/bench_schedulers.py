"""Micro-benchmark of the scheduling hot path: Pool.pick + take + drop, per scheduler.

    .venv/bin/python bench/bench_schedulers.py [--sizes 10,100,1000,10000]
                                                 [--ops 20000] [--repeat 5] [--json FILE]

For every registered scheduler (lbproxy.core.schedulers.available()) and every pool size n it
builds a real Pool from VirtualServerConfig/RealServerConfig objects (as tests/factories.py
does) and times two workloads, in nanoseconds per connection (one pick + one take + one
drop):

``short``  every connection ends before the next arrives: pick, take, drop.
``held``   2 x n connections stay open (n >= 10: at least 20) and each new connection
           replaces the oldest one (pick, take, then drop the oldest): the heap keys really
           move, as on a proxy holding long-lived connections.

The simulated clock advances 100 us per connection (10,000 connections per second), so
time-driven work (slow-start steps, least-load's load sampling every
``load_poll_interval``) runs at the rate it would on a busy proxy and its cost is
amortised over the connections, as it is in production.

Set-up per scheduler: weights 1..5 cycling (so weighted schedulers really weigh);
``least-load`` gets ``max_connections: 1000`` per server (its per-connection estimate);
``dwd`` and ``dwr`` get an ``snmp:`` block and a reported value per server (so they run
on dynamic weights, not the all-zero fallback); ``sap`` load factors 1..4 cycling.

Connections come from 4,096 client addresses in turn (passed to pick and take, as the
proxy does), so ``maglev`` hashes real keys; the other schedulers ignore them.

Each figure is the median of ``--repeat`` timed runs of ``--ops`` connections, after one
untimed warm-up run. The last columns are the ratio of the cost at the largest size to the
cost at the smallest (issue 7's goal: 10,000 real servers within 2x of 10).

Then the affinity figures (issue 14; ``--no-affinity`` skips them; CPU time of this
process, each the fastest of ``--repeat`` runs, build times the fastest of 3): the cost of a pick
alone (``Pool.pick`` with a client) for ``rr`` and ``maglev`` at 10 and 10,000 servers
(goal: maglev within 1.2x between the sizes, and no slower than rr); the time to build a
Maglev table of 65,537 slots for 10 and 10,000 servers, equal weights and weights 1..5;
the share of other servers' slots that move when one of N leaves; and what persistence
adds to a connection (rr with ``persistence:`` against rr without; every client is a
hit after the first round) and the cost of one ``Persistence.lookup``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import deque
from pathlib import Path

from common import entry, print_table, write_json

from lbproxy.config.model import (
    Address,
    HealthCheckConfig,
    PersistenceConfig,
    RealServerConfig,
    SnmpConfig,
    VirtualServerConfig,
)
from lbproxy.core import schedulers
from lbproxy.core.persistence import Persistence
from lbproxy.core.pool import Pool
from lbproxy.core.schedulers.maglev import populate

STEP = 1e-4  # simulated seconds between connections: 10,000 per second
# What the runs are timed with: wall time (perf_counter) for the per-connection table;
# the affinity figures use this process's CPU time, which other processes on a busy
# machine do not inflate (only their cache and memory traffic still shows).
_clock = time.perf_counter_ns
CLIENTS = [(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", 32768 + i) for i in range(4096)]


def build_pool(scheduler: str, n: int, **options) -> Pool:
    """A pool of `n` real servers set up so that `scheduler` runs its real algorithm."""
    dynamic = schedulers.get(scheduler).dynamic_weights
    snmp = SnmpConfig(on_no_answer="zero") if dynamic else None
    servers = tuple(
        RealServerConfig(
            name=f"rs{i}",
            address=Address("127.0.0.1", 20000 + i % 40000),
            weight=1 + i % 5,
            max_connections=1000 if scheduler == "least-load" else 0,
            load_factor=float(1 + i % 4),
            snmp=snmp,
        )
        for i in range(n)
    )
    config = VirtualServerConfig(
        name="bench",
        listen=(Address("127.0.0.1", 19999),),
        real_servers=servers,
        scheduler=scheduler,
        health_check=HealthCheckConfig(type="none"),
        snmp=snmp,
        **options,
    )
    pool = Pool(config, 0.0)
    if dynamic:
        # dwd: weight = the value; dwr: weight = max_value - value. 10..50 either way.
        for i, rs in enumerate(pool.servers):
            value = 10.0 * (1 + i % 5)
            pool.report_value(rs, value if scheduler == "dwd" else 100.0 - value, 0.0)
        assert not pool.fallback, "dynamic weights should be in use"
    return pool


def run_short(pool: Pool, ops: int, now: float) -> tuple[int, float]:
    pick, take, drop = pool.pick, pool.take, pool.drop
    clients, count = CLIENTS, len(CLIENTS)
    t0 = _clock()
    for i in range(ops):
        now += STEP
        client = clients[i % count]
        rs = pick(now, (), client)
        drop(take(rs, now, None, client), now)
    return _clock() - t0, now


def run_held(pool: Pool, ops: int, now: float, held: deque) -> tuple[int, float]:
    pick, take, drop = pool.pick, pool.take, pool.drop
    push, pop = held.append, held.popleft
    clients, count = CLIENTS, len(CLIENTS)
    t0 = _clock()
    for i in range(ops):
        now += STEP
        client = clients[i % count]
        rs = pick(now, (), client)
        push(take(rs, now, None, client))
        drop(pop(), now)
    return _clock() - t0, now


def run_picks(pool: Pool, ops: int) -> int:
    """Picks alone, at one instant (no take: nothing changes between them)."""
    pick, clients, count = pool.pick, CLIENTS, len(CLIENTS)
    t0 = _clock()
    for i in range(ops):
        pick(1.0, (), clients[i % count])
    return _clock() - t0


def fastest_ns(run, ops: int, repeat: int) -> float:
    """The fastest of `repeat` runs, per op: a figure of tens to hundreds of ns is moved
    most by other processes, and only ever upwards, so the minimum is the steadiest."""
    run()  # warm-up
    return min(run() / ops for _ in range(repeat))


def affinity(ops: int, repeat: int) -> dict[str, dict]:
    global _clock
    wall, _clock = _clock, time.process_time_ns
    try:
        return _affinity(ops, repeat)
    finally:
        _clock = wall


def _affinity(ops: int, repeat: int) -> dict[str, dict]:
    figures: dict[str, dict] = {"pick": {}, "build": {}, "moved": {}, "persistence": {}}
    for name in ("rr", "maglev"):
        for n in (10, 10000):
            pool = build_pool(name, n)
            figures["pick"][f"{name} n={n}"] = fastest_ns(
                lambda p=pool: run_picks(p, ops), ops, repeat
            )
    for n in (10, 10000):
        names = [f"rs{i}" for i in range(n)]
        for label, weights in (("equal", [1.0] * n), ("1..5", [1.0 + i % 5 for i in range(n)])):
            times = []
            for _ in range(3):
                t0 = _clock()
                populate(names, names, weights, 65537)
                times.append((_clock() - t0) / 1e9)
            figures["build"][f"n={n} {label}"] = min(times) * 1e3
    for n in (10, 100, 1000):
        names = [f"rs{i}" for i in range(n)]
        full = populate(names, names, [1.0] * n, 65537)
        worst = 0.0
        for gone in names[:5]:
            rest = [x for x in names if x != gone]
            table = populate(rest, rest, [1.0] * (n - 1), 65537)
            others = [slot for slot, owner in enumerate(full) if owner != gone]
            moved = sum(1 for slot in others if table[slot] != full[slot])
            worst = max(worst, moved / len(others))
        figures["moved"][f"n={n}"] = worst * 100
    plain = build_pool("rr", 10)
    sticky = build_pool("rr", 10, persistence=PersistenceConfig(timeout=300, max_entries=100000))
    for label, pool in (("rr", plain), ("rr + persistence", sticky)):

        def short(p=pool):
            return run_short(p, ops, 1.0)[0]

        figures["persistence"][label] = fastest_ns(short, ops, repeat)
    table = Persistence(300.0, 100000)
    for client in CLIENTS:
        table.release(table.acquire(client[0], "a", 0.0), 0.0)
    hosts = [client[0] for client in CLIENTS]

    def lookups() -> int:
        lookup = table.lookup
        t0 = _clock()
        for i in range(ops):
            lookup(hosts[i % 4096], 1.0)
        return _clock() - t0

    figures["persistence"]["Persistence.lookup (hit)"] = fastest_ns(lookups, ops, repeat)
    return figures


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def print_affinity(figures: dict[str, dict]) -> None:
    pick = figures["pick"]
    print("\naffinity figures: CPU time of this process, fastest of the runs")
    print("pick alone (Pool.pick with a client), ns:")
    for label, value in pick.items():
        print(f"  {label:<16} {value:8,.0f}")
    ratio = pick["maglev n=10000"] / pick["maglev n=10"]
    versus = max(pick[f"maglev n={n}"] / pick[f"rr n={n}"] for n in (10, 10000))
    print(
        f"  maglev 10,000 / 10: {ratio:.2f}x (goal <= 1.2x: {_met(ratio <= 1.2)});"
        f" maglev / rr at the same n, worst: {versus:.2f}x (goal <= 1: {_met(versus <= 1)})"
    )
    print("maglev table build, 65,537 slots, ms:")
    for label, value in figures["build"].items():
        print(f"  {label:<16} {value:8,.1f}")
    print("one of N servers leaves: other servers' slots that move, worst of 5, %:")
    for label, value in figures["moved"].items():
        print(f"  {label:<16} {value:8.2f}")
    print("persistence, ns per connection (pick + take + drop) and per lookup:")
    for label, value in figures["persistence"].items():
        print(f"  {label:<26} {value:8,.0f}")


def measure(scheduler: str, n: int, ops: int, repeat: int) -> dict[str, float]:
    result: dict[str, float] = {}
    # short
    pool = build_pool(scheduler, n)
    now = 1.0
    _, now = run_short(pool, ops, now)  # warm-up
    times = []
    for _ in range(repeat):
        elapsed, now = run_short(pool, ops, now)
        times.append(elapsed / ops)
    result["short"] = statistics.median(times)
    # held
    pool = build_pool(scheduler, n)
    now = 1.0
    held: deque = deque()
    for _ in range(max(20, 2 * n)):
        now += STEP
        held.append(pool.take(pool.pick(now), now))
    _, now = run_held(pool, ops, now, held)  # warm-up
    times = []
    for _ in range(repeat):
        elapsed, now = run_held(pool, ops, now, held)
        times.append(elapsed / ops)
    result["held"] = statistics.median(times)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,100,1000,10000")
    parser.add_argument("--ops", type=int, default=20000, help="connections per timed run")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs (median reported)")
    parser.add_argument("--schedulers", default="", help="comma-separated (default: all)")
    parser.add_argument("--json", dest="json_path", help="also write the figures here")
    parser.add_argument("--no-affinity", action="store_true", help="skip the maglev figures")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    names = args.schedulers.split(",") if args.schedulers else schedulers.available()

    gc.collect()
    results: dict[str, dict[int, dict[str, float]]] = {}
    for name in names:
        results[name] = {}
        for n in sizes:
            results[name][n] = measure(name, n, args.ops, args.repeat)
            gc.collect()

    lo, hi = sizes[0], sizes[-1]
    head = ["scheduler", "workload"] + [f"n={n:,}" for n in sizes] + [f"{hi:,} / {lo:,}", "goal"]
    rows = []
    for name in names:
        for workload in ("short", "held"):
            figures = [results[name][n][workload] for n in sizes]
            ratio = figures[-1] / figures[0]
            rows.append(
                [name, workload]
                + [f"{f:,.0f}" for f in figures]
                + [f"{ratio:.2f}x", "met" if ratio <= 2.0 else "NOT met"]
            )
    print(f"ns per connection (pick + take + drop); median of {args.repeat} runs of {args.ops}")
    print_table(None, head, rows, left=2)
    extra = None if args.no_affinity else affinity(args.ops, args.repeat)
    if extra is not None:
        print_affinity(extra)
    if args.json_path:
        payload = {
            "unit": "ns per connection (pick + take + drop)",
            "ops": args.ops,
            "repeat": args.repeat,
            "python": sys.version.split()[0],
            "results": {
                name: {str(n): v for n, v in per_n.items()} for name, per_n in results.items()
            },
        } | ({"affinity": extra} if extra is not None else {})
        write_json(Path(args.json_path), payload)
    return 0


if __name__ == "__main__":
    entry(main)
