"""Merging the workers' metrics and documents into the supervisor's (the merging rules:
the package header, lbproxy/runtime/workers/__init__.py)."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from lbproxy.admin.metric_families import MAX, OWN, merged_by

# How each family merges: the one table (admin/metric_families.py). Gauges that say what
# a state is rather than how much there is take the highest value; the supervisor's own
# families replace the workers'.
MAX_FAMILIES = merged_by(MAX)
OWN_FAMILIES = merged_by(OWN)
COUNTER_TYPES = ("counter", "histogram")
PROCESS_PREFIX = "process_"  # prometheus_client's ProcessCollector

THROTTLE_ORDER = {"low": 0, "high": 1, "digg": 2}
VS_SUMS = ("active_connections", "clients", "queued")
RS_SUMS = ("active_connections", "connections_total", "bytes_in", "bytes_out")


class MetricSums:
    """Metric families added up across workers (state-like gauges: the maximum)."""

    def __init__(self) -> None:
        # family name -> (help, type, {(sample name, labels): (sample name, labels, value)})
        self.families: dict[str, tuple[str, str, dict[tuple, tuple[str, dict, float]]]] = {}

    def add(self, families: Iterable[Metric], *, existing_only: bool = False) -> None:
        """Add samples in; with `existing_only`, only to samples already present."""
        for family in families:
            entry = self.families.get(family.name)
            if entry is None:
                if existing_only:
                    continue
                entry = self.families[family.name] = (family.documentation, family.type, {})
            values = entry[2]
            highest = family.name in MAX_FAMILIES
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                old = values.get(key)
                if old is None:
                    if not existing_only:
                        values[key] = (sample.name, sample.labels, sample.value)
                    continue
                value = max(old[2], sample.value) if highest else old[2] + sample.value
                values[key] = (sample.name, old[1], value)

    def metrics(self) -> list[Metric]:
        merged = []
        for name, (documentation, kind, values) in self.families.items():
            metric = Metric(name, documentation, kind)
            for sample_name, labels, value in values.values():
                metric.add_sample(sample_name, labels, value)
            merged.append(metric)
        return merged


def parse_metrics(text: str) -> list[Metric]:
    """A worker's /metrics, without the families the supervisor reports itself: its
    own and prometheus_client's process_* (the process scraped is the supervisor: its
    memory, descriptors and CPU; a sum of the workers' start times would mean nothing)."""
    return [
        f
        for f in text_string_to_metric_families(text)
        if f.name not in OWN_FAMILIES and not f.name.startswith(PROCESS_PREFIX)
    ]


def _merge_real_server(rs: dict[str, Any], other: dict[str, Any]) -> None:
    for key in RS_SUMS:
        rs[key] = rs.get(key, 0) + other.get(key, 0)
    if other.get("health") == "up":
        rs["health"] = "up"  # as lbproxy_real_server_up: up when any worker sees it up
    # Each worker ejects on its own connects: ejected while any worker holds it back,
    # until the latest end (ISO 8601 UTC strings of one format compare as times).
    until = [t for t in (rs.get("ejected_until"), other.get("ejected_until")) if t]
    if until:
        rs["ejected_until"] = max(until)
    _add_rates(rs, other)
    for key, count in (other.get("errors") or {}).items():
        rs.setdefault("errors", {})[key] = rs["errors"].get(key, 0) + count
    since = [t for t in (rs.get("since"), other.get("since")) if t]
    if since:
        rs["since"] = max(since)  # the latest change any worker saw
    if "downtime_s" in rs and "downtime_s" in other:
        # down while every worker sees it down, as "health" above
        rs["downtime_s"] = min(rs["downtime_s"], other["downtime_s"])


def _add_rates(document: dict[str, Any], other: dict[str, Any]) -> None:
    """Each worker accepts its own connections: the rates add up, and so do their
    highest (the sum of the maxes: an upper bound, as the workers' peaks need not fall
    in the same second; the supervisor does not sample the workers every second)."""
    rate, other_rate = document.get("rate"), other.get("rate")
    if rate and other_rate:
        for key in ("current", "max"):
            rate[key] = round((rate.get(key) or 0) + (other_rate.get(key) or 0), 1)


def _merge_virtual_server(vs: dict[str, Any], other: dict[str, Any]) -> None:
    for key in VS_SUMS:
        if key in vs:
            vs[key] += other.get(key, 0)
    for reason, count in (other.get("rejected") or {}).items():
        vs.setdefault("rejected", {})[reason] = vs["rejected"].get(reason, 0) + count
    if THROTTLE_ORDER.get(other.get("throttle_mode", ""), 0) > THROTTLE_ORDER.get(
        vs.get("throttle_mode", ""), 0
    ):
        vs["throttle_mode"] = other["throttle_mode"]
    _add_rates(vs, other)
    if other.get("dynamic_weight_fallback"):
        vs["dynamic_weight_fallback"] = True
    if other.get("panic"):
        vs["panic"] = True  # as lbproxy_panic: the highest
    udp, other_udp = vs.get("udp"), other.get("udp")
    if udp and other_udp:  # SPEC §19: each worker's own sessions and datagrams
        for key in ("datagrams_in", "datagrams_out", "sessions_total"):
            udp[key] = udp.get(key, 0) + other_udp.get(key, 0)
        for reason, count in (other_udp.get("dropped") or {}).items():
            udp.setdefault("dropped", {})[reason] = udp["dropped"].get(reason, 0) + count
    table, other_table = vs.get("per_source"), other.get("per_source")
    if table and other_table:  # SPEC §23: each worker counts its own networks
        for key in ("tracked", "rejected", "untracked", "remote_open"):
            table[key] = table.get(key, 0) + other_table.get(key, 0)
    by_name = {rs["name"]: rs for rs in other.get("real_servers", [])}
    for rs in vs.get("real_servers", []):
        if rs["name"] in by_name:
            _merge_real_server(rs, by_name[rs["name"]])


def merge_documents(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """The workers' /api/v1/virtual-servers documents as one: counts and bytes added up,
    names, states and weights from the first worker, health up when any sees it up."""
    merged = copy.deepcopy(documents[0])
    for document in documents[1:]:
        cluster = document.get("cluster")
        if merged.get("cluster") and cluster:  # each worker is a member of its own
            merged["cluster"]["connected"] &= bool(cluster.get("connected"))
        by_name = {vs["name"]: vs for vs in document.get("virtual_servers", [])}
        for vs in merged.get("virtual_servers", []):
            if vs["name"] in by_name:
                _merge_virtual_server(vs, by_name[vs["name"]])
    return merged


def merge_real_servers(documents: list[dict[str, Any]]) -> dict[str, Any]:
    merged = copy.deepcopy(documents[0])
    for document in documents[1:]:
        _merge_real_server(merged, document)
    return merged


def merge_per_source(documents: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """The workers' GET .../per-source answers as one: each worker tracks the networks
    whose connections it accepted, so a network's open connections and arrivals add up;
    it is at its limit when any worker would refuse its next arrival (each worker
    applies the limits to its own counts); the other instances' counts (`shared`) are
    the highest any worker holds (each worker's view of every other member, the other
    workers included, so they are not added). `tracked` adds the workers' tables up, as
    the virtual server's document does. The `limit` busiest, ordered as one table's."""
    merged = copy.deepcopy(documents[0])
    merged["tracked"] = sum(document.get("tracked", 0) for document in documents)
    merged["limit"] = limit
    rows: dict[str, dict[str, Any]] = {}
    for document in documents:
        for row in document.get("networks", []):
            seen = rows.get(row["network"])
            if seen is None:
                rows[row["network"]] = dict(row)
                continue
            seen["open"] += row["open"]
            if seen["arrivals"] is not None or row["arrivals"] is not None:
                seen["arrivals"] = (seen["arrivals"] or 0) + (row["arrivals"] or 0)
            seen["limited_by"] = seen["limited_by"] or row["limited_by"]
            seen["at_limit"] = seen["limited_by"] is not None
            for key in ("remote_open", "remote_arrivals"):
                if row.get(key) is not None:
                    seen[key] = max(seen.get(key) or 0, row[key])
    ordered = sorted(
        rows.values(), key=lambda row: (-row["open"], -(row["arrivals"] or 0), row["network"])
    )
    merged["networks"] = ordered[:limit]
    return merged
