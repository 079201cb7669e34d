"""What a DNS discovery round costs on the event loop, by the number of servers.

    .venv/bin/python bench/bench_discovery.py

The usual round brings the same answer again; a changed round (one address in, the
previous newcomer out) converts the answer, merges it with the static servers and applies
it through `Pool.reconfigure`, the reload's path. No DNS traffic: the answers are the
address lists the resolver would give (lbproxy.control.discovery.resolve does the querying).
"""

from __future__ import annotations

import argparse
import time

from common import entry

from lbproxy.config.model import Address, DnsDiscoveryConfig, VirtualServerConfig
from lbproxy.control.discovery import LastAnswer
from lbproxy.core.discovery_model import DiscoveryState, resolution, servers_from_addresses
from lbproxy.core.pool import Pool

ROUNDS = 20


def bench(n: int) -> tuple[float, float]:
    vs = VirtualServerConfig(
        name="vs",
        listen=(Address("127.0.0.1", 8080),),
        real_servers=(),
        discovery=DnsDiscoveryConfig(name="web.test", type="A", port=80),
    )
    assert vs.discovery is not None
    ips = tuple(sorted(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(n)))
    state, last = DiscoveryState("vs", vs.discovery), LastAnswer()

    def answer(raw: tuple[str, ...], now: float) -> bool:
        outcome = last.convert(
            raw, lambda: resolution(*servers_from_addresses(raw, 80, last.addresses))
        )
        return state.record(outcome, now)

    answer(ips, 0.0)
    pool = Pool(state.merged(vs), 0.0)
    start = time.perf_counter()
    for r in range(ROUNDS):
        assert not answer(tuple(sorted(ips)), 1.0 + r)
    unchanged = (time.perf_counter() - start) / ROUNDS
    start = time.perf_counter()
    for r in range(ROUNDS):
        assert answer(tuple(sorted((*ips, f"11.0.{r // 256}.{r % 256}"))), 100.0 + r)
        pool.reconfigure(state.merged(vs), 100.0 + r, keep_runtime=True)
    changed = (time.perf_counter() - start) / ROUNDS
    return unchanged, changed


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    print("servers  unchanged round  changed round")
    for n in (10, 100, 1000, 5000):
        unchanged, changed = bench(n)
        print(f"{n:7d}  {unchanged * 1000:12.3f} ms  {changed * 1000:10.1f} ms")


if __name__ == "__main__":
    entry(main)
