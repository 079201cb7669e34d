"""maglev: Maglev consistent hashing of the client address (Eisenbud et al., NSDI 2016).

The paper's §3.4. A lookup table of M slots (M prime, `table_size`, default 65537) is
filled from one permutation of the slots per server:

    offset = h1(name) mod M,  skip = h2(name) mod (M - 1) + 1
    permutation[j] = (offset + j * skip) mod M

and the population loop (Pseudocode 1): servers take turns, each claiming the next slot
of its permutation that is still empty, until the table is full. A client goes to
`table[h(client) mod M]`: one hash and one index per pick. Because every server walks
its own fixed permutation, removing one server changes little more than its own slots
(the paper measures a few % of the others), and adding it back gives the very same
table, slot for slot.

Weights (Envoy's weighted Maglev, `maglev_lb.cc`: a server's turns are in proportion to
its weight): the turns are earliest-deadline-first, server i's k-th turn (k = 0, 1, ...)
at virtual time k / w_i, ties in name order. Every server gets a turn at time 0, so each
holds at least one slot; after that its share of the table follows its effective weight
(±1 slot). With equal weights this is the paper's round robin exactly (a fast path
without the heap gives the same table). Servers are ordered by name, not by
configuration order, so two configurations listing the same servers in another order
still agree.

Hashes are fixed functions, never Python's per-process randomised `hash()`: BLAKE2b of
the server name (its two 64-bit halves are h1 and h2; computed once per name and table
size), and CRC-32 (zlib, in C: ~0.1 us) of the client address, with `hash_key:
source_port` also of the source port. Two lbproxy processes with the same configuration
therefore build the same table and send a client to the same server: N instances behind
ECMP need no shared state. CRC-32 is not a keyed hash; a client who wants a given
server could choose its address anyway, so nothing is lost.

Membership: the table holds every server that is online (enabled, health up, weight > 0)
or available (a passive-health trial). A server that is full (`max_connections`) stays
in the table; a pick that lands on it, or on a server a retry avoids, walks on to the
next slot whose server can take the connection, so a full server spills over without
moving anyone else's slots. The table is rebuilt only when the membership or a member's
effective weight changes, lazily on the next pick (so a burst of changes costs one
rebuild).

Cost: a rebuild is O(M log M) probes on average (the paper's bound; about 12 M probes
for M = 65537, whatever the number of servers), plus O(M log N) for the weighted turn
order; bench/bench_schedulers.py measures it. A pick is O(1).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from hashlib import blake2b
from typing import TYPE_CHECKING, Any, ClassVar
from zlib import crc32

from lbproxy.config.values import choice, table_size
from lbproxy.core.schedulers import CLIENT, Scheduler, register

if TYPE_CHECKING:
    from lbproxy.config.model import VirtualServerConfig
    from lbproxy.config.values import Converter
    from lbproxy.core.pool import Pool, RealServer

log = logging.getLogger("lbproxy.schedulers.maglev")

DEFAULT_TABLE_SIZE = 65537


@dataclass(frozen=True, slots=True)
class MaglevOptions:
    """maglev's own keys, written on the virtual server (`table_size:`, `hash_key:`)."""

    table_size: int = DEFAULT_TABLE_SIZE  # lookup table slots, a prime >= 101
    hash_key: str = "source"  # source | source_port


def permutation(name: str, size: int) -> tuple[int, int]:
    """(offset, skip) of the server called `name` in a table of `size` slots."""
    digest = blake2b(name.encode(), digest_size=16, person=b"lbproxy-maglev").digest()
    h1 = int.from_bytes(digest[:8], "big")
    h2 = int.from_bytes(digest[8:], "big")
    return h1 % size, h2 % (size - 1) + 1


def client_hash(client: tuple[Any, ...] | None, with_port: bool = False) -> int:
    """The fixed hash of a client address `(host, port, ...)`; 0 for no client."""
    if client is None:
        return 0
    host = client[0]
    if host.startswith("::ffff:") and "." in host:
        # An IPv4 client seen by a dual-stack listener: hash it as the IPv4 address,
        # as an instance listening on 0.0.0.0 sees it.
        host = host[7:]
    value = crc32(host.encode())
    if with_port:
        value = crc32(client[1].to_bytes(2, "big"), value)
    return value


def populate(
    servers: list[Any],
    names: list[str],
    weights: list[float],
    size: int,
    cache: dict[str, tuple[int, int]] | None = None,
) -> list[Any]:
    """The Maglev table: `size` slots, each one of `servers` (given in name order).

    `cache` maps name -> (offset, skip) for this size and is filled as needed.
    """
    if not servers:
        return []
    cache = {} if cache is None else cache
    position, skips = [], []
    for name in names:
        pair = cache.get(name)
        if pair is None:
            pair = cache[name] = permutation(name, size)
        position.append(pair[0])
        skips.append(pair[1])
    if min(weights) == max(weights):
        return _round_robin(servers, position, skips, size)
    return _weighted(servers, weights, position, skips, size)


def _round_robin(servers: list[Any], position: list[int], skips: list[int], size: int) -> list[Any]:
    """The paper's population loop: servers take one turn each, in order, until full.

    (The weighted order below gives the same table when the weights are equal; this
    loop is the fast path without a heap.)
    """
    table: list[Any] = [None] * size
    filled = 0
    n = len(servers)
    while True:
        for i in range(n):
            c, skip = position[i], skips[i]
            while table[c] is not None:
                c += skip
                if c >= size:
                    c -= size
            table[c] = servers[i]
            c += skip
            position[i] = c - size if c >= size else c
            filled += 1
            if filled == size:
                return table


def _weighted(
    servers: list[Any], weights: list[float], position: list[int], skips: list[int], size: int
) -> list[Any]:
    """The population loop with turns in proportion to weight (earliest deadline first).

    The k-th turn of server i is at virtual time k / w_i, ties in name order; computed
    from k each time (not accumulated), so float drift never reorders turns.
    """
    table: list[Any] = [None] * size
    filled = 0
    heap = [(0.0, i) for i in range(len(servers))]  # sorted, hence a heap
    turns = [0] * len(servers)
    while True:
        i = heap[0][1]
        c, skip = position[i], skips[i]
        while table[c] is not None:
            c += skip
            if c >= size:
                c -= size
        table[c] = servers[i]
        c += skip
        position[i] = c - size if c >= size else c
        filled += 1
        if filled == size:
            return table
        turns[i] += 1
        heapq.heapreplace(heap, (turns[i] / weights[i], i))


@register
class Maglev(Scheduler):
    score_legend = "the slots the server holds in the lookup table: the client's hash picks a slot"
    name = "maglev"
    keys = frozenset({"slow_start"})  # the table follows effective weights
    rank = 100
    reads = frozenset({CLIENT})
    Options = MaglevOptions
    options: ClassVar[Mapping[str, Converter]] = {
        "table_size": table_size.about(
            "slots of the lookup table; more slots, finer shares (keep it above 100 × the "
            "number of real servers)"
        ),
        "hash_key": choice("source", "source_port").about(
            "hash the client address (`source`) or address and port (`source_port`)"
        ),
    }

    @classmethod
    def describe_options(cls, config: VirtualServerConfig) -> str:
        options = cls.options_of(config)
        return f", table {options.table_size}, hash {options.hash_key}"

    def __init__(self, pool: Pool) -> None:
        super().__init__(pool)
        options = self.options_of(pool.config)
        self.size: int = options.table_size
        self.with_port = options.hash_key == "source_port"
        self.members: dict[RealServer, None] = {}  # an ordered set: online or available
        self.full: set[RealServer] = set()  # members that cannot take a connection now
        # The lookup table; None while stale (rebuilt by the next pick), [] when empty.
        self.table: list[RealServer] | None = []
        self.entries: dict[RealServer, int] = {}  # slots of each member in the table
        self._weights: dict[RealServer, float] = {}  # the weights the table was built with
        self._permutations: dict[str, tuple[int, int]] = {}  # name -> (offset, skip)
        if self.with_port:
            self.pick_for = self._pick_with_port  # type: ignore[method-assign]  # chosen once, per instance

    # -- picks ---------------------------------------------------------------------

    def pick(self, now: float, avoid: Collection[RealServer] = ()) -> RealServer | None:
        return self.pick_for(None, now, avoid)

    def pick_for(
        self, client: tuple[Any, ...] | None, now: float, avoid: Collection[RealServer] = ()
    ) -> RealServer | None:
        """The server for `client` (its address tuple; None: the empty key)."""
        table = self.table
        if not table:
            if table is None:
                table = self._build()
            if not table:
                return None
        if client is None:
            slot = 0
        else:  # client_hash(), inlined: this is the whole cost of a pick
            host = client[0]
            if ":" in host and host.startswith("::ffff:") and "." in host:
                host = host[7:]
            slot = crc32(host.encode()) % self.size
        rs = table[slot]
        if rs.available and (not avoid or rs not in avoid):
            return rs
        return self._walk(table, slot, avoid)

    def _pick_with_port(
        self, client: tuple[Any, ...] | None, now: float, avoid: Collection[RealServer] = ()
    ) -> RealServer | None:
        """pick_for with `hash_key: source_port` (bound in its place by __init__)."""
        table = self.table if self.table is not None else self._build()
        if not table:
            return None
        slot = client_hash(client, True) % self.size
        rs = table[slot]
        if rs.available and (not avoid or rs not in avoid):
            return rs
        return self._walk(table, slot, avoid)

    def _walk(
        self, table: list[RealServer], slot: int, avoid: Collection[RealServer]
    ) -> RealServer | None:
        """The first server after `slot` that can take the connection and is not avoided."""
        members = self.members
        excluded = len(self.full) + sum(1 for rs in avoid if rs in members and rs not in self.full)
        if excluded >= len(members):
            return None
        size = len(table)
        for step in range(1, size):  # bounded: a member may hold no slot when N > M
            rs = table[(slot + step) % size]
            if rs.available and rs not in avoid:
                return rs
        return None

    def peek(self, client: tuple[Any, ...] | None, now: float) -> RealServer | None:
        # A stale table is computed for this answer and not kept: the next pick
        # rebuilds it as it would have anyway.
        table = self.table if self.table is not None else self._compute()[0]
        if not table:
            return None
        slot = client_hash(client, self.with_port) % self.size
        rs = table[slot]
        return rs if rs.available else self._walk(table, slot, ())

    # -- membership ------------------------------------------------------------------

    def on_online(self, rs: RealServer, now: float) -> None:
        self._join(rs)

    def on_available(self, rs: RealServer, now: float) -> None:
        self.full.discard(rs)
        if rs not in self.members:
            self._join(rs)
        elif self._weights.get(rs) != rs.effective_weight:
            self.table = None  # its weight changed while it was full

    def on_unavailable(self, rs: RealServer, now: float) -> None:
        if rs.online and rs in self.members:
            self.full.add(rs)  # full: keeps its slots, picks walk past it
        else:
            self._leave(rs)

    def on_offline(self, rs: RealServer, now: float) -> None:
        if not rs.available:
            self._leave(rs)

    def on_weight(self, rs: RealServer, old: float, now: float) -> None:
        if rs in self.members:
            self.table = None

    def _join(self, rs: RealServer) -> None:
        if rs not in self.members:
            self.members[rs] = None
            self.table = None

    def _leave(self, rs: RealServer) -> None:
        self.full.discard(rs)
        if self.members.pop(rs, 0) is None:
            self.table = None

    def _compute(self) -> tuple[list[RealServer], dict[RealServer, float]]:
        """The lookup table of the current members and the weights it is built with."""
        members = sorted(
            (rs for rs in self.members if rs.effective_weight > 0), key=lambda rs: rs.name
        )
        weights = [rs.effective_weight for rs in members]
        table = populate(
            members, [rs.name for rs in members], weights, self.size, self._permutations
        )
        return table, dict(zip(members, weights, strict=True))

    def _build(self) -> list[RealServer]:
        table, self._weights = self._compute()
        entries: dict[RealServer, int] = dict.fromkeys(self._weights, 0)
        for rs in table:
            entries[rs] += 1
        self.entries = entries
        self.table = table
        log.debug("%s: maglev table rebuilt for %d server(s)", self.pool.name, len(entries))
        return table

    def explain(self, rs: RealServer) -> Any:
        if self.table is None:
            self._build()
        return f"{self.entries.get(rs, 0)}/{self.size} slots"
