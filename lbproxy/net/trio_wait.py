"""The pump reactor waits in trio's place: one epoll_wait when trio has nothing to run.

The reactor (net/reactor.py) keeps every pumped socket in its own epoll set. Served as
a trio task, each wake-up costs a trio round -- trio's epoll_wait reporting the set's
descriptor, rescheduling the task, stepping it, the task's ``epoll_ctl`` to re-arm --
all of it Python. A proxy that is busy but not saturated goes idle between most bursts,
so keep-alive traffic would pay that round on a large share of its requests, and it was
a large share of lbproxy's user time per request (docs/benchmarks.md).

Instead, trio's loop calls `TrioWait.before_io_wait` -- trio's public instrument hook
(`trio.abc.Instrument`), called just before trio blocks for I/O, with the time it is
about to block. With nothing runnable trio would only wait; the reactor waits instead,
in C, on its own set, which also holds trio's epoll descriptor, and moves bytes and
accepts clients as they come. It gives the loop back to trio, which then waits without
blocking, as soon as trio has reason to run:

* trio's own descriptor is ready (a socket a task waits on; trio's wake-up socket,
  which signals and other threads write to);
* a batch made a task runnable (a connection that must wait gets its task, an Event is
  set), or moved trio's next deadline earlier;
* trio's timeout is over (the next deadline; a test's ``wait_all_tasks_blocked``
  cushion or autojump threshold).

In the last two cases trio's own wait would still block for the whole timeout it
computed before the hook, so the reactor wakes it (``force_wakeup``, the wake-up socket
trio itself uses for signals) -- except when the timeout is a test's idle priming, which
a wake-up would defeat (trio idles only on a wait that saw no event); trio then waits
that short time on its own, and the reactor's set with it, as a task would have.

When trio is busy (timeout 0) the hook runs one batch without blocking, so the
reactor is served once per trio round, as its task was.

This reads trio's internals, of the trio versions pyproject.toml allows: the run's
Runner (``runq``, ``deadlines``, ``waiting_for_idle``, ``clock_autojump_threshold``),
its epoll I/O manager (``_epoll``, ``force_wakeup``) and its ``SystemClock`` (whose
``offset`` lets the C wait read the run's time itself); `install` returns None where
they are not as expected, and the reactor stays a task. A batch
that raises (a bug past the per-connection barrier) takes the hook out and hands the
reactor back to its task, which goes on serving the set (``TrioWait.parked``).

(HAProxy's and nginx's event loops are the model: one wait per wake-up, for every
descriptor the process watches.)
"""

from __future__ import annotations

import contextlib
import math
import select
import time
from collections.abc import Callable
from typing import Any

import outcome
import trio

__all__ = ["TrioWait", "clock_offset", "install"]

# A batch: block up to this many milliseconds (0: do not block) for the reactor's
# events, handle them (and pass on the FINs read in it), return how many there were.
Batch = Callable[[int], int]
# The C reactor's wait: (trio_fd, timeout, offset, next_deadline, runq) -> True if
# trio's descriptor is ready.
CompiledWait = Callable[[int, float, float, Callable[[], float], Any], bool]
# The reactor's listen / unlisten: (fd, callback(fd, events)).
Listen = Callable[[int, Callable[[int, int], object]], None]


class _TrioReady:
    """The reader of trio's own epoll descriptor in the reactor's set: it only notes
    that trio has events (trio's own wait, right after, takes them)."""

    __slots__ = ("fired",)

    def __init__(self) -> None:
        self.fired = False

    def on_event(self, fd: int, events: int) -> None:
        self.fired = True


class TrioWait(trio.abc.Instrument):
    """The hook, installed for one trio run and one reactor (see the module's doc)."""

    def __init__(
        self,
        runner: Any,
        batch: Batch,
        listen: Listen,
        unlisten: Listen,
        compiled_wait: CompiledWait | None,
        system_clock: type,
    ) -> None:
        self._runner = runner
        self._runq = runner.runq
        self._next_deadline = runner.deadlines.next_deadline
        clock = runner.clock
        self._sleep_time = clock.deadline_to_sleep_time
        # trio's own clock reads offset + perf_counter(): the time left to a deadline is
        # computed here without its two Python frames, once per batch.
        own_clock = type(clock) is system_clock
        self._offset: float | None = clock.offset if own_clock else None
        self._wake = runner.io_manager.force_wakeup
        self._batch = batch
        # _wait's loop in C (the C reactor's wait), for trio's own clock: no Python frame
        # per batch but next_deadline's.
        self._compiled_wait = compiled_wait if self._offset is not None else None
        self._unlisten = unlisten
        self._trio_fd = runner.io_manager._epoll.fileno()
        self._ready = _TrioReady()
        self._task: Any = None  # the reactor's task while it is parked
        self._given_back: outcome.Outcome[None] | None = None
        listen(self._trio_fd, self._ready.on_event)
        trio.lowlevel.add_instrument(self)

    def before_io_wait(self, timeout: float) -> None:
        try:
            if timeout <= 0:
                self._batch(0)
                return
            self._wait(timeout)
        except BaseException as exc:  # an instrument that raises is dropped by trio
            self._give_back(outcome.Error(exc))
            self._wake()  # the reactor's task is runnable: trio must not block

    def _wait(self, timeout: float) -> None:
        ready, runq, batch = self._ready, self._runq, self._batch
        next_deadline, offset, now = self._next_deadline, self._offset, time.perf_counter
        if self._compiled_wait is not None:
            assert offset is not None
            if self._compiled_wait(self._trio_fd, timeout, offset, next_deadline, runq):
                return  # trio's own wait sees its events at once
            self._woken_after_wait()
            return
        end = now() + timeout
        ready.fired = False
        while True:
            # The time left: to the end of trio's timeout, or to trio's next deadline if a
            # batch has brought one nearer.
            deadline = next_deadline()
            if offset is not None:
                left = min(end, deadline - offset) - now()
            else:
                left = min(end - now(), self._sleep_time(deadline))
            if left <= 0:
                break
            # Rounded up, as trio's own epoll wait rounds: never back before the deadline.
            batch(min(math.ceil(left * 1000.0), 86_400_000))
            if ready.fired:
                return  # trio's own wait sees its events at once
            if runq:
                break
        self._woken_after_wait()

    def _woken_after_wait(self) -> None:
        """The wait is over (its time, or a task is runnable) with nothing for trio's own
        wait to see: wake it, or it would block its whole timeout again -- unless that
        timeout is a test's idle priming, which a wake-up would defeat."""
        runner = self._runner
        if not runner.waiting_for_idle and runner.clock_autojump_threshold == math.inf:
            self._wake()

    def _give_back(self, result: outcome.Outcome[None]) -> None:
        """Take the hook out and hand the reactor back to its task (once)."""
        if self._given_back is not None:
            return
        self._given_back = result
        trio.lowlevel.remove_instrument(self)
        # The task will wait on the reactor's descriptor in trio's set: trio's own
        # descriptor must leave the reactor's first (epoll refuses a loop, ELOOP).
        with contextlib.suppress(OSError, ValueError):  # the set is closed already
            self._unlisten(self._trio_fd, self._ready.on_event)
        if self._task is not None:
            task, self._task = self._task, None
            trio.lowlevel.reschedule(task, result)

    async def parked(self) -> None:
        """The reactor task's wait while the hook serves the set: returns if the hook
        gave the reactor back after a batch raised an Exception (re-raised in the
        task if it was not an Exception: KeyboardInterrupt, say). Cancelled at the
        end of the run (a system task), it takes the hook out first."""
        if self._given_back is None:
            self._task = trio.lowlevel.current_task()

            def abort(_: object) -> trio.lowlevel.Abort:
                self._task = None
                self._give_back(outcome.Value(None))
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        else:
            await trio.lowlevel.checkpoint()
        assert self._given_back is not None
        self._given_back.unwrap()

    def close(self) -> None:
        """Take the hook out (idempotent): before the reactor's set is closed."""
        self._give_back(outcome.Value(None))


def install(
    batch: Batch,
    listen: Listen,
    unlisten: Listen,
    compiled_wait: CompiledWait | None = None,
) -> TrioWait | None:
    """Install the hook for the current trio run, or None where trio's internals are
    not the ones this module reads (then the reactor stays a task). `batch(timeout_ms)`
    handles one batch; `listen` / `unlisten` put trio's own descriptor in the reactor's
    set and take it out; `compiled_wait`, if any, is the whole wait in C."""
    try:
        # internals, checked here: an ImportError or AttributeError leaves the task
        from trio._core._run import GLOBAL_RUN_CONTEXT, SystemClock

        runner = GLOBAL_RUN_CONTEXT.runner
        manager = runner.io_manager
        if runner.is_guest or not isinstance(manager._epoll, select.epoll):
            return None
        # Read here once, so that a trio without them is found now, not in a batch.
        _needed = (
            runner.runq,
            runner.deadlines.next_deadline,
            runner.clock.deadline_to_sleep_time,
            runner.waiting_for_idle,
            runner.clock_autojump_threshold,
            manager.force_wakeup,
        )
    except (ImportError, AttributeError):  # outside a run, or another trio
        return None
    return TrioWait(runner, batch, listen, unlisten, compiled_wait, SystemClock)


def clock_offset(clock: object) -> float | None:
    """The offset of trio's own SystemClock (its time is that plus
    time.perf_counter(), which the C reactor computes itself), None for any other
    clock (a test's MockClock), which must be called."""
    try:
        from trio._core._run import SystemClock
    except ImportError:  # another trio: call the clock
        return None
    if type(clock) is not SystemClock:
        return None
    offset = clock.offset
    return offset if type(offset) is float else None
