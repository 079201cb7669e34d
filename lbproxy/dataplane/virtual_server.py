"""The runtime virtual server: the one object the handler, the sensors and the admin read.

A `VirtualServer` is its pool (real servers, scheduler, counters, `pool.config`) plus
the few runtime parts that are not the pool itself: the access-log flag, the
admission-control monitor and the connection queue, if any. It owns no task and moves no byte.

Imports point one way (ARCHITECTURE.md): the connection handler (connection.py), the
sensors (checks.py, throttle_monitor.py), the listeners and the server all import this
module, and it imports none of them (only the pool and the queue it holds). The
throttle monitor is therefore named here only by the two methods the handler calls
(`Admission`), not by its class.
"""

from __future__ import annotations

import logging
from typing import Protocol

from lbproxy.config.model import PerSourceConfig
from lbproxy.core.per_source import Limits, PerSourceTable
from lbproxy.core.pool import Pool
from lbproxy.core.throttle import LOW, Throttle
from lbproxy.dataplane.queue import Queue, QueueStats

log = logging.getLogger("lbproxy.virtual_server")


class Admission(Protocol):
    """What the connection handler asks of an admission-control monitor."""

    def arrival(self) -> bool:
        """Count one accepted client, already counted in `pool.clients`; True: refuse
        it (digg). May take the mode up at once (throttle.py)."""
        ...

    def idle_timeout_for(self, own: float) -> float:
        """The idle timeout a new connection starts with, given the virtual server's own."""
        ...

    @property
    def mode(self) -> str:
        """low | high | digg, the throttle's own state (for the metrics and the API)."""
        ...

    @property
    def model(self) -> Throttle:
        """The throttle's state, which `lbproxy explain` reads without counting an arrival."""
        ...


class VirtualServer:
    """The running side of one virtual server: its pool and its runtime switches."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.access_log = False  # global.access_log, set by the Server
        # Admission control (throttle_monitor.py), set by the Server's Throttles when the
        # virtual server has a `throttle:` block; it keeps its mode (`throttle_mode`).
        self.throttle: Admission | None = None
        # The connection queue (queue.py), when the virtual server has `queue:`; what it
        # publishes outlives it (a reload that removes the queue keeps the waits counted).
        self.queue: Queue | None = None
        self.queue_stats = QueueStats()
        # The client networks of `per_source:` (None: no such block), kept across reloads
        # (sync_per_source) so the open connections stay counted.
        self.per_source: PerSourceTable | None = None
        self._per_source_config: PerSourceConfig | None = None

    @property
    def name(self) -> str:
        return self.pool.name

    def sync_per_source(self, config: PerSourceConfig | None) -> None:
        """Give the virtual server the per-source table `config` asks for (a reload's:
        the same table under the new limits where it can)."""
        if config is self._per_source_config:
            return
        self._per_source_config = config
        if config is None:
            self.per_source = None
            return
        limits = Limits.of(config)
        table = self.per_source
        self.per_source = PerSourceTable(limits) if table is None else table.reconfigure(limits)

    @property
    def throttle_model(self) -> Throttle | None:
        """The admission monitor's state (None: no `throttle:` block), for explain."""
        throttle = self.throttle
        return None if throttle is None else throttle.model

    @property
    def throttle_mode(self) -> str:
        """The admission monitor's mode; low without one (SPEC section 5)."""
        throttle = self.throttle
        return LOW if throttle is None else throttle.mode
