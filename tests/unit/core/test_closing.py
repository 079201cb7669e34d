"""core/closing.py: a connection's jittered lifetime and the oldest-first order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lbproxy.core.closing import lifetime, oldest_first


@pytest.mark.parametrize(("draw", "expected"), [(0.0, 1.6), (0.5, 2.0), (1.0, 2.4), (0.25, 1.8)])
def test_the_lifetime_is_uniform_within_the_duration_plus_or_minus_the_jitter(draw, expected):
    assert lifetime(2.0, 20.0, draw) == pytest.approx(expected)


def test_without_jitter_every_connection_gets_the_duration():
    assert {lifetime(2.0, 0.0) for _ in range(100)} == {2.0}


def test_random_draws_stay_within_the_window_and_spread():
    draws = [lifetime(10.0, 50.0) for _ in range(2000)]
    assert 5.0 <= min(draws) < 5.5 and 14.5 < max(draws) <= 15.0


def test_oldest_first_orders_by_the_connections_start():
    leases = [SimpleNamespace(handle=SimpleNamespace(started=t)) for t in (3.0, 1.0, 2.0)]
    leases.append(SimpleNamespace(handle=None))  # no start time: last
    assert [getattr(lease.handle, "started", None) for lease in oldest_first(leases)] == [
        1.0,
        2.0,
        3.0,
        None,
    ]
