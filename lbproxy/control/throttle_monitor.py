"""The admission-control monitor: one trio task per virtual server with a `throttle:` block.

The model (modes, formula, hysteresis) is the pure lbproxy/core/throttle.py; this module
samples it, applies its decisions to live connections, and logs them.

How it runs (DWR's load-management thread is the model: "runs ... while there are
incoming connections. When no more incoming connections are being received the load
monitor will simply shutdown and sleep until a new connection is requested"):

- The connection handler calls `ThrottleMonitor.arrival()` for every accepted client,
  before anything else. That counts the arrival in the rate window, tells the handler
  whether to refuse it (digg), and -- only when the monitor sleeps -- wakes it. A busy
  virtual server therefore pays one ring increment and a few comparisons per arrival;
  going down and re-tuning the idle timeout is the monitor's job, every
  `throttle.interval`. Going up is not: the arrival that finds the load at the next
  mode's threshold takes the mode up itself (throttle.py, "Going up does not wait"),
  and is applied here as an evaluation would be. A burst shorter than `interval` --
  hundreds of connections from one client in half a second -- is refused from the
  arrival that reaches `digg_factor`, not served whole before the monitor looks.
- The monitor evaluates every `interval` while the virtual server has client connections
  open or arrivals within the last second. Once it is empty it is set to low (the SPEC
  wants an empty virtual server in low mode before its monitor sleeps) and the monitor
  sleeps on a trio.Event until the next arrival, which it evaluates at once.
- A change of mode, or of the imposed idle timeout by more than 2 %, is applied to every
  existing connection of the virtual server: flow.idle_timeout = min(its own timeout,
  imposed), and its own timeout again in low. Flow applies a new timeout at once, so an
  idle connection that has already been idle longer is closed right away. New
  connections start with the current imposed timeout (`idle_timeout_for`).
- Mode changes are logged at INFO. The mode ("low", "high", "digg") is the model's own
  state (`Throttle.mode`), read through `mode` by the virtual server for the metrics
  and the admin API; a virtual server without a monitor is in low.

`Throttles` keeps one monitor per virtual server in step with the configuration (the one
reconciler, reconcile.py): it starts, reconfigures and stops monitors after start-up and
after each reload.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import trio

from lbproxy.config.model import ThrottleConfig
from lbproxy.control.reconcile import Configured, Reconciler
from lbproxy.core.throttle import DIGG, Change, Throttle

log = logging.getLogger("lbproxy.throttle_monitor")


class Throttled(Configured, Protocol):
    """A virtual server with a seat for its admission monitor (`throttle`), which the
    connection handler asks (dataplane/virtual_server.py's `Admission`)."""

    throttle: Any


class ThrottleMonitor:
    """The throttle of one virtual server: its model, its task, and its effects."""

    def __init__(self, vs: Throttled, config: ThrottleConfig) -> None:
        self.vs = vs
        self.model = Throttle(config)
        self.cancel_scope = trio.CancelScope()
        self._wake: trio.Event | None = None  # set while the monitor sleeps
        self._refused_in_digg = 0

    # -- called by the connection handler, once per accepted client ----------------

    def arrival(self) -> bool:
        """Count a new client connection; True when it must be refused (digg).

        Called by the handler once it has counted the client in `pool.clients`, so the
        connections already open are `pool.clients - 1`.
        """
        model = self.model
        change = model.arrival(trio.current_time(), self.vs.pool.clients - 1)
        if change is not None:  # this arrival took the mode up
            self._apply(change)
        wake = self._wake
        if wake is not None:
            self._wake = None
            wake.set()
        if model.refusing:
            self._refused_in_digg += 1
            return True
        return False

    @property
    def mode(self) -> str:
        """low | high | digg: the model's mode, as the last change applied it."""
        return self.model.mode

    def idle_timeout_for(self, own: float) -> float:
        """The idle timeout a new connection whose own timeout is `own` starts with."""
        imposed = self.model.idle_timeout
        return own if imposed is None or imposed >= own else imposed

    # -- the task -------------------------------------------------------------------

    async def run(self) -> None:
        """Evaluate every interval while the virtual server is busy; sleep while empty."""
        pool = self.vs.pool
        model = self.model
        with self.cancel_scope:
            while True:
                now = trio.current_time()
                if model.idle(pool.clients, now):
                    self._apply(model.reset(now))
                    wake = self._wake = trio.Event()
                    await wake.wait()
                    now = trio.current_time()
                self._apply(model.evaluate(pool.clients, now))
                await trio.sleep(model.config.interval)

    def reconfigure(self, config: ThrottleConfig) -> None:
        """New limits from a reload; applied at the next evaluation (woken now if asleep)."""
        if config == self.model.config:
            return
        self.model.reconfigure(config)
        wake = self._wake
        if wake is not None:  # re-check at once; an empty VS goes back to sleep
            self._wake = None
            wake.set()

    def stop(self) -> None:
        """The throttle block was removed, or the virtual server: give connections back
        their own idle timeouts and stop the task."""
        self.cancel_scope.cancel()
        self._apply(self.model.reset(trio.current_time()))

    # -- effects --------------------------------------------------------------------

    def _apply(self, change: Change | None) -> None:
        if change is None:
            return
        pool = self.vs.pool
        if change.mode_changed:
            timeout = "own" if change.idle_timeout is None else f"{change.idle_timeout:.3g}s"
            refused = ""
            if change.old_mode == DIGG:
                refused = f"; refused {self._refused_in_digg} connection(s) in digg"
                self._refused_in_digg = 0
            log.info(
                "%s: throttle %s -> %s (load %.2f, idle timeout %s%s)",
                pool.name,
                change.old_mode,
                change.mode,
                change.load,
                timeout,
                refused,
            )
        imposed = change.idle_timeout
        for rs in pool.servers:
            # A copy: a connection already idle longer than its new timeout ends at
            # once, inside the assignment below, and drops its lease from this set.
            for lease in list(rs.leases):
                handle = lease.handle
                own = getattr(handle, "own_idle_timeout", None)
                if own is None:
                    continue
                target = own if imposed is None or imposed >= own else imposed
                flow = handle.flow
                if flow.idle_timeout != target:
                    flow.idle_timeout = target  # takes effect at once (Flow.poke)


class Throttles(Reconciler["Throttled", ThrottleConfig]):
    """One monitor per virtual server with a `throttle:` block, kept in step with reloads
    by the one reconciler (reconcile.py): new limits retune the running monitor."""

    def __init__(self) -> None:
        super().__init__()
        self._monitors: dict[Throttled, ThrottleMonitor] = {}
        self._running: set[Throttled] = set()

    def wanted(self, virtual_servers: Iterable[Any]) -> dict[Throttled, ThrottleConfig]:
        # Any: the runtime's virtual servers, which have the `throttle` seat (Throttled)
        running: list[Throttled] = list(virtual_servers)
        self._running = set(running)
        return {
            vs: vs.pool.config.throttle for vs in running if vs.pool.config.throttle is not None
        }

    def start(self, key: Throttled, spec: ThrottleConfig) -> Callable[[], Awaitable[None]]:
        monitor = self._monitors[key] = ThrottleMonitor(key, spec)
        key.throttle = monitor
        return monitor.run

    def retune(self, key: Throttled, spec: ThrottleConfig) -> bool:
        self._monitors[key].reconfigure(spec)
        return True

    def stopped(self, key: Throttled) -> None:
        monitor = self._monitors.pop(key)
        if key.throttle is monitor:
            key.throttle = None
        monitor.stop()

    def describe(self, key: Throttled, event: str) -> str | None:
        if event == "removed" and key not in self._running:
            return None  # the virtual server itself went: the reload says so
        return f"{key.name}: throttle {event}"
