"""Prometheus metrics, read from the live pools at scrape time (SPEC §8).

Nothing here runs on the connection path: the pools, the pump's flows and the pollers
keep plain counters, and this collector turns them into metric families when
`/metrics` is scraped (the prometheus-pve-exporter pattern). Each Server gets its own
registry, so tests never share state. Every family's name, type, help and labels are in
the one table, metric_families.py, which the workers' supervisor reads as well.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

import trio
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.metrics_core import Metric

from lbproxy import __version__
from lbproxy.admin.metric_families import counter, gauge, histogram
from lbproxy.config.model import PerSourceConfig
from lbproxy.core.agent import RESULTS as AGENT_RESULTS
from lbproxy.core.closing import ON_PURPOSE_REASONS
from lbproxy.core.discovery_model import REFUSALS as DISCOVERY_REFUSALS
from lbproxy.core.discovery_model import RESULTS as DISCOVERY_RESULTS
from lbproxy.core.discovery_model import DiscoveryState
from lbproxy.core.health import CLOSE_REASONS
from lbproxy.core.histogram import Histogram
from lbproxy.core.per_source import PerSourceTable
from lbproxy.core.persistence import RESULTS as PERSISTENCE_RESULTS
from lbproxy.core.pool import REJECT_REASONS, Pool
from lbproxy.core.throttle import MODE_VALUES, Throttle
from lbproxy.core.udp_stats import DIRECTIONS as UDP_DIRECTIONS
from lbproxy.core.udp_stats import DROP_REASONS as UDP_DROP_REASONS
from lbproxy.net.barrier import WHERE as INTERNAL_ERROR_PLACES
from lbproxy.net.barrier import internal_errors
from lbproxy.net.descriptors import UNLIMITED, clients
from lbproxy.wire.cluster_messages import KINDS as CLUSTER_KINDS

CONNECT_FAILURE_REASONS = ("refused", "timeout", "error")
HEALTH_RESULTS = ("ok", "fail", "timeout")
SNMP_RESULTS = ("ok", "timeout", "error", "bad_value")
RELOAD_RESULTS = ("ok", "error")
CLUSTER_IGNORED = ("oversized", "garbage", "invalid", "signature", "future", "unknown")
CLUSTER_SKIPPED = ("entries", "state")
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


class QueueView(Protocol):
    """What a virtual server's queue publishes (dataplane/queue.py, `QueueStats`)."""

    @property
    def queued(self) -> int: ...

    @property
    def waits(self) -> Histogram: ...


class VirtualServerView(Protocol):
    """A running virtual server as the admin reads it: its pool, and the state of its
    throttle and queue, which their owners keep (dataplane/virtual_server.py's
    `VirtualServer`; named by what is read, as the admin does not import the data plane)."""

    @property
    def pool(self) -> Pool: ...

    @property
    def throttle_mode(self) -> str: ...

    @property
    def throttle_model(self) -> Throttle | None: ...

    @property
    def queue_stats(self) -> QueueView: ...

    @property
    def per_source(self) -> PerSourceTable | None: ...

    def sync_per_source(self, config: PerSourceConfig | None) -> None: ...


class MetricsSource(Protocol):
    """What the collector reads: the running virtual servers and pools, the reload counts."""

    reloads: dict[str, int]

    @property
    def virtual_servers(self) -> Mapping[str, VirtualServerView]: ...

    def pools(self) -> Iterable[Pool]: ...


class LbproxyCollector:
    def __init__(self, source: MetricsSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        connections = counter("lbproxy_connections")
        active = gauge("lbproxy_active_connections")
        bytes_total = counter("lbproxy_bytes")
        rejected = counter("lbproxy_rejected_connections")
        connect_failures = counter("lbproxy_connect_failures")
        up = gauge("lbproxy_real_server_up")
        weight = gauge("lbproxy_real_server_weight")
        checks = counter("lbproxy_health_checks")
        polls = counter("lbproxy_snmp_polls")
        agent_checks = counter("lbproxy_agent_checks")
        poll_duration = histogram("lbproxy_snmp_poll_duration_seconds")
        fallback = gauge("lbproxy_dynamic_weight_fallback")
        throttle = gauge("lbproxy_throttle_mode")
        duration = histogram("lbproxy_connection_duration_seconds")
        persistence_entries = gauge("lbproxy_persistence_entries")
        persistence_lookups = counter("lbproxy_persistence_lookups")
        queued = gauge("lbproxy_queued_connections")
        queue_wait = histogram("lbproxy_queue_wait_seconds")
        now = trio.current_time()
        for running in self.source.virtual_servers.values():
            pool = running.pool
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
            throttle.add_metric([vs], MODE_VALUES.get(running.throttle_mode, 0))
            duration.add_metric([vs], pool.durations.cumulative(), pool.durations.total)
            waits = running.queue_stats.waits
            if pool.config.queue is not None or waits.count:
                queued.add_metric([vs], running.queue_stats.queued)
                queue_wait.add_metric([vs], waits.cumulative(), waits.total)
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
                if rs.config.agent_check or pool.config.agent_check:
                    for result in AGENT_RESULTS:
                        agent_checks.add_metric([*labels, result], rs.counters.agent_checks[result])
                if rs.config.snmp is not None and pool.polls_snmp:
                    for result in SNMP_RESULTS:
                        polls.add_metric([*labels, result], rs.counters.snmp_polls[result])
        yield from self._discovery()
        reloads = counter("lbproxy_config_reloads")
        for result in RELOAD_RESULTS:
            reloads.add_metric([result], self.source.reloads.get(result, 0))
        internal = counter("lbproxy_internal_errors")
        counts = internal_errors().counts
        for where in INTERNAL_ERROR_PLACES:
            internal.add_metric([where], counts.get(where, 0))
        yield internal
        yield from self._closed_on_purpose()
        yield from self._resilience()
        yield from self._locator_families()
        yield from self._cluster()
        yield from self._udp()
        yield build_info()
        yield from client_families()
        yield from (
            connections,
            active,
            bytes_total,
            rejected,
            connect_failures,
            up,
            weight,
            checks,
            agent_checks,
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

    def _closed_on_purpose(self) -> Iterator[Metric]:
        """SPEC §22: connections closed by `on_down: close` and `on_up: close_backups`."""
        closed = counter("lbproxy_connections_closed")
        for pool in self.source.pools():
            for reason in CLOSE_REASONS + ON_PURPOSE_REASONS:
                closed.add_metric([pool.name, reason], pool.closed[reason])
        yield closed

    def _resilience(self) -> Iterator[Metric]:
        """SPEC §23: panic for every virtual server; ejections where outlier detection
        is configured (or has ejected a server before a reload switched it off). Read
        after `statistics(now)` above: ejections that ended are released already."""
        ejections = counter("lbproxy_outlier_ejections")
        ejected = gauge("lbproxy_real_server_ejected")
        panic = gauge("lbproxy_panic")
        for pool in self.source.pools():
            panic.add_metric([pool.name], 1.0 if pool.panic else 0.0)
            for rs in pool.servers:
                if pool.outlier is None and not rs.counters.ejections:
                    continue
                labels = [pool.name, rs.name]
                ejections.add_metric(labels, rs.counters.ejections)
                ejected.add_metric(labels, 0.0 if pool.ejected_until(rs) is None else 1.0)
        yield from (ejections, ejected, panic)

    def _discovery(self) -> Iterator[Metric]:
        """SPEC §14; only for virtual servers with `discovery.dns` (none: no families)."""
        discovery = getattr(self.source, "discovery", None)
        states: dict[str, DiscoveryState] = getattr(discovery, "states", {})
        if not states:
            return
        resolutions = counter("lbproxy_discovery_resolutions")
        discovered = gauge("lbproxy_discovered_servers")
        refused = counter("lbproxy_discovery_refused")
        for name, state in states.items():
            for result in DISCOVERY_RESULTS:
                resolutions.add_metric([name, result], state.results[result])
            discovered.add_metric([name], len(state.current))
            for reason in DISCOVERY_REFUSALS:
                refused.add_metric([name, reason], state.refused[reason])
        yield resolutions
        yield discovered
        yield refused

    def _cluster(self) -> Iterator[Metric]:
        """SPEC §18; only with `global.cluster` (without it: no families)."""
        cluster = getattr(self.source, "cluster", None)
        if cluster is None:
            return
        yield gauge("lbproxy_cluster_connected", value=1 if cluster.connected else 0)
        yield gauge("lbproxy_cluster_name_clash", value=1 if cluster.name_clash else 0)
        messages = counter("lbproxy_cluster_messages")
        for kind in (*CLUSTER_KINDS, "entries", "sources", "invalid"):
            for direction in ("in", "out"):
                if kind != "invalid" or direction == "in":
                    messages.add_metric([kind, direction], cluster.messages[kind, direction])
        yield messages
        ignored = counter("lbproxy_cluster_ignored_messages")
        for reason in CLUSTER_IGNORED:
            ignored.add_metric([reason], cluster.ignored[reason])
        yield ignored
        skipped = counter("lbproxy_cluster_skipped")
        for kind in CLUSTER_SKIPPED:
            skipped.add_metric([kind], cluster.skipped[kind])
        yield skipped
        yield gauge("lbproxy_cluster_sync_lag_seconds", value=cluster.sync_lag)

    def _udp(self) -> Iterator[Metric]:
        """SPEC §19; only for virtual servers with `protocol: udp` (none: no families).
        Sessions are the pool's leases; lbproxy_bytes_total counts their bytes too."""
        pools = [pool for pool in self.source.pools() if pool.config.protocol == "udp"]
        if not pools:
            return
        datagrams = counter("lbproxy_udp_datagrams")
        active = gauge("lbproxy_udp_active_sessions")
        sessions = counter("lbproxy_udp_sessions")
        dropped = counter("lbproxy_udp_dropped")
        for pool in pools:
            counters = pool.udp
            counters.settle()
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
        answers = counter("lbproxy_locator_answers")
        reports = counter("lbproxy_load_reports")
        load = gauge("lbproxy_real_server_load")
        conditioned = counter("lbproxy_conditioned_connections")
        for pool in self.source.pools():
            vs = pool.name
            shows_load = pool.scheduler.shows_load
            for rs in pool.servers:
                labels = [vs, rs.name]
                for via in LOCATOR_VIAS:
                    answers.add_metric([*labels, via], pool.locator.answers[rs.name, via])
                reports.add_metric(labels, pool.locator.report_counts[rs.name])
                if shows_load:
                    load.add_metric(labels, pool.load_of(rs) or 0.0)
                if pool.config.conditioning is not None:
                    conditioned.add_metric(labels, pool.conditioned[rs.name])
        queries = counter("lbproxy_dns_queries")
        counted = getattr(self.source, "dns_queries", None) or {}
        for rcode in DNS_RCODES:
            queries.add_metric([rcode], counted.get(rcode, 0))
        yield from (answers, reports, load, conditioned, queries)


def make_registry(source: MetricsSource) -> CollectorRegistry:
    """This process's families: lbproxy's, and the process_* ones of prometheus_client
    (open and max descriptors, memory, CPU, start time; read from /proc at scrape time)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LbproxyCollector(source))
    ProcessCollector(registry=registry)
    return registry


def build_info() -> Metric:
    info = gauge("lbproxy_build_info")
    info.add_metric([__version__], 1)
    return info


def client_families() -> Iterator[Metric]:
    """The clients open against `max_clients` (net/descriptors.py); the limit only
    when there is one."""
    yield gauge("lbproxy_open_clients", clients.open)
    if clients.limit != UNLIMITED:
        yield gauge("lbproxy_max_clients", clients.limit)
