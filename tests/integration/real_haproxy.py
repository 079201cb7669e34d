"""The real HAProxy (Debian's haproxy, /usr/sbin/haproxy) in the foreground on a
configuration, with a stats socket to ask it what it thinks of its servers: for the
comparison of `lbproxy import`'s output with the configuration it came from."""

from __future__ import annotations

import csv
import socket
import subprocess
from pathlib import Path

from tests.integration.harness import listening, wait_for
from tests.tools import need


class Haproxy:
    """`haproxy -db -f FILE` on `config` (a `global` with a stats socket put in front of
    it); `stop()` ends it by its PID."""

    def __init__(
        self, folder: Path, config: str, ports: list[int], env: dict[str, str] | None = None
    ):
        self.env = env  # its environment variables (this process's when None)
        self.program = need("haproxy", "haproxy")
        folder.mkdir(parents=True, exist_ok=True)
        self.socket_path = str(folder / "haproxy.sock")
        self.path = folder / "haproxy.cfg"
        stats = f"global\n    stats socket {self.socket_path} mode 600 level admin\n\n"
        self.path.write_text(stats + config)
        self.log_path = folder / "haproxy.log"
        self.ports = ports
        self.proc: subprocess.Popen | None = None

    def start(self) -> Haproxy:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [self.program, "-db", "-f", str(self.path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.path.parent,  # where the relative names of `-f` lists are
                env=self.env,
            )

        def ready() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log()
            return all(listening(port) for port in self.ports) and Path(self.socket_path).exists()

        wait_for(ready, 20, "haproxy to listen", details=self.log)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stats(self) -> dict[tuple[str, str], dict[str, str]]:
        """`show stat`: (proxy, server) -> its row (`status`, `scur`, ...)."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(self.socket_path)
            s.sendall(b"show stat\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        rows = csv.DictReader(data.decode().lstrip("# ").splitlines())
        return {(row["pxname"], row["svname"]): row for row in rows}

    def server_status(self, proxy: str, server: str) -> str:
        return self.stats()[(proxy, server)]["status"]

    def active(self, proxy: str, server: str) -> int:
        return int(self.stats()[(proxy, server)]["scur"] or 0)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
