"""The connection queue of a virtual server (`queue: {max, timeout}`, SPEC §13).

When every real server that could take a connection is held back only by its
`max_connections`, a new client waits here, first come first served, instead of being
refused; past `timeout` it is closed (`queue_timeout`), beyond `max` waiting clients it
is refused at once (`queue_full`). HAProxy's `src/queue.c` is the model: a pending
connection (`pendconn_add`) is handed the next free slot (`process_srv_queue`) in
arrival order, and `timeout queue` bounds its wait.

What it costs:

- Not configured: nothing (`vs.queue is None`, one attribute test per connection).
- Configured and empty: two integer tests per connection (`must_wait`).
- Each waiting client: its parked task (no scope, no task of its own) and one entry in
  the process-wide deadline heap (deadlines.py) for its timeout.

How a freed slot reaches the oldest waiter, and not a newcomer:

- The pool calls its one hook, `pool.on_available` (a plain callback the queue sets:
  the pool stays pure), whenever a server becomes available: a connection ended
  below `max_connections`, a server came up, a weight changed... `kick()` then wakes
  the oldest waiter.
- While anyone waits or has been woken and has not run yet, a newcomer joins the back
  of the queue even if a slot is free (`must_wait`), so it cannot overtake.
- A woken waiter checks for a free server when it runs; if there is one, it returns to
  the connection handler, which picks and takes it before its next checkpoint. If there
  is none (another arrival with a retry got there first), it goes back to the head of
  the queue with its original deadline.
- The handler calls `kick()` again once its connect has taken the slot: a server with
  room for several connections becomes available only once, so the next waiter is
  woken in turn.

A client that goes away while it waits must not take a slot when its turn comes (Envoy
drops a downstream that left; HAProxy has `option abortonclose`). The handler's `gone`
looks at the client's socket when the wait ends, not while it waits (no task, no timer
per waiter): a client that reset its connection is ABANDONED (counted, closed), and the
slot goes to the next waiter. A client that only sent its FIN is still served: at L4 a
FIN may be a half-close (the request sent, the reply awaited), which TCP allows; with
`abort_on_close` (HAProxy's `option abortonclose`) it is ABANDONED too. Until
its turn, an abandoned client keeps its place (and counts toward `max`).

What the metrics and the API read is the queue's own: `QueueStats` (its length and its
waits), one per virtual server (`VirtualServer.queue_stats`), kept when a reload removes
the queue so that the waits already counted stay counted.

Waiters that time out or are cancelled are only marked; they are dropped when they
reach the head of the deque (they do so in order, since every waiter has the same
timeout), so removing one is O(1).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

import trio

from lbproxy.config.model import QueueConfig
from lbproxy.core.histogram import QUEUE_BUCKETS, Histogram
from lbproxy.core.pool import Pool
from lbproxy.net.deadlines import Deadline, deadlines

log = logging.getLogger("lbproxy.waiting")

_QUEUED, _WOKEN, _DONE = 0, 1, 2
_TIMEOUT = "queue_timeout"
ABANDONED = "queue_abandoned"


class QueueStats:
    """What a virtual server's queue publishes, for the metrics and the admin API."""

    __slots__ = ("queued", "waits")

    def __init__(self) -> None:
        self.queued = 0  # clients waiting now (queued or woken, not yet run)
        self.waits = Histogram(QUEUE_BUCKETS)  # every finished wait, seconds


class _Waiter:
    __slots__ = ("alarm", "expired", "queue", "state", "task", "timed_out")

    def __init__(self, queue: Queue, task: trio.lowlevel.Task) -> None:
        self.queue = queue
        self.task = task
        self.state = _QUEUED
        self.expired = False  # the deadline passed while it was woken
        self.timed_out = False  # the deadline passed while it was queued
        self.alarm: Deadline | None = None

    def ring(self) -> None:
        """The deadline heap: `timeout` has passed (must not raise)."""
        self.alarm = None
        if self.state == _QUEUED:
            self.state = _DONE
            self.queue.waiting -= 1
            self.queue._publish()
            self.timed_out = True
            trio.lowlevel.reschedule(self.task)
        elif self.state == _WOKEN:
            self.expired = True  # it is about to run; it decides


class Queue:
    """The waiting clients of one virtual server's pool."""

    def __init__(self, pool: Pool, config: QueueConfig, stats: QueueStats | None = None) -> None:
        self.pool = pool
        self.config = config
        self.stats = QueueStats() if stats is None else stats  # the virtual server's
        self._deque: collections.deque[_Waiter] = collections.deque()
        self.waiting = 0  # queued, not yet woken
        self.woken = 0  # woken, not yet run
        self.closed = False  # removed by a reload: waiters go and try for a server
        pool.on_available = self.kick

    def must_wait(self) -> bool:
        """Called for every new client: wait (or be refused) rather than pick now?"""
        pool = self.pool
        return bool(
            self.waiting or self.woken or (not pool.available_servers and pool.full_servers)
        )

    async def wait(self, gone: Callable[[], bool] | None = None) -> str | None:
        """Wait for a free server: None when there is one now, else the reject reason.

        The caller picks and takes a server before its next checkpoint, then calls
        `kick()`. Cancellation (the drain deadline) leaves the queue and re-raises.
        `gone()` (asked when the wait ends, not before) says whether the client went
        away meanwhile: then it is ABANDONED and a free slot goes to the next waiter.
        """
        if self.waiting + self.woken >= self.config.max:
            return "queue_full"
        # A server may be free already, with earlier waiters not woken yet: wake the
        # oldest first, then join the line (never waking ourselves: reschedule() is
        # for a task that waits).
        self.kick()
        started = trio.current_time()
        waiter = _Waiter(self, trio.lowlevel.current_task())
        waiter.alarm = deadlines().at(started + self.config.timeout, waiter)
        self._deque.append(waiter)
        self.waiting += 1
        self._publish()
        try:
            while True:
                await trio.lowlevel.wait_task_rescheduled(lambda _: self._abort(waiter))
                if waiter.timed_out:
                    return ABANDONED if gone is not None and gone() else _TIMEOUT
                self.woken -= 1
                if self.pool.available_servers or self.closed:
                    if gone is not None and gone():
                        waiter.state = _DONE
                        self.kick()  # the slot it was woken for goes to the next one
                        return ABANDONED
                    return None
                if waiter.expired:
                    waiter.state = _DONE
                    return ABANDONED if gone is not None and gone() else _TIMEOUT
                waiter.state = _QUEUED  # beaten to it: back to the head of the line
                self._deque.appendleft(waiter)
                self.waiting += 1
        finally:
            if waiter.alarm is not None:
                waiter.alarm.cancel()
                waiter.alarm = None
            waiter.state = _DONE
            self.stats.waits.observe(trio.current_time() - started)
            self._publish()

    def kick(self) -> None:
        """Wake the oldest waiter if a server is available and no woken one is on its way.

        Called by the pool when a server becomes available (possibly from inside a
        pool operation: it only reschedules a task) and by the handler after a waiter
        has taken its slot.
        """
        if self.woken or not self.waiting or not self.pool.available_servers:
            return
        deque = self._deque
        while deque:
            waiter = deque.popleft()
            if waiter.state != _QUEUED:
                continue  # timed out or cancelled while queued
            waiter.state = _WOKEN
            self.waiting -= 1
            self.woken += 1
            trio.lowlevel.reschedule(waiter.task)
            return

    def release_all(self) -> None:
        """The queue was removed by a reload: every waiter tries for a server now."""
        self.closed = True
        if self.pool.on_available == self.kick:
            self.pool.on_available = None
        deque = self._deque
        while deque:
            waiter = deque.popleft()
            if waiter.state == _QUEUED:
                waiter.state = _WOKEN
                self.waiting -= 1
                self.woken += 1
                trio.lowlevel.reschedule(waiter.task)

    def _abort(self, waiter: _Waiter) -> trio.lowlevel.Abort:
        if waiter.state == _QUEUED:
            self.waiting -= 1
        elif waiter.state == _WOKEN:
            self.woken -= 1
        waiter.state = _DONE
        return trio.lowlevel.Abort.SUCCEEDED

    def _publish(self) -> None:
        self.stats.queued = self.waiting + self.woken


def sync(
    vs_queue: Queue | None, pool: Pool, stats: QueueStats | None = None
) -> tuple[Queue | None, str | None]:
    """The queue a virtual server should have after a (re)configuration, and the change.

    A queue added starts empty; one changed keeps its waiters (a new `max` applies at
    once, a new `timeout` to clients that arrive from now on); one removed lets its
    waiters try for a server now, as they would have without a queue. A queue added
    publishes into `stats`, the virtual server's (a new one when not given).
    """
    config = pool.config.queue
    if config is None:
        if vs_queue is None:
            return None, None
        vs_queue.release_all()
        return None, "queue removed"
    if vs_queue is None:
        return Queue(pool, config, stats), "queue added"
    if vs_queue.config != config:
        vs_queue.config = config
        return vs_queue, "queue changed"
    return vs_queue, None
