"""`lbproxy demo`: three demo real servers and the proxy in front of them, on loopback.

One trio program runs everything: three demo real servers (`alpha`, `bravo`, `charlie`,
weights 1, 2, 3) on ports the OS picks, and a `Server` with one virtual server `demo`
(scheduler `wlc`) on 127.0.0.1:PORT. A demo real server speaks first -- its name and a
newline -- then echoes until the client closes.

Output (SPEC §1, §9): the first line on stdout is `lbproxy demo: connect to HOST:PORT`,
then how to try it, then a per-server table read from `pool.statistics()` -- a
`rich.live.Live` table on a terminal, one plain line per server every second otherwise
(tests, pipes). SIGINT/SIGTERM stop everything with exit code 0; a listen address that
cannot be bound prints a message naming it and gives exit code 1.
"""

from __future__ import annotations

import math
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import trio
from rich.console import Console
from rich.live import Live
from rich.table import Table

from lbproxy import logs
from lbproxy.config import (
    Address,
    AdminConfig,
    Config,
    GlobalConfig,
    HealthCheckConfig,
    RealServerConfig,
    VirtualServerConfig,
)
from lbproxy.pool import Pool, PoolStats
from lbproxy.server import BindError, Server

HOST = "127.0.0.1"
VIRTUAL_SERVER = "demo"
DEMO_SERVERS = (("alpha", 1), ("bravo", 2), ("charlie", 3))
DRAIN_TIMEOUT = 1.0  # Ctrl-C: held connections get this long before they are closed
LIVE_REFRESH = 0.25  # seconds between two renders of the live table (terminal)
PLAIN_REFRESH = 1.0  # seconds between two blocks of plain lines (not a terminal)


@dataclass(frozen=True)
class Backend:
    name: str
    weight: int
    address: Address


def run(port: int = 8080, duration: float | None = None) -> int:
    """Run the demo until Ctrl-C/SIGTERM (or `duration` seconds); returns the exit code."""
    logs.configure("text", "warning")  # keep the table readable
    if port == 0:
        port = free_port(HOST)
    failures: list[BindError] = []
    try:
        trio.run(_main, port, duration, sys.stdout.isatty())
    except* BindError as group:
        failures.extend(group.exceptions)  # type: ignore[arg-type]
    except* KeyboardInterrupt:
        pass  # Ctrl-C before the signal receiver was installed: still a clean stop
    for exc in failures:
        print(f"lbproxy demo: {exc} (try --port 0 for a free port)", file=sys.stderr)
    return 1 if failures else 0


def free_port(host: str = HOST) -> int:
    """A port the OS reports free right now (the Server binds the configured port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def demo_config(port: int, backends: Sequence[Backend]) -> Config:
    """The demo's configuration, built in code: what a YAML file would say."""
    virtual_server = VirtualServerConfig(
        name=VIRTUAL_SERVER,
        listen=(Address(HOST, port),),
        scheduler="wlc",
        connect_timeout=1.0,
        real_servers=tuple(
            RealServerConfig(name=b.name, address=b.address, weight=b.weight) for b in backends
        ),
        health_check=HealthCheckConfig(type="tcp", interval=1.0, timeout=0.5, rise=2, fall=2),
    )
    return Config(
        global_=GlobalConfig(admin=AdminConfig(listen=None), drain_timeout=DRAIN_TIMEOUT),
        virtual_servers=(virtual_server,),
    )


# -- the program --------------------------------------------------------------------


async def _main(port: int, duration: float | None, tty: bool) -> None:
    # Installed first: from here on SIGINT/SIGTERM are messages, not KeyboardInterrupt.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            backends = []
            for name, weight in DEMO_SERVERS:
                demo_port = await nursery.start(_demo_server, name)
                backends.append(Backend(name, weight, Address(HOST, demo_port)))
            server = Server(demo_config(port, backends))
            served = trio.Event()
            await nursery.start(_serve, server, served)  # raises BindError
            pool = server.virtual_servers[VIRTUAL_SERVER].pool

            print(f"lbproxy demo: connect to {HOST}:{port}", flush=True)
            _print_intro(port, backends)
            display = trio.CancelScope()
            nursery.start_soon(_display, display, pool, tty)

            with trio.move_on_after(math.inf if duration is None else duration):
                async for _ in signals:
                    break
            display.cancel()
            server.stop()
            with trio.move_on_after(DRAIN_TIMEOUT + 1.0):
                await served.wait()
            nursery.cancel_scope.cancel()  # the demo real servers
    if not tty:
        for line in plain_lines(pool.statistics(), label="final"):
            print(line)
    print("lbproxy demo: stopped", flush=True)


async def _serve(server: Server, served: trio.Event, task_status: trio.TaskStatus[None]) -> None:
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


# -- output -------------------------------------------------------------------------


def _print_intro(port: int, backends: Sequence[Backend]) -> None:
    lines = [
        "",
        "Three demo real servers run behind it on loopback, scheduler wlc "
        "(weighted least-connections):",
    ]
    for b in backends:
        lines.append(f"  {b.name:<8} {b.address!s:<16} weight {b.weight}")
    lines += [
        "Each one answers with its name, then echoes what you send. Try:",
        f"  nc {HOST} {port}",
        "  python3 -c \"import socket; s=[socket.create_connection(('127.0.0.1',"
        f' {port})) for _ in range(12)]; print(*[c.recv(64).decode().strip() for c in s])"',
        "Held connections split 1:2:3 (2, 4, 6 of 12). Short connections that close before",
        "the next one arrives find every server idle, so they take turns.",
        "Ctrl-C stops everything.",
        "",
    ]
    print("\n".join(lines), flush=True)


async def _display(scope: trio.CancelScope, pool: Pool, tty: bool) -> None:
    with scope:
        if tty:
            console = Console(highlight=False)
            with Live(stats_table(pool.statistics()), console=console, auto_refresh=False) as live:
                while True:
                    await trio.sleep(LIVE_REFRESH)
                    live.update(stats_table(pool.statistics()), refresh=True)
        else:
            start = trio.current_time()
            while True:
                await trio.sleep(PLAIN_REFRESH)
                elapsed = trio.current_time() - start
                for line in plain_lines(pool.statistics(), f"{elapsed:.0f}s"):
                    print(line)
                sys.stdout.flush()


def stats_table(stats: PoolStats) -> Table:
    table = Table(
        title=f"virtual server {stats.name} ({stats.scheduler}): "
        f"{stats.active_connections} active connection(s)",
        caption="weight: static/effective; total: connections sent so far (picks)",
    )
    table.add_column("real server")
    table.add_column("address")
    table.add_column("weight", justify="right")
    table.add_column("state")
    table.add_column("health")
    table.add_column("active", justify="right")
    table.add_column("total", justify="right")
    table.add_column("bytes in", justify="right")
    table.add_column("bytes out", justify="right")
    for rs in stats.real_servers:
        health = "[green]up[/]" if rs.health == "up" else "[red]down[/]"
        table.add_row(
            rs.name,
            rs.address,
            f"{_number(rs.weight_static)}/{_number(rs.weight_effective)}",
            rs.state,
            health,
            str(rs.active_connections),
            str(rs.connections_total),
            str(rs.bytes_in),
            str(rs.bytes_out),
        )
    return table


def plain_lines(stats: PoolStats, label: str) -> list[str]:
    """One line per real server, for output that is not a terminal."""
    width = max((len(rs.name) for rs in stats.real_servers), default=0)
    return [
        f"[{label:>5}] {rs.name:<{width}}  {rs.address}"
        f"  weight {_number(rs.weight_static)}/{_number(rs.weight_effective)}"
        f"  {rs.state}  {rs.health}  active {rs.active_connections}"
        f"  total {rs.connections_total}  in {rs.bytes_in}  out {rs.bytes_out}"
        for rs in stats.real_servers
    ]


def _number(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:.2f}"
