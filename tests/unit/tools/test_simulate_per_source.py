"""`lbproxy simulate` with `per_source:` (SPEC §23): the table `lbproxy run` uses admits
each arrival on the simulated clock, before the throttle; a refused one is not served
and counted in `rejected`."""

from __future__ import annotations

from lbproxy.config.model import PerSourceConfig
from lbproxy.tools.simulate import Event, simulate
from tests.factories import virtual_server


def two(per_source: PerSourceConfig):
    return virtual_server("rr", {"a": {}, "b": {}}, per_source=per_source)


def test_held_connections_of_one_network_stop_at_max_connections_until_one_closes():
    # Without `clients`, connection k comes from 10.0.0.k: one /24 network.
    vs = two(PerSourceConfig(max_connections=3, prefix_v4=24))
    result = simulate(vs, 8, hold=True, events=[Event(6, (("close", {"a": 1}),))])
    assert result.sequence == ["a", "b", "a", None, None, "b", None, None]
    assert result.rejected == {"per_source": 4}
    assert result.as_json()["rejected"] == {"per_source": 4}


def test_each_address_is_its_own_network_by_default():
    result = simulate(two(PerSourceConfig(max_connections=1)), 6, hold=True)
    assert None not in result.sequence
    assert result.rejected == {}
    assert "rejected" not in result.as_json()  # nothing refused: the document as before


def test_a_rate_is_a_sliding_window_on_the_simulated_clock():
    # 10 arrivals a second from 2 clients alternating, each allowed 2 within 0.9 s.
    # Client 1 arrives at 0.0, 0.2, 0.4, ...: served at 0.0 and 0.2, refused until 0.9
    # after the older of the two (1.0), and so on; refused arrivals do not fill the window.
    vs = two(PerSourceConfig(rate=2, interval=0.9))
    result = simulate(vs, 24, rate=10.0, clients=2)
    served = [name is not None for name in result.sequence]
    pattern = [True, True, False, False, False] * 2 + [True, True]  # 1.0 1.2, then 2.0 2.2
    assert served[0::2] == pattern  # client 1: 10.0.0.1
    assert served[1::2] == pattern  # client 2: 10.0.0.2, 0.1 s later
    assert result.rejected == {"per_source": 12}


def test_without_hold_a_connection_gives_its_count_back_at_once():
    result = simulate(two(PerSourceConfig(max_connections=1, prefix_v4=8)), 10)
    assert result.sequence == ["a", "b"] * 5
