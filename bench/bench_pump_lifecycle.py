"""Instructions per pump lifecycle, compiled against pure (issue 26; not a test).

    .venv/bin/python bench/bench_pump_lifecycle.py [--pumps 32] [--rounds 20]

What a connection costs the pump from the moment both descriptors are connected to the
report of its end, and nothing else: ``reactor().open(client, server, b"", 60.0,
on_end)`` (both descriptors registered, the idle deadline armed), the two FINs (client
and server both shut their write side, in one batch), the end (both descriptors closed,
the pipes back) and the ``on_end`` call. Each round makes P pairs of loopback TCP
connections, pumps them and ends them; a control run makes and closes the same
connections without a pump, and its count is subtracted, so what is left is the pump's
own work. User-space instructions counted by valgrind's callgrind (exact, whatever the
machine's load); each measurement is a child process (the path is chosen at import).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
from functools import partial

from common import callgrind, callgrind_count, entry, path_env, tcp_pair


def child(pumps: int, rounds: int, control: bool) -> None:
    import trio

    from lbproxy.net import pump as pump_module

    def open_pump(client: int, server: int, on_end: object) -> None:
        if hasattr(pump_module, "reactor") and hasattr(pump_module.reactor(), "open"):
            pump_module.reactor().open(client, server, b"", 60.0, on_end)
            return
        # an older tree (a --base tree, PYTHONPATH): the pump before its API
        new_pump = getattr(pump_module, "new_pump", pump_module.Pump)
        p = new_pump(client, server, pump_module.Flow(60.0), close_sockets=True)
        p.on_end = on_end
        p.start()

    pair = partial(tcp_pair, blocking=False)

    async def main() -> None:
        ended: list[object] = []
        for _ in range(rounds):
            done = trio.Event()

            def on_end(p: object, done: trio.Event = done) -> None:
                ended.append(p)
                if len(ended) == pumps:
                    done.set()

            ends = []
            for _ in range(pumps):
                client, proxy_client = pair()
                proxy_server, server = pair()
                ends.append((client, server))
                if control:
                    proxy_client.close()
                    proxy_server.close()
                    continue
                open_pump(proxy_client.detach(), proxy_server.detach(), on_end)
            await trio.sleep(0)
            for client, server in ends:
                client.shutdown(socket.SHUT_WR)
                server.shutdown(socket.SHUT_WR)
            if not control:
                await done.wait()
            ended.clear()
            for client, server in ends:
                client.close()
                server.close()
        print("ok")

    trio.run(main)


def run(mode: str, pumps: int, rounds: int, control: bool) -> int:
    env = path_env(mode)
    argv = [sys.executable, __file__, "--child", "--pumps", str(pumps), "--rounds", str(rounds)]
    if control:
        argv.append("--control")
    with tempfile.TemporaryDirectory() as tmp:
        vg = callgrind(f"{tmp}/o")
        out = subprocess.run(vg + argv, env=env, capture_output=True, text=True, check=True)
    return callgrind_count(out.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pumps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--modes", default="compiled,pure")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--control", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.pumps, a.rounds, a.control)
        return
    n = a.pumps * a.rounds
    for mode in a.modes.split(","):
        pumped = run(mode, a.pumps, a.rounds, False)
        control = run(mode, a.pumps, a.rounds, True)
        per = (pumped - control) / n
        print(f"{mode:9s} {per:10,.0f} instructions per pump (start, two FINs, end, on_end)")


if __name__ == "__main__":
    entry(main)
