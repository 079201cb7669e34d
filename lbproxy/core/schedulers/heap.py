"""A keyed min-heap: insert, re-key and remove one item in O(log n), in C.

Every scheduler that must not scan all servers keeps its *available* servers in one of
these, keyed by what it minimises (HAProxy's `lb_fwlc.c` re-positions one server in an
ebtree on take/drop the same way).

It is the standard library's `heapq` (C) with lazy deletion, the recipe of the heapq
documentation: re-keying pushes a fresh entry and leaves the old one in the heap as
stale; stale entries are dropped when they reach the top, and the heap is rebuilt when
they outnumber the live ones. A sift in C costs about the same for 10 servers as for
10,000, where an indexed heap sifting in Python cost 2-4x more at 10,000
(bench/bench_schedulers.py).

Entries are (*key, tick, item) tuples (a key is a tuple, compared element by element;
flat, so C compares one tuple instead of a tuple in a tuple): the tick, unique and
increasing, breaks exact key ties so items themselves are never compared.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from heapq import heapify, heappop, heappush, heapreplace
from itertools import count
from typing import Any

# Rebuild the heap when it holds more than this many entries per live item (+ slack):
# bounds the memory and the depth that stale entries add.
_STALE_FACTOR = 2
_STALE_SLACK = 32


class KeyedHeap:
    __slots__ = ("_heap", "_ticks", "entries")

    def __init__(self) -> None:
        self._heap: list[tuple[Any, ...]] = []
        # The live entry of each item; read-only outside this class (`item in
        # heap.entries` is `item in heap` without __contains__'s Python frame).
        self.entries: dict[Hashable, tuple[Any, ...]] = {}
        self._ticks = count()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, item: Hashable) -> bool:
        return item in self.entries

    def key(self, item: Hashable) -> tuple[Any, ...]:
        return self.entries[item][:-2]

    def set(self, item: Hashable, key: tuple[Any, ...]) -> None:
        """Insert `item` with `key` (a tuple), or move it to `key` if it is already here."""
        entry = (*key, next(self._ticks), item)
        entries = self.entries
        old = entries.get(item)
        entries[item] = entry
        heap = self._heap
        if heap and old is not None and heap[0] is old:
            # The item on top (a take re-keys the server just picked): replaced in one
            # sift, leaving no stale entry for the next pick to pop.
            heapreplace(heap, entry)
            return
        heappush(heap, entry)
        if len(heap) > _STALE_FACTOR * len(entries) + _STALE_SLACK:
            self._heap = list(self.entries.values())
            heapify(self._heap)

    def discard(self, item: Hashable) -> None:
        self.entries.pop(item, None)  # its entries in the heap are stale from now on

    def clear(self) -> None:
        self._heap.clear()
        self.entries.clear()

    def min(self, avoid: Collection[Hashable] = ()) -> Hashable | None:
        """The item with the smallest key that is not in `avoid`, or None.

        Avoided items (at most the few servers a connection already failed on) are
        taken off the top, the minimum read, and they are put back.
        """
        heap = self._heap
        if heap and not avoid:  # the common case, inline: a live entry on top
            entry = heap[0]
            item: Hashable = entry[-1]
            if self.entries.get(item) is entry:
                return item
        top = self._top()
        if top is None or top[-1] not in avoid:
            return None if top is None else top[-1]
        aside = []
        while top is not None and top[-1] in avoid:
            aside.append(heappop(self._heap))
            top = self._top()
        for entry in aside:
            heappush(self._heap, entry)
        return None if top is None else top[-1]

    def peek(self) -> Hashable | None:
        """The item `min()` returns, without touching the heap (no stale entry popped):
        O(n) over the live entries, for a reader that must change nothing."""
        entries = self.entries
        return min(entries.values())[-1] if entries else None

    def items(self) -> list[Hashable]:
        return list(self.entries)

    def _top(self) -> tuple[Any, ...] | None:
        heap, entries = self._heap, self.entries
        while heap:
            entry = heap[0]
            if entries.get(entry[-1]) is entry:
                return entry
            heappop(heap)  # stale: re-keyed or discarded since it was pushed
        return None
