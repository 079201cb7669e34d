"""Connections closed on purpose (SPEC §23): `max_connection_duration` with its jitter,
`shutdown-sessions`, and a drain's `close_after` / `close_rate`, through real `lbproxy
run` processes on both connection paths (compiled and LBPROXY_PURE=1).

The real server here (`HeldServer`) serves many long-lived connections from one thread:
it says its name, echoes, and notes when each connection ends.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time

import pytest

from tests.integration.harness import counted, free_port, vs_config, wait_for, with_admin

CLOSED = "lbproxy_connections_closed_total"
# What scheduling adds to a close on this loaded, shared machine: the idle timer's wake-up,
# a batch, the client's own wake-up. A bound, not a sleep.
SLACK = 0.5


@pytest.fixture(params=["default", "pure"])
def path(request, monkeypatch):
    """The connection path of the lbproxy processes the test runs: the default one
    (compiled where it is built) or the pure-Python one."""
    if request.param == "pure":
        monkeypatch.setenv("LBPROXY_PURE", "1")
    return request.param


class HeldServer:
    """A real server for many long-lived connections, in one thread: says its name and
    echoes; `open` is how many of its connections are open now."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.open = 0
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        try:
            while not self._stop:
                for key, _ in sel.select(0.1):
                    if key.fileobj is self.listener:
                        with contextlib.suppress(BlockingIOError):
                            while True:
                                conn, _ = self.listener.accept()
                                conn.setblocking(False)
                                with contextlib.suppress(OSError):
                                    conn.send(f"{self.name}\n".encode())
                                sel.register(conn, selectors.EVENT_READ)
                                self.open += 1
                        continue
                    conn = key.fileobj
                    try:
                        data = conn.recv(65536)  # type: ignore[union-attr]
                        if data:
                            conn.send(data)  # type: ignore[union-attr]
                            continue
                    except BlockingIOError:
                        continue
                    except OSError:
                        pass
                    sel.unregister(conn)
                    conn.close()  # type: ignore[union-attr]
                    self.open -= 1
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            sel.close()

    def stop(self) -> None:
        self._stop = True
        self._thread.join(10)


@pytest.fixture
def held_servers():
    started: list[HeldServer] = []

    def make(*names: str) -> list[HeldServer]:
        servers = [HeldServer(name) for name in names]
        started.extend(servers)
        return servers

    yield make
    for server in started:
        server.stop()


def connect_many(port: int, n: int) -> list[tuple[socket.socket, float, str]]:
    """n connections through the proxy, each with the time just before its connect and
    the real server's name it read (so it is established)."""
    held: list[tuple[socket.socket, float, str]] = []
    try:
        for _ in range(n):
            began = time.monotonic()
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(100)
                assert chunk, "closed before the server's name"
                data += chunk
            held.append((sock, began, data.decode().strip()))
    except BaseException:
        for sock, _, _ in held:
            sock.close()
        raise
    return held


def watch_ends(socks: list[socket.socket], timeout: float) -> dict[socket.socket, float]:
    """Wait (at most `timeout`) until each socket's connection ends (EOF or a reset);
    when each ended. Bytes received meanwhile are read and dropped."""
    ended: dict[socket.socket, float] = {}
    sel = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while len(ended) < len(socks) and time.monotonic() < deadline:
            for key, _ in sel.select(0.2):
                sock = key.fileobj
                try:
                    if sock.recv(65536):  # type: ignore[union-attr]
                        continue
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                ended[sock] = time.monotonic()  # type: ignore[index]
                sel.unregister(sock)
    finally:
        sel.close()
    return ended


def test_max_connection_duration_with_jitter_closes_each_connection_in_its_window(
    path, held_servers, lbproxy
):
    """100 connections with max_connection_duration 2s ± 20%: each is closed (both
    sides) between 1.6 s and 2.4 s after its connect (+ SLACK for scheduling), the
    limits are spread (not one time for all), and each close is counted."""
    (a,) = held_servers("a")
    port, admin_port = free_port(), free_port()
    extra = "max_connection_duration: 2s\nmax_connection_duration_jitter: 20%"
    lbproxy(with_admin(vs_config(port, [a], "rr", extra), admin_port))
    held = connect_many(port, 100)
    try:
        ended = watch_ends([sock for sock, _, _ in held], timeout=10 + 2.4)
        assert len(ended) == 100, f"{100 - len(ended)} connection(s) still open"
        lifetimes = sorted(ended[sock] - began for sock, began, _ in held)
        # The proxy's limit starts after the client's connect: never earlier than 1.6 s.
        assert lifetimes[0] >= 1.6, lifetimes[:5]
        assert lifetimes[-1] <= 2.4 + SLACK, lifetimes[-5:]
        # uniform draws over 0.8 s: 100 of them spread over far more than 0.3 s
        assert lifetimes[-1] - lifetimes[0] >= 0.3, (lifetimes[0], lifetimes[-1])
        wait_for(lambda: a.open == 0, timeout=5, what="the server's side closed too")
        wait_for(
            lambda: counted(admin_port, CLOSED, reason="max_duration") == 100,
            timeout=5,
            what="100 closes counted as max_duration",
        )
    finally:
        for sock, _, _ in held:
            sock.close()


def test_without_max_connection_duration_a_connection_stays_open(held_servers, lbproxy):
    """The default: no lifetime; an idle connection outlives 2.4 s (a control for the
    test above, so its closes are the key's doing)."""
    (a,) = held_servers("a")
    port, admin_port = free_port(), free_port()
    lbproxy(with_admin(vs_config(port, [a], "rr"), admin_port))
    held = connect_many(port, 3)
    try:
        ended = watch_ends([sock for sock, _, _ in held], timeout=3)
        assert not ended
        assert counted(admin_port, CLOSED, reason="max_duration") == 0
    finally:
        for sock, _, _ in held:
            sock.close()
