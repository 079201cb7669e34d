"""Clients in a connect -> echo -> close loop, counting what a user would notice across a
restart or an upgrade: a refused connect, a reset, an echo that is not byte-exact."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import Counter

from tests.integration.harness import wait_for


class ClientLoop:
    """`clients` threads, each connecting to `port` again and again until stopped: send
    a payload of its own, read it back whole, close. Bounded: `stop()` or `limit`
    seconds, whichever comes first."""

    def __init__(self, port: int, clients: int = 10, *, limit: float = 60.0, size: int = 64):
        self.port = port
        self.size = size
        self.counts: Counter = Counter()
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._deadline = time.monotonic() + limit
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)
        ]

    def __enter__(self) -> ClientLoop:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> Counter:
        self._stop.set()
        for thread in self._threads:
            thread.join(15)
        return self.counts

    def wait_for(self, ok: int, timeout: float = 10.0) -> None:
        """Until `ok` more exchanges succeeded (the loop is running through the proxy)."""
        target = self.counts["ok"] + ok
        wait_for(
            lambda: self.counts["ok"] >= target,
            timeout,
            f"{ok} more exchanges",
            0.01,
            details=lambda: f"client loop stalled: {dict(self.counts)} {self.errors}",
        )

    def _count(self, what: str, detail: str = "") -> None:
        with self._lock:
            self.counts[what] += 1
            if detail and len(self.errors) < 20:
                self.errors.append(detail)

    def _run(self, index: int) -> None:
        n = 0
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            n += 1
            payload = f"{index}:{n}:".encode() + os.urandom(self.size)
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
                    s.sendall(payload)
                    received = b""
                    while len(received) < len(payload):
                        chunk = s.recv(65536)
                        if not chunk:
                            break
                        received += chunk
            except ConnectionRefusedError:
                self._count("refused", f"client {index}: refused")
                continue
            except ConnectionResetError:
                self._count("reset", f"client {index}: reset")
                continue
            except OSError as exc:
                self._count("error", f"client {index}: {exc!r}")
                continue
            if received == payload:
                self._count("ok")
            else:
                self._count("mismatch", f"client {index}: {len(received)}/{len(payload)} bytes")
