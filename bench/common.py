"""What every benchmark needs, once: its processes (started in their own session, stopped
by PID), free ports and waiting for them, pinning to a core, the real servers (nginx over
HTTP, a TCP echo), an lbproxy started from a source tree, the CPU and memory of processes
from /proc, tracers and valgrind, the JSON results and plain-text tables.

The benchmarks measure this checkout's lbproxy: importing this module puts the
repository on ``sys.path`` before whatever lbproxy the Python running it has installed
(PYTHONPATH still comes first: ``PYTHONPATH=OTHER_TREE`` measures another tree).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")

# After the script's folder and PYTHONPATH (which may name another tree to measure),
# before whatever lbproxy the running Python has installed.
if str(ROOT) not in sys.path:
    _given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path.insert(1 + len(_given), str(ROOT))


class BenchError(Exception):
    """Something the run cannot go on without (a peer that does not start, ...)."""


def entry(main: Callable[[], int | None]) -> NoReturn:
    """A benchmark's ``__main__``: `main`'s exit status; a BenchError (a tool missing, a
    server that does not start) is one line on standard error and status 2."""
    try:
        status = main()
    except BenchError as exc:
        print(f"{Path(sys.argv[0]).name}: {exc}", file=sys.stderr)
        status = 2
    raise SystemExit(status or 0)


def need(tool: str, package: str | None = None) -> str:
    """The path of `tool` (also looked for in /usr/sbin, which a user's PATH may lack),
    or a BenchError naming the Debian package that has it."""
    found = shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")
    if found is None:
        raise BenchError(f"{tool} is not installed (apt-get install {package or tool})")
    return found


# --------------------------------------------------------------------- processes


class Processes:
    """Every process this run started, stopped by PID in reverse order, whatever happens.

    Each child gets its own session (``start_new_session``), so a Ctrl-C in the terminal
    reaches this script only; the ``finally`` around the run (or the end of a ``with``
    block) then stops the children itself: SIGTERM, up to 5 s, then SIGKILL. Nothing is
    ever stopped by name.
    """

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(
        self, name: str, argv: list[str], log: Path | None = None, **popen: Any
    ) -> subprocess.Popen:
        """Start `argv`; its output goes to the file `log` (both streams), else where
        `popen` says (by default this process's own)."""
        out = log.open("wb") if log is not None else None
        if out is not None:
            popen.update(stdout=out, stderr=subprocess.STDOUT)
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True, **popen)
        except OSError as exc:
            raise BenchError(f"cannot start {name}: {exc}") from None
        finally:
            if out is not None:
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


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def stop_pid(pid: int, timeout: float = 5.0) -> None:
    """Stop a process this run caused but did not start itself (an upgrade's new
    lbproxy): SIGTERM, up to `timeout` seconds, then SIGKILL."""
    if not alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if not wait_for(lambda: not alive(pid), timeout):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """The children of `pid`, their children and so on (an lbproxy's workers)."""
    out = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                out += [int(child), *descendants(int(child))]
    return out


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


# ------------------------------------------------------------ ports and waiting


def free_port(kind: socket.SocketKind = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Callable[[], object], timeout: float, interval: float = 0.05) -> bool:
    """Poll `condition` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def wait_port(
    port: int,
    proc: subprocess.Popen | None = None,
    log: Path | None = None,
    timeout: float = 20.0,
) -> None:
    """Wait until 127.0.0.1:`port` accepts a connection; a BenchError if `proc` exits
    first or the time is up (with the end of its `log`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BenchError(f"exited with {proc.returncode}: {tail(log)}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise BenchError(f"port {port} not open after {timeout}s: {tail(log)}")


def tail(path: Path | None, n: int = 600) -> str:
    """The end of a log file, for an error message."""
    if path is None:
        return "(no log)"
    try:
        return path.read_text(errors="replace")[-n:].strip() or "(no output)"
    except OSError:
        return "(no log)"


# ----------------------------------------------------------------------- cores


def taskset(core: int | None) -> list[str]:
    """The prefix that pins a command to `core` (nothing for None)."""
    return [] if core is None else ["taskset", "-c", str(core)]


def can_pin(cores: Iterable[int]) -> bool:
    """Whether taskset is there and this process may run on all of `cores`."""
    return shutil.which("taskset") is not None and set(cores) <= os.sched_getaffinity(0)


# ------------------------------------------------------------------ real servers

#: The HTTP real server's bodies: /small (64 bytes), /1m (1 MiB) and / ("ok").
SMALL_BODY = b"lbproxy bench: a small response body of 64 bytes.".ljust(63, b".") + b"\n"
assert len(SMALL_BODY) == 64
BIG_SIZE = 1 << 20


def nginx_preamble(folder: Path, connections: int = 12000) -> str:
    """The start of an nginx configuration: one process, in the foreground, its pid file
    and error log in `folder`."""
    return f"""
daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile 30000;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections {connections}; }}"""


def nginx_http_conf(work: Path, port: int) -> str:
    www = work / "www"
    www.mkdir(exist_ok=True)
    (www / "small").write_bytes(SMALL_BODY)
    (www / "1m").write_bytes(os.urandom(BIG_SIZE))
    t = work / "nginx-http"
    t.mkdir(exist_ok=True)
    return (
        nginx_preamble(t)
        + f"""
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
        location = / {{ return 200 "ok\\n"; }}
    }}
}}
"""
    )


def start_nginx(
    procs: Processes, work: Path, pin: list[str] | None = None
) -> tuple[int, subprocess.Popen]:
    """nginx as the HTTP real server (one worker; `pin`: a taskset prefix): its port and
    its process."""
    port = free_port()
    conf = work / "nginx-http.conf"
    conf.write_text(nginx_http_conf(work, port))
    log = work / "nginx-http.log"
    argv = [*(pin or []), need("nginx"), "-c", str(conf), "-p", str(work)]
    proc = procs.start("nginx-http", argv, log)
    wait_port(port, proc, log)
    return port, proc


ECHO = """
import asyncio
async def echo(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    writer.close()
async def main():
    server = await asyncio.start_server(echo, "127.0.0.1", 0, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""


def start_echo(procs: Processes) -> int:
    """A TCP echo server (a process of its own, asyncio) on 127.0.0.1; its port."""
    proc = procs.start("echo", [sys.executable, "-c", ECHO], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise BenchError(f"the echo server exited with {proc.wait()}")
    return int(line)


# ----------------------------------------------------------------------- lbproxy


def lbproxy_argv(
    config: Path, python: str = sys.executable, log_level: str | None = "warning"
) -> list[str]:
    """`lbproxy run CONFIG` with `python`; run from a source tree's root (its cwd), the
    tree's lbproxy is the one that runs."""
    argv = [python, "-m", "lbproxy", "run", str(config)]
    return [*argv, "--log-level", log_level] if log_level else argv


def start_lbproxy(
    procs: Processes,
    work: Path,
    config: str,
    *,
    name: str = "lbproxy",
    root: Path = ROOT,
    prefix: list[str] | None = None,
    log_level: str | None = "warning",
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """An lbproxy from the source tree `root` with `config` (written to WORK/NAME.yaml;
    its output in WORK/NAME.log); `prefix` goes before the command (taskset, valgrind)."""
    path = work / f"{name}.yaml"
    path.write_text(config)
    argv = [*(prefix or []), *lbproxy_argv(path, log_level=log_level)]
    return procs.start(name, argv, work / f"{name}.log", cwd=root, env=env)


def path_env(mode: str) -> dict[str, str]:
    """The environment that runs lbproxy on its `compiled` or `pure` connection path."""
    env = dict(os.environ)
    env.pop("LBPROXY_PURE", None)
    if mode == "pure":
        env["LBPROXY_PURE"] = "1"
    return env


# -------------------------------------------------------------------------- /proc


def cpu_split(pids: Iterable[int]) -> tuple[int, int]:
    """(user, system) CPU ticks of `pids`, all threads, from /proc/PID/stat."""
    user = system = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            user += int(fields[11])  # utime
            system += int(fields[12])  # stime
    return user, system


def cpu_seconds(pids: Iterable[int]) -> tuple[float, float]:
    """(user, system) CPU seconds of `pids`, all threads."""
    user, system = cpu_split(pids)
    return user / CLK_TCK, system / CLK_TCK


def own_cpu() -> tuple[float, float]:
    """(user, system) CPU seconds of this process (getrusage)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise BenchError(f"no VmRSS for pid {pid}")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def core_times() -> dict[int, dict[str, int]]:
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


# --------------------------------------------------------- tracers and valgrind


def parse_strace_summary(text: str) -> dict[str, dict[str, int]]:
    """``strace -c`` table -> {syscall: {"calls": n, "errors": n}} (no "total" row)."""
    out: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 5 or parts[0].startswith(("%", "-")) or parts[-1] == "total":
            continue
        try:
            float(parts[0])
            numbers = [int(x) for x in parts[3:-1]]
        except ValueError:
            continue
        if not numbers:
            continue
        calls, errors = numbers[0], (numbers[1] if len(numbers) > 1 else 0)
        out[parts[-1]] = {"calls": calls, "errors": errors}
    return out


def callgrind(out: Path | str) -> list[str]:
    """The prefix that runs a command under valgrind's callgrind, writing to `out`."""
    return [need("valgrind"), "--tool=callgrind", "--cache-sim=no", f"--callgrind-out-file={out}"]


def callgrind_count(valgrind_output: str) -> int:
    """The user-space instructions callgrind counted, from its summary on stderr."""
    for line in valgrind_output.splitlines():
        if "Collected :" in line:
            return int(line.rsplit(":", 1)[1])
    raise BenchError(f"no callgrind summary:\n{valgrind_output[-2000:]}")


# ----------------------------------------------------------------------- clients


def tcp_pair(nodelay: bool = False, blocking: bool = True) -> tuple[socket.socket, socket.socket]:
    """Two ends of one loopback TCP connection."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    for s in (a, b):
        if nodelay:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(blocking)
    return a, b


def round_trip(port: int, data: bytes, expect: int) -> None:
    """One connection to 127.0.0.1:`port` through an echo: `data` sent, `expect` bytes
    read back (an OSError if they do not come), closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(data)
        got = 0
        while got < expect:
            chunk = c.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed after {got} of {expect} bytes")
            got += len(chunk)


def in_threads(work: Callable[[], None], threads: int) -> float:
    """Run `work` in `threads` threads at once; the wall time until all have ended."""
    workers = [threading.Thread(target=work) for _ in range(threads)]
    started = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.monotonic() - started


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


# -------------------------------------------------------------------------- wrk

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


def wrk_argv(
    port: int,
    path: str = "/small",
    conns: int = 50,
    seconds: float = 5,
    close: bool = False,
    pin: list[str] | None = None,
) -> list[str]:
    """wrk with one thread and `conns` connections for `seconds` against
    http://127.0.0.1:PORT/PATH; with `close`, every request a new connection."""
    argv = [*(pin or []), "wrk", "-t1", f"-c{conns}", f"-d{round(seconds)}s", "--latency"]
    argv += ["--timeout", "5s"]
    if close:
        argv += ["-H", "Connection: close"]
    return [*argv, f"http://127.0.0.1:{port}{path}"]


def wrk(
    port: int,
    path: str = "/small",
    conns: int = 50,
    seconds: float = 5,
    close: bool = False,
    pin: list[str] | None = None,
) -> dict[str, Any]:
    """One wrk run (`wrk_argv`), its figures (`parse_wrk`)."""
    argv = wrk_argv(port, path, conns, seconds, close, pin)
    return parse_wrk(run_client(argv, timeout=seconds + 30))


# ---------------------------------------------------------------------- results


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def save_result(folder: Path, kind: str, data: Any, stamp: dt.datetime | None = None) -> Path:
    """Write a run's result to FOLDER/KIND-YYYYmmdd-HHMMSS.json (`stamp`, else now) and
    say where."""
    path = write_json(folder / f"{kind}-{(stamp or dt.datetime.now()):%Y%m%d-%H%M%S}.json", data)
    print(f"\nwrote {path}")
    return path


def print_table(title: str | None, head: list[str], rows: list[list[str]], left: int = 1) -> None:
    """A plain-text table: the first `left` columns left-aligned, the rest right-aligned;
    with a `title`, after a blank line and with a rule under the head."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    if title is not None:
        print(f"\n{title}")
    print(line(head))
    if title is not None:
        print("-" * len(line(head)))
    for r in rows:
        print(line(r))
