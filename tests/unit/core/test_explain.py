"""Explain's admission (SPEC §24): a client the data path would refuse before any pick is
answered `by: reject` with the reason lbproxy_rejected_total counts it under, in the
data path's order, and asking counts nothing."""

from __future__ import annotations

import ipaddress

from lbproxy.config.model import PerSourceConfig, ThrottleConfig
from lbproxy.core.explain import REJECT, SCHEDULER, Admission, explain
from lbproxy.core.per_source import Limits, PerSourceTable
from lbproxy.core.pool import Pool
from lbproxy.core.throttle import Throttle
from tests.factories import virtual_server

CLIENT = ("10.0.0.7", 40000)


def pool_of(**options) -> Pool:
    return Pool(virtual_server("rr", {"a": {}, "b": {}}, **options), 0)


def open_clients(pool: Pool, n: int) -> None:
    """`n` client connections open, as the handler counts them (before any pick)."""
    pool.clients += n


def test_an_admitted_client_goes_to_the_scheduler_pick_with_no_reason():
    answer = explain(pool_of(), CLIENT, 0.0, admission=Admission())
    assert (answer.pick, answer.by, answer.reason) == ("a", SCHEDULER, None)
    assert answer.document()["reason"] is None


def test_a_denied_client_is_rejected_by_acl_and_the_servers_are_still_shown():
    pool = pool_of(deny=(ipaddress.ip_network("10.0.0.0/24"),))
    answer = explain(pool, CLIENT, 0.0, admission=Admission())
    assert (answer.pick, answer.by, answer.reason) == (None, REJECT, "acl")
    assert [s.eligible for s in answer.servers] == [True, True]
    other = explain(pool, ("10.0.1.7", 1), 0.0, admission=Admission())
    assert (other.pick, other.reason) == ("a", None)


def test_a_client_outside_allow_is_rejected_by_acl():
    pool = pool_of(allow=(ipaddress.ip_network("192.0.2.0/24"),))
    assert explain(pool, CLIENT, 0.0, admission=Admission()).reason == "acl"
    assert explain(pool, ("192.0.2.1", 1), 0.0, admission=Admission()).reason is None


def test_max_connections_rejects_once_the_virtual_server_holds_that_many():
    pool = pool_of(max_connections=3)
    open_clients(pool, 2)
    assert explain(pool, CLIENT, 0.0, admission=Admission()).reason is None  # the 3rd: in
    open_clients(pool, 1)
    answer = explain(pool, CLIENT, 0.0, admission=Admission())
    assert (answer.by, answer.reason) == (REJECT, "max_connections")


def test_per_source_connections_reject_that_network_only_and_asking_admits_nothing():
    config = PerSourceConfig(max_connections=2)
    pool = pool_of(per_source=config)
    table = PerSourceTable(Limits.of(config))
    admission = Admission(per_source=table)
    assert table.admit("10.0.0.7", 0.0) is not None
    for _ in range(5):  # asking does not count: the second connection is still free
        assert explain(pool, CLIENT, 0.0, admission=admission).reason is None
    assert table.admit("10.0.0.7", 0.0) is not None
    answer = explain(pool, CLIENT, 0.0, admission=admission)
    assert (answer.pick, answer.by, answer.reason) == (None, REJECT, "per_source")
    assert explain(pool, ("10.0.0.8", 1), 0.0, admission=admission).reason is None
    assert len(table) == 1 and table.refused == 0  # nothing tracked or refused by asking


def test_per_source_rate_is_peeked_not_used_up():
    config = PerSourceConfig(rate=2, interval=10.0)
    pool = pool_of(per_source=config)
    table = PerSourceTable(Limits.of(config))
    admission = Admission(per_source=table)
    entry = table.admit("10.0.0.7", 0.0)
    for _ in range(5):
        assert explain(pool, CLIENT, 1.0, admission=admission).reason is None
    assert table.admit("10.0.0.7", 1.0) is not None  # the rate's second: asking took none
    assert explain(pool, CLIENT, 2.0, admission=admission).reason == "per_source"
    assert explain(pool, CLIENT, 10.5, admission=admission).reason is None  # 0.0 is out
    assert entry is not None and table.admit("10.0.0.7", 2.0) is None  # the real one agrees


def test_the_throttle_in_digg_rejects_and_asking_counts_no_arrival():
    throttle = Throttle(ThrottleConfig(max_connections=2, digg_factor=2.0))
    pool = pool_of()
    admission = Admission(throttle=throttle)
    open_clients(pool, 3)  # load 1.5: high, not digg
    assert explain(pool, CLIENT, 0.0, admission=admission).reason is None
    assert throttle.window.count(0.0) == 0 and throttle.mode == "low"  # nothing counted
    open_clients(pool, 1)  # load 2.0: this arrival would take it to digg and be refused
    assert explain(pool, CLIENT, 0.0, admission=admission).reason == "throttle"
    assert throttle.mode == "low"  # a peek: the mode is the throttle's own business
    throttle.arrival(0.0, pool.clients)
    assert throttle.refusing
    assert explain(pool, CLIENT, 0.0, admission=admission).reason == "throttle"


def test_max_clients_comes_first_then_the_data_paths_order():
    config = PerSourceConfig(max_connections=1)
    throttle = Throttle(ThrottleConfig(max_connections=1, digg_factor=1.5))
    table = PerSourceTable(Limits.of(config))
    table.admit("10.0.0.7", 0.0)
    pool = pool_of(per_source=config, max_connections=1, deny=(ipaddress.ip_network("10.0.0.0/8"),))
    open_clients(pool, 2)
    everything = Admission(clients_full=True, throttle=throttle, per_source=table)
    order = []
    for admission in (
        everything,
        Admission(throttle=throttle, per_source=table),
        Admission(per_source=table),
    ):
        order.append(explain(pool, CLIENT, 0.0, admission=admission).reason)
    assert order == ["max_clients", "throttle", "acl"]
    allowed = pool_of(per_source=config, max_connections=1)
    open_clients(allowed, 1)
    assert explain(allowed, CLIENT, 0.0, admission=Admission(per_source=table)).reason == (
        "max_connections"
    )


def test_no_server_is_the_reason_when_every_server_is_left_out():
    pool = pool_of()
    for rs in pool.servers:
        pool.set_state(rs, "disabled", 0.0)
    answer = explain(pool, CLIENT, 0.0, admission=Admission())
    assert (answer.pick, answer.by, answer.reason) == (None, REJECT, "no_server")


def test_without_admission_state_only_the_pick_is_explained():
    pool = pool_of(deny=(ipaddress.ip_network("10.0.0.0/24"),))
    answer = explain(pool, CLIENT, 0.0)  # a UDP virtual server: its relay decides
    assert (answer.pick, answer.reason) == ("a", None)
