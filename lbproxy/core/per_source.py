"""Per-client-network limits of a TCP virtual server (`per_source:`, SPEC §23).

PURE. A client network (its address at the configured prefix length) may hold at most
`max_connections` open connections and have at most `rate` connections accepted within
the last `interval` seconds; the next one is refused. The table is asked once per
accepted connection and told once per ended one, so both are O(1):

- the networks are a dict; those with open connections (`_busy`) are never forgotten,
  the others (`_idle`) are an OrderedDict in the order they were last seen (an arrival,
  refused or not, or the end of their last connection), so the least recently seen idle
  network is the first forgotten once the table holds `max_tracked`;
- the rate is a true sliding window: each network keeps the times of its last `rate`
  accepted arrivals in a ring (an `array` of doubles, 8 bytes each, grown only as far as
  the network's arrivals go), and an arrival is refused while the `rate`-th latest of
  them is less than `interval` old. Refused arrivals are not put in the window. With
  counts from other instances (`shared`), the `rate - remote`-th latest is looked at
  instead: still one index.

When every tracked network has open connections and the table is full, a new network is
let in untracked (counted in `untracked`): refusing every new client because the table is
full would be worse than not limiting the few beyond it (HAProxy's stick tables do the
same when no entry can be freed).

The operator's view (`lbproxy per-source`, HAProxy's `show table` and `clear table`):
`listing` walks every tracked network once (O(tracked), off the connection path) and
names the busiest; `clear` forgets the arrivals of one network or of all. Open
connections cannot be forgotten: each still holds its entry and gives its count back
when it ends, so a cleared network with open connections keeps its entry and its open
count, and only a network with none (here or, `shared`, at the other instances) is
removed, as HAProxy's `clear table` removes only the entries not in use.

The clock is the caller's: every method takes `now` (seconds, monotonic).
"""

from __future__ import annotations

import heapq
import ipaddress
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from lbproxy.config.model import PerSourceConfig

__all__ = [
    "MAX_LISTED",
    "Limits",
    "NetworkCounts",
    "PerSourceTable",
    "SourceEntry",
    "network_key",
    "network_named",
    "network_of_text",
    "network_text",
]

MAX_LISTED = 10_000  # networks one listing names at most

# What the table keys a network by: an IPv4 address at /32 is the accept's string as it
# is (no parse); anything else (version, network number).
NetworkKey = str | tuple[int, int]


@dataclass(frozen=True, slots=True)
class Limits:
    """What the table enforces; 0 for `max_connections` or `rate`: that limit is off."""

    max_connections: int = 0
    rate: int = 0
    interval: float = 1.0
    prefix_v4: int = 32
    prefix_v6: int = 64
    max_tracked: int = 100_000

    @classmethod
    def of(cls, config: PerSourceConfig) -> Limits:
        """The limits of a `per_source:` block (its unset limits are 0: off)."""
        return cls(
            max_connections=config.max_connections or 0,
            rate=config.rate or 0,
            interval=config.interval,
            prefix_v4=config.prefix_v4,
            prefix_v6=config.prefix_v6,
            max_tracked=config.max_tracked,
        )


def network_key(host: str, prefix_v4: int, prefix_v6: int) -> NetworkKey:
    """The network `host` (an accepted peer's address string) counts under. An IPv4
    address on an IPv6 socket (`::ffff:a.b.c.d`) is the IPv4 address; a zone is
    dropped; a string that is no address is its own network."""
    if prefix_v4 >= 32 and "." in host and ":" not in host:
        return host
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        mapped = ip.ipv4_mapped
        if mapped is None:
            return 6, int(ip) >> (128 - prefix_v6)
        ip = mapped
    if prefix_v4 >= 32:
        return str(ip)
    return 4, int(ip) >> (32 - prefix_v4)


def network_text(key: NetworkKey, prefix_v4: int, prefix_v6: int) -> str | None:
    """How a network key is written for the other instances: the address, or
    `ADDRESS/PREFIX`; None for a key that is no address."""
    if isinstance(key, str):
        return key if "." in key and ":" not in key else None
    version, number = key
    if version == 4:
        return str(ipaddress.IPv4Network((number << (32 - prefix_v4), prefix_v4)))
    return str(ipaddress.IPv6Network((number << (128 - prefix_v6), prefix_v6)))


def network_of_text(text: str, prefix_v4: int, prefix_v6: int) -> NetworkKey | None:
    """The key of a network another instance wrote (`network_text`) under these
    prefixes; None when it was cut at another prefix length (a configuration that
    differs between the instances) or is no network."""
    if "/" not in text:
        return network_key(text, prefix_v4, prefix_v6)
    try:
        network = ipaddress.ip_network(text)
    except ValueError:
        return None
    prefix = prefix_v4 if network.version == 4 else prefix_v6
    if network.prefixlen != prefix:
        return None
    return network.version, int(network.network_address) >> (network.max_prefixlen - prefix)


def network_named(text: str, prefix_v4: int, prefix_v6: int) -> NetworkKey:
    """The key of the network an operator names: an address (the network it is in) or
    `ADDRESS/PREFIX` at the configured prefix length, as `listing` writes it. ValueError
    saying what is wrong."""
    shown = text if len(text) <= 60 else text[:57] + "..."
    address, slash, prefix = text.partition("/")
    if "%" in address:
        raise ValueError(f"{shown!r}: an IPv6 zone is not a client network")
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise ValueError(
            f"{shown!r} is not an address or ADDRESS/PREFIX (e.g. 203.0.113.7, 203.0.113.0/24)"
        ) from None
    if not slash:
        return network_key(str(ip), prefix_v4, prefix_v6)
    expected = prefix_v4 if ip.version == 4 else prefix_v6
    if not (prefix.isascii() and prefix.isdigit()) or int(prefix) != expected:
        raise ValueError(
            f"{shown!r}: this table counts IPv{ip.version} clients by /{expected}; "
            f"name an address or its /{expected}"
        )
    try:
        network = ipaddress.ip_network(f"{ip}/{expected}")
    except ValueError:
        raise ValueError(
            f"{shown!r} has host bits set: the /{expected} is "
            f"{ipaddress.ip_network(f'{ip}/{expected}', strict=False)}"
        ) from None
    return network_key(str(network.network_address), prefix_v4, prefix_v6)


@dataclass(frozen=True, slots=True)
class NetworkCounts:
    """One tracked network as `listing` names it."""

    network: str  # the address, ADDRESS/PREFIX, or the key as it is when it is no address
    open: int  # connections open here
    arrivals: int | None  # accepted within the last interval (None: no `rate`, none kept)
    remote_open: int  # the other instances' (`shared`), as last published
    remote_arrivals: int
    limited_by: str | None  # "max_connections", "rate": its next arrival would be refused


class SourceEntry:
    """One client network: its open connections, the times of its latest accepted
    arrivals (a ring) and the other instances' counts (`shared`)."""

    __slots__ = ("head", "key", "open", "remote_open", "remote_rate", "times")

    def __init__(self, key: NetworkKey) -> None:
        self.key = key
        self.open = 0  # connections open here
        self.times = array("d")  # accepted arrivals, a ring once it holds `rate`
        self.head = 0  # the oldest in the ring once it is full
        self.remote_open = 0  # the other instances' open connections, as last published
        self.remote_rate = 0  # and their arrivals within their last interval

    def latest(self, k: int) -> float | None:
        """The time of the k-th latest accepted arrival (1: the last), or None."""
        times = self.times
        n = len(times)
        if k > n or k < 1:
            return None
        return times[(self.head - k) % n]

    def recent(self, now: float, interval: float) -> int:
        """Accepted arrivals within the last `interval` (for publishing): a binary search
        of the ring, which is in time order from `head` on."""
        times, head = self.times, self.head
        n = len(times)
        if not n or now - times[head - 1] >= interval:  # the latest is out: none
            return 0
        if now - times[head] < interval:  # the oldest is in: all
            return n
        # the index, in time order, of the first arrival still within the interval
        first = bisect_left(range(n), True, key=lambda i: now - times[(head + i) % n] < interval)
        return n - first


class PerSourceTable:
    """The networks of one virtual server and their counts (see the module's doc)."""

    __slots__ = ("_busy", "_idle", "_plain_v4", "_remote", "limits", "refused", "untracked")

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        # An IPv4 address is its own key (the prefixes never change: see reconfigure).
        self._plain_v4 = limits.prefix_v4 >= 32
        self._busy: dict[NetworkKey, SourceEntry] = {}
        self._idle: OrderedDict[NetworkKey, SourceEntry] = OrderedDict()
        self._remote: list[SourceEntry] = []  # the entries set_remote gave counts to
        self.refused = 0  # arrivals refused, over the table's life
        self.untracked = 0  # arrivals let in untracked: the table was full of busy networks

    def __len__(self) -> int:
        return len(self._busy) + len(self._idle)

    def admit(self, host: str, now: float) -> SourceEntry | bool | None:
        """An arrival from `host`: its entry (counted open: give it back to `release`
        at the connection's end), True (admitted untracked: nothing to release) or
        None (refused)."""
        limits = self.limits
        if self._plain_v4 and "." in host and ":" not in host:
            key: NetworkKey = host  # network_key's answer, without the call
        else:
            key = network_key(host, limits.prefix_v4, limits.prefix_v6)
        busy = self._busy
        entry = busy.get(key)
        idle = None
        if entry is None:  # not busy: taken out of the idle ones (back at their end if refused)
            idle = self._idle
            entry = idle.pop(key, None)
            if entry is None:
                if len(busy) + len(idle) >= limits.max_tracked:
                    if not idle:
                        self.untracked += 1
                        return True
                    idle.popitem(last=False)  # the least recently seen idle network
                entry = SourceEntry(key)
        maximum = limits.max_connections
        if maximum and entry.open + entry.remote_open >= maximum:
            self._refuse(idle, key, entry)
            return None
        rate = limits.rate
        if rate:
            times = entry.times
            need = rate - entry.remote_rate
            n = len(times)
            if need <= 0 or (need <= n and now - times[(entry.head - need) % n] < limits.interval):
                self._refuse(idle, key, entry)
                return None
            if n < rate:
                times.append(now)  # head stays 0: the ring fills in order
            else:
                head = entry.head
                times[head] = now
                entry.head = head + 1 if head + 1 < n else 0
        if idle is not None:
            busy[key] = entry
        entry.open += 1
        return entry

    def would_admit(self, host: str, now: float) -> bool:
        """Whether `admit(host, now)` would let an arrival in, read without admitting,
        counting or moving anything (for `lbproxy explain`). A network the table does
        not know has nothing counted against it: admitted (tracked or not)."""
        limits = self.limits
        key = network_key(host, limits.prefix_v4, limits.prefix_v6)
        entry = self._busy.get(key)
        if entry is None:
            entry = self._idle.get(key)
            if entry is None:
                return True
        return self.limited_by(entry, now) is None

    def limited_by(self, entry: SourceEntry, now: float) -> str | None:
        """The limit `entry`'s next arrival would be refused by ("max_connections",
        "rate"), None when it would be let in; `admit`'s tests, read only (`admit` has
        them inline: it runs per connection, and a call there costs more than they do)."""
        limits = self.limits
        maximum = limits.max_connections
        if maximum and entry.open + entry.remote_open >= maximum:
            return "max_connections"
        rate = limits.rate
        if rate:
            times = entry.times
            need = rate - entry.remote_rate
            n = len(times)
            if need <= 0 or (need <= n and now - times[(entry.head - need) % n] < limits.interval):
                return "rate"
        return None

    def listing(self, now: float, limit: int) -> list[NetworkCounts]:
        """The `limit` busiest tracked networks: most open connections first, then most
        arrivals within the last interval, then by name. One pass over the table
        (O(tracked), for the admin API, never per connection); only the networks named
        are written out."""
        limits = self.limits
        interval, rate = limits.interval, limits.rate
        counted = (
            (entry.open, entry.recent(now, interval) if rate else 0, entry)
            for entry in [*self._busy.values(), *self._idle.values()]
        )
        busiest = heapq.nlargest(limit, counted, key=lambda item: (item[0], item[1]))
        rows = [
            NetworkCounts(
                network=self._text(entry.key),
                open=open_here,
                arrivals=arrivals if rate else None,
                remote_open=entry.remote_open,
                remote_arrivals=entry.remote_rate,
                limited_by=self.limited_by(entry, now),
            )
            for open_here, arrivals, entry in busiest
        ]
        rows.sort(key=lambda row: (-row.open, -(row.arrivals or 0), row.network))
        return rows

    def _text(self, key: NetworkKey) -> str:
        limits = self.limits
        text = network_text(key, limits.prefix_v4, limits.prefix_v6)
        return text if text is not None else str(key)

    def clear(self, key: NetworkKey | None = None) -> tuple[int, int]:
        """Forget the arrivals of the network `key` (None: of every network), so a
        network at its `rate` is let in again. (cleared, kept): the networks cleared,
        and of those the ones still tracked because they hold open connections here
        or, `shared`, at the other instances; the others are forgotten whole. Open
        connections stay counted: each still holds its entry, which `release` counts
        down at its end. Arrivals the other instances published still count until
        they leave their window there."""
        if key is None:
            entries = [*self._busy.values(), *self._idle.values()]
        else:
            found = self._busy.get(key) or self._idle.get(key)
            entries = [] if found is None else [found]
        kept = 0
        idle = self._idle
        for entry in entries:
            entry.times = array("d")
            entry.head = 0
            if entry.open or entry.remote_open or entry.remote_rate:
                kept += 1
            else:
                del idle[entry.key]  # no open connection here: an idle entry
        return len(entries), kept

    def _refuse(
        self, idle: OrderedDict[NetworkKey, SourceEntry] | None, key: NetworkKey, entry: SourceEntry
    ) -> None:
        """Refuse an arrival: counted; a network that is not busy goes back to the idle
        ones, at the end (seen)."""
        self.refused += 1
        if idle is not None:
            idle[key] = entry

    def release(self, entry: SourceEntry) -> None:
        """A connection `admit` counted has ended. An entry of another table (a reload
        that changed the prefixes) is counted down and nothing else."""
        entry.open -= 1
        if not entry.open:
            key = entry.key
            busy = self._busy
            found = busy.pop(key, None)
            if found is entry:
                self._idle[key] = entry  # seen: its last connection just ended
            elif found is not None:  # another table's entry: this one's stays
                busy[key] = found

    def reconfigure(self, limits: Limits) -> PerSourceTable:
        """This table under new limits (a reload): the same table when the prefixes are
        unchanged (the rings re-cut to the new `rate`), else a new, empty one."""
        old = self.limits
        if (limits.prefix_v4, limits.prefix_v6) != (old.prefix_v4, old.prefix_v6):
            return PerSourceTable(limits)
        self.limits = limits
        if limits.rate != old.rate:
            for entry in self.entries():
                times = entry.times
                n = len(times)
                ordered = [times[(entry.head + i) % n] for i in range(n)]
                entry.times = array("d", ordered[-limits.rate :] if limits.rate else ())
                entry.head = 0
        idle = self._idle
        while len(self) > limits.max_tracked and idle:
            idle.popitem(last=False)
        return self

    def entries(self) -> Iterator[SourceEntry]:
        """Every tracked network (busy first, then idle from least recently seen)."""
        yield from self._busy.values()
        yield from self._idle.values()

    def local_counts(self, now: float) -> Iterator[tuple[NetworkKey, int, int]]:
        """Each network with anything to tell the other instances (`shared`): (key, open
        connections, accepted arrivals within the last interval). Off the connection
        path (the cluster publishes it periodically); over a copy of the table's
        entries, so its caller may let connections come and go between two networks."""
        interval = self.limits.interval
        rate = self.limits.rate
        for entry in [*self._busy.values(), *self._idle.values()]:
            recent = entry.recent(now, interval) if rate else 0
            if entry.open or recent:
                yield entry.key, entry.open, recent

    def remote_open(self) -> int:
        """The other instances' open connections, as last given (`set_remote`)."""
        return sum(entry.remote_open for entry in self._remote)

    def set_remote(self, counts: dict[NetworkKey, tuple[int, int]]) -> None:
        """The other instances' counts, summed (replacing the last ones). A network not
        tracked here is added only if the table has room: the remote counts matter when
        it arrives, and it is then added with them."""
        for entry in self._remote:
            entry.remote_open = entry.remote_rate = 0
        self._remote = remote = []
        busy, idle = self._busy, self._idle
        for key, (remote_open, remote_rate) in counts.items():
            known = busy.get(key) or idle.get(key)
            if known is not None:
                entry = known
            else:
                if len(busy) + len(idle) >= self.limits.max_tracked:
                    continue
                entry = idle[key] = SourceEntry(key)
                idle.move_to_end(key, last=False)  # not seen here: first to go
            entry.remote_open = remote_open
            entry.remote_rate = remote_rate
            remote.append(entry)
