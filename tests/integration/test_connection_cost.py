"""What a new connection costs lbproxy in system calls, counted by strace on a real
process that serves one client at a time (docs/benchmarks.md, "lbproxy against nginx
stream, per new connection"). A count of calls does not move with the machine's load,
as a CPU time would.

One client at a time is the case where every connection finds the proxy idle: the
handler's set of live connections goes from empty to one and back each time. A proxy
in C (nginx stream) pays nothing for that; lbproxy used to start a guardian task at
each such transition and end it at the next, two trio rounds per connection with their
wake-ups: a write to trio's wake-up socket, trio's own epoll_wait and two reads to drain
it, each twice -- 28 calls per connection where 20 do.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from tests.integration.harness import (
    NameServer,
    compiled_path_expected,
    free_port,
    read_name,
    wait_for,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace"),
]

WARM_UP = 20
CONNECTIONS = 200


def exchange(port: int) -> None:
    """One client: connect, read the real server's greeting, half-close, and read to
    the end: the proxy closes its side once the server has closed too, so the
    connection has ended in the proxy before the next client connects."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        assert read_name(s) == "a"
        s.shutdown(socket.SHUT_WR)
        assert s.recv(100) == b""


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def counted_calls(summary: str) -> tuple[int, int]:
    """(all calls, successful accept4 calls) from strace -c's table."""
    total = accepted = 0
    for line in summary.splitlines():
        fields = line.split()
        if len(fields) >= 5 and re.fullmatch(r"[\d.]+", fields[0]):
            name = fields[-1]
            calls = int(fields[3])
            errors = int(fields[4]) if len(fields) == 6 else 0
            if name == "total":
                total = calls
            elif name in ("accept4", "accept"):
                accepted += calls - errors
    return total, accepted


def calls_per_connection(pid: int, port: int, folder: Path) -> float:
    """System calls of the whole process (every thread) per connection, for
    CONNECTIONS clients served one after the other."""
    out = folder / "strace.txt"
    log = folder / "strace.log"
    with open(log, "wb") as err:
        tracer = subprocess.Popen(
            ["strace", "-f", "-c", "-o", str(out), "-p", str(pid)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    try:
        # attached to every thread (strace says so for each) before the first client
        wait_for(
            lambda: log.read_text().count("attached") >= threads(pid) or tracer.poll() is not None,
            what="strace attached",
        )
        if tracer.poll() is not None:
            pytest.skip(f"strace cannot attach: {log.read_text().strip()}")
        for _ in range(CONNECTIONS):
            exchange(port)
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(30)
    total, accepted = counted_calls(out.read_text())
    assert accepted == CONNECTIONS
    return total / accepted


def test_a_client_that_finds_the_proxy_idle_wakes_no_task(lbproxy, tmp_path):
    with NameServer("a") as a:
        port = free_port()
        proxy = lbproxy(
            f"""
            global: {{admin: {{listen: none}}}}
            virtual_servers:
              - {{name: web, listen: 127.0.0.1:{port}, health_check: {{type: none}},
                  real_servers: [{{name: a, address: 127.0.0.1:{a.port}}}]}}
            """,
            [port],
        )
        for _ in range(WARM_UP):
            exchange(port)
        per_connection = calls_per_connection(proxy.proc.pid, port, tmp_path)
    # accept4 (and the one that finds the backlog empty), socket, setsockopt, connect,
    # getpeername, two epoll_ctl, a read and a send of the greeting, the client's FIN
    # read and passed on (shutdown, epoll_ctl), the server's FIN read, two closes, and
    # the reactor's epoll_wait for each of the four events: 20 calls. The pure path adds
    # two: the fcntl after accept and the getsockname of the connect's socket object.
    # The margin (2) is for an epoll_wait that a timer ends, or that sees one event of
    # two that come together, under load.
    limit = 22 if compiled_path_expected() else 24
    assert per_connection <= limit, f"{per_connection:.2f} system calls per connection"
