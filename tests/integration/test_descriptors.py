"""No descriptor outlives its connection: 10,000 connections of every ending against a
real `lbproxy run`, then /proc/PID/fd holds what it held before.

The endings (SPEC §4): a whole exchange ended by the client's half-close, a client that
resets (SO_LINGER 0) after the greeting, a client that closes before the greeting, a
virtual server whose only real server is dead (the connect is refused, the client is
closed), and clients that send nothing until the idle timeout closes them.

Pooled splice pipes are the one thing lbproxy keeps on purpose (net/pump.py: up to
MAX_IDLE_PIPES empty pipes, reused by the next connections), so pipes are compared
with that bound; every other descriptor (sockets, epoll, eventfd, files) is counted
exactly.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import struct
import sys
import threading

import pytest

from lbproxy.net.pump import MAX_IDLE_PIPES
from tests.integration.harness import free_port, metrics, read_name, sample, wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

THREADS = 4
ROUNDS = 9  # per thread: 4 x 9 x 250 = 9,000 + 10 x 100 idle timeouts = 10,000
PER_ROUND = 250
IDLE_BATCHES, IDLE_BATCH = 10, 100
WARM_UP = 20


def descriptors(pid: int) -> collections.Counter[str]:
    """The process's open descriptors by kind: socket, pipe, anon_inode:[eventpoll], a
    file path, ..."""
    kinds: collections.Counter[str] = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed between listdir and readlink
            continue
        kinds[target.split(":[", 1)[0] if ":[" in target else target] += 1
    return kinds


def pipes_aside(kinds: collections.Counter[str]) -> tuple[dict[str, int], int]:
    rest = {kind: n for kind, n in kinds.items() if kind != "pipe"}
    return rest, kinds["pipe"]


def exchange(port: int) -> None:
    """Greeting, a line echoed, the client's FIN passed on, the server's FIN back."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        assert read_name(s) == "a"
        s.sendall(b"ping\n")
        s.shutdown(socket.SHUT_WR)  # half-close: the echo still comes back
        data = b""
        while chunk := s.recv(100):
            data += chunk
        assert data == b"ping\n"


def reset_after_greeting(port: int) -> None:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    assert read_name(s) == "a"
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()  # RST


def close_at_once(port: int) -> None:
    socket.create_connection(("127.0.0.1", port), timeout=10).close()


def refused_behind(port: int) -> None:
    """The real server is dead: lbproxy's connect is refused and the client closed."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as s,
        contextlib.suppress(ConnectionResetError),
    ):
        assert s.recv(100) == b""


def test_ten_thousand_connections_leave_no_descriptor_behind(name_servers, lbproxy):
    (a,) = name_servers("a")
    web, idle, dead, admin = free_port(), free_port(), free_port(), free_port()
    dead_port = free_port()  # nothing listens there
    none = "health_check: {type: none}"
    proxy = lbproxy(
        f"""
        global: {{admin: {{listen: 127.0.0.1:{admin}}}, drain_timeout: 2s}}
        virtual_servers:
          - {{name: web, listen: 127.0.0.1:{web}, {none},
              real_servers: [{{name: a, address: 127.0.0.1:{a.port}}}]}}
          - {{name: idle, listen: 127.0.0.1:{idle}, idle_timeout: 300ms, {none},
              real_servers: [{{name: a, address: 127.0.0.1:{a.port}}}]}}
          # fall: never marked down, so every client costs a refused connect
          - {{name: dead, listen: 127.0.0.1:{dead}, health_check: {{type: none, fall: 1000000}},
              real_servers: [{{name: gone, address: 127.0.0.1:{dead_port}}}]}}
        """,
        [web, idle, dead],
    )
    pid = proxy.proc.pid
    # Warm up every path once (the reactor, deadline heap and pools are made on first
    # use), then wait for the warm-up connections to end.
    for _ in range(WARM_UP):
        exchange(web)
        reset_after_greeting(web)
        refused_behind(dead)
    before = wait_for(lambda: stable(pid), what="a steady descriptor count before")
    before_rest, before_pipes = pipes_aside(before)

    errors: list[BaseException] = []
    done = collections.Counter()
    lock = threading.Lock()

    def worker() -> None:
        kinds = (exchange, reset_after_greeting, close_at_once, refused_behind, exchange)
        try:
            for _ in range(ROUNDS):
                for i in range(PER_ROUND):
                    one = kinds[i % len(kinds)]
                    one(dead if one is refused_behind else web)
                    with lock:
                        done[one.__name__] += 1
        except BaseException as exc:  # reported by the test below
            errors.append(exc)

    def idle_timeouts() -> None:
        try:
            for _ in range(IDLE_BATCHES):
                held = [
                    socket.create_connection(("127.0.0.1", idle), timeout=10)
                    for _ in range(IDLE_BATCH)
                ]
                for s in held:  # nothing sent: closed by the 300 ms idle timeout
                    data = b""
                    while chunk := s.recv(100):
                        data += chunk
                    assert data in (b"", b"a\n")  # the greeting, unless the timeout came first
                    s.close()
                with lock:
                    done["idle_timeout"] += IDLE_BATCH
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    threads.append(threading.Thread(target=idle_timeouts))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "the load did not finish"
    assert not errors, errors[:3]
    assert sum(done.values()) == 10_000, done
    refused = sample(
        metrics(admin),
        "lbproxy_connect_failures_total",
        virtual_server="dead",
        real_server="gone",
        reason="refused",
    )
    # each one cost a refused connect (and so did wait_port's probe of the port)
    assert refused == done["refused_behind"] + WARM_UP + 1

    def back() -> collections.Counter[str] | None:
        now = stable(pid)
        return now if now is not None and pipes_aside(now)[0] == before_rest else None

    try:  # the idle ones and the last few are still closing: wait, bounded
        after = wait_for(back, timeout=15, what="every non-pipe descriptor back")
    except AssertionError:
        after = descriptors(pid)  # compared below, so the message shows the difference
    after_rest, after_pipes = pipes_aside(after)
    assert after_rest == before_rest
    # pooled pipes: empty, kept for reuse, bounded (two descriptors each)
    assert before_pipes <= after_pipes <= 2 * MAX_IDLE_PIPES, (before_pipes, after_pipes)
    assert proxy.proc.poll() is None


def stable(pid: int) -> collections.Counter[str] | None:
    """The descriptor counts, when two reads 50 ms apart agree (no connection ending
    between them); None otherwise."""
    first = descriptors(pid)
    threading.Event().wait(0.05)
    return first if descriptors(pid) == first else None
