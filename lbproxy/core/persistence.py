"""Client persistence: a client address goes back to the real server it used before.

PURE: no trio, no clock (every method that needs the time takes `now`).

LVS's `-p` (a connection template per client address) and HAProxy's `stick on src`:
while a client has a connection open, or had one that ended less than `timeout` ago,
its next connection goes to the same real server, as long as that server is available;
otherwise the scheduler picks and the entry is replaced (SPEC §12). One table per
virtual server and per process (with `workers`, per worker): nothing is shared, which
is why `maglev` is the answer across processes.

The table is one OrderedDict, client address -> Entry, kept in the order entries were
last touched: a connection starting or ending moves its client's entry to the end. So
the idle entries (no connection open) are in the order their last connection ended,
which, with one `timeout` for the whole table, is the order in which they expire: the
table is its own deadline queue. Expiry costs nothing per idle entry: an expired entry
is dropped when its client comes back (lazily), by a sweep of at most a few entries
from the front by a lookup once the oldest is due, and by a sweep to the first live
entry when the entries are counted (`expire`, at every metrics scrape), so the entries
gauge falls as entries expire. An entry with a connection still open never expires;
met at the front by a sweep it is moved to the end (it is in use: recently used, for
the LRU order too).

Beyond `max_entries` the least recently touched entry is evicted; one with a connection
open is passed over (moved to the end, as in use) unless the first few all are, and then
the oldest goes all the same (that client's next connection is scheduled afresh). Each
entry counts its client's open connections; a lease holds its Entry, so a connection
ending after its entry was evicted or replaced changes nothing.

Shared persistence (SPEC §18, lbproxy/control/cluster.py): with a cluster, `outbox` is a
dict and every entry this table creates or moves to another server is put in it (key ->
entry; a later change of the same client replaces the earlier), as is an entry in use
whose last share is older than half the timeout (so the other instances' copies, which
expire `timeout` after they were shared, do not run out while the client still comes
here). The cluster sync empties the outbox in the background: the connection path only
does a dict assignment. Entries the other instances share come in through `learn`,
which neither counts a lookup nor goes to the outbox.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

log = logging.getLogger("lbproxy.persistence")

RESULTS = ("hit", "miss", "moved")
SWEEP_PER_LOOKUP = 4  # expired entries dropped from the front at most, per lookup


class Entry:
    __slots__ = ("active", "expires", "key", "server", "shared")

    def __init__(self, key: str, server: Any) -> None:
        self.key = key
        self.server = server
        self.active = 0  # connections of this client open now
        self.expires = 0.0  # meaningful once active is 0
        self.shared = 0.0  # when it was last shared with (or learned from) the cluster


def client_key(client: tuple[Any, ...]) -> str:
    """The table key of a client address `(host, port, ...)`: its host."""
    host: str = client[0]
    if host.startswith("::ffff:") and "." in host:
        return host[7:]  # an IPv4 client seen through a dual-stack listener
    return host


class Persistence:
    def __init__(self, timeout: float, max_entries: int) -> None:
        self.timeout = timeout
        self.max_entries = max_entries
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.lookups = dict.fromkeys(RESULTS, 0)
        self.evicted = 0
        # No idle entry expires before this: the expiry of the idle entry a sweep last
        # stopped at (entries behind it expire later; entries touched since, later
        # still). Lookups sweep only from then on: one comparison until something is due.
        self._sweep_at = float("-inf")
        # With a cluster: entries to share, filled here, emptied by the cluster sync.
        self.outbox: dict[str, Entry] | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, key: str, now: float) -> Entry | None:
        """The live entry of client `key`, or None (an expired one is dropped)."""
        entries = self.entries
        entry = entries.get(key)
        if entry is not None and not entry.active and entry.expires <= now:
            del entries[key]
            entry = None
        if now >= self._sweep_at:
            self.expire(now, SWEEP_PER_LOOKUP)
        return entry

    def peek(self, key: str, now: float) -> Entry | None:
        """The live entry of client `key`, or None, as `lookup` finds it, but changing
        nothing: no expired entry dropped, no sweep, no lookup counted (explain)."""
        entry = self.entries.get(key)
        if entry is not None and not entry.active and entry.expires <= now:
            return None
        return entry

    def holds(self, key: str, server: Any, now: float) -> bool:
        """True when client `key` has a live entry for `server`: a connection sent there
        now is a persistence hit, not a scheduler pick (rr's turn must not move)."""
        entry = self.entries.get(key)
        return (
            entry is not None
            and entry.server is server
            and (entry.active > 0 or entry.expires > now)
        )

    def acquire(self, key: str, server: Any, now: float) -> Entry:
        """A connection of client `key` was sent to `server`; returns its entry."""
        entries = self.entries
        entry = entries.get(key)
        if entry is None or (not entry.active and entry.expires <= now):
            entry = entries[key] = Entry(key, server)
            entries.move_to_end(key)  # a replaced expired entry keeps its old place
            while len(entries) > self.max_entries:  # more than one after a reload lowered it
                self._evict(key)
            if self.outbox is not None:
                self._share(entry, now)
        else:
            if self.outbox is not None and (
                entry.server is not server or now - entry.shared >= self.timeout / 2
            ):
                self._share(entry, now)
            entry.server = server
            entries.move_to_end(key)
        entry.active += 1
        return entry

    def _share(self, entry: Entry, now: float) -> None:
        entry.shared = now
        self.outbox[entry.key] = entry  # type: ignore[index]  # outbox is set while shared

    def learn(self, key: str, server: Any, ttl: float, now: float) -> Entry:
        """Another instance sent client `key` to `server`; the entry has `ttl` left.

        The entry is this table's like any other (the next lookup hits it) but not this
        instance's to share. A client with connections open here keeps them (they finish
        on their old server); its next connection goes to `server`. Placed at the end
        like a touched entry, although it may expire before entries ahead of it: only
        the gauge may count it a little longer, a lookup checks its own expiry.
        """
        entries = self.entries
        entry = entries.get(key)
        if entry is None:
            entry = entries[key] = Entry(key, server)
            while len(entries) > self.max_entries:
                self._evict(key)
        entry.server = server
        entry.shared = now
        if not entry.active:
            entry.expires = now + min(ttl, self.timeout)
        entries.move_to_end(key)
        return entry

    def _evict(self, keep: str) -> None:
        """Forget the least recently touched entry, passing over (a few) in use."""
        entries = self.entries
        for _ in range(SWEEP_PER_LOOKUP):
            key = next(iter(entries))
            if key != keep and not entries[key].active:
                break
            entries.move_to_end(key)  # in use (or the new one): recently used
        key = next(iter(entries))
        if key == keep:
            entries.move_to_end(key)
            key = next(iter(entries))
        del entries[key]
        self.evicted += 1

    def release(self, entry: Entry, now: float) -> None:
        """A connection counted by `acquire` ended."""
        entry.active -= 1
        if entry.active <= 0 and self.entries.get(entry.key) is entry:
            entry.active = 0
            entry.expires = now + self.timeout
            self.entries.move_to_end(entry.key)
            if self.outbox is not None and now - entry.shared >= self.timeout / 2:
                self._share(entry, now)

    def expire(self, now: float, limit: int | None = None) -> int:
        """Drop expired entries from the front (at most `limit` steps); returns the count."""
        entries = self.entries
        dropped = 0
        if not entries:
            self._sweep_at = now + self.timeout  # the earliest any new entry can expire
            return 0
        steps = len(entries) if limit is None else min(limit, len(entries))
        self._sweep_at = now  # unless the sweep finds where to stop: go on next time
        for _ in range(steps):
            key = next(iter(entries))
            entry = entries[key]
            if entry.active:
                entries.move_to_end(key)  # in use: neither expires nor blocks the sweep
            elif entry.expires <= now:
                del entries[key]
                dropped += 1
            else:
                self._sweep_at = entry.expires  # idle entries behind it expire later
                break
        else:
            if not entries:
                self._sweep_at = now + self.timeout
        return dropped
