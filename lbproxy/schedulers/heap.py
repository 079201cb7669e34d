"""An indexed binary min-heap: push, remove and re-key one item in O(log n).

Every scheduler that must not scan all servers keeps its *available* servers in one of
these, keyed by what it minimises (HAProxy's `lb_fwlc.c` re-positions one server in an
ebtree on take/drop the same way). The position of each item is kept in a dict so a
server whose load changes is sifted from where it is instead of searched for.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from typing import Any


class KeyedHeap:
    __slots__ = ("_items", "_keys", "_pos")

    def __init__(self) -> None:
        self._items: list[Hashable] = []
        self._keys: list[Any] = []
        self._pos: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: Hashable) -> bool:
        return item in self._pos

    def key(self, item: Hashable) -> Any:
        return self._keys[self._pos[item]]

    def set(self, item: Hashable, key: Any) -> None:
        """Insert `item` with `key`, or move it to `key` if it is already here."""
        i = self._pos.get(item)
        if i is None:
            self._items.append(item)
            self._keys.append(key)
            i = len(self._items) - 1
            self._pos[item] = i
            self._sift_up(i)
            return
        old = self._keys[i]
        self._keys[i] = key
        if key < old:
            self._sift_up(i)
        else:
            self._sift_down(i)

    def discard(self, item: Hashable) -> None:
        i = self._pos.pop(item, None)
        if i is None:
            return
        last_item = self._items.pop()
        last_key = self._keys.pop()
        if i == len(self._items):
            return
        self._items[i] = last_item
        self._keys[i] = last_key
        self._pos[last_item] = i
        self._sift_up(i)
        self._sift_down(self._pos[last_item])

    def clear(self) -> None:
        self._items.clear()
        self._keys.clear()
        self._pos.clear()

    def min(self, avoid: Collection[Hashable] = ()) -> Hashable | None:
        """The item with the smallest key that is not in `avoid`, or None.

        Avoided items (at most the few servers a connection already failed on) are
        taken out, the minimum read, and they are put back: O(len(avoid) · log n).
        """
        if not self._items:
            return None
        top = self._items[0]
        if top not in avoid:
            return top
        removed = [(item, self._keys[self._pos[item]]) for item in avoid if item in self._pos]
        for item, _ in removed:
            self.discard(item)
        best = self._items[0] if self._items else None
        for item, key in removed:
            self.set(item, key)
        return best

    def items(self) -> list[Hashable]:
        return list(self._items)

    # -- sifting -------------------------------------------------------------------
    # "Hole" sifting: the moving item is held aside and each level costs one write of
    # the displaced item (and its position) instead of a swap of two; 20-30 % faster at
    # 10,000 servers (scripts/bench_schedulers.py).

    def _sift_up(self, i: int) -> None:
        items, keys, pos = self._items, self._keys, self._pos
        item, key = items[i], keys[i]
        while i > 0:
            parent = (i - 1) >> 1
            parent_key = keys[parent]
            if not key < parent_key:
                break
            parent_item = items[parent]
            items[i] = parent_item
            keys[i] = parent_key
            pos[parent_item] = i
            i = parent
        items[i] = item
        keys[i] = key
        pos[item] = i

    def _sift_down(self, i: int) -> None:
        items, keys, pos = self._items, self._keys, self._pos
        item, key = items[i], keys[i]
        n = len(keys)
        while True:
            child = 2 * i + 1
            if child >= n:
                break
            right = child + 1
            if right < n and keys[right] < keys[child]:
                child = right
            child_key = keys[child]
            if not child_key < key:
                break
            child_item = items[child]
            items[i] = child_item
            keys[i] = child_key
            pos[child_item] = i
            i = child
        items[i] = item
        keys[i] = key
        pos[item] = i
