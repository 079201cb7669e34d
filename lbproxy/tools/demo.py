"""`lbproxy demo`: three demo real servers, their SNMP agents and the proxy, on loopback.

One trio program runs everything:

- three demo real servers (`alpha`, `bravo`, `charlie`) on ports the OS picks; a demo
  real server speaks first -- its name and a newline -- then echoes until the client
  closes;
- one small SNMPv2c agent per demo real server (`snmp_agent.serve_v2c_agent`, UDP on
  127.0.0.1, a port the OS picks), answering the default `snmp.oid` from a dict the
  demo changes: alpha 30, bravo 20, charlie 10 at the start;
- a `Server` with two virtual servers in front of the same three demo servers:
  `demo` (scheduler `wlc`, static weights 1, 2, 3) on 127.0.0.1:PORT, and `demo-dwd`
  (scheduler `dwd`: each server's weight is the value its agent reports, polled every
  second) on PORT+1 (a free port with `--port 0`);
- the admin endpoint on 127.0.0.1 (the dashboard at `/`, `/metrics`, the API that
  `lbproxy status` and `lbproxy drain` use): port 9100, where those commands look by
  default, or a free port when 9100 is taken, with `--port 0`, or `--admin-port`; its
  admin socket (the default one, for that port), through which `lbproxy drain` changes
  a server with no token; and a token made for this run (printed), which the
  dashboard's buttons ask for, as over TCP every change needs one (SPEC §21);
- a control port on 127.0.0.1 (a port the OS picks) taking lines `NAME VALUE` (answered
  `ok NAME VALUE`), so another terminal changes a reported value with `nc` or bash's
  `/dev/tcp`; on a terminal the same lines can be typed into the demo itself.

`on_no_answer: hold` (stale_after 3 s) for `demo-dwd`: the agents are in-process and
answer at once, so the policy only matters for `NAME none` (the agent then answers
noSuchInstance) -- hold shows that a missed poll does not drain a server at once, and the
weight still drops to 0 three seconds later; a loaded demo (someone benchmarking it)
that misses one poll keeps its weights instead of flickering to 0.

Output (SPEC §1, §9): the first line on stdout is `lbproxy demo: connect to HOST:PORT`
(the contract scripts read), the second `dashboard: http://127.0.0.1:PORT/`
(the dashboard's URL before anything else the demo says), then the dwd address and the
control command, then how to try it, then a per-server
table of both virtual servers read from `pool.statistics(now)` -- a `rich.live.Live` view
on a terminal, one plain line per server and virtual server every second otherwise
(tests, pipes). SIGINT/SIGTERM stop everything with exit code 0; a listen address that
cannot be bound prints a message naming it and gives exit code 1.
"""

from __future__ import annotations

import logging
import math
import os
import re
import secrets
import signal
import socket
import sys
import termios
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import trio
from rich.console import Console, Group
from rich.live import Live
from rich.logging import RichHandler
from rich.text import Text

from lbproxy.config.model import (
    Address,
    AdminConfig,
    Config,
    GlobalConfig,
    HealthCheckConfig,
    RealServerConfig,
    SnmpConfig,
    VirtualServerConfig,
)
from lbproxy.core.pool import Pool
from lbproxy.dataplane.listener import failure_lines, listen_socket
from lbproxy.runtime import logs
from lbproxy.runtime.server import BindError, Server
from lbproxy.tools.render import dwd_table, plain_lines, stats_table
from lbproxy.tools.snmp_agent import serve_v2c_agent

HOST = "127.0.0.1"
VIRTUAL_SERVER = "demo"
DWD_VIRTUAL_SERVER = "demo-dwd"
_NAMES = (VIRTUAL_SERVER, DWD_VIRTUAL_SERVER)
# name, static weight (demo, wlc), the value its SNMP agent reports at the start (demo-dwd)
DEMO_SERVERS = (("alpha", 1, 30), ("bravo", 2, 20), ("charlie", 3, 10))
DWD_STATIC_WEIGHT = 1  # demo-dwd's static weights: used only when every dynamic one is 0
OID = SnmpConfig().oid  # the default `snmp.oid` (UCD-SNMP laLoadInt.1)
COMMUNITY = "public"
SNMP = SnmpConfig(
    host=HOST,
    community=COMMUNITY,
    interval=1.0,
    timeout=0.5,
    retries=1,
    on_no_answer="hold",  # see the module docstring
    stale_after=3.0,
)
MAX_VALUE = 2**31 - 1  # SNMP Integer32
DRAIN_TIMEOUT = 1.0  # Ctrl-C: held connections get this long before they are closed
LIVE_REFRESH = 0.25  # seconds between two renders of the live view (terminal)
PLAIN_REFRESH = 1.0  # seconds between two blocks of plain lines (not a terminal)
CONTROL_WAIT = 30.0  # a control connection may take this long to send its first line
CONTROL_LINGER = 0.5  # after an answer, this long for another line, then the port closes
MAX_LINE = 200  # longest control line (and typed line) accepted
ADMIN_PORT = 9100  # lbproxy's default admin port: `lbproxy status` finds the demo there


@dataclass
class Backend:
    name: str
    weight: int  # static weight in `demo`
    address: Address
    agent: Address | None = None  # its SNMP agent
    values: dict[str, int | None] = field(default_factory=dict)  # what the agent answers

    @property
    def value(self) -> int | None:
        return self.values.get(OID)

    @property
    def value_text(self) -> str:
        return "none" if self.value is None else str(self.value)


def run(port: int = 8080, duration: float | None = None, admin_port: int | None = None) -> int:
    """Run the demo until Ctrl-C/SIGTERM (or `duration` seconds); returns the exit code.

    `admin_port`: the admin endpoint's port; None: 9100, or a free port when 9100 is taken
    or `port` is 0 (free ports everywhere); 0: a free port."""
    logs.configure("text", "warning")  # keep the table readable
    try:
        admin = admin_socket(admin_port, free=port == 0)
    except BindError as exc:
        print(f"lbproxy demo: {exc} (try --admin-port 0 for a free port)", file=sys.stderr)
        return 1
    port, dwd_port, reserved = listen_ports(port)
    tty = sys.stdout.isatty()
    keyboard = tty and _foreground_terminal(sys.stdin)
    failures: list[str] = []
    try:
        trio.run(_main, port, dwd_port, reserved, duration, tty, keyboard, admin)
    except* BindError as group:
        failures.extend(failure_lines(group))
    except* KeyboardInterrupt:
        pass  # Ctrl-C before the signal receiver was installed: still a clean stop
    finally:
        _release(reserved)
    for failure in failures:
        print(f"lbproxy demo: {failure} (try --port 0 for free ports)", file=sys.stderr)
    return 1 if failures else 0


def listen_ports(port: int) -> tuple[int, int, list[socket.socket]]:
    """`demo` on PORT and `demo-dwd` on PORT+1; free ports the OS picks for port 0.

    A picked port comes with a socket bound to it that keeps it from the demo real
    servers (also on ports the OS picks) until `_release`, just before the Server binds.
    """
    reserved = []
    for _ in range(2 if port == 0 else 0 if port < 65535 else 1):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((HOST, 0))
        reserved.append(sock)
    ports = [sock.getsockname()[1] for sock in reserved]
    if port == 0:
        return ports[0], ports[1], reserved
    return port, ports[0] if ports else port + 1, reserved


def admin_socket(port: int | None, *, free: bool) -> socket.socket:
    """The admin endpoint's listening socket (bound here, so the printed URL is sure)."""
    if port is not None:
        return listen_socket(Address(HOST, port))
    if not free:
        try:
            return listen_socket(Address(HOST, ADMIN_PORT))
        except BindError:
            pass  # another lbproxy (or anything) has 9100: the demo takes a free port
    return listen_socket(Address(HOST, 0))


def _release(reserved: list[socket.socket]) -> None:
    for sock in reserved:
        sock.close()


def demo_config(
    port: int, dwd_port: int, backends: Sequence[Backend], admin: Address | None = None
) -> Config:
    """The demo's configuration, built in code: what a YAML file would say."""
    health_check = HealthCheckConfig(type="tcp", interval=1.0, timeout=0.5, rise=2, fall=2)
    wlc = VirtualServerConfig(
        name=VIRTUAL_SERVER,
        listen=(Address(HOST, port),),
        scheduler="wlc",
        connect_timeout=1.0,
        real_servers=tuple(
            RealServerConfig(name=b.name, address=b.address, weight=b.weight) for b in backends
        ),
        health_check=health_check,
    )
    dwd = VirtualServerConfig(
        name=DWD_VIRTUAL_SERVER,
        listen=(Address(HOST, dwd_port),),
        scheduler="dwd",
        connect_timeout=1.0,
        real_servers=tuple(
            RealServerConfig(
                name=b.name,
                address=b.address,
                weight=DWD_STATIC_WEIGHT,
                snmp=_agent_snmp(b),
            )
            for b in backends
        ),
        health_check=health_check,
        snmp=SNMP,
    )
    return Config(
        global_=GlobalConfig(admin=AdminConfig(listen=admin), drain_timeout=DRAIN_TIMEOUT),
        virtual_servers=(wlc, dwd),
    )


def _agent_snmp(backend: Backend) -> SnmpConfig:
    assert backend.agent is not None
    return replace(SNMP, host=backend.agent.host, port=backend.agent.port)


def apply_command(backends: Mapping[str, Backend], line: str) -> tuple[str, str | None]:
    """One control line: `NAME VALUE`, `NAME none`, or `list` (or nothing).

    Returns the answer and, when a value changed, what to tell the demo's user."""
    words = line.split()
    if not words or words == ["list"]:
        return " ".join(f"{b.name} {b.value_text}" for b in backends.values()), None
    if len(words) == 2 and words[0] in backends:
        backend, text = backends[words[0]], words[1].lower()
        if text == "none":
            backend.values[OID] = None  # the agent answers noSuchInstance
            return (
                f"ok {backend.name} none",
                f"{backend.name}'s agent now answers noSuchInstance (no number): "
                f"on_no_answer hold keeps its weight for {SNMP.stale_after:g}s, then 0",
            )
        if re.fullmatch(r"[0-9]{1,10}", text) and int(text) <= MAX_VALUE:
            backend.values[OID] = int(text)
            return (
                f"ok {backend.name} {int(text)}",
                f"{backend.name} now reports {int(text)}; demo-dwd's weight follows "
                f"at the next poll (every {SNMP.interval:g}s)",
            )
    names = " ".join(backends)
    return (
        f"error: expected NAME VALUE (e.g. bravo 80); NAME: {names}; "
        f"VALUE: 0..{MAX_VALUE} or none; 'list' shows the values",
        None,
    )


# -- the program --------------------------------------------------------------------


class View:
    """What the display shows, and where the changes from the control port go."""

    def __init__(self, backends: Sequence[Backend], tty: bool, keyboard: bool) -> None:
        self.backends = {b.name: b for b in backends}
        self.tty = tty
        self.keyboard = keyboard
        self.pools: list[Pool] = []
        self.control: Address | None = None
        self.typed = ""  # the line being typed (terminal)
        self.message = ""  # the last answer or change (terminal)
        self.changed = trio.Event()

    def command(self, line: str, source: str) -> str:
        answer, change = apply_command(self.backends, line)
        if self.tty:
            self.message = answer if change is None else f"{change} (from the {source})"
            self.poke()
        elif change is not None:
            print(f"lbproxy demo: {change} (from the {source})", flush=True)
        return answer

    def poke(self) -> None:
        self.changed.set()

    def reported(self) -> dict[str, str]:
        return {name: b.value_text for name, b in self.backends.items()}

    def render(self) -> Group:
        wlc, dwd = (pool.statistics(trio.current_time()) for pool in self.pools)
        parts: list = [stats_table(wlc), Text(), dwd_table(dwd, self.reported()), Text()]
        hint = f"echo 'bravo 80' > /dev/tcp/{HOST}/{self.control_port}"
        if self.keyboard:
            parts.append(Text(f"type NAME VALUE + Enter, or: {hint}", style="dim"))
            parts.append(Text.assemble(("> ", "bold"), self.typed, ("_", "blink")))
        else:
            parts.append(Text(f"change a value: {hint}", style="dim"))
        if self.message:
            parts.append(Text(self.message, style="red" if self.message[:6] == "error:" else ""))
        return Group(*parts)

    @property
    def control_port(self) -> int:
        return self.control.port if self.control else 0


async def _main(
    port: int,
    dwd_port: int,
    reserved: list[socket.socket],
    duration: float | None,
    tty: bool,
    keyboard: bool,
    admin_sock: socket.socket,
) -> None:
    # Installed first: from here on SIGINT/SIGTERM are messages, not KeyboardInterrupt.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            backends = []
            for name, weight, value in DEMO_SERVERS:
                demo_port = await nursery.start(_demo_server, name)
                backend = Backend(name, weight, Address(HOST, demo_port), values={OID: value})
                agent_port = await nursery.start(_agent, backend)
                backend.agent = Address(HOST, agent_port)
                backends.append(backend)
            view = View(backends, tty, keyboard)
            _release(reserved)
            admin = Address(HOST, admin_sock.getsockname()[1])
            token = secrets.token_urlsafe(12)  # the dashboard's buttons ask for it
            server = Server(
                demo_config(port, dwd_port, backends, admin),
                admin_token=token,
                admin_sock=admin_sock,
            )
            served = trio.Event()
            await nursery.start(_serve, server, served)  # raises BindError
            view.pools = [server.virtual_servers[name].pool for name in _NAMES]
            control_port = await nursery.start(_control_server, view)
            view.control = Address(HOST, control_port)

            print(f"lbproxy demo: connect to {HOST}:{port}", flush=True)
            print(f"dashboard: http://{admin}/", flush=True)
            socket_path = server.admin_socket.path if server.admin_socket is not None else None
            _print_intro(
                port, dwd_port, control_port, backends, keyboard, admin, token, socket_path
            )
            display = trio.CancelScope()
            nursery.start_soon(_display, display, view)

            with trio.move_on_after(math.inf if duration is None else duration):
                async for _ in signals:
                    break
            display.cancel()
            server.stop()
            with trio.move_on_after(DRAIN_TIMEOUT + 1.0):
                await served.wait()
            nursery.cancel_scope.cancel()  # the demo real servers, agents, control port
    if not tty:
        for pool in view.pools:
            for line in plain_lines(
                pool.statistics(trio.current_time()),
                "final",
                view.reported(),
                virtual_servers=_NAMES,
            ):
                print(line)
    print("lbproxy demo: stopped", flush=True)


async def _serve(server: Server, served: trio.Event, task_status: trio.TaskStatus[Server]) -> None:
    try:
        await server.serve(task_status=task_status, handle_signals=False)
    finally:
        served.set()


async def _demo_server(name: str, task_status: trio.TaskStatus[int]) -> None:
    """A demo real server: says its name and a newline, then echoes until EOF."""

    async def handler(stream: trio.SocketStream) -> None:
        try:
            await stream.send_all(f"{name}\n".encode())
            async for data in stream:
                await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client reset: nothing to do, serve_listeners closes the stream

    listeners = await trio.open_tcp_listeners(0, host=HOST)
    port = listeners[0].socket.getsockname()[1]
    task_status.started(port)
    await trio.serve_listeners(handler, listeners)


async def _agent(backend: Backend, task_status: trio.TaskStatus[int]) -> None:
    """The demo real server's SNMP agent: answers GETs from `backend.values`."""
    with trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM) as sock:
        await sock.bind((HOST, 0))
        task_status.started(sock.getsockname()[1])
        await serve_v2c_agent(sock, backend.values, COMMUNITY)


async def _control_server(view: View, task_status: trio.TaskStatus[int]) -> None:
    """Lines `NAME VALUE` on a loopback TCP port, each answered with one line."""
    listeners = await trio.open_tcp_listeners(0, host=HOST)
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(partial(_control_connection, view=view), listeners)


async def _control_connection(stream: trio.SocketStream, view: View) -> None:
    # `printf 'bravo 80\n' | nc HOST PORT` keeps the connection open after its input
    # ends (OpenBSD nc without -N), so the port closes CONTROL_LINGER after an answer
    # when nothing more comes: the command returns by itself.
    buffer = b""
    wait = CONTROL_WAIT
    try:
        while True:
            with trio.move_on_after(wait) as timer:
                data = await stream.receive_some(MAX_LINE + 1)
            if timer.cancelled_caught:
                return
            if not data:  # EOF: a last line without its newline still counts
                if buffer.strip():
                    await _answer(stream, view, buffer)
                return
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                await _answer(stream, view, line)
                wait = CONTROL_LINGER
            if len(buffer) > MAX_LINE:
                await stream.send_all(b"error: line too long\n")
                return
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the client went away (bash's /dev/tcp closes without reading)


async def _answer(stream: trio.SocketStream, view: View, line: bytes) -> None:
    answer = view.command(line.decode(errors="replace"), "control port")
    await stream.send_all(f"{answer}\n".encode())


# -- output -------------------------------------------------------------------------


def _print_intro(
    port: int,
    dwd_port: int,
    control_port: int,
    backends: Sequence[Backend],
    keyboard: bool,
    admin: Address,
    token: str,
    socket_path: str | None,
) -> None:
    example = f"{backends[1].name} 80"
    # On this host the CLI finds the admin socket by itself; without one (no runtime
    # folder) it needs the token over TCP.
    cli = "lbproxy" if socket_path else f"LBPROXY_TOKEN={token} lbproxy"
    weights = [b.weight for b in backends]
    values = [b.value or 0 for b in backends]
    # Clients made of what every machine that runs the demo has (python3, bash): a fresh
    # Debian has no nc.
    one = (
        "python3 -c \"import socket; c=socket.create_connection(('127.0.0.1',"
        f' {port})); print(c.recv(64).decode().strip())"'
    )
    python = (
        "python3 -c \"import socket; s=[socket.create_connection(('127.0.0.1',"
        f' {port})) for _ in range(12)]; print(*[c.recv(64).decode().strip() for c in s])"'
    )
    control = f"echo '{example}' > /dev/tcp/{HOST}/{control_port}"
    lines = [
        f"lbproxy demo: {DWD_VIRTUAL_SERVER} (weights from SNMP) on {HOST}:{dwd_port}",
        f"lbproxy demo: change a reported value: {control}   (bash)",
        "",
        "Three demo real servers on loopback answer with their name, then echo what you send.",
        f"Each has a small SNMP agent (v2c, community {COMMUNITY}) reporting a number:",
    ]
    for b in backends:
        lines.append(
            f"  {b.name:<8} {b.address!s:<16} agent {b.agent!s:<16} reports {b.value_text}"
        )
    lines += [
        "",
        f"{VIRTUAL_SERVER:<9} {HOST}:{port:<5}  wlc, static weights {_list(weights)}: "
        f"12 held connections split {_list(_split(weights, 12))}",
        f"{DWD_VIRTUAL_SERVER:<9} {HOST}:{dwd_port:<5}  dwd, weight = reported value, polled "
        f"every {SNMP.interval:g}s: split {_list(_split(values, 12))}",
        f"Try:  {one}",
        f"      {python}",
        f"      nc {HOST} {port}   (talks and echoes; nc: apt-get install netcat-openbsd)",
        f"      (port {dwd_port} for {DWD_VIRTUAL_SERVER}). Short connections that close "
        "before the next",
        f"      one arrives find every server idle: wlc sends each to {backends[-1].name}.",
        "",
        f"The dashboard (http://{admin}/) shows both virtual servers; its drain, enable,",
        "disable and weight buttons change a server while connections are held (they ask",
        f"once for this demo's admin token: {token}). So does",
        f"  {cli} drain {VIRTUAL_SERVER} {backends[-1].name} --admin http://{admin}",
        f"and lbproxy status --admin http://{admin} prints the table; /metrics is there too.",
        "",
        f"Change what an agent reports; {DWD_VIRTUAL_SERVER}'s weights follow within a "
        "second or two:",
        f"  {control}   (bash)",
        f"  printf '{example}\\n' | nc {HOST} {control_port}     (answers: ok {example})",
    ]
    if keyboard:
        lines.append(f"  or type  {example}  and Enter here")
    lines += [
        f"  NAME none: its agent answers with no number; on_no_answer hold keeps the weight "
        f"{SNMP.stale_after:g}s, then 0",
        f"Read a value: snmpget -v2c -c {COMMUNITY} {backends[1].agent} {OID}",
        "Ctrl-C stops everything.",
        "",
    ]
    print("\n".join(lines), flush=True)


def _split(weights: Sequence[int], connections: int) -> list[int]:
    total = sum(weights)
    return [connections * w // total if total else 0 for w in weights]


def _list(numbers: Sequence[int]) -> str:
    return ", ".join(str(n) for n in numbers)


async def _display(scope: trio.CancelScope, view: View) -> None:
    with scope:
        if view.tty:
            await _live(view)
        else:
            start = trio.current_time()
            reported = view.reported
            while True:
                await trio.sleep(PLAIN_REFRESH)
                elapsed = trio.current_time() - start
                for pool in view.pools:
                    for line in plain_lines(
                        pool.statistics(trio.current_time()),
                        f"{elapsed:.0f}s",
                        reported(),
                        virtual_servers=_NAMES,
                    ):
                        print(line)
                sys.stdout.flush()


async def _live(view: View) -> None:
    console = Console(highlight=False)
    root = logging.getLogger("lbproxy")
    handlers = root.handlers[:]
    root.handlers[:] = [RichHandler(console=console, show_path=False)]  # above the view
    try:
        with Live(view.render(), console=console, auto_refresh=False) as live:
            async with trio.open_nursery() as nursery:
                if view.keyboard:
                    nursery.start_soon(_keyboard, view)
                while True:
                    with trio.move_on_after(LIVE_REFRESH):
                        await view.changed.wait()
                    view.changed = trio.Event()
                    live.update(view.render(), refresh=True)
    finally:
        root.handlers[:] = handlers


def _foreground_terminal(stream) -> bool:
    """True when `stream` is a terminal this process may read (not a background job)."""
    try:
        fd = stream.fileno()
        return os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


_ESCAPES = re.compile(r"\x1b(?:\[[0-9;?]*[ -/]*[@-~]|O.|.)?")  # arrow keys and the like


def edit(typed: str, keys: str) -> tuple[str, list[str]]:
    """Apply keystrokes to the line being typed; returns it and the lines entered."""
    entered = []
    for ch in _ESCAPES.sub("", keys):
        if ch in "\r\n":
            entered.append(typed)
            typed = ""
        elif ch in "\x7f\b":
            typed = typed[:-1]
        elif ch == "\x15":  # Ctrl-U
            typed = ""
        elif ch.isprintable() and len(typed) < MAX_LINE:
            typed += ch
    return typed, entered


async def _keyboard(view: View) -> None:
    """Read typed lines on the terminal; the view echoes them (the terminal does not,
    or the echo would scroll the live view)."""
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    mode = termios.tcgetattr(fd)
    mode[3] &= ~(termios.ECHO | termios.ICANON)  # lflag: no echo, a key at a time
    mode[6][termios.VMIN] = 1
    mode[6][termios.VTIME] = 0
    termios.tcsetattr(fd, termios.TCSANOW, mode)  # ISIG stays: Ctrl-C is still SIGINT
    try:
        while True:
            await trio.lowlevel.wait_readable(fd)
            data = os.read(fd, 1024)
            if not data:
                return
            view.typed, entered = edit(view.typed, data.decode(errors="ignore"))
            for line in entered:
                if line.strip():
                    view.command(line, "keyboard")
            view.poke()
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
