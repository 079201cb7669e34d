"""The metric families lbproxy exports: the one table of names, types, help and labels.

`admin/metrics.py` builds every family it yields from this table (`family(name)`), and
the supervisor of `workers: N` (runtime/workers/merge.py) reads it to merge its workers'
families: `merge` says how. SUM (counters, histograms, amounts such as open connections)
adds the workers' samples up; MAX takes the highest, for gauges that say what a state is
rather than how much there is (a real server is up when any worker sees it up; weights
are the same in every worker); OWN is the supervisor's own family, not merged (it counts
its reloads; the workers' counts are dropped). A family added here is exported and
merged right without a second list to keep in step. docs/reference/metrics.md is the
user's description of the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

__all__ = [
    "FAMILIES",
    "MAX",
    "OWN",
    "SUM",
    "Family",
    "counter",
    "family",
    "gauge",
    "histogram",
    "merged_by",
]

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
SUM, MAX, OWN = "sum", "max", "own"  # how the supervisor merges its workers' samples
VS, RS = "virtual_server", "real_server"

_KINDS = {COUNTER: CounterMetricFamily, GAUGE: GaugeMetricFamily, HISTOGRAM: HistogramMetricFamily}


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # without _total: prometheus_client adds it to counters
    kind: str  # COUNTER, GAUGE or HISTOGRAM
    help: str
    labels: tuple[str, ...] = ()
    merge: str = SUM


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "lbproxy_connections",
            COUNTER,
            "Connections established to each real server (failed connects not included).",
            (VS, RS),
        ),
        Family(
            "lbproxy_active_connections",
            GAUGE,
            "Connections open to each real server.",
            (VS, RS),
        ),
        Family(
            "lbproxy_bytes",
            COUNTER,
            "Bytes moved; direction in is client to server, out is server to client.",
            (VS, RS, "direction"),
        ),
        Family(
            "lbproxy_rejected_connections",
            COUNTER,
            "Client connections closed without being served, by reason.",
            (VS, "reason"),
        ),
        Family(
            "lbproxy_connect_failures",
            COUNTER,
            "Failed connects to a real server, by reason.",
            (VS, RS, "reason"),
        ),
        Family(
            "lbproxy_real_server_up",
            GAUGE,
            "1 when the real server's health is up.",
            (VS, RS),
            merge=MAX,
        ),
        Family(
            "lbproxy_real_server_weight",
            GAUGE,
            "Static (configured or set at run time) and effective weight.",
            (VS, RS, "kind"),
            merge=MAX,
        ),
        Family(
            "lbproxy_health_checks",
            COUNTER,
            "Active health check results.",
            (VS, RS, "result"),
        ),
        Family(
            "lbproxy_agent_checks",
            COUNTER,
            "Agent check exchanges: ok (a good answer, whatever it says), fail (no connect, "
            "or closed without a line), timeout, bad_answer (a line over 512 bytes, an "
            "unknown word, a weight above 256%).",
            (VS, RS, "result"),
        ),
        Family(
            "lbproxy_snmp_polls",
            COUNTER,
            "SNMP poll results.",
            (VS, RS, "result"),
        ),
        Family(
            "lbproxy_snmp_poll_duration_seconds",
            HISTOGRAM,
            "Time from an SNMP request to its answer or the poll's failure.",
            (VS,),
        ),
        Family(
            "lbproxy_dynamic_weight_fallback",
            GAUGE,
            "1 while every dynamic weight is 0 and static weights are used.",
            (VS,),
            merge=MAX,
        ),
        Family(
            "lbproxy_throttle_mode",
            GAUGE,
            "Admission control mode: 0 low, 1 high, 2 digg.",
            (VS,),
            merge=MAX,
        ),
        Family(
            "lbproxy_connection_duration_seconds",
            HISTOGRAM,
            "Lifetime of proxied connections.",
            (VS,),
        ),
        Family(
            "lbproxy_persistence_entries",
            GAUGE,
            "Clients remembered by persistence (expired entries are not counted).",
            (VS,),
        ),
        Family(
            "lbproxy_persistence_lookups",
            COUNTER,
            "Persistence lookups, one per connection: hit, miss, or moved (the remembered "
            "server was unavailable).",
            (VS, "result"),
        ),
        Family(
            "lbproxy_queued_connections",
            GAUGE,
            "Clients waiting in the virtual server's queue for a free real server.",
            (VS,),
        ),
        Family(
            "lbproxy_queue_wait_seconds",
            HISTOGRAM,
            "Time clients waited in the queue, timed-out waits included.",
            (VS,),
        ),
        Family(
            "lbproxy_config_reloads",
            COUNTER,
            "Configuration reloads, by result.",
            ("result",),
            merge=OWN,
        ),
        Family(
            "lbproxy_internal_errors",
            COUNTER,
            "Bugs caught by the exception barrier: each ended one unit (a connection, "
            "check, poll, locate or request) and nothing else.",
            ("where",),
        ),
        Family(
            "lbproxy_discovery_resolutions",
            COUNTER,
            "DNS discovery rounds, by result (ok, empty, nxdomain, error).",
            (VS, "result"),
        ),
        Family(
            "lbproxy_discovery_refused",
            COUNTER,
            "Addresses of DNS answers not used, once per round that brought them, by reason "
            "(self: one of this process's listeners; loopback, link_local, unspecified, "
            "multicast: outside discovery.dns.allow_addresses).",
            (VS, "reason"),
        ),
        Family(
            "lbproxy_discovered_servers",
            GAUGE,
            "Real servers in the last DNS answer that counted (leaving ones not included).",
            (VS,),
            merge=MAX,
        ),  # every worker resolves the same name
        Family(
            "lbproxy_cluster_connected",
            GAUGE,
            "1 while this instance is connected to the cluster's Redis.",
            (),
            merge=MAX,
        ),  # each worker is a member: 1 when any is connected
        Family(
            "lbproxy_cluster_name_clash",
            GAUGE,
            "1 while another instance heartbeats under this instance's cluster name "
            "(global.cluster.redis.name).",
            (),
            merge=MAX,
        ),  # 1 when any worker's name is another's too
        Family(
            "lbproxy_cluster_messages",
            COUNTER,
            "Cluster messages, by kind (state, weight, load, entries, invalid) and "
            "direction (in: read from Redis, out: written).",
            ("kind", "direction"),
        ),
        Family(
            "lbproxy_cluster_ignored_messages",
            COUNTER,
            "Messages and values from Redis not applied, by reason (oversized, garbage, "
            "invalid, signature: its MAC is missing or not made with this instance's key, "
            "future: made more than 60 s ahead of this instance's clock, unknown: a "
            "virtual or real server this instance does not have).",
            ("reason",),
        ),
        Family(
            "lbproxy_cluster_skipped",
            COUNTER,
            "Entries a resync did not read from Redis, by kind (entries: persistence "
            "entries beyond global.cluster.max_entries; state: fields of the state hash "
            "beyond 10,000).",
            ("kind",),
        ),
        Family(
            "lbproxy_cluster_sync_lag_seconds",
            GAUGE,
            "Connected: how long the last change from another instance took to apply "
            "here; disconnected: how long Redis has been away.",
            (),
            merge=MAX,
        ),  # the worst worker's
        Family(
            "lbproxy_udp_datagrams",
            COUNTER,
            "UDP datagrams relayed; direction in is client to server, out is server to client.",
            (VS, RS, "direction"),
        ),
        Family(
            "lbproxy_udp_active_sessions",
            GAUGE,
            "UDP sessions open to each real server.",
            (VS, RS),
        ),
        Family(
            "lbproxy_udp_sessions",
            COUNTER,
            "UDP sessions opened to each real server.",
            (VS, RS),
        ),
        Family(
            "lbproxy_udp_dropped",
            COUNTER,
            "UDP datagrams dropped, by reason: max_sessions, per_source, no_server, acl, "
            "throttle (no session opened), unrequested (a reply beyond udp.responses), "
            "send_error, reply_error.",
            (VS, "reason"),
        ),
        Family(
            "lbproxy_locator_answers",
            COUNTER,
            "Locator answers (HTTP or DNS locate), by real server answered.",
            (VS, RS, "via"),
        ),
        Family(
            "lbproxy_load_reports",
            COUNTER,
            "Load reports pushed by real servers.",
            (VS, RS),
        ),
        Family(
            "lbproxy_real_server_load",
            GAUGE,
            "least-load: the load the scheduler uses now, estimates included.",
            (VS, RS),
            merge=MAX,
        ),  # each worker is its own locator: the highest estimate
        Family(
            "lbproxy_conditioned_connections",
            COUNTER,
            "Connections closed by conditioning to rebalance the pool.",
            (VS, RS),
        ),
        Family(
            "lbproxy_connections_closed",
            COUNTER,
            "Connections closed on a change of health, by reason: marked_down "
            "(on_down: close), backup_returned (on_up: close_backups); or on purpose: "
            "max_duration (max_connection_duration), shutdown (shutdown-sessions), "
            "drain (a drain's close_after).",
            (VS, "reason"),
        ),
        Family(
            "lbproxy_outlier_ejections",
            COUNTER,
            "Times outlier detection ejected the real server (connects failed in a row).",
            (VS, RS),
        ),
        Family(
            "lbproxy_real_server_ejected",
            GAUGE,
            "1 while outlier detection holds the real server back (ejected).",
            (VS, RS),
            merge=MAX,
        ),
        Family(
            "lbproxy_panic",
            GAUGE,
            "1 while too few real servers are available (panic_threshold) and every "
            "enabled one is picked as if up.",
            (VS,),
            merge=MAX,
        ),
        Family(
            "lbproxy_dns_queries",
            COUNTER,
            "DNS locator queries, by rcode answered.",
            ("rcode",),
        ),
        # Each process's client count against its limit (net/descriptors.py): with
        # workers, each worker has its own of both, so the process's are their sums.
        Family(
            "lbproxy_open_clients",
            GAUGE,
            "Client connections open now, counted against max_clients.",
        ),
        Family(
            "lbproxy_max_clients",
            GAUGE,
            "Client connections served at once at most (global.max_clients, or derived "
            "from the open-file limit); beyond it a new client is closed at accept.",
        ),
        # The supervisor's own (runtime/workers/supervisor.py), beside the workers' merged ones.
        Family(
            "lbproxy_build_info",
            GAUGE,
            "Always 1: the version of lbproxy running, as a label.",
            ("version",),
            merge=OWN,
        ),
        Family(
            "lbproxy_workers_ready",
            GAUGE,
            "Worker processes ready to serve.",
            merge=OWN,
        ),
        Family(
            "lbproxy_worker_restarts",
            COUNTER,
            "Worker processes restarted after an exit.",
            merge=OWN,
        ),
    )
}


def family(name: str, value: float | None = None) -> Metric:
    """An empty family `name` of the table, to add samples to; `value`: a gauge with one
    unlabelled sample. A name not in the table is a KeyError (a bug, caught by tests)."""
    f = FAMILIES[name]
    if value is not None:
        return GaugeMetricFamily(f.name, f.help, value=value)
    return _KINDS[f.kind](f.name, f.help, labels=list(f.labels) or None)


_Kind = TypeVar("_Kind", CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily)


def _of_kind(name: str, kind: type[_Kind], value: float | None = None) -> _Kind:
    metric = family(name, value)
    if not isinstance(metric, kind):  # a bug (the table says another kind), caught by tests
        raise TypeError(f"{name} is a {FAMILIES[name].kind}, not a {kind.__name__}")
    return metric


def counter(name: str) -> CounterMetricFamily:
    """family(name), typed: the table's counter `name` (add_metric(labels, value))."""
    return _of_kind(name, CounterMetricFamily)


def gauge(name: str, value: float | None = None) -> GaugeMetricFamily:
    """family(name, value), typed: the table's gauge `name` (add_metric(labels, value))."""
    return _of_kind(name, GaugeMetricFamily, value)


def histogram(name: str) -> HistogramMetricFamily:
    """family(name), typed: the table's histogram `name` (add_metric(labels, buckets,
    sum))."""
    return _of_kind(name, HistogramMetricFamily)


def merged_by(merge: str) -> frozenset[str]:
    """The names of the families merged this way (SUM, MAX or OWN)."""
    return frozenset(f.name for f in FAMILIES.values() if f.merge == merge)
