"""The comparison's set-up and its measurements: the real servers on the load core, one
proxy at a time on the proxy core, and a measurement window around each load (wrk,
iperf3, idle connections) with the CPU it cost and the noise it saw."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (
    CLK_TCK,
    ROOT,
    BenchError,
    Processes,
    core_times,
    cpu_split,
    fd_count,
    free_port,
    lbproxy_argv,
    need,
    rss_kb,
    run_client,
    start_nginx,
    taskset,
    wait_port,
    wrk,
)
from noise import others_between, process_ticks
from peers import (
    NGINX_STREAM_MODULE,
    Proxy,
    haproxy_conf,
    lbproxy_conf,
    nginx_stream_conf,
)


class Bench:
    def __init__(self, args: argparse.Namespace, procs: Processes, work: Path) -> None:
        self.args = args
        self.procs = procs
        self.work = work
        self.load_core = args.load_core
        self.proxy_core = args.proxy_core
        self.pin_load = taskset(self.load_core) if args.pin else []
        self.pin_proxy = taskset(self.proxy_core) if args.pin else []

    # -- real servers ------------------------------------------------------------

    def start_real_servers(self) -> None:
        self.http_port, nginx = start_nginx(self.procs, self.work, self.pin_load)
        self.load_pids = [nginx.pid]  # the real servers (on the load core)
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
            "lbproxy": lambda c: lbproxy_argv(Path(c), python),
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
            text = lbproxy_conf(routes, getattr(self.args, "lbproxy_extra", ""))
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
        c0, s0, t0 = cpu_split(pids), core_times(), time.monotonic()
        out = body()
        c1, s1, t1 = cpu_split(pids), core_times(), time.monotonic()
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
        return wrk(port, path, conns, duration, close, pin=self.pin_load)

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


def traced_bench(
    args: argparse.Namespace, procs: Processes, work: Path, tool: str, package: str
) -> tuple[Bench, list[Proxy]]:
    """The set-up of a run under a tracer (--syscalls: strace, --kernel: perf): the tool
    is installed, the real servers run; the proxies that are installed."""
    need(tool, package)
    bench = Bench(args, procs, work)
    bench.start_real_servers()
    return bench, [p for p in bench.proxies() if p.argv is not None]
