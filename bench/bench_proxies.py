"""lbproxy against HAProxy and nginx stream, in one run, on the same cores (issue 7).

Started by ``scripts/bench`` (which installs the peers and the virtual environment);
``scripts/bench --help`` lists the options. Python standard library only: the proxies,
the real servers and the load generators are separate processes, and this one only
starts them, reads /proc and prints.

What runs where (two cores; ``--load-core``/``--proxy-core`` change it):

    core 0   wrk and iperf3 clients (load), nginx HTTP and iperf3 servers (real
             servers), and this script (asleep while a measurement runs)
    core 1   the proxy under test: lbproxy, HAProxy, HAProxy + splice, nginx stream

Every proxy forwards one TCP port to one real server (lbproxy: ``scheduler: rr``, admin
off, no health check; HAProxy: ``mode tcp``, ``nbthread 1``; nginx: one ``stream``
``proxy_pass``) and is measured in turn, while the same real servers keep running:

keep-alive   wrk, 1 thread, 50 connections, a small body, for ``--duration`` seconds:
             requests/s and the p50/p99 latency wrk reports.
new-conn     the same with ``Connection: close``: every request is a new TCP connection
             through the proxy (accept, pick, connect, two closes).
bulk         iperf3 through the proxy, one stream, client -> server, Gbit/s.
http-1m      wrk, 4 connections, GET of a 1 MiB file (keep-alive): Gbit/s of body.
idle         N connections opened and held idle through the proxy (each also connected
             on to the real server); RSS of the proxy after minus before, / N, from
             /proc/PID/status VmRSS. User-space memory only: kernel socket buffers are
             not in RSS (they are the same for every proxy).

For every measurement the proxy's CPU time (utime + stime from /proc/PID/stat, all its
threads) is read before and after: ``util`` = CPU-seconds / wall-seconds, and a figure
"per core" = figure / util, what one fully busy proxy core would do at the same
efficiency. When the load core is the bottleneck (a fast proxy idles part of the time)
the absolute figures of two proxies are close and the per-core figures tell them apart.

Noise is recorded, not hidden: a fixed CPU loop timed on each core before and after the
run (its spread is how much the machine's speed moved), the load average, the steal time,
and the CPU time other processes took on the proxy core during each measurement
(``others``: CPU time of every other user process, from /proc; a measurement
during which they took more than 10 % of a core is repeated, up to twice).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    ROOT,
    BenchError,
    Processes,
    can_pin,
    entry,
    run_client,
    save_result,
    taskset,
    time_limit,
)
from harness import Bench
from noise import (
    busy_processes,
    machine,
    noise_probe,
    noise_summary,
    print_noise,
    wait_for_quiet,
)
from peers import tool_versions
from summary import print_schedulers, report, summarize

PROXIES_DEFAULT = "lbproxy,haproxy,haproxy-splice,nginx,direct"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/bench",
        description="lbproxy against HAProxy and nginx stream on loopback, in one run.",
        epilog="The other benchmarks, each with its own options (scripts/bench SUB --help;"
        " bench/README.md): --locator, --udp, --cluster, --sni, --upgrade, --workers,"
        " --worker-queue, --schedulers, --discovery, --handler, --instructions, --reactor,"
        " --pump-lifecycle, --pump, --syscall-choices, --udp-session, --floor decisions|c-only.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="short run: 2 s per measurement, 500 idle connections, 2 scheduler sizes",
    )
    p.add_argument("--duration", type=int, help="seconds per measurement (default 5)")
    p.add_argument("--idle-conns", type=int, help="idle connections held (default 2000)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every proxy this many times, order rotated (default 1)",
    )
    p.add_argument(
        "--proxies",
        default=PROXIES_DEFAULT,
        help="comma-separated subset (default: all five; direct = no proxy)",
    )
    p.add_argument("--load-core", type=int, default=0)
    p.add_argument("--proxy-core", type=int, default=1)
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not use taskset")
    p.add_argument(
        "--lbproxy-root",
        type=Path,
        default=ROOT,
        help="run lbproxy from this source tree (default: this checkout)",
    )
    p.add_argument(
        "--lbproxy-extra",
        default="",
        metavar="YAML",
        help="keys added to each lbproxy virtual server, as flow YAML on one line, e.g."
        " 'per_source: {max_connections: 100000}' (to measure what a feature costs)",
    )
    p.add_argument(
        "--no-schedulers",
        dest="schedulers",
        action="store_false",
        help="skip bench/bench_schedulers.py",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0,
        help="first wait up to this many seconds for other processes to calm down",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "bench-results",
        help="folder for the JSON result (default bench-results/)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work folder (configs, logs)")
    p.add_argument(
        "--max-others",
        type=float,
        default=0.10,
        help="a measurement during which other processes used more than this share of a"
        " core is repeated (default 0.10)",
    )
    p.add_argument("--retries", type=int, default=2, help="repeats of a noisy measurement")
    p.add_argument("--max-time", type=int, default=1200, help="hard limit for the run, seconds")
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead of the comparison: profile lbproxy with py-spy (bench/bench_profile.py)",
    )
    p.add_argument(
        "--syscalls",
        action="store_true",
        help="instead of the comparison: CPU per new connection split into user and system"
        " time, and system calls per connection by name under strace"
        " (bench/bench_syscalls.py; default proxies lbproxy,haproxy)",
    )
    p.add_argument(
        "--sequence",
        action="store_true",
        help="with --syscalls: each proxy's system calls for one new connection, in order,"
        " with their sockets and arguments (bench/bench_sequence.py; default proxies"
        " lbproxy,haproxy,nginx)",
    )
    p.add_argument(
        "--kernel",
        action="store_true",
        help="instead of the comparison: where the system time of a new connection goes,"
        " by system call and in waking the peers, from perf (bench/bench_kernel.py;"
        " default proxies lbproxy,haproxy)",
    )
    p.add_argument(
        "--conns",
        default="20",
        help="--kernel: wrk connections at a time, comma-separated (default 20)",
    )
    a = p.parse_args(argv)
    a.conns = [int(x) for x in a.conns.split(",") if x]
    if a.kernel and a.proxies == PROXIES_DEFAULT:
        a.proxies = "lbproxy,haproxy"
    if a.sequence and a.proxies == PROXIES_DEFAULT:
        a.proxies = "lbproxy,haproxy,nginx"
    if a.syscalls and a.proxies == PROXIES_DEFAULT:
        a.proxies = "lbproxy,haproxy"
    if a.duration is None:
        a.duration = 2 if a.quick else 5
    if a.idle_conns is None:
        a.idle_conns = 500 if a.quick else 2000
    a.proxies = [x for x in a.proxies.split(",") if x]
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not sys.platform.startswith("linux"):
        print("scripts/bench reads /proc and uses taskset: Linux only", file=sys.stderr)
        return 2
    for tool in ("wrk", "iperf3", "nginx"):
        if shutil.which(tool) is None:
            print(
                f"scripts/bench needs {tool} (apt-get install haproxy nginx "
                "libnginx-mod-stream wrk iperf3; scripts/bench does it as root)",
                file=sys.stderr,
            )
            return 2
    if args.pin and not can_pin({args.load_core, args.proxy_core}):
        print("note: cannot pin to the requested cores; running unpinned")
        args.pin = False
    # Hold N idle connections (+ the proxy's 2N): raise the soft descriptor limit to
    # the hard one; children inherit it.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < 2 * args.idle_conns + 200:
        args.idle_conns = max(100, (hard - 200) // 2)
        print(f"note: descriptor limit {hard}: holding only {args.idle_conns} idle connections")

    # SIGTERM and SIGHUP end the run like Ctrl-C: the finally below stops every child.
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)
    started = dt.datetime.now()
    procs = Processes()
    work = Path(tempfile.mkdtemp(prefix="lbproxy-bench-"))
    result: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": tool_versions(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    cores = sorted({args.load_core, args.proxy_core})
    interrupted = False
    rounds: list[dict[str, dict]] = []
    try:
        with time_limit(args.max_time):
            busy = (
                wait_for_quiet(args.wait_quiet, 0.3, {os.getpid()})
                if args.wait_quiet
                else busy_processes(1.0, {os.getpid()})
            )
            result["other_processes_before"] = busy[:8]
            result["noise_before"] = noise_probe(cores, 5)
            if args.pin:  # this script sleeps on the load core, away from the proxy
                os.sched_setaffinity(0, {args.load_core})
            if args.profile:
                import bench_profile

                bench_profile.run(args, procs, work)
                return 0
            if args.kernel:
                import bench_kernel

                bench_kernel.run(args, procs, work)
                return 0
            if args.sequence:
                import bench_sequence

                bench_sequence.run(args, procs, work)
                return 0
            if args.syscalls:
                import bench_syscalls

                bench_syscalls.run(args, procs, work)
                return 0
            bench = Bench(args, procs, work)
            bench.start_real_servers()
            proxies = bench.proxies()
            names = [p.name for p in proxies]
            for r in range(args.rounds):
                order = proxies[r % len(proxies) :] + proxies[: r % len(proxies)]
                rounds.append({})
                for proxy in order:
                    label = f"round {r + 1}/{args.rounds}: {proxy.name}"
                    print(f"{label} ...", flush=True)
                    t0 = time.monotonic()
                    try:
                        rounds[-1][proxy.name] = bench.measure(proxy)
                    except BenchError as exc:
                        print(f"  {proxy.name} failed: {exc}")
                        rounds[-1][proxy.name] = {"error": str(exc)}
                    print(f"  done in {time.monotonic() - t0:.0f}s", flush=True)
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
            result["noise_after"] = noise_probe(cores, 5)
            result["other_processes_after"] = busy_processes(1.0, {os.getpid()})[:8]
            if args.schedulers:
                result["schedulers"] = run_scheduler_bench(args, work)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: stopping every process this run started")
    finally:
        procs.stop_all()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work folder kept: {work}")
    if interrupted or not rounds:
        return 130 if interrupted else 1

    result["rounds"] = rounds
    result["summary"] = summarize(rounds, names)
    result.update(
        report(result["summary"], names, ranges=args.rounds > 1, scheds=result.get("schedulers"))
    )
    result["noise"] = noise_summary(result, rounds)
    print_noise(result["noise"])
    if "schedulers" in result:
        print_schedulers(result["schedulers"])
    result["finished"] = dt.datetime.now().isoformat(timespec="seconds")
    save_result(args.out, "bench", result, started)
    return 0


def run_scheduler_bench(args: argparse.Namespace, work: Path) -> dict[str, Any] | None:
    out = work / "schedulers.json"
    argv = [
        str(ROOT / ".venv" / "bin" / "python"),
        str(ROOT / "bench" / "bench_schedulers.py"),
        "--json",
        str(out),
    ]
    argv += (
        ["--sizes", "10,10000", "--ops", "3000", "--repeat", "3"]
        if args.quick
        else ["--ops", "5000", "--repeat", "3"]
    )
    if args.pin:
        argv = [*taskset(args.proxy_core), *argv]
    print("scheduler micro-benchmark ...", flush=True)
    try:
        run_client(argv, timeout=300)
    except BenchError as exc:
        print(f"  failed: {exc}")
        return None
    return json.loads(out.read_text())


if __name__ == "__main__":
    entry(main)
