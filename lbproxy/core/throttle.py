"""Admission control: a virtual server's load -> mode (low / high / digg) and idle timeout.

PURE: no trio, no sockets, no clock -- every method that needs the time takes `now`.
The trio side (the monitor task that samples, applies and logs) is throttle_monitor.py.

The theory: DWR's ThrottlingServerLoadMonitor
----------------------------------------------
DWR keeps a server usable under a flood by changing how long a client may stay connected
("connected time") and how long it must then stay away ("disconnected time"):

    DWR mode      trigger                          connected   away
    low usage     below the limits                 default     default
    high usage    "reached the maximum connected   49 s        1 s      at the start,
                   thread limit"                                        then adjusted
                                                                        linearly
    digg usage    the linear adjustment reaches    0 s         2 s
                  a connected time of 1 s

A TCP balancer cannot tell a client when to come back, so "connected time" becomes the
idle timeout imposed on the virtual server's connections, and "connected time 0" becomes
refusing new connections (accepted and closed at once, counted with reason="throttle")
while the established ones are kept (SPEC section 5):

    load  = max(active / max_connections, rate / max_rate)    (an omitted limit is 0)
    low   : load < 1                      imposed idle timeout: none (the VS's own)
    high  : 1 <= load < digg_factor       high_idle_timeout - (high_idle_timeout -
                                          min_idle_timeout) * (load - 1) / (digg_factor - 1)
    digg  : load >= digg_factor           min_idle_timeout; new connections refused

With the defaults (high_idle_timeout 49 s, min_idle_timeout 1 s, digg_factor 2) this is
DWR's table: 49 s at load 1 (the start of high usage), falling linearly to the 1 s floor
at load 2, where digg begins. `active` is the client connections open; `rate` is the new
connections of the last second, every arrival counted, refused ones included -- a flood
of refused clients is still a flood.

Going up does not wait for the monitor. The monitor evaluates every `interval`, but a
burst can be over within one interval: a rate limit of 5/s that lets 400 connections of
a 0.4 s burst through before it looks is no limit. So every arrival checks, with two
integer comparisons, whether the load as it stands when it arrives (the connections
already open, the arrivals of the last second before it) has reached the next mode's
threshold -- 1 in low, digg_factor in high -- and if so the load is evaluated at once,
for this arrival: the one that finds 10 arrivals in the last second with max_rate 5, or
8 connections open with max_connections 4, is the first refused. The thresholds are
turned into counts (`_rate_trigger` arrivals, `_active_trigger` connections) whenever
the mode or the limits change, so the arrival path divides nothing.

Hysteresis. Going up is immediate (low -> digg in one step when load >= digg_factor).
Going down needs the load clearly under the threshold, so a load that hovers at a
boundary does not flap: digg is left when load < 0.9 x digg_factor (to high), high is
left when load < 0.9 (to low). Digg steps down to high, then low: at most one step down
per evaluation. In the bands where a mode is kept only by the hysteresis the imposed
timeout is clamped: high with 0.9 <= load < 1 imposes high_idle_timeout, digg with
0.9 x digg_factor <= load < digg_factor imposes min_idle_timeout.

The imposed timeout is announced (and the monitor re-applies it to every connection)
only when the mode changes or the exact value has moved by more than ANNOUNCE_STEP
relative: touching thousands of connections each interval for a 0.3 % change would cost
more than it gives.

The rate window is a ring of RATE_BUCKETS counters over RATE_WINDOW seconds: an arrival
is one increment (no allocation), and sliding costs one zeroed bucket per elapsed bucket
width, so both are O(1) amortised. An arrival counts for between 0.95 s and 1 s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from lbproxy.config.model import ThrottleConfig

LOW, HIGH, DIGG = "low", "high", "digg"
MODES = (LOW, HIGH, DIGG)
MODE_VALUES = {LOW: 0, HIGH: 1, DIGG: 2}  # lbproxy_throttle_mode
HYSTERESIS = 0.9  # leave a mode when the load is below 0.9 x its threshold
ANNOUNCE_STEP = 0.02  # re-announce the imposed timeout when it moved by more than 2 %
RATE_WINDOW = 1.0  # seconds (SPEC: new connections per second over a sliding 1 s)
RATE_BUCKETS = 20  # 50 ms resolution


class RateWindow:
    """Arrivals over the last `window` seconds, counted in a ring of buckets.

    `add` and `count` take a `now` that never goes backwards (a monotonic clock); an
    earlier `now` counts in the current bucket.
    """

    __slots__ = ("_counts", "_current", "_total", "_width", "window")

    def __init__(self, window: float = RATE_WINDOW, buckets: int = RATE_BUCKETS) -> None:
        if window <= 0 or buckets < 1:
            raise ValueError("window must be > 0 and buckets >= 1")
        self.window = window
        self._width = window / buckets
        self._counts = [0] * buckets
        self._current = -1  # absolute number of the bucket `now` falls in; -1: none yet
        self._total = 0

    def add(self, now: float, n: int = 1) -> None:
        self._advance(now)
        self._counts[self._current % len(self._counts)] += n
        self._total += n

    def count(self, now: float) -> int:
        """Arrivals in the window that ends at `now`."""
        self._advance(now)
        return self._total

    def rate(self, now: float) -> float:
        """Arrivals per second over the window that ends at `now`."""
        return self.count(now) / self.window

    def _advance(self, now: float) -> None:
        bucket = math.floor(now / self._width)
        current = self._current
        if bucket <= current:
            return
        counts = self._counts
        size = len(counts)
        if self._total == 0 or bucket - current >= size:
            if self._total:
                counts[:] = [0] * size
                self._total = 0
        else:
            for number in range(current + 1, bucket + 1):
                slot = number % size
                self._total -= counts[slot]
                counts[slot] = 0
        self._current = bucket


def load_of(config: ThrottleConfig, active: int, rate: float) -> float:
    """The load of SPEC section 5; a limit that is not configured contributes 0."""
    load = 0.0
    if config.max_connections:
        load = active / config.max_connections
    if config.max_rate:
        load = max(load, rate / config.max_rate)
    return load


def next_mode(mode: str, load: float, digg_factor: float) -> str:
    """The mode after one evaluation at `load`, with the hysteresis of SPEC section 5."""
    if load >= digg_factor:
        return DIGG
    if mode == DIGG:
        return DIGG if load >= HYSTERESIS * digg_factor else HIGH  # one step down
    if load >= 1.0:
        return HIGH
    if mode == HIGH and load >= HYSTERESIS:
        return HIGH
    return LOW


def imposed_idle_timeout(config: ThrottleConfig, mode: str, load: float) -> float | None:
    """The idle timeout a mode imposes at `load` (None in low: the VS's own applies)."""
    if mode == LOW:
        return None
    if mode == DIGG:
        return config.min_idle_timeout
    high, floor = config.high_idle_timeout, config.min_idle_timeout
    fraction = (load - 1.0) / (config.digg_factor - 1.0)
    fraction = min(1.0, max(0.0, fraction))
    return max(floor, high - (high - floor) * fraction)


@dataclass(frozen=True, slots=True)
class Change:
    """What an evaluation changed: the mode, or the announced idle timeout, or both."""

    time: float
    old_mode: str
    mode: str
    load: float
    idle_timeout: float | None  # imposed; None: the virtual server's own

    @property
    def mode_changed(self) -> bool:
        return self.old_mode != self.mode


class Throttle:
    """The admission-control state of one virtual server.

    The caller reports every arrival (`arrival`, which may take the mode up at once)
    and, every `config.interval` while the virtual server has connections open or
    arriving, calls `evaluate` with the number of client connections open. `mode`
    decides admission (`refusing`), `idle_timeout` is what new and existing connections
    get (None: their own).
    """

    __slots__ = (
        "_active_trigger",
        "_rate_trigger",
        "config",
        "idle_timeout",
        "load",
        "mode",
        "refusing",
        "window",
    )

    def __init__(self, config: ThrottleConfig) -> None:
        self.config = config
        self.window = RateWindow()
        self.mode = LOW
        self.refusing = False  # mode == DIGG, read on every arrival
        self.load = 0.0  # at the last evaluation
        self.idle_timeout: float | None = None  # announced imposed timeout
        self._set_triggers()

    def arrival(self, now: float, active: int = 0) -> Change | None:
        """Count one new connection, arriving while `active` client connections are open
        (itself not included); `refusing` then says whether to refuse it (digg).

        When the load this arrival finds has reached the next mode's threshold, the
        mode goes up now rather than at the next evaluation: the change is returned for
        the caller to apply. Otherwise this costs two comparisons and one increment.
        """
        change = None
        if not self.refusing and (
            active >= self._active_trigger or self.window.count(now) >= self._rate_trigger
        ):
            change = self.evaluate(active, now)
        self.window.add(now)  # refused or not, it counts toward the rate
        return change

    def would_refuse(self, now: float, active: int) -> bool:
        """Whether an arrival at `now`, with `active` client connections open, would be
        refused (`arrival`'s verdict), without counting it or changing the mode: for
        `lbproxy explain`. Reading the window moves it on to `now`, as any reader does."""
        if self.refusing:
            return True
        if active >= self._active_trigger or self.window.count(now) >= self._rate_trigger:
            config = self.config
            load = load_of(config, active, self.window.rate(now))
            return next_mode(self.mode, load, config.digg_factor) == DIGG
        return False

    def rate(self, now: float) -> float:
        return self.window.rate(now)

    def idle(self, active: int, now: float) -> bool:
        """True when nothing is open and nothing arrived within the rate window."""
        return active == 0 and self.window.count(now) == 0

    def evaluate(self, active: int, now: float) -> Change | None:
        """Re-evaluate with `active` client connections open; None when nothing changed."""
        config = self.config
        load = load_of(config, active, self.window.rate(now))
        self.load = load
        mode = next_mode(self.mode, load, config.digg_factor)
        timeout = imposed_idle_timeout(config, mode, load)
        return self._set(mode, load, timeout, now)

    def reset(self, now: float) -> Change | None:
        """Back to low at once: the virtual server has emptied (before the monitor sleeps)."""
        self.load = 0.0
        return self._set(LOW, 0.0, None, now)

    def reconfigure(self, config: ThrottleConfig) -> None:
        """New limits (a reload); the next `evaluate` applies them. Arrivals are kept."""
        self.config = config
        self._set_triggers()

    def _set_triggers(self) -> None:
        """The counts at which an arrival takes the mode up: the smallest number of
        connections open, and of arrivals within the window, whose load reaches the next
        mode's threshold (none above digg). Computed with `load_of` itself, so that an
        arrival that triggers is sure to go up when evaluated."""
        config = self.config
        threshold = {LOW: 1.0, HIGH: config.digg_factor}.get(self.mode)
        self._active_trigger = self._rate_trigger = math.inf
        if threshold is None:
            return
        if config.max_connections:
            self._active_trigger = _smallest(
                lambda n: load_of(config, n, 0.0) >= threshold,
                threshold * config.max_connections,
            )
        if config.max_rate:
            window = self.window.window
            self._rate_trigger = _smallest(
                lambda n: load_of(config, 0, n / window) >= threshold,
                threshold * config.max_rate * window,
            )

    def _set(self, mode: str, load: float, timeout: float | None, now: float) -> Change | None:
        old_mode, announced = self.mode, self.idle_timeout
        if mode == old_mode and not _moved(announced, timeout):
            return None
        self.mode = mode
        self.refusing = mode == DIGG
        self.idle_timeout = timeout
        if mode != old_mode:
            self._set_triggers()
        return Change(now, old_mode, mode, load, timeout)


def _smallest(reaches: Callable[[int], bool], estimate: float) -> int:
    """The smallest integer n >= 0 for which `reaches(n)` holds, near `estimate` (the
    exact real solution; float rounding moves the answer by one at most)."""
    n = max(0, math.ceil(estimate))
    while n > 0 and reaches(n - 1):
        n -= 1
    while not reaches(n):
        n += 1
    return n


def _moved(announced: float | None, timeout: float | None) -> bool:
    if announced is None or timeout is None:
        return announced is not timeout
    return abs(timeout - announced) > ANNOUNCE_STEP * announced
