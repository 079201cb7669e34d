"""The run's clock (trio's, monotonic) as wall-clock time: one offset for the run.

A moment the run noted on its own clock (a server's last change) is shown as wall-clock
time, and an upgrade hands it to the next process that way. Reading both clocks afresh
for each conversion gives a slightly different answer each time (the two readings are
never at the same instant, and a process can be preempted between them), so the same
moment would be shown as 27.053 on one read and 27.054 on the next. Instead the offset
is read once per run, from the closest of a few paired readings, and read again only
when the wall clock has moved by more than STEP against the monotonic one (set by hand,
or stepped by NTP).
"""

from __future__ import annotations

import time

import trio

STEP = 0.5  # seconds: a wall clock moved by more than this is read again
TIGHT = 0.001  # seconds: a pair of readings this close is taken at once
TRIES = 3

_cached: tuple[trio.abc.Clock, float] | None = None  # the run's clock and its offset


def offset() -> float:
    """Wall-clock time minus the run's time, the same for the whole run."""
    global _cached
    clock = trio.lowlevel.current_clock()
    fresh = _paired_reading(clock)
    if _cached is None or _cached[0] is not clock or abs(fresh - _cached[1]) > STEP:
        _cached = (clock, fresh)
    return _cached[1]


def to_wall(when: float) -> float:
    """A time of the run's clock as wall-clock seconds since 1970."""
    return when + offset()


def _paired_reading(clock: trio.abc.Clock) -> float:
    """time.time() minus the run's time at the same instant, from the tightest of up to
    TRIES bracketed readings (a preemption between two readings makes that pair wide)."""
    best_width, best = float("inf"), 0.0
    for _ in range(TRIES):
        before = clock.current_time()
        wall = time.time()
        after = clock.current_time()
        if after - before < best_width:
            best_width, best = after - before, wall - (before + after) / 2
        if best_width < TIGHT:
            break
    return best
