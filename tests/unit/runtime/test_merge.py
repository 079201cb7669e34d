"""The supervisor's merging of its workers' metrics and documents
(lbproxy/runtime/workers/merge.py): pure functions, fed the text and JSON documents
workers serve, checked against the merging rules of docs/concepts/workers.md."""

from __future__ import annotations

import copy
from typing import Any

from lbproxy.runtime.workers.merge import (
    COUNTER_TYPES,
    MetricSums,
    merge_documents,
    merge_per_source,
    merge_real_servers,
    parse_metrics,
)

# -- metrics ------------------------------------------------------------------------------


def worker_metrics(
    *, connections: int, active: int, up: int, weight: int, mode: int, reloads: int = 1
) -> str:
    """A worker's /metrics for one real server `a` of virtual server `web` (the families
    of admin/metric_families.py, as a worker exports them)."""
    labels = 'real_server="a",virtual_server="web"'
    return f"""\
# HELP lbproxy_connections_total Connections sent to each real server.
# TYPE lbproxy_connections_total counter
lbproxy_connections_total{{{labels}}} {connections}
# HELP lbproxy_active_connections Connections open to each real server.
# TYPE lbproxy_active_connections gauge
lbproxy_active_connections{{{labels}}} {active}
# HELP lbproxy_real_server_up 1 when the real server's health is up.
# TYPE lbproxy_real_server_up gauge
lbproxy_real_server_up{{{labels}}} {up}
# HELP lbproxy_real_server_weight The real server's weight.
# TYPE lbproxy_real_server_weight gauge
lbproxy_real_server_weight{{{labels}}} {weight}
# HELP lbproxy_throttle_mode The virtual server's throttle mode.
# TYPE lbproxy_throttle_mode gauge
lbproxy_throttle_mode{{virtual_server="web"}} {mode}
# HELP lbproxy_connect_seconds Time to connect to a real server.
# TYPE lbproxy_connect_seconds histogram
lbproxy_connect_seconds_bucket{{{labels},le="0.01"}} {connections - 1}
lbproxy_connect_seconds_bucket{{{labels},le="+Inf"}} {connections}
lbproxy_connect_seconds_count{{{labels}}} {connections}
lbproxy_connect_seconds_sum{{{labels}}} {connections * 0.005}
# HELP lbproxy_config_reloads_total Configuration reloads, by result.
# TYPE lbproxy_config_reloads_total counter
lbproxy_config_reloads_total{{result="ok"}} {reloads}
# HELP lbproxy_workers_ready Workers ready.
# TYPE lbproxy_workers_ready gauge
lbproxy_workers_ready 2
"""


def values(sums: MetricSums) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in sums.metrics()
        for sample in family.samples
    }


def value(sums: MetricSums, name: str, **labels: str) -> float:
    return values(sums)[(name, tuple(sorted(labels.items())))]


A = {"real_server": "a", "virtual_server": "web"}
COUNTER = "# TYPE lbproxy_connections_total counter\n"


def test_counters_and_amounts_are_added_up_across_workers():
    sums = MetricSums()
    sums.add(parse_metrics(worker_metrics(connections=3, active=1, up=0, weight=2, mode=0)))
    sums.add(parse_metrics(worker_metrics(connections=4, active=5, up=1, weight=2, mode=1)))
    sums.add(parse_metrics(worker_metrics(connections=10, active=0, up=0, weight=2, mode=0)))
    assert value(sums, "lbproxy_connections_total", **A) == 17
    assert value(sums, "lbproxy_active_connections", **A) == 6  # an amount: SUM too


def test_histograms_are_added_up_bucket_by_bucket():
    sums = MetricSums()
    sums.add(parse_metrics(worker_metrics(connections=3, active=0, up=1, weight=1, mode=0)))
    sums.add(parse_metrics(worker_metrics(connections=5, active=0, up=1, weight=1, mode=0)))
    assert value(sums, "lbproxy_connect_seconds_bucket", **A, le="0.01") == 6
    assert value(sums, "lbproxy_connect_seconds_bucket", **A, le="+Inf") == 8
    assert value(sums, "lbproxy_connect_seconds_count", **A) == 8
    assert value(sums, "lbproxy_connect_seconds_sum", **A) == 8 * 0.005


def test_state_like_gauges_take_the_highest_value():
    sums = MetricSums()
    sums.add(parse_metrics(worker_metrics(connections=1, active=0, up=0, weight=3, mode=2)))
    sums.add(parse_metrics(worker_metrics(connections=1, active=0, up=1, weight=3, mode=0)))
    sums.add(parse_metrics(worker_metrics(connections=1, active=0, up=0, weight=3, mode=1)))
    assert value(sums, "lbproxy_real_server_up", **A) == 1  # up when any worker sees it up
    assert value(sums, "lbproxy_real_server_weight", **A) == 3  # not 9
    assert value(sums, "lbproxy_throttle_mode", virtual_server="web") == 2


def test_the_supervisors_own_families_are_not_taken_from_the_workers():
    families = parse_metrics(worker_metrics(connections=1, active=0, up=1, weight=1, mode=0))
    names = {family.name for family in families}
    assert "lbproxy_config_reloads" not in names  # the supervisor counts its own reloads
    assert "lbproxy_workers_ready" not in names
    assert "lbproxy_connections" in names


def test_a_sample_one_worker_has_alone_is_kept_and_label_order_does_not_matter():
    sums = MetricSums()
    for sample in (
        'lbproxy_connections_total{real_server="a",virtual_server="web"} 2',
        'lbproxy_connections_total{virtual_server="web",real_server="a"} 3',
        'lbproxy_connections_total{real_server="b",virtual_server="web"} 7',
    ):
        sums.add(parse_metrics(f"{COUNTER}{sample}\n"))
    assert values(sums) == {
        ("lbproxy_connections_total", (("real_server", "a"), ("virtual_server", "web"))): 5,
        ("lbproxy_connections_total", (("real_server", "b"), ("virtual_server", "web"))): 7,
    }


def test_merged_families_keep_the_help_and_type_of_the_first_worker():
    sums = MetricSums()
    sums.add(parse_metrics(worker_metrics(connections=1, active=0, up=1, weight=1, mode=0)))
    sums.add(parse_metrics(worker_metrics(connections=2, active=0, up=1, weight=1, mode=0)))
    by_name = {family.name: family for family in sums.metrics()}
    connections = by_name["lbproxy_connections"]
    assert (connections.type, connections.documentation) == (
        "counter",
        "Connections sent to each real server.",
    )
    assert by_name["lbproxy_connect_seconds"].type == "histogram"


def test_an_exited_workers_counters_are_added_only_to_samples_still_reported():
    """The supervisor keeps the last counters of a worker that exited (`existing_only`):
    they keep the sums from going backwards, but add no sample nobody reports now."""
    exited = worker_metrics(connections=40, active=7, up=1, weight=1, mode=0)
    exited += COUNTER + 'lbproxy_connections_total{real_server="gone",virtual_server="web"} 9\n'
    exited += "# TYPE lbproxy_old_total counter\nlbproxy_old_total 1\n"
    retired = MetricSums()  # as the supervisor keeps them: counters and histograms only
    retired.add([f for f in parse_metrics(exited) if f.type in COUNTER_TYPES])
    sums = MetricSums()
    sums.add(parse_metrics(worker_metrics(connections=2, active=1, up=1, weight=1, mode=0)))
    for family in retired.metrics():
        sums.add([family], existing_only=True)
    assert value(sums, "lbproxy_connections_total", **A) == 42
    assert value(sums, "lbproxy_connect_seconds_count", **A) == 42
    assert value(sums, "lbproxy_active_connections", **A) == 1  # a gauge: its own now
    gone = ("real_server", "gone"), ("virtual_server", "web")
    assert ("lbproxy_connections_total", gone) not in values(sums)
    assert "lbproxy_old" not in {family.name for family in sums.metrics()}


def test_nothing_added_is_nothing_reported():
    assert MetricSums().metrics() == []


# -- documents ----------------------------------------------------------------------------


def real_server(name: str, total: int, health: str = "up", **extra: Any) -> dict[str, Any]:
    rs = {"name": name, "address": f"127.0.0.1:{8000 + ord(name[0])}", "state": "enabled"}
    rs |= {"health": health, "weight": {"static": 2, "effective": 2}}
    rs |= {"active_connections": total % 3, "connections_total": total}
    rs |= {"bytes_in": 10 * total, "bytes_out": 100 * total}
    return rs | extra


def virtual_server(name: str, servers: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    vs = {"name": name, "listen": ["127.0.0.1:80"], "scheduler": "rr", "throttle_mode": "low"}
    vs |= {"active_connections": sum(rs["active_connections"] for rs in servers)}
    vs |= {"clients": 1, "sni": [], "queued": 0, "rejected": {}}
    vs |= {"dynamic_weight_fallback": False, "real_servers": servers, "protocol": "tcp"}
    vs |= {"udp": None}
    return vs | extra


def test_documents_of_three_workers_add_up_counts_and_bytes():
    documents = [
        {"virtual_servers": [virtual_server("web", [real_server("a", t), real_server("b", 1)])]}
        for t in (4, 5, 9)
    ]
    merged = merge_documents(documents)
    (vs,) = merged["virtual_servers"]
    a, b = vs["real_servers"]
    assert (a["connections_total"], a["active_connections"]) == (18, 1 + 2 + 0)
    assert (a["bytes_in"], a["bytes_out"]) == (180, 1800)
    assert (b["connections_total"], b["active_connections"]) == (3, 3)
    assert (vs["active_connections"], vs["clients"], vs["queued"]) == (1 + 2 + 0 + 3, 3, 0)


def test_names_states_and_weights_come_from_the_first_worker():
    first = real_server("a", 1, state="drain", weight={"static": 5, "effective": 4})
    later = real_server("a", 1, state="enabled", weight={"static": 1, "effective": 1})
    merged = merge_documents(
        [
            {"virtual_servers": [virtual_server("web", [first], scheduler="wlc")]},
            {"virtual_servers": [virtual_server("web", [later], scheduler="rr")]},
        ]
    )
    (vs,) = merged["virtual_servers"]
    (rs,) = vs["real_servers"]
    assert (vs["scheduler"], rs["state"], rs["weight"]) == (
        "wlc",
        "drain",
        {"static": 5, "effective": 4},
    )


def test_health_is_up_when_any_worker_sees_it_up():
    def health(*seen: str) -> str:
        documents = [
            {"virtual_servers": [virtual_server("web", [real_server("a", 1, health=h)])]}
            for h in seen
        ]
        return merge_documents(documents)["virtual_servers"][0]["real_servers"][0]["health"]

    assert health("down", "up", "down") == "up"
    assert health("up", "down") == "up"
    assert health("down", "down") == "down"
    assert health("unknown", "down") == "unknown"  # the first worker's, unless one sees up


def test_rejections_add_up_by_reason_and_the_highest_throttle_mode_wins():
    merged = merge_documents(
        [
            {"virtual_servers": [virtual_server("web", [], rejected={"acl": 1})]},
            {"virtual_servers": [virtual_server("web", [], throttle_mode="digg")]},
            {
                "virtual_servers": [
                    virtual_server("web", [], rejected={"acl": 2, "max_clients": 5}),
                ]
            },
            {"virtual_servers": [virtual_server("web", [], throttle_mode="high")]},
        ]
    )
    (vs,) = merged["virtual_servers"]
    assert vs["rejected"] == {"acl": 3, "max_clients": 5}
    assert vs["throttle_mode"] == "digg"  # low < high < digg


def test_dynamic_weight_fallback_is_true_when_any_worker_falls_back():
    merged = merge_documents(
        [
            {"virtual_servers": [virtual_server("web", [])]},
            {"virtual_servers": [virtual_server("web", [], dynamic_weight_fallback=True)]},
            {"virtual_servers": [virtual_server("web", [])]},
        ]
    )
    assert merged["virtual_servers"][0]["dynamic_weight_fallback"] is True


def test_udp_sessions_datagrams_and_drops_add_up():
    def udp(n: int, **dropped: int) -> dict[str, Any]:
        return {
            "datagrams_in": n,
            "datagrams_out": 2 * n,
            "sessions_total": n // 2,
            "dropped": dropped,
        }

    merged = merge_documents(
        [
            {"virtual_servers": [virtual_server("dns", [], protocol="udp", udp=udp(4, full=1))]},
            {"virtual_servers": [virtual_server("dns", [], protocol="udp", udp=udp(6, no=2))]},
        ]
    )
    assert merged["virtual_servers"][0]["udp"] == {
        "datagrams_in": 10,
        "datagrams_out": 20,
        "sessions_total": 5,
        "dropped": {"full": 1, "no": 2},
    }


def test_virtual_and_real_servers_are_the_first_workers_and_matched_by_name():
    """A worker that reloaded later may know other servers for a moment: the merged
    document lists the first worker's, each merged with the same name elsewhere."""
    first = {"virtual_servers": [virtual_server("web", [real_server("a", 1)])]}
    second = {
        "virtual_servers": [
            virtual_server("web", [real_server("new", 7), real_server("a", 2)]),
            virtual_server("other", [real_server("x", 3)]),
        ]
    }
    merged = merge_documents([first, second])
    assert [vs["name"] for vs in merged["virtual_servers"]] == ["web"]
    (rs,) = merged["virtual_servers"][0]["real_servers"]
    assert (rs["name"], rs["connections_total"]) == ("a", 3)


def test_the_cluster_is_connected_only_when_every_worker_is():
    def cluster(connected: bool) -> dict[str, Any]:
        return {"name": "host-w1", "connected": connected, "members": []}

    def merged(*connected: bool) -> dict[str, Any]:
        documents = [{"cluster": cluster(c), "virtual_servers": []} for c in connected]
        return merge_documents(documents)["cluster"]

    assert merged(True, True, True)["connected"] is True
    assert merged(True, False, True)["connected"] is False
    assert merged(False, True)["connected"] is False
    assert merged(True, True)["name"] == "host-w1"  # the first worker's membership
    without = merge_documents([{"cluster": None}, {"cluster": cluster(True)}])
    assert without["cluster"] is None


def test_merging_leaves_the_workers_documents_alone():
    documents = [
        {"virtual_servers": [virtual_server("web", [real_server("a", t)], rejected={"x": 1})]}
        for t in (1, 2)
    ]
    before = copy.deepcopy(documents)
    merge_documents(documents)
    merge_documents(documents)
    assert documents == before


def test_one_document_is_returned_as_it_is():
    document = {"virtual_servers": [virtual_server("web", [real_server("a", 4)])]}
    assert merge_documents([document]) == document


# -- a PATCH's answer: one real server of every worker --------------------------------------


def test_a_real_servers_answers_merge_as_in_the_document():
    merged = merge_real_servers(
        [
            real_server("a", 4, health="down", state="drain"),
            real_server("a", 5, health="up", state="enabled"),
        ]
    )
    assert merged == real_server("a", 4, health="up", state="drain") | {
        "active_connections": 1 + 2,
        "connections_total": 9,
        "bytes_in": 90,
        "bytes_out": 900,
    }


def test_a_real_server_count_missing_in_the_first_answer_is_added():
    merged = merge_real_servers([{"name": "a"}, {"name": "a", "bytes_in": 3}, {"name": "a"}])
    assert merged == {
        "name": "a",
        "active_connections": 0,
        "connections_total": 0,
        "bytes_in": 3,
        "bytes_out": 0,
    }


def test_ejection_and_panic_merge_as_any_worker_sees_them():
    def document(until_a, panic):
        return {
            "virtual_servers": [
                {
                    "name": "web",
                    "panic": panic,
                    "real_servers": [
                        {"name": "a", "ejected_until": until_a},
                        {"name": "b", "ejected_until": None},
                    ],
                }
            ]
        }

    merged = merge_documents(
        [
            document(None, False),
            document("2026-12-05T15:04:23.120Z", True),
            document("2026-12-05T15:04:21.000Z", False),
        ]
    )
    (vs,) = merged["virtual_servers"]
    assert vs["panic"] is True
    assert [rs["ejected_until"] for rs in vs["real_servers"]] == ["2026-12-05T15:04:23.120Z", None]


def test_per_source_tables_add_up_and_keep_the_bound():
    """Each worker has its own per-source table (SPEC §23): the supervisor's document adds
    up their networks, rejections and remote counts; the bound is each worker's."""

    def table(tracked: int, rejected: int) -> dict[str, Any]:
        return {
            "tracked": tracked,
            "max_tracked": 100,
            "rejected": rejected,
            "untracked": 1,
            "remote_open": 2,
        }

    merged = merge_documents(
        [
            {"virtual_servers": [virtual_server("web", [], per_source=table(3, 40))]},
            {"virtual_servers": [virtual_server("web", [], per_source=table(5, 2))]},
        ]
    )
    assert merged["virtual_servers"][0]["per_source"] == {
        "tracked": 8,
        "max_tracked": 100,
        "rejected": 42,
        "untracked": 2,
        "remote_open": 4,
    }


# -- the operator's view (SPEC §24) -------------------------------------------------------


def _view(current: float, peak: float, refused: int, since: str, downtime: float) -> dict:
    return {
        "name": "web",
        "rate": {"current": current, "max": peak},
        "real_servers": [
            {
                "name": "a",
                "rate": {"current": current, "max": peak},
                "errors": {
                    "connect_refused": refused,
                    "connect_timeout": 0,
                    "connect_error": 0,
                    "reset": 1,
                },
                "since": since,
                "downtime_s": downtime,
                "max_connections": 10,
            }
        ],
    }


def test_rates_and_errors_add_up_since_is_the_latest_downtime_the_least():
    one = _view(2.0, 30.0, 3, "2026-12-05T15:00:00.000Z", 12.5)
    two = _view(1.5, 20.0, 4, "2026-12-05T15:01:00.000Z", 10.0)
    merged = merge_documents([{"virtual_servers": [one]}, {"virtual_servers": [two]}])
    (vs,) = merged["virtual_servers"]
    (rs,) = vs["real_servers"]
    assert vs["rate"] == {"current": 3.5, "max": 50.0}  # the sum of the maxes
    assert rs["rate"] == {"current": 3.5, "max": 50.0}
    assert rs["errors"] == {
        "connect_refused": 7,
        "connect_timeout": 0,
        "connect_error": 0,
        "reset": 2,
    }
    assert rs["since"] == "2026-12-05T15:01:00.000Z" and rs["downtime_s"] == 10.0
    assert rs["max_connections"] == 10  # each worker's limit, as configured


# -- GET .../per-source ---------------------------------------------------------------


def per_source_answer(tracked: int, *rows: tuple, shared: bool = False) -> dict[str, Any]:
    """A worker's GET .../per-source answer; rows: (network, open, arrivals, limited_by
    [, remote_open, remote_arrivals])."""
    networks = []
    for network, open_here, arrivals, limited_by, *remote in rows:
        networks.append(
            {
                "network": network,
                "open": open_here,
                "arrivals": arrivals,
                "at_limit": limited_by is not None,
                "limited_by": limited_by,
                "remote_open": remote[0] if remote else None,
                "remote_arrivals": remote[1] if remote else None,
            }
        )
    limits = {"max_connections": 4, "rate": 5, "interval": 1, "prefix_v4": 32, "prefix_v6": 64}
    return {
        "virtual_server": "web",
        "tracked": tracked,
        "max_tracked": 100000,
        "limits": {**limits, "shared": shared},
        "limit": 10000,
        "networks": networks,
    }


def test_per_source_listings_add_up_per_network_and_sort_again():
    """A network both workers track has its open connections and arrivals added up and
    is at its limit when either worker is; the order is the busiest first again, cut to
    the limit asked; `tracked` is added up as in the document."""
    one = per_source_answer(
        3, ("10.0.0.1", 2, 2, None), ("10.0.0.2", 1, 5, "rate"), ("10.0.0.3", 0, 1, None)
    )
    two = per_source_answer(2, ("10.0.0.3", 3, 3, None), ("10.0.0.1", 1, 1, None))
    merged = merge_per_source([one, two], 3)
    assert merged["tracked"] == 5 and merged["limit"] == 3
    rows = [(r["network"], r["open"], r["arrivals"], r["at_limit"]) for r in merged["networks"]]
    assert rows == [
        ("10.0.0.3", 3, 4, False),
        ("10.0.0.1", 3, 3, False),
        ("10.0.0.2", 1, 5, True),
    ]
    assert [r["network"] for r in merge_per_source([one, two], 1)["networks"]] == ["10.0.0.3"]
    assert one["networks"][0]["open"] == 2  # the workers' answers are left alone


def test_per_source_remote_counts_are_the_highest_not_added():
    """With `shared` each worker holds every other member's counts, the other workers'
    included: adding them would count the same connections twice."""
    one = per_source_answer(1, ("10.0.0.1", 1, 1, None, 4, 2), shared=True)
    two = per_source_answer(1, ("10.0.0.1", 2, 2, None, 3, 1), shared=True)
    (row,) = merge_per_source([one, two], 10)["networks"]
    assert (row["open"], row["arrivals"], row["remote_open"], row["remote_arrivals"]) == (
        3,
        3,
        4,
        2,
    )


def test_per_source_without_rate_keeps_arrivals_null():
    one = per_source_answer(1, ("10.0.0.1", 1, None, None))
    two = per_source_answer(1, ("10.0.0.1", 1, None, "max_connections"))
    (row,) = merge_per_source([one, two], 10)["networks"]
    assert (row["open"], row["arrivals"], row["limited_by"]) == (2, None, "max_connections")
