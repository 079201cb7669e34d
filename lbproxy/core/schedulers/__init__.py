"""Schedulers: one small module per algorithm, registered by name.

PURE: no trio, no clock (time is passed in as `now`).

A scheduler sees the *available* real servers of one pool (enabled, not draining,
health up, below `max_connections`, effective weight > 0) through hooks the pool calls
when something changes, as HAProxy's `struct lb_ops` (backend-t.h): any hook may be a
no-op. `pick` never blocks and never raises; `None` means nothing is available.

Most algorithms minimise a key over the available servers; `HeapScheduler` keeps them in
a keyed heap (schedulers/heap.py) and re-keys one server on take/drop/weight change, so a pick costs
O(log n) whatever the number of servers (no scan, as `lb_fwlc.c`).

Registration rejects a duplicate name, as IPVS's `register_ip_vs_scheduler` does.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any, ClassVar

from lbproxy.core.schedulers.heap import KeyedHeap

if TYPE_CHECKING:
    from lbproxy.core.pool import Pool, RealServer

_REGISTRY: dict[str, type[Scheduler]] = {}


def register(cls: type[Scheduler]) -> type[Scheduler]:
    """Class decorator: make `cls` selectable as `scheduler: <cls.name>`."""
    if cls.name in _REGISTRY:
        raise ValueError(f"scheduler {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def get(name: str) -> type[Scheduler]:
    _load_builtins()
    return _REGISTRY[name]


def available() -> list[str]:
    """Every registered scheduler name, sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def _load_builtins() -> None:
    # Imported for their @register side effect; late, so the modules can import this one.
    from lbproxy.core.schedulers import dynamic, first, lc, least_load, maglev, rr, sap  # noqa: F401


def format_score(score: Any) -> str:
    """A scheduler's score as a short string for decision-explain output."""
    if isinstance(score, tuple):
        return "(" + ", ".join(format_score(part) for part in score) + ")"
    if isinstance(score, float):
        return f"{score:.4g}"
    return str(score)


class Scheduler:
    """Base: every hook is a no-op; subclasses override what their algorithm needs."""

    name: ClassVar[str]
    # True: the pool feeds SNMP values into weights (dwd, dwr) and applies on_no_answer.
    dynamic_weights: ClassVar[bool] = False
    # True: with `quiesce: true`, a server coming online resets the connection table.
    quiesce_resets: ClassVar[bool] = False
    # True: picks depend on the client (maglev); the pool calls `pick_for` with its address.
    keyed: ClassVar[bool] = False

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def pick(self, now: float, avoid: Collection[RealServer] = ()) -> RealServer | None:
        raise NotImplementedError

    def pick_for(
        self, client: tuple | None, now: float, avoid: Collection[RealServer] = ()
    ) -> RealServer | None:
        """`pick` for a client address `(host, port)`; only `keyed` schedulers use it."""
        return self.pick(now, avoid)

    def on_online(self, rs: RealServer, now: float) -> None:
        """`rs` came online (enabled, health up, weight > 0): called before on_available."""

    def on_offline(self, rs: RealServer, now: float) -> None:
        """`rs` is no longer online (called before on_unavailable, if it was available)."""

    def on_available(self, rs: RealServer, now: float) -> None:
        """`rs` can take new connections again (or for the first time)."""

    def on_unavailable(self, rs: RealServer, now: float) -> None:
        """`rs` must get no new connection until `on_available`."""

    def on_weight(self, rs: RealServer, old: float, now: float) -> None:
        """The effective weight of an available `rs` changed from `old`."""

    def on_take(self, rs: RealServer, now: float) -> None:
        """A connection was sent to `rs` (after `pick` chose it)."""

    def on_sticky_take(self, rs: RealServer, now: float) -> None:
        """A connection was sent to `rs` by persistence, not by `pick` (a hit).

        It counts as any connection (`sched_active` includes it, so least connections
        and least-load see it: the default is `on_take`), but a scheduler whose state
        is a position in a rotation (rr, wrr) must not move it: a hit is not a pick."""
        self.on_take(rs, now)

    def on_drop(self, rs: RealServer, now: float) -> None:
        """A connection to `rs` that counts for scheduling ended."""

    def on_reset(self, now: float) -> None:
        """The quiesce reset zeroed every server's scheduling count."""

    def on_report(self, rs: RealServer, value: float, now: float) -> None:
        """An SNMP value arrived for `rs` (least-load with `load_source: snmp`)."""

    def on_tick(self, now: float) -> float:
        """Periodic work; returns when it next wants to run (inf: never)."""
        return float("inf")

    def explain(self, rs: RealServer) -> Any:
        """The score this scheduler gives `rs` (for decision logs)."""
        return None

    def balance_load(self, rs: RealServer) -> tuple[float, float] | None:
        """(L, p) of SPEC §11 for `rs`: its load and the load one connection adds, for
        Geode's balance rule (lbproxy/core/balance.py); None: this algorithm has no load."""
        return None

    def on_moved_away(self, rs: RealServer, now: float) -> None:
        """A locator client leaves `rs` for another server (`?current=` replace): take
        back one connection's worth of what `on_take` added, where that is not the
        pool's own count (least-load's estimate, sap's accumulated load)."""


class HeapScheduler(Scheduler):
    """Minimises `key(rs)` over the available servers, kept in a KeyedHeap."""

    def __init__(self, pool: Pool) -> None:
        super().__init__(pool)
        self.heap = KeyedHeap()

    def key(self, rs: RealServer) -> tuple:
        """What this algorithm minimises, as a tuple compared element by element."""
        raise NotImplementedError

    def pick(self, now: float, avoid: Collection[RealServer] = ()) -> RealServer | None:
        return self.heap.min(avoid)  # type: ignore[return-value]

    def _rekey(self, rs: RealServer) -> None:
        if rs in self.heap:
            self.heap.set(rs, self.key(rs))

    def on_available(self, rs: RealServer, now: float) -> None:
        self.heap.set(rs, self.key(rs))

    def on_unavailable(self, rs: RealServer, now: float) -> None:
        self.heap.discard(rs)

    def on_weight(self, rs: RealServer, old: float, now: float) -> None:
        self._rekey(rs)

    def on_take(self, rs: RealServer, now: float) -> None:
        self._rekey(rs)

    def on_drop(self, rs: RealServer, now: float) -> None:
        self._rekey(rs)

    def on_reset(self, now: float) -> None:
        for rs in self.heap.items():
            self._rekey(rs)  # type: ignore[arg-type]

    def explain(self, rs: RealServer) -> Any:
        return self.key(rs)
