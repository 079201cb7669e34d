"""A real nginx (the `stream` module) on loopback ports, for comparing what it does with a
configuration and what lbproxy does with that configuration imported (SPEC §25).

    conf = render(DATA / "rr.conf", LB=port, S1=s1.port, ...)   # @LB@ -> the port
    with Nginx(tmp_path / "nginx", conf).start(wait_ports=[port]) as nginx:
        ...

The configuration a test writes is the stream part; `Nginx` puts before it what nginx
needs to run in the foreground in a folder of its own (the stream module, one worker,
its pid file and error log there), as a first-time reader of the test would. lbproxy
imports that same file: those lines are what it names as not translated. nginx is
stopped by its own PID (SIGQUIT would wait for connections: SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

from tests import tools
from tests.integration.harness import wait_for, wait_port

NGINX = tools.find("nginx")
STREAM_MODULE = Path("/usr/lib/nginx/modules/ngx_stream_module.so")

requires_nginx = tools.requires("nginx", package="nginx libnginx-mod-stream")


def render(template: Path, **ports: int | str) -> str:
    """The template's text with each @NAME@ replaced by ports[NAME]."""

    def value(match: re.Match[str]) -> str:
        return str(ports[match.group(1)])

    return re.sub(r"@([A-Z0-9_]+)@", value, template.read_text())


class Nginx:
    def __init__(self, folder: Path, stream_conf: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "logs").mkdir(exist_ok=True)
        self.folder = folder
        self.conf = folder / "nginx.conf"
        module = f"load_module {STREAM_MODULE};\n" if STREAM_MODULE.exists() else ""
        self.conf.write_text(
            f"{module}"
            "worker_processes 1;\n"
            f"pid {folder / 'nginx.pid'};\n"
            "error_log stderr info;\n"
            "events { worker_connections 1024; }\n" + stream_conf
        )
        self.log_path = folder / "nginx.log"
        self.proc: subprocess.Popen | None = None

    def start(self, wait_ports: list[int] = (), timeout: float = 15.0) -> Nginx:
        if NGINX is None or not STREAM_MODULE.exists():
            tools.missing("nginx", "nginx libnginx-mod-stream")
        assert NGINX is not None
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [NGINX, "-p", str(self.folder), "-c", str(self.conf), "-g", "daemon off;"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        proc = self.proc

        def started() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"nginx exited {proc.returncode}:\n{self.log()}")
            return "start worker process" in self.log()

        wait_for(started, timeout, "nginx to start", details=self.log)
        for port in wait_ports:
            wait_port(port, timeout)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        self.proc = None

    def __enter__(self) -> Nginx:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
