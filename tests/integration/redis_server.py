"""A real redis-server on a loopback port, in its own folder (SPEC §18 tests).

    redis = RedisServer(tmp_path / "redis").start()          # or .start(password="...")
    redis.url                 # redis://127.0.0.1:PORT/0, for global.cluster.redis.url
    redis.cli("HGETALL", "lbproxy:state")                    # redis-cli, its output
    redis.stop()              # SIGTERM by PID, waited for; start() again: the same port
    replica = RedisServer(tmp_path / "replica").start(replica_of=redis.port)
    replica.cli("REPLICAOF", "NO", "ONE")                    # promoted

No persistence (`save ""`, no AOF): a restart starts empty, as a Redis restarted
without its data would, which is the harder case for a resync. Stopped by PID only.
"""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path

from tests import tools
from tests.integration.harness import free_port, wait_for

REDIS_SERVER = tools.find("redis-server")
REDIS_CLI = tools.find("redis-cli")

requires_redis = tools.requires("redis-server", "redis-cli", package="redis-server")


class RedisServer:
    def __init__(self, folder: Path, port: int | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.port = port or free_port()
        self.password: str | None = None
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(
        self, password: str | None = None, timeout: float = 10.0, replica_of: int | None = None
    ) -> RedisServer:
        """Start it; `replica_of`: a replica of the Redis on that loopback port (with the
        same password)."""
        if password is not None:
            self.password = password
        conf = self.folder / "redis.conf"
        lines = [
            "bind 127.0.0.1",
            f"port {self.port}",
            f"dir {self.folder}",
            'save ""',
            "appendonly no",
            "protected-mode yes",
            "daemonize no",
            f"logfile {self.folder / 'redis.log'}",
        ]
        if self.password:
            lines.append(f"requirepass {self.password}")
        if replica_of is not None:
            lines.append(f"replicaof 127.0.0.1 {replica_of}")
            if self.password:
                lines.append(f"masterauth {self.password}")
        conf.write_text("\n".join(lines) + "\n")
        assert REDIS_SERVER is not None
        self.proc = subprocess.Popen(
            [REDIS_SERVER, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

        def answers() -> bool:
            assert self.proc is not None
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(100):  # +PONG, or -NOAUTH with a password: up either way
                        return True
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server did not start: {self.log()}")
            return False

        wait_for(answers, timeout, "redis-server to answer", details=self.log)
        return self

    def log(self) -> str:
        path = self.folder / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def cli(self, *args: str) -> str:
        assert REDIS_CLI is not None
        command = [REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), "--no-auth-warning"]
        if self.password:
            command += ["-a", self.password]
        done = subprocess.run(
            [*command, *args], capture_output=True, text=True, timeout=10, check=True
        )
        return done.stdout

    def publish(self, channel: str, payload: bytes) -> None:
        """PUBLISH exactly these bytes (redis-cli -x reads the last argument from stdin)."""
        assert REDIS_CLI is not None
        command = [REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), "--no-auth-warning"]
        if self.password:
            command += ["-a", self.password]
        subprocess.run(
            [*command, "-x", "PUBLISH", channel], input=payload, timeout=10, check=True,
            capture_output=True,
        )  # fmt: skip

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> RedisServer:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
