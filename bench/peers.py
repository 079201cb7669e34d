"""The proxies under test: their configurations, as equivalent as each allows, and the
versions of the peers and load generators."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from common import ROOT, nginx_preamble


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
load_module {NGINX_STREAM_MODULE};{nginx_preamble(t)}
stream {{{servers}
}}
"""


def lbproxy_conf(routes: list[tuple[int, int]], extra: str = "") -> str:
    """lbproxy's configuration: one virtual server per route, each with `extra` (keys
    of a virtual server on one line, e.g. `per_source: {max_connections: 100000}`)."""
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
        if extra:
            text += f"    {extra}\n"
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
