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
import collections
import contextlib
import datetime as dt
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024

SMALL_BODY = b"lbproxy bench: a small response body of 64 bytes.".ljust(63, b".") + b"\n"
assert len(SMALL_BODY) == 64
BIG_SIZE = 1 << 20


class BenchError(Exception):
    """Something the run cannot go on without (a peer that does not start, ...)."""


# --------------------------------------------------------------------- processes


class Processes:
    """Every process this run started, stopped by PID in reverse order, whatever happens.

    Each child gets its own session (``start_new_session``), so a Ctrl-C in the terminal
    reaches this script only; the ``finally`` around the run then stops the children
    itself: SIGTERM, up to 5 s, then SIGKILL. Nothing is ever stopped by name.
    """

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], log: Path, **kwargs: Any) -> subprocess.Popen:
        out = log.open("wb")
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **kwargs,
            )
        except OSError as exc:
            raise BenchError(f"cannot start {name}: {exc}") from None
        finally:
            out.close()
        self.procs.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen, timeout: float = 5.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(5)
        self.procs = [(n, p) for n, p in self.procs if p is not proc]

    def stop_all(self) -> None:
        for _, proc in reversed(list(self.procs)):
            with contextlib.suppress(Exception):
                self.stop(proc)


@contextlib.contextmanager
def attached(argv: list[str], settle: float, timeout: float = 30.0) -> Iterator[None]:
    """Run a tracer or profiler that attaches to a process (strace -p, perf record -p)
    around the block: started, given `settle` seconds to attach, then SIGINT (detach
    and write its output), waited for up to `timeout` seconds, killed if it hangs."""
    tracer = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        time.sleep(settle)
        yield
    finally:
        tracer.send_signal(signal.SIGINT)
        try:
            tracer.wait(timeout)
        except subprocess.TimeoutExpired:
            tracer.kill()
            tracer.wait(5)


def traced_bench(
    args: argparse.Namespace, procs: Processes, work: Path, tool: str, package: str
) -> tuple[Bench, list[Proxy]]:
    """The set-up of a run under a tracer (--syscalls: strace, --kernel: perf): the tool
    is installed, the real servers run; the proxies that are installed."""
    if shutil.which(tool) is None:
        raise BenchError(f"{tool} is not installed (apt-get install {package})")
    bench = Bench(args, procs, work)
    bench.start_real_servers()
    return bench, [p for p in bench.proxies() if p.argv is not None]


def run_client(argv: list[str], timeout: float) -> str:
    """Run a load generator to completion (bounded) and return its standard output."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait(5)
        raise
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise BenchError(f"{argv[0]} exited with {proc.returncode}: {text.strip()[-400:]}")
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"exited with {proc.returncode}: {_tail(log)}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise BenchError(f"port {port} not open after {timeout}s: {_tail(log)}")


def _tail(path: Path, n: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip() or "(no output)"
    except OSError:
        return "(no log)"


# --------------------------------------------------------------------------- /proc


def cpu_ticks(pids: list[int]) -> int:
    return sum(cpu_split(pids))


def cpu_split(pids: list[int]) -> tuple[int, int]:
    """(user, system) CPU ticks of `pids`, all threads, from /proc/PID/stat."""
    user = system = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            user += int(fields[11])  # utime
            system += int(fields[12])  # stime
    return user, system


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise BenchError(f"no VmRSS for pid {pid}")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_times() -> dict[int, dict[str, int]]:
    """Per CPU, jiffies since boot from /proc/stat: task time (user, nice, system),
    interrupt time (irq, softirq: mostly the loopback network stack, not charged to any
    process in /proc/PID/stat when the kernel accounts IRQ time separately), steal, total.
    """
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3].isdigit():
            name, *vals = line.split()
            v = [int(x) for x in vals]
            out[int(name[3:])] = {
                "task": v[0] + v[1] + v[2],
                "irq": v[5] + v[6],
                "steal": v[7],
                "total": sum(v[:8]),  # guest time is already counted in user
            }
    return out


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


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


# ------------------------------------------------------------------------- peers


def tool_versions() -> dict[str, str]:
    def first_line(argv: list[str]) -> str:
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
            return (out.stdout + out.stderr).strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "missing"

    rev = first_line(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    dirty = first_line(["git", "-C", str(ROOT), "status", "--porcelain", "--", "lbproxy"])
    return {
        "haproxy": first_line(["haproxy", "-v"]),
        "nginx": first_line(["nginx", "-v"]),
        "wrk": first_line(["wrk", "--version"]),
        "iperf3": first_line(["iperf3", "--version"]),
        "python": sys.version.split()[0],
        "lbproxy_git": rev + (" (lbproxy/ modified)" if dirty not in ("missing", "") else ""),
    }


NGINX_STREAM_MODULE = "/usr/lib/nginx/modules/ngx_stream_module.so"


def nginx_http_conf(work: Path, port: int) -> str:
    www = work / "www"
    www.mkdir(exist_ok=True)
    (www / "small").write_bytes(SMALL_BODY)
    (www / "1m").write_bytes(os.urandom(BIG_SIZE))
    t = work / "nginx-http"
    t.mkdir(exist_ok=True)
    return f"""
daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile 30000;
pid {t}/nginx.pid;
error_log {t}/error.log warn;
events {{ worker_connections 12000; }}
http {{
    access_log off;
    client_body_temp_path {t}/body; proxy_temp_path {t}/proxy;
    fastcgi_temp_path {t}/fastcgi; uwsgi_temp_path {t}/uwsgi; scgi_temp_path {t}/scgi;
    default_type application/octet-stream;
    sendfile on;
    tcp_nodelay on;
    keepalive_requests 100000000;
    keepalive_timeout 300s;
    client_header_timeout 300s;
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        root {www};
    }}
}}
"""


def haproxy_conf(routes: list[tuple[int, int]], splice: bool) -> str:
    text = f"""
global
    nbthread 1
    maxconn 5000
    log stderr format raw local0 err

defaults
    mode tcp
    timeout connect 3s
    timeout client 300s
    timeout server 300s
    {"option splice-auto" if splice else ""}
"""
    for i, (listen, server) in enumerate(routes):
        text += f"""
listen bench{i}
    bind 127.0.0.1:{listen}
    balance roundrobin
    server s1 127.0.0.1:{server}
"""
    return text


def nginx_stream_conf(work: Path, routes: list[tuple[int, int]]) -> str:
    t = work / "nginx-stream"
    t.mkdir(exist_ok=True)
    servers = "".join(
        f"""
    server {{
        listen 127.0.0.1:{listen} backlog=4096;
        proxy_pass 127.0.0.1:{server};
        proxy_connect_timeout 3s;
        proxy_timeout 300s;
    }}"""
        for listen, server in routes
    )
    return f"""
load_module {NGINX_STREAM_MODULE};
daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile 30000;
pid {t}/nginx.pid;
error_log {t}/error.log warn;
events {{ worker_connections 12000; }}
stream {{{servers}
}}
"""


def lbproxy_conf(routes: list[tuple[int, int]]) -> str:
    text = """
global:
  admin:
    listen: none
  drain_timeout: 1s
virtual_servers:
"""
    for i, (listen, server) in enumerate(routes):
        text += f"""
  - name: bench{i}
    listen: 127.0.0.1:{listen}
    scheduler: rr
    connect_timeout: 3s
    idle_timeout: 5m
    health_check:
      type: none
    real_servers:
      - name: s1
        address: 127.0.0.1:{server}
"""
    return text


class Proxy:
    """One proxy under test: how to start it, and the PIDs whose CPU and memory count."""

    def __init__(self, name: str, argv: list[str] | None, conf: str | None, suffix: str):
        self.name = name
        self.argv = argv  # None: "direct", no proxy at all
        self.conf = conf
        self.suffix = suffix
        self.proc: subprocess.Popen | None = None

    @property
    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None else []


# ------------------------------------------------------------------ measurements

_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not m:
        raise BenchError(f"cannot read wrk latency {text!r}")
    return float(m[1]) * _UNITS[m[2]]


def parse_wrk(text: str) -> dict[str, Any]:
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    if not rps:
        raise BenchError(f"no Requests/sec in wrk output: {text[-400:]}")
    out: dict[str, Any] = {"rps": float(rps[1])}
    for pct in ("50", "99"):
        m = re.search(rf"^\s+{pct}%\s+(\S+)", text, re.M)
        out[f"p{pct}_ms"] = _ms(m[1]) if m else None
    m = re.search(r"(\d+) requests in ([\d.]+)(\w+), ([\d.]+)(\w+) read", text)
    if m:
        out["requests"] = int(m[1])
        scale = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
        out["bytes_read"] = float(m[4]) * scale.get(m[5], 1)
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    out["socket_errors"] = sum(int(x) for x in m.groups()) if m else 0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    out["non_2xx"] = int(m[1]) if m else 0
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, procs: Processes, work: Path) -> None:
        self.args = args
        self.procs = procs
        self.work = work
        self.load_core = args.load_core
        self.proxy_core = args.proxy_core
        self.pin_load = ["taskset", "-c", str(self.load_core)] if args.pin else []
        self.pin_proxy = ["taskset", "-c", str(self.proxy_core)] if args.pin else []

    # -- real servers ------------------------------------------------------------

    def start_real_servers(self) -> None:
        self.http_port = free_port()
        conf = self.work / "nginx-http.conf"
        conf.write_text(nginx_http_conf(self.work, self.http_port))
        log = self.work / "nginx-http.log"
        proc = self.procs.start(
            "nginx-http", [*self.pin_load, "nginx", "-c", str(conf), "-p", str(self.work)], log
        )
        wait_port(self.http_port, proc, log)
        self.load_pids = [proc.pid]  # the real servers (on the load core)
        self.iperf_port = free_port()
        log = self.work / "iperf3-server.log"
        proc = self.procs.start(
            "iperf3-server",
            [
                *self.pin_load,
                "iperf3",
                "-s",
                "-B",
                "127.0.0.1",
                "-p",
                str(self.iperf_port),
                "--idle-timeout",
                "60",
            ],
            log,
        )
        wait_port(self.iperf_port, proc, log)
        self.load_pids.append(proc.pid)

    # -- proxies -----------------------------------------------------------------

    def proxies(self) -> list[Proxy]:
        want = self.args.proxies
        python = str(ROOT / ".venv" / "bin" / "python")
        table = {
            "lbproxy": lambda c: [python, "-m", "lbproxy", "run", c, "--log-level", "warning"],
            "haproxy": lambda c: ["haproxy", "-db", "-f", c],
            "haproxy-splice": lambda c: ["haproxy", "-db", "-f", c],
            "nginx": lambda c: ["nginx", "-c", c, "-p", str(self.work)],
        }
        out = []
        for name in want:
            if name == "direct":
                out.append(Proxy(name, None, None, ""))
                continue
            tool = {"lbproxy": python}.get(name, name.split("-")[0])
            if shutil.which(tool) is None and not Path(tool).exists():
                print(f"note: {tool} not found, {name} skipped")
                continue
            if name == "nginx" and not Path(NGINX_STREAM_MODULE).exists():
                print(f"note: {NGINX_STREAM_MODULE} missing (libnginx-mod-stream), nginx skipped")
                continue
            suffix = {"lbproxy": ".yaml", "nginx": ".conf"}.get(name, ".cfg")
            out.append(Proxy(name, table[name]("{conf}"), None, suffix))
        return out

    def start_proxy(self, proxy: Proxy) -> tuple[int, int]:
        """Start `proxy` with one listener per real server: (HTTP port, iperf3 port)."""
        if proxy.argv is None:
            return self.http_port, self.iperf_port
        routes = [(free_port(), self.http_port), (free_port(), self.iperf_port)]
        if proxy.name == "lbproxy":
            text = lbproxy_conf(routes)
        elif proxy.name.startswith("haproxy"):
            text = haproxy_conf(routes, splice=proxy.name == "haproxy-splice")
        else:
            text = nginx_stream_conf(self.work, routes)
        conf = self.work / f"{proxy.name}{proxy.suffix}"
        conf.write_text(text)
        argv = [a.replace("{conf}", str(conf)) for a in proxy.argv]
        log = self.work / f"{proxy.name}.log"
        cwd = self.args.lbproxy_root if proxy.name == "lbproxy" else None
        proxy.proc = self.procs.start(proxy.name, [*self.pin_proxy, *argv], log, cwd=cwd)
        try:
            for listen, _ in routes:
                wait_port(listen, proxy.proc, log)
        except BenchError as exc:
            raise BenchError(f"{proxy.name}: {exc}") from None
        return routes[0][0], routes[1][0]

    def stop_proxy(self, proxy: Proxy) -> None:
        if proxy.proc is not None:
            self.procs.stop(proxy.proc)
            proxy.proc = None

    # -- one measurement window ---------------------------------------------------

    def window(self, proxy: Proxy, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run `body` and add the proxy's CPU use, the cores' load and the machine's other
        load over that time.

        ``others``: CPU (in cores, across the machine) that user processes other than
        this run's used meanwhile -- concurrent test suites, say. ``kernel_threads``: the
        same for kernel threads (softirq and worker threads, partly doing our own network
        work), for information.
        """
        pids = proxy.pids
        ours = {*pids, *self.load_pids, os.getpid()}
        p0 = process_ticks()
        c0, s0, t0 = cpu_split(pids), cpu_times(), time.monotonic()
        out = body()
        c1, s1, t1 = cpu_split(pids), cpu_times(), time.monotonic()
        p1 = process_ticks()
        wall = t1 - t0
        user, system = (c1[0] - c0[0]) / CLK_TCK, (c1[1] - c0[1]) / CLK_TCK
        cpu = user + system
        out["wall_s"] = round(wall, 3)
        if pids:
            out["cpu_s"] = round(cpu, 3)
            out["cpu_user_s"] = round(user, 3)
            out["cpu_sys_s"] = round(system, 3)
            out["util"] = round(cpu / wall, 3)
        others, kernel, busiest = others_between(p0, p1, ours, wall)
        out["others"] = round(others, 3)
        out["others_top"] = [f"{p['comm']}:{p['cpu']:.2f}" for p in busiest[:3]]
        out["kernel_threads"] = round(kernel, 3)
        for core, label in ((self.load_core, "load_core"), (self.proxy_core, "proxy_core")):
            if core not in s0 or core not in s1:
                continue
            d = {k: s1[core][k] - s0[core][k] for k in s0[core]}
            total = max(1, d["total"])
            out[f"{label}_busy"] = round((d["task"] + d["irq"]) / total, 3)
            if core == self.proxy_core:
                # Interrupt time is charged to no process: on loopback it is mostly the
                # kernel delivering the proxy's own packets.
                out["proxy_core_irq"] = round(d["irq"] / total, 3)
                out["steal"] = round(d["steal"] / total, 3)
                if self.args.pin:
                    # Task time on the proxy core not explained by the proxy (pinned
                    # there) nor by kernel threads: processes that came and went between
                    # the two /proc snapshots, which `others` cannot see.
                    own = cpu / wall if pids else 0.0
                    unexplained = d["task"] / total - own - kernel
                    out["others_proxy_core"] = round(max(0.0, unexplained), 3)
        return out

    def measured(self, proxy: Proxy, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """`window`, repeated (up to --retries times) while other processes took more than
        --max-foreign of a core; the quietest attempt is kept, with the count."""
        best: dict[str, Any] | None = None
        for attempt in range(1 + self.args.retries):
            out = self.window(proxy, body)
            # (with no proxy, "direct", the proxy core is not ours to watch)
            noise = max(out["others"], (out.get("others_proxy_core") or 0.0) if proxy.pids else 0)
            out["attempts"] = attempt + 1
            if best is None or noise < best["_noise"]:
                best = {**out, "_noise": noise}
            if noise <= self.args.max_others:
                break
            print(
                f"  noisy (other processes used {noise * 100:.0f}% of a core: "
                f"{', '.join(out['others_top'])}): measuring again"
            )
            time.sleep(1)
        assert best is not None
        best["attempts"] = out["attempts"]
        best.pop("_noise")
        return best

    def wrk(self, port: int, path: str, conns: int, duration: float, close: bool) -> dict:
        argv = [*self.pin_load, "wrk", "-t1", f"-c{conns}", f"-d{round(duration)}s", "--latency"]
        argv += ["--timeout", "5s"]
        if close:
            argv += ["-H", "Connection: close"]
        argv.append(f"http://127.0.0.1:{port}{path}")
        return parse_wrk(run_client(argv, timeout=duration + 30))

    def iperf(self, port: int, duration: float) -> dict:
        argv = [
            *self.pin_load,
            "iperf3",
            "-c",
            "127.0.0.1",
            "-p",
            str(port),
            "-t",
            str(duration),
            "-J",
            "--connect-timeout",
            "3000",
        ]
        data = json.loads(run_client(argv, timeout=duration + 30))
        if "error" in data:
            raise BenchError(f"iperf3: {data['error']}")
        end = data["end"]
        return {
            "gbps": end["sum_received"]["bits_per_second"] / 1e9,
            "retransmits": end["sum_sent"].get("retransmits", 0),
        }

    def idle(self, proxy: Proxy, port: int, n: int) -> dict[str, Any]:
        """RSS growth per held idle connection (each connected through to nginx)."""
        pid = proxy.proc.pid  # type: ignore[union-attr]
        time.sleep(0.3)
        fd0, rss0 = fd_count(pid), rss_kb(pid)
        socks: list[socket.socket] = []
        try:
            for _ in range(n):
                s = socket.socket()
                socks.append(s)
                s.settimeout(5)
                s.connect(("127.0.0.1", port))
            # Wait until the proxy holds both ends of every connection (two fds each).
            deadline = time.monotonic() + 15
            while fd_count(pid) < fd0 + 2 * n and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)
            fd1, rss1 = fd_count(pid), rss_kb(pid)
        finally:
            for s in socks:
                s.close()
        deadline = time.monotonic() + 15
        while fd_count(pid) > fd0 + 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        return {
            "connections": n,
            "kb_per_conn": round((rss1 - rss0) / n, 2),
            "fds_per_conn": round((fd1 - fd0) / n, 2),
            "rss_before_kb": rss0,
            "rss_after_kb": rss1,
            "rss_after_close_kb": rss_kb(pid),
        }

    # -- one proxy, all measurements ----------------------------------------------

    def measure(self, proxy: Proxy) -> dict[str, Any]:
        a = self.args
        d = a.duration
        http, iperf = self.start_proxy(proxy)
        res: dict[str, Any] = {}
        try:
            # warm-up: connections, caches, Python's allocator
            self.wrk(http, "/small", 50, 1, close=False)
            if proxy.argv is not None:
                res["idle"] = self.window(proxy, lambda: self.idle(proxy, http, a.idle_conns))
            res["keepalive"] = self.measured(
                proxy, lambda: self.wrk(http, "/small", 50, d, close=False)
            )
            res["newconn"] = self.measured(
                proxy, lambda: self.wrk(http, "/small", 50, d, close=True)
            )
            res["bulk"] = self.measured(proxy, lambda: self.iperf(iperf, d))
            res["http1m"] = self.measured(proxy, lambda: self.wrk(http, "/1m", 4, d, close=False))
            res["http1m"]["gbps"] = res["http1m"].get("bytes_read", 0) * 8 / 1e9 / d
            # CPU cost per unit of work: the inverse of the per-core figures, easier to
            # compare between changes to lbproxy ("us per new connection").
            for key in ("keepalive", "newconn"):
                m = res[key]
                if m.get("cpu_s") is not None and m.get("requests"):
                    m["cpu_us_per_req"] = round(m["cpu_s"] / m["requests"] * 1e6, 2)
                    # Where that time is spent: in user space (Python, the proxy's own
                    # code) or in the kernel (system calls and the loopback TCP work
                    # they run inline), from utime/stime.
                    m["user_us_per_req"] = round(m["cpu_user_s"] / m["requests"] * 1e6, 2)
                    m["sys_us_per_req"] = round(m["cpu_sys_s"] / m["requests"] * 1e6, 2)
            m = res["bulk"]
            if m.get("cpu_s") is not None and m.get("gbps"):
                m["cpu_s_per_gb"] = round(m["cpu_s"] / (m["gbps"] * d / 8), 3)
            if proxy.proc is not None and proxy.proc.poll() is not None:
                raise BenchError(f"{proxy.name} exited during the run")
        finally:
            self.stop_proxy(proxy)
        return res


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


def print_table(title: str, head: list[str], rows: list[list[str]], left: int = 1) -> None:
    """A plain-text table: the first `left` columns left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    print(f"\n{title}")
    print(line(head))
    print("-" * len(line(head)))
    for r in rows:
        print(line(r))


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


# -------------------------------------------------------------------------- main


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


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Bound the whole run: SIGALRM raises, and the finally clauses stop everything."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise BenchError(f"the run exceeded --max-time {seconds}s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


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


PROXIES_DEFAULT = "lbproxy,haproxy,haproxy-splice,nginx,direct"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/bench",
        description="lbproxy against HAProxy and nginx stream on loopback, in one run.",
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
    if args.pin and (
        shutil.which("taskset") is None
        or not {args.load_core, args.proxy_core} <= os.sched_getaffinity(0)
    ):
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
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench-{started:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {path}")
    return 0


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
        argv = ["taskset", "-c", str(args.proxy_core), *argv]
    print("scheduler micro-benchmark ...", flush=True)
    try:
        run_client(argv, timeout=300)
    except BenchError as exc:
        print(f"  failed: {exc}")
        return None
    return json.loads(out.read_text())


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


if __name__ == "__main__":
    raise SystemExit(main())
