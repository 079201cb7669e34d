"""The reactor's cost per event, compiled against pure (issue 26; not a test).

    .venv/bin/python bench/bench_reactor.py [--pumps 64] [--rounds 2000] [--repeat 3]
    .venv/bin/python bench/bench_reactor.py --callgrind    # instructions, exact
    .venv/bin/python bench/bench_reactor.py --callgrind --keep /tmp/cg  # and the profiles
    .venv/bin/python bench/bench_reactor.py --callgrind --new-pump  # production's pumps

P pumps between real loopback TCP connections in one trio run; each round writes a
100-byte chunk into every client socket, then reads it at every server socket, then
the same the other way (a request and a response per connection and round). All P
chunks are in the kernel before the reactor runs, so every round is exactly two batches
of P events, whichever path runs: the work per event is the same, only its cost differs.
The endpoints' sends and receives run in this process too and are the same on both
paths. Each measurement is a child process (the path is chosen at import), compiled and
pure alternating; CPU time from getrusage, or, with --callgrind, the user-space
instructions valgrind counts (exact, whatever the machine's load), the run with
--rounds 0 subtracted (start-up, the connections' set-up). --keep DIR keeps valgrind's
output files there (MODE-ROUNDS.out) for callgrind_annotate. The pumps are what
production makes: the run's reactor's (pump.reactor().open), C or pure. (--new-pump is
accepted for the command lines of older trees, where it chose those.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from functools import partial

from common import callgrind_count, entry, own_cpu, path_env, tcp_pair

PAYLOAD = b"x" * 100


def child(pumps: int, rounds: int, new_pump: bool) -> None:
    import math

    import trio

    from lbproxy.net import compiled
    from lbproxy.net.pump import reactor

    pair = partial(tcp_pair, nodelay=True, blocking=False)

    async def main() -> None:
        ends = []
        for _ in range(pumps):
            client, proxy_client = pair()
            proxy_server, server = pair()
            reactor().open(proxy_client.detach(), proxy_server.detach(), b"", math.inf, None)
            ends.append((client, server))
        await trio.sleep(0.01)
        u0, s0 = own_cpu()
        for _ in range(rounds):
            for a, b in ((0, 1), (1, 0)):
                for e in ends:
                    e[a].send(PAYLOAD)
                for e in ends:
                    got = 0
                    while got < len(PAYLOAD):
                        try:
                            got += len(e[b].recv(65536))
                        except BlockingIOError:
                            await trio.lowlevel.wait_readable(e[b])
        u1, s1 = own_cpu()
        events = max(1, rounds * 2 * pumps)
        print(
            f"{compiled.IMPLEMENTATION} {(u1 - u0) / events * 1e6:.3f} "
            f"{(s1 - s0) / events * 1e6:.3f}"
        )

    trio.run(main)


def run(
    mode: str,
    pumps: int,
    rounds: int,
    callgrind: bool,
    keep: str | None = None,
    new_pump: bool = False,
) -> tuple[float, ...]:
    env = path_env(mode)
    argv = [sys.executable, __file__, "--child", "--pumps", str(pumps), "--rounds", str(rounds)]
    if new_pump:
        argv.append("--new-pump")
    if not callgrind:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
        name, user, system = out.stdout.split()
        assert name == mode, (name, mode)
        return float(user), float(system)
    with tempfile.TemporaryDirectory() as tmp:
        where = f"{keep}/{mode}-{rounds}.out" if keep else f"{tmp}/o"
        vg = callgrind(where)
        out = subprocess.run(vg + argv, env=env, capture_output=True, text=True, check=True)
    return (float(callgrind_count(out.stderr)),)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pumps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--callgrind", action="store_true")
    p.add_argument("--keep", metavar="DIR", help="with --callgrind: keep valgrind's output here")
    p.add_argument(
        "--new-pump",
        action="store_true",
        help=argparse.SUPPRESS,  # what older trees needed
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.pumps, a.rounds, a.new_pump)
        return
    modes = ("compiled", "pure")
    kind = "reactor().open"
    print(f"load average {os.getloadavg()[0]:.1f}; {a.pumps} {kind} pumps, {a.rounds} rounds")
    if a.callgrind:
        rounds = min(a.rounds, 200)
        if a.keep:
            os.makedirs(a.keep, exist_ok=True)
        for mode in modes:
            base = run(mode, a.pumps, 0, True, a.keep, a.new_pump)[0]
            full = run(mode, a.pumps, rounds, True, a.keep, a.new_pump)[0]
            per = (full - base) / (rounds * 2 * a.pumps)
            print(f"{mode:9s} {per:10,.0f} instructions per event (reactor + both endpoints)")
        return
    results: dict[str, list[tuple[float, ...]]] = {m: [] for m in modes}
    for _ in range(a.repeat):
        for mode in modes:
            results[mode].append(run(mode, a.pumps, a.rounds, False, None, a.new_pump))
    for mode in modes:
        user = statistics.median(r[0] for r in results[mode])
        system = statistics.median(r[1] for r in results[mode])
        spread = ", ".join(f"{r[0]:.2f}" for r in results[mode])
        print(
            f"{mode:9s} user {user:6.2f} us + system {system:6.2f} us per event "
            f"(user per run: {spread})"
        )


if __name__ == "__main__":
    entry(main)
