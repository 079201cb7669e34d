"""The run's pump reactor: which implementation, how trio serves it, its idle timer.

A reactor holds one epoll set for every pump of a trio run (and the listening sockets
whose accepts share its wait, net/accept.py). Two implementations have the same API --
``lbproxy.net._cpump`` (C, lbproxy/net/_cpump.c) and ``lbproxy.net.pure_pump`` (pure
Python) -- described here by the `Reactor` and `Pump` protocols; net/compiled.py picks
one. This module gives each trio run its reactor (`reactor()`) and runs it:

* Batches are served by trio's loop itself (net/trio_wait.py): one before each of trio's
  I/O checks, and, when trio has nothing to run, in trio's place -- one epoll_wait on the
  reactor's set, which then also holds trio's own descriptor. Where trio's internals are
  not the expected ones, or after a batch raised past the per-connection barrier, the
  reactor's task serves the set instead (up to REPOLL_ROUNDS batches per wake-up).
* Idle timeouts: the reactor keeps its pumps' deadlines itself (a heap, in C for the C
  one) and ends the idle ones when `expire()` is called; one task per run, the idle
  timer, calls it and sleeps until the next deadline in a trio cancel scope. So trio's
  own deadline logic -- trio_wait's next-deadline check, a test's autojump clock, the
  task mode -- sees the one deadline that matters with no change, and a pump costs no
  Python call to arm or cancel its deadline. A pump armed earlier than the timer sleeps
  calls `wake(when)`, which moves the scope's deadline (with equal timeouts, once per
  idle period at most).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import Protocol

import trio
from trio.lowlevel import wait_readable

from lbproxy.net import pure_pump, trio_wait
from lbproxy.net.barrier import record
from lbproxy.net.compiled import cpump

__all__ = [
    "Pump",
    "Reactor",
    "close_idle_pipes",
    "idle_pipes",
    "implementation",
    "reactor",
    "splice_available",
    "start",
]

log = logging.getLogger("lbproxy.pump")

# When its task serves the set: after a batch that had events, poll again at once, up
# to this many batches per wake-up (under load the next events are there already, and
# an empty epoll_wait(0) costs far less than a trio round); other tasks run between.
REPOLL_ROUNDS = 4


class Pump(Protocol):
    """One connection's pump (both implementations): made by `Reactor.open`."""

    @property
    def client_fd(self) -> int: ...
    @property
    def server_fd(self) -> int: ...
    @property
    def bytes_in(self) -> int: ...  # client -> server bytes written (initial ones included)
    @property
    def bytes_out(self) -> int: ...  # server -> client bytes written
    @property
    def last_activity(self) -> float: ...  # the run's time of the last byte either way
    @property
    def outcome(self) -> str | None: ...  # None while open
    @property
    def error(self) -> BaseException | None: ...  # behind a *_reset or error outcome

    idle_timeout: float  # a new value applies at once

    def close(self) -> None: ...  # end it now: "cancelled"


class Reactor(Protocol):
    """The run's epoll set and its pumps (both implementations)."""

    def open(
        self,
        client_fd: int,
        server_fd: int,
        initial: bytes,
        idle_timeout: float,
        on_end: Callable[[Pump], object] | None,
        uncounted: int = 0,
        splice: bool = True,
        max_duration: float = ...,
    ) -> Pump: ...
    def listen(self, fd: int, callback: Callable[[int, int], object]) -> None: ...
    def unlisten(self, fd: int, callback: Callable[[int, int], object]) -> None: ...
    def dispatch(self, timeout_ms: int = 0) -> int: ...
    def expire(self) -> float: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...
    @property
    def pumps(self) -> int: ...


# The implementation new reactors use (tests may switch it for a run).
_implementation: ModuleType = cpump if cpump is not None else pure_pump


def implementation() -> ModuleType:
    """The module whose Reactor a new run gets: _cpump or pure_pump."""
    return _implementation


def splice_available() -> bool:
    """Whether a pump opened now with ``splice=True`` would splice bulk chunks."""
    return bool(_implementation.splice_available())


def idle_pipes() -> list[tuple[int, int]]:
    """The pipes pooled for reuse, as (read, write) descriptors."""
    return list(_implementation.idle_pipes())


def close_idle_pipes() -> int:
    """Close every pooled pipe (both implementations'); how many were closed. For
    shutdown and for tests that count descriptors: pumps make new pipes as needed."""
    n = pure_pump.close_idle_pipes()
    if cpump is not None:
        n += cpump.close_idle_pipes()
    return n


if hasattr(os, "register_at_fork"):
    # A forked worker shares the parent's pipes: two processes splicing through one
    # pipe would mix their connections' bytes. The child drops its copies.
    os.register_at_fork(after_in_child=close_idle_pipes)


def _splice_refused(exc: OSError) -> None:
    log.warning("splice(2) refused (%s); copying with read/write", exc)


_reactors: trio.lowlevel.RunVar[Reactor] = trio.lowlevel.RunVar("lbproxy_reactor")


def reactor() -> Reactor:
    """The current trio run's reactor (made on first use, with its task and timer)."""
    try:
        return _reactors.get()
    except LookupError:
        r = start(_implementation)
        _reactors.set(r)
        return r


def start(impl: ModuleType, clock: Callable[[], float] | None = None) -> Reactor:
    """A new reactor of `impl` (_cpump or pure_pump), served in the current trio run
    until it ends. `clock`: the run's own unless given (a test's)."""
    timer = _IdleTimer()
    offset = None
    if clock is None:
        run_clock = trio.lowlevel.current_clock()
        clock = run_clock.current_time
        offset = trio_wait.clock_offset(run_clock)
    r: Reactor = impl.Reactor(clock, offset, record, timer.wake, _splice_refused)
    trio.lowlevel.spawn_system_task(_serve, r, name="lbproxy pump reactor")
    trio.lowlevel.spawn_system_task(timer.run, r, name="lbproxy idle timeouts")
    return r


async def _serve(r: Reactor) -> None:
    """Serve `r`'s set until the run ends (then close it): from trio's loop where
    trio_wait can hook it, else (or once a batch has raised past the barrier) here."""
    fd = r.fileno()
    waiter = trio_wait.install(r.dispatch, r.listen, r.unlisten, getattr(r, "wait", None))
    try:
        if waiter is not None:
            try:
                await waiter.parked()  # returns only if the hook gave the set back
            except Exception as exc:  # a batch raised past the per-connection barrier
                record("pump", exc, "a reactor batch (its task serves the set from now on)")
        while True:
            await wait_readable(fd)
            for _ in range(REPOLL_ROUNDS):
                if not r.dispatch(0):
                    break
    finally:  # the run is over (system tasks are cancelled last)
        if waiter is not None:
            waiter.close()  # before the set it reads is closed
        trio.lowlevel.notify_closing(fd)
        r.close()


class _IdleTimer:
    """Calls the reactor's expire() at its next idle deadline; `wake` brings that time
    forward when a pump is armed earlier."""

    __slots__ = ("_scope",)

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None

    def wake(self, when: float) -> None:
        scope = self._scope
        if scope is not None and when < scope.deadline:
            scope.deadline = when

    async def run(self, r: Reactor) -> None:
        while True:
            try:
                when = r.expire()
            except Exception as exc:  # a system task's error would end the run
                record("deadline", exc)
                when = trio.current_time() + 1.0
            with trio.CancelScope(deadline=when) as self._scope:
                await trio.sleep_forever()
