"""Prometheus metrics, read from the live pools at scrape time (SPEC §8).

Nothing here runs on the connection path: the pools, the pump's flows and the pollers
keep plain counters, and this collector turns them into metric families when
`/metrics` is scraped (the prometheus-pve-exporter pattern). Each Server gets its own
registry, so tests never share state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from lbproxy.core.discovery_model import RESULTS as DISCOVERY_RESULTS
from lbproxy.core.discovery_model import DiscoveryState
from lbproxy.core.persistence import RESULTS as PERSISTENCE_RESULTS
from lbproxy.core.pool import REJECT_REASONS, Pool
from lbproxy.core.throttle import MODE_VALUES
from lbproxy.core.udp_stats import DIRECTIONS as UDP_DIRECTIONS
from lbproxy.core.udp_stats import DROP_REASONS as UDP_DROP_REASONS
from lbproxy.net.barrier import WHERE as INTERNAL_ERROR_PLACES
from lbproxy.net.barrier import internal_errors
from lbproxy.wire.cluster_messages import KINDS as CLUSTER_KINDS

CONNECT_FAILURE_REASONS = ("refused", "timeout", "error")
HEALTH_RESULTS = ("ok", "fail", "timeout")
SNMP_RESULTS = ("ok", "timeout", "error", "bad_value")
RELOAD_RESULTS = ("ok", "error")
CLUSTER_IGNORED = ("oversized", "garbage", "invalid", "unknown")
LOCATOR_VIAS = ("http", "dns")
DNS_RCODES = (
    "NOERROR",
    "NXDOMAIN",
    "REFUSED",
    "SERVFAIL",
    "FORMERR",
    "NOTIMP",
    "dropped",
    "ratelimited",
)
VS, RS = "virtual_server", "real_server"


class MetricsSource(Protocol):
    """What the collector reads: the running pools and the reload counts."""

    reloads: dict[str, int]

    def pools(self) -> Iterable[Pool]: ...


class LbproxyCollector:
    def __init__(self, source: MetricsSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        connections = CounterMetricFamily(
            "lbproxy_connections",
            "Connections established to each real server (failed connects not included).",
            labels=[VS, RS],
        )
        active = GaugeMetricFamily(
            "lbproxy_active_connections", "Connections open to each real server.", labels=[VS, RS]
        )
        bytes_total = CounterMetricFamily(
            "lbproxy_bytes",
            "Bytes moved; direction in is client to server, out is server to client.",
            labels=[VS, RS, "direction"],
        )
        rejected = CounterMetricFamily(
            "lbproxy_rejected_connections",
            "Client connections closed without being served, by reason.",
            labels=[VS, "reason"],
        )
        connect_failures = CounterMetricFamily(
            "lbproxy_connect_failures",
            "Failed connects to a real server, by reason.",
            labels=[VS, RS, "reason"],
        )
        up = GaugeMetricFamily(
            "lbproxy_real_server_up", "1 when the real server's health is up.", labels=[VS, RS]
        )
        weight = GaugeMetricFamily(
            "lbproxy_real_server_weight",
            "Static (configured or set at run time) and effective weight.",
            labels=[VS, RS, "kind"],
        )
        checks = CounterMetricFamily(
            "lbproxy_health_checks", "Active health check results.", labels=[VS, RS, "result"]
        )
        polls = CounterMetricFamily(
            "lbproxy_snmp_polls", "SNMP poll results.", labels=[VS, RS, "result"]
        )
        poll_duration = HistogramMetricFamily(
            "lbproxy_snmp_poll_duration_seconds",
            "Time from an SNMP request to its answer or the poll's failure.",
            labels=[VS],
        )
        fallback = GaugeMetricFamily(
            "lbproxy_dynamic_weight_fallback",
            "1 while every dynamic weight is 0 and static weights are used.",
            labels=[VS],
        )
        throttle = GaugeMetricFamily(
            "lbproxy_throttle_mode",
            "Admission control mode: 0 low, 1 high, 2 digg.",
            labels=[VS],
        )
        duration = HistogramMetricFamily(
            "lbproxy_connection_duration_seconds",
            "Lifetime of proxied connections.",
            labels=[VS],
        )
        persistence_entries = GaugeMetricFamily(
            "lbproxy_persistence_entries",
            "Clients remembered by persistence (expired entries are not counted).",
            labels=[VS],
        )
        persistence_lookups = CounterMetricFamily(
            "lbproxy_persistence_lookups",
            "Persistence lookups, one per connection: hit, miss, or moved (the remembered "
            "server was unavailable).",
            labels=[VS, "result"],
        )
        queued = GaugeMetricFamily(
            "lbproxy_queued_connections",
            "Clients waiting in the virtual server's queue for a free real server.",
            labels=[VS],
        )
        queue_wait = HistogramMetricFamily(
            "lbproxy_queue_wait_seconds",
            "Time clients waited in the queue, timed-out waits included.",
            labels=[VS],
        )
        now = trio.current_time()
        for pool in self.source.pools():
            vs = pool.name
            if pool.persistence is not None:
                # Counting the entries drops the expired ones first, so the gauge falls
                # as entries expire even when no client arrives.
                persistence_entries.add_metric([vs], pool.persistence_entries(now))
                for result in PERSISTENCE_RESULTS:
                    persistence_lookups.add_metric([vs, result], pool.persistence.lookups[result])
            for reason in REJECT_REASONS:
                rejected.add_metric([vs, reason], pool.rejected[reason])
            fallback.add_metric([vs], 1.0 if pool.fallback else 0.0)
            throttle.add_metric([vs], MODE_VALUES.get(pool.throttle_mode, 0))
            duration.add_metric([vs], pool.durations.cumulative(), pool.durations.total)
            if pool.config.queue is not None or pool.queue_waits.count:
                queued.add_metric([vs], pool.queued)
                queue_wait.add_metric([vs], pool.queue_waits.cumulative(), pool.queue_waits.total)
            poll_duration.add_metric(
                [vs], pool.poll_durations.cumulative(), pool.poll_durations.total
            )
            # At scrape time: a slow-start ramp shows the weight the scheduler uses now.
            for stats in pool.statistics(now).real_servers:
                rs = pool.by_name[stats.name]
                labels = [vs, stats.name]
                connections.add_metric(labels, stats.connections_total)
                active.add_metric(labels, stats.active_connections)
                bytes_total.add_metric([*labels, "in"], stats.bytes_in)
                bytes_total.add_metric([*labels, "out"], stats.bytes_out)
                up.add_metric(labels, 1.0 if stats.health == "up" else 0.0)
                weight.add_metric([*labels, "static"], stats.weight_static)
                weight.add_metric([*labels, "effective"], stats.weight_effective)
                for reason in CONNECT_FAILURE_REASONS:
                    connect_failures.add_metric(
                        [*labels, reason], rs.counters.connect_failures[reason]
                    )
                for result in HEALTH_RESULTS:
                    checks.add_metric([*labels, result], rs.counters.health_checks[result])
                if rs.config.snmp is not None and pool.polls_snmp:
                    for result in SNMP_RESULTS:
                        polls.add_metric([*labels, result], rs.counters.snmp_polls[result])
        yield from self._discovery()
        reloads = CounterMetricFamily(
            "lbproxy_config_reloads", "Configuration reloads, by result.", labels=["result"]
        )
        for result in RELOAD_RESULTS:
            reloads.add_metric([result], self.source.reloads.get(result, 0))
        internal = CounterMetricFamily(
            "lbproxy_internal_errors",
            "Bugs caught by the exception barrier: each ended one unit (a connection, "
            "check, poll, locate or request) and nothing else.",
            labels=["where"],
        )
        counts = internal_errors().counts
        for where in INTERNAL_ERROR_PLACES:
            internal.add_metric([where], counts.get(where, 0))
        yield internal
        yield from self._locator_families()
        yield from self._cluster()
        yield from self._udp()
        yield from (
            connections,
            active,
            bytes_total,
            rejected,
            connect_failures,
            up,
            weight,
            checks,
            polls,
            poll_duration,
            fallback,
            throttle,
            duration,
            persistence_entries,
            persistence_lookups,
            queued,
            queue_wait,
            reloads,
        )

    def _discovery(self) -> Iterator[Metric]:
        """SPEC §14; only for virtual servers with `discovery.dns` (none: no families)."""
        discovery = getattr(self.source, "discovery", None)
        states: dict[str, DiscoveryState] = getattr(discovery, "states", {})
        if not states:
            return
        resolutions = CounterMetricFamily(
            "lbproxy_discovery_resolutions",
            "DNS discovery rounds, by result (ok, empty, nxdomain, error).",
            labels=[VS, "result"],
        )
        discovered = GaugeMetricFamily(
            "lbproxy_discovered_servers",
            "Real servers in the last DNS answer that counted (leaving ones not included).",
            labels=[VS],
        )
        for name, state in states.items():
            for result in DISCOVERY_RESULTS:
                resolutions.add_metric([name, result], state.results[result])
            discovered.add_metric([name], len(state.current))
        yield resolutions
        yield discovered

    def _cluster(self) -> Iterator[Metric]:
        """SPEC §18; only with `global.cluster` (without it: no families)."""
        cluster = getattr(self.source, "cluster", None)
        if cluster is None:
            return
        yield GaugeMetricFamily(
            "lbproxy_cluster_connected",
            "1 while this instance is connected to the cluster's Redis.",
            value=1 if cluster.connected else 0,
        )
        messages = CounterMetricFamily(
            "lbproxy_cluster_messages",
            "Cluster messages, by kind (state, weight, load, entries, invalid) and "
            "direction (in: read from Redis, out: written).",
            labels=["kind", "direction"],
        )
        for kind in (*CLUSTER_KINDS, "entries", "invalid"):
            for direction in ("in", "out"):
                if kind != "invalid" or direction == "in":
                    messages.add_metric([kind, direction], cluster.messages[kind, direction])
        yield messages
        ignored = CounterMetricFamily(
            "lbproxy_cluster_ignored_messages",
            "Messages from Redis not applied, by reason (oversized, garbage, invalid, "
            "unknown: a virtual or real server this instance does not have).",
            labels=["reason"],
        )
        for reason in CLUSTER_IGNORED:
            ignored.add_metric([reason], cluster.ignored[reason])
        yield ignored
        yield GaugeMetricFamily(
            "lbproxy_cluster_sync_lag_seconds",
            "Connected: how long the last change from another instance took to apply "
            "here; disconnected: how long Redis has been away.",
            value=cluster.sync_lag,
        )

    def _udp(self) -> Iterator[Metric]:
        """SPEC §19; only for virtual servers with `protocol: udp` (none: no families).
        Sessions are the pool's leases; lbproxy_bytes_total counts their bytes too."""
        pools = [pool for pool in self.source.pools() if pool.config.protocol == "udp"]
        if not pools:
            return
        datagrams = CounterMetricFamily(
            "lbproxy_udp_datagrams",
            "UDP datagrams relayed; direction in is client to server, out is server to client.",
            labels=[VS, RS, "direction"],
        )
        active = GaugeMetricFamily(
            "lbproxy_udp_active_sessions", "UDP sessions open to each real server.", labels=[VS, RS]
        )
        sessions = CounterMetricFamily(
            "lbproxy_udp_sessions", "UDP sessions opened to each real server.", labels=[VS, RS]
        )
        dropped = CounterMetricFamily(
            "lbproxy_udp_dropped",
            "UDP datagrams dropped, by reason: max_sessions, per_source, no_server, acl, "
            "throttle (no session opened), unrequested (a reply beyond udp.responses), "
            "send_error, reply_error.",
            labels=[VS, "reason"],
        )
        for pool in pools:
            counters = pool.udp
            for rs in pool.servers:
                labels = [pool.name, rs.name]
                for direction in UDP_DIRECTIONS:
                    datagrams.add_metric(
                        [*labels, direction], counters.datagrams[rs.name, direction]
                    )
                active.add_metric(labels, rs.active)
                sessions.add_metric(labels, counters.sessions_total[rs.name])
            for reason in UDP_DROP_REASONS:
                dropped.add_metric([pool.name, reason], counters.dropped[reason])
        yield from (datagrams, active, sessions, dropped)

    def _locator_families(self) -> Iterator[Metric]:
        """SPEC §10 and §11: locator answers, DNS queries, load reports, conditioning."""
        answers = CounterMetricFamily(
            "lbproxy_locator_answers",
            "Locator answers (HTTP or DNS locate), by real server answered.",
            labels=[VS, RS, "via"],
        )
        reports = CounterMetricFamily(
            "lbproxy_load_reports", "Load reports pushed by real servers.", labels=[VS, RS]
        )
        load = GaugeMetricFamily(
            "lbproxy_real_server_load",
            "least-load: the load the scheduler uses now, estimates included.",
            labels=[VS, RS],
        )
        conditioned = CounterMetricFamily(
            "lbproxy_conditioned_connections",
            "Connections closed by conditioning to rebalance the pool.",
            labels=[VS, RS],
        )
        for pool in self.source.pools():
            vs = pool.name
            shows_load = pool.scheduler.shows_load
            for rs in pool.servers:
                labels = [vs, rs.name]
                for via in LOCATOR_VIAS:
                    answers.add_metric([*labels, via], pool.answers[rs.name, via])
                reports.add_metric(labels, pool.load_report_counts[rs.name])
                if shows_load:
                    load.add_metric(labels, pool.load_of(rs) or 0.0)
                if pool.config.conditioning is not None:
                    conditioned.add_metric(labels, pool.conditioned[rs.name])
        queries = CounterMetricFamily(
            "lbproxy_dns_queries", "DNS locator queries, by rcode answered.", labels=["rcode"]
        )
        counted = getattr(self.source, "dns_queries", None) or {}
        for rcode in DNS_RCODES:
            queries.add_metric([rcode], counted.get(rcode, 0))
        yield from (answers, reports, load, conditioned, queries)


def make_registry(source: MetricsSource) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LbproxyCollector(source))  # type: ignore[arg-type]
    return registry
