"""Deadlines for many connections from one trio task and a heap.

A trio cancel scope with a deadline is the usual way to time something out, but one per
connection costs memory for the connection's whole life and time to enter and leave
(docs/benchmarks.md). A UDP session's idle timeout and a queued client's wait need a
deadline each and nothing else from a scope, so their deadlines live here instead: a heap of
``(deadline, sequence, entry)`` served by one system task per trio run, which calls
``target.ring()`` when a deadline passes. Ringing does not cancel anything; the target
decides what the deadline means (a session checks whether it really was idle that long,
and schedules itself again if not). (The TCP pumps' idle deadlines are their reactor's
own, the same idea in C: net/reactor.py.)

Cancelling a deadline only marks its entry dead (O(1)); dead entries are dropped when
they reach the top of the heap, and the heap is rebuilt without them once they are the
majority, so connections that end long before their deadline (most of them) cannot pile
up: the heap holds at most about twice the live deadlines.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Protocol

import trio

from lbproxy.net.barrier import record

__all__ = ["Deadline", "Deadlines", "deadlines"]


class _Target(Protocol):
    def ring(self) -> None: ...


class Deadline:
    """A handle on one scheduled call; ``cancel()`` makes sure it never rings."""

    __slots__ = ("_owner", "target", "when")

    def __init__(self, owner: Deadlines, when: float, target: _Target) -> None:
        self._owner = owner
        self.when = when
        self.target: _Target | None = target

    def cancel(self) -> None:
        if self.target is not None:
            self.target = None
            self._owner._dead += 1


class Deadlines:
    """The heap and its task. Use :func:`deadlines` to get the one of the current run."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Deadline]] = []
        self._sequence = itertools.count()  # ties: first scheduled rings first
        self._dead = 0
        # The task sleeps until the earliest deadline in this scope; an earlier one
        # arriving cancels the sleep so it can sleep again, shorter.
        self._sleep: trio.CancelScope | None = None
        self._sleeping_until = math.inf
        self._task_started = False

    def __len__(self) -> int:
        return len(self._heap) - self._dead

    def at(self, when: float, target: _Target) -> Deadline:
        """Call ``target.ring()`` once ``trio.current_time() >= when``."""
        entry = Deadline(self, when, target)
        heapq.heappush(self._heap, (when, next(self._sequence), entry))
        if not self._task_started:
            self._task_started = True
            trio.lowlevel.spawn_system_task(self._run, name="lbproxy deadlines")
        elif when < self._sleeping_until and self._sleep is not None:
            self._sleep.cancel()
        if self._dead > 64 and self._dead * 2 > len(self._heap):
            self._compact()
        return entry

    def _compact(self) -> None:
        self._heap = [item for item in self._heap if item[2].target is not None]
        heapq.heapify(self._heap)
        self._dead = 0

    async def _run(self) -> None:
        while True:
            now = trio.current_time()
            # self._heap each time: a ring() may schedule, and _compact() replaces it.
            while self._heap and self._heap[0][0] <= now:
                entry = heapq.heappop(self._heap)[2]
                target = entry.target
                if target is None:
                    self._dead -= 1
                    continue
                entry.target = None
                try:
                    target.ring()
                except Exception as exc:  # a system task's error would end the run
                    record("deadline", exc)
            self._sleeping_until = self._heap[0][0] if self._heap else math.inf
            with trio.CancelScope(deadline=self._sleeping_until) as self._sleep:
                await trio.sleep_forever()
            self._sleep = None


_current: trio.lowlevel.RunVar[Deadlines] = trio.lowlevel.RunVar("lbproxy_deadlines")


def deadlines() -> Deadlines:
    """The deadline heap of the current trio run (created on first use)."""
    try:
        return _current.get()
    except LookupError:
        heap = Deadlines()
        _current.set(heap)
        return heap
