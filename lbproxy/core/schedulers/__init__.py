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

The registry is also the one place that knows what each algorithm *reads*: every class
declares it (`reads`: SNMP values, pushed load reports, the client address; `keys`: the
configuration keys it reads beyond the common ones; `options`: keys of its own, with their
converters), as nginx's upstream modules declare the flags they support. The
configuration reader, its reference and schema, the pool, the API and the metrics ask
these questions (`reading`, `with_load`, `option_fields`, `Scheduler.reads_snmp`, ...)
and never name an algorithm, so adding one is adding one module here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

# DEFAULT: the scheduler of a virtual server without a `scheduler:` key (re-exported)
from lbproxy.core.schedulers.default import DEFAULT as DEFAULT
from lbproxy.core.schedulers.heap import KeyedHeap

if TYPE_CHECKING:
    from lbproxy.config.model import VirtualServerConfig
    from lbproxy.config.values import Converter
    from lbproxy.core.pool import Pool, RealServer

_REGISTRY: dict[str, type[Scheduler]] = {}

# What a scheduler may read besides the pool's own counts (`Scheduler.reads`).
SNMP = "snmp"  # values polled from each server's SNMP agent (the `snmp:` block)
REPORTS = "reports"  # load reports the servers push (`PUT .../load`)
CLIENT = "client"  # the client's address: picks are keyed by it


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


def catalogue() -> list[type[Scheduler]]:
    """Every registered scheduler class, in catalogue order (`Scheduler.rank`): the order
    in which the reference lists the schedulers that read a key."""
    _load_builtins()
    return sorted(_REGISTRY.values(), key=lambda cls: (cls.rank, cls.name))


def reading(what: str) -> tuple[str, ...]:
    """The schedulers that may read `what`: an input (SNMP, REPORTS, CLIENT) or a
    configuration key (`quiesce`, `load_factor`, ...), in catalogue order."""
    return tuple(cls.name for cls in catalogue() if what in cls.reads or what in cls.keys)


def with_load() -> tuple[str, ...]:
    """The schedulers with a load to balance (SPEC §11): they alone take `conditioning`."""
    return tuple(cls.name for cls in catalogue() if cls.has_load())


def without_load() -> tuple[str, ...]:
    return tuple(cls.name for cls in catalogue() if not cls.has_load())


def option_fields() -> dict[str, Converter]:
    """Every scheduler's own keys, read beside the virtual server's (YAML keys stay where
    SPEC puts them), each marked as accepted by its owner only."""
    fields: dict[str, Converter] = {}
    for cls in catalogue():
        for key, converter in cls.options.items():
            if key in fields:
                raise ValueError(f"scheduler option {key!r} is declared twice")
            fields[key] = converter.about(
                converter.description, default=converter.default, only=(cls.name,)
            )
    return fields


def option_models() -> dict[str, type]:
    """Option key -> the `Options` dataclass whose field default is that key's default."""
    return {key: cls.Options for cls in catalogue() if cls.Options for key in cls.options}


def option_owner(key: str) -> str | None:
    """The scheduler that declares option `key`; None: not a scheduler option."""
    return next((cls.name for cls in catalogue() if key in cls.options), None)


def _load_builtins() -> None:
    # Imported for their @register side effect; late, so the modules can import this one,
    # and so importing this package loads no algorithm: the configuration model reads
    # default.py, which runs this file first, and maglev reads config/values.py, which
    # reads the model.
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
    # Position in the catalogue (`catalogue()`): the order the reference lists them in.
    rank: ClassVar[int] = 1000
    # -- what it reads, declared (asked by config, pool, API, metrics; see the header) --
    # Inputs it may read: SNMP, REPORTS, CLIENT (some only with a configuration, see
    # `reads_snmp`, `reads_reports`).
    reads: ClassVar[frozenset[str]] = frozenset()
    # Configuration keys it reads that others ignore (`quiesce`, `load_factor`, ...).
    keys: ClassVar[frozenset[str]] = frozenset()
    # What `explain` gives per server (simulate --explain, GET .../explain), in words.
    score_legend: ClassVar[str] = ""
    # Keys of its own (key -> converter, lbproxy/config/values.py), accepted only with
    # this scheduler; `Options(**values)` holds what was read (`VirtualServerConfig.options`).
    options: ClassVar[Mapping[str, Converter]] = {}
    Options: ClassVar[type | None] = None
    # True: its load is a figure users read (the API's `load`, `lbproxy_real_server_load`).
    shows_load: ClassVar[bool] = False
    # True: the pool feeds SNMP values into weights (dwd, dwr) and applies on_no_answer.
    dynamic_weights: ClassVar[bool] = False
    # True: with `quiesce: true`, a server coming online resets the connection table.
    quiesce_resets: ClassVar[bool] = False
    # True: picks depend on the client (CLIENT in `reads`); the pool calls `pick_for`
    # with its address. Derived from `reads`, so the two cannot disagree.
    keyed: ClassVar[bool] = False
    # False: its on_drop is the base's no-op, which the pool then does not call (a
    # Python frame per connection's end). Derived from the class, so it cannot drift.
    watches_drops: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.keyed = CLIENT in cls.reads
        cls.watches_drops = cls.on_drop is not Scheduler.on_drop

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    # -- declarations that depend on the configuration -------------------------------

    @classmethod
    def reads_snmp(cls, config: VirtualServerConfig) -> bool:
        """True when this virtual server's servers must be polled over SNMP."""
        return SNMP in cls.reads

    @classmethod
    def reads_reports(cls, config: VirtualServerConfig) -> bool:
        """True when pushed load reports change this scheduler's picks."""
        return REPORTS in cls.reads

    @classmethod
    def has_load(cls) -> bool:
        """A load to balance (SPEC §11): it says `balance_load`, so conditioning and the
        locator's `?current=` can compare servers."""
        return cls.balance_load is not Scheduler.balance_load

    @classmethod
    def options_of(cls, config: VirtualServerConfig) -> Any:
        """This scheduler's options for `config` (its `Options` defaults when none were read)."""
        if config.options is not None:
            return config.options
        return cls.Options() if cls.Options is not None else None

    @classmethod
    def describe_source(cls, config: VirtualServerConfig) -> str:
        """For `lbproxy check`'s summary: where its load comes from (", load from ...")."""
        return ""

    @classmethod
    def describe_options(cls, config: VirtualServerConfig) -> str:
        """For `lbproxy check`'s summary: its own options (", table ...")."""
        return ""

    @classmethod
    def problems(cls, config: VirtualServerConfig) -> Iterator[tuple[Any, str]]:
        """What this scheduler needs that `config` lacks, as (where, message): `where` is
        "scheduler", "discovery" (the key whose line the problem is reported at) or a
        RealServerConfig. Called by the configuration reader, once per virtual server."""
        if cls.reads_snmp(config) and config.snmp is None:
            what = cls._snmp_reader(config)
            missing = [rs.name for rs in config.real_servers if rs.snmp is None]
            if missing:
                yield (
                    "scheduler",
                    f"scheduler {what} needs an snmp block on the virtual server or on every "
                    f"real server (missing on {', '.join(missing)})",
                )
            if config.discovery is not None:
                yield (
                    "discovery",
                    f"scheduler {cls.name} with discovery needs an snmp block on the virtual "
                    "server (discovered real servers are polled with it)",
                )

    @classmethod
    def _snmp_reader(cls, config: VirtualServerConfig) -> str:
        """This scheduler as named where it needs SNMP."""
        return cls.name

    # -- the hot path and the hooks ----------------------------------------------------

    def pick(self, now: float, avoid: Collection[RealServer] = ()) -> RealServer | None:
        raise NotImplementedError

    def pick_for(
        self, client: tuple[Any, ...] | None, now: float, avoid: Collection[RealServer] = ()
    ) -> RealServer | None:
        """`pick` for a client address `(host, port)`; only `keyed` schedulers use it."""
        return self.pick(now, avoid)

    def peek(self, client: tuple[Any, ...] | None, now: float) -> RealServer | None:
        """The server `pick_for(client, now)` would return, changing nothing (explain).

        A pick moves no rotation here (rr's turn, wrr's deadlines, sap's load advance in
        `on_take`), so this default is `pick_for`; a scheduler whose pick tidies its own
        structures as it reads them overrides it with a read that does not."""
        return self.pick_for(client, now)

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

    def key(self, rs: RealServer) -> tuple[Any, ...]:
        """What this algorithm minimises, as a tuple compared element by element."""
        raise NotImplementedError

    def pick(self, now: float, avoid: Collection[RealServer] = ()) -> RealServer | None:
        return self.heap.min(avoid)  # type: ignore[return-value]  # the heap holds RealServers only

    def peek(self, client: tuple[Any, ...] | None, now: float) -> RealServer | None:
        # The live entries' minimum, O(n): `pick` pops stale entries off the heap.
        return self.heap.peek()  # type: ignore[return-value]  # the heap holds RealServers only

    def _rekey(self, rs: RealServer) -> None:
        heap = self.heap
        if rs in heap.entries:
            heap.set(rs, self.key(rs))

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
            self._rekey(rs)  # type: ignore[arg-type]  # the heap holds RealServers only

    def explain(self, rs: RealServer) -> Any:
        return self.key(rs)
