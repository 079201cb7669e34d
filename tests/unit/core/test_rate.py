"""core/rate.py: a per-second rate sampled from a growing counter, and its highest."""

from __future__ import annotations

from lbproxy.core.rate import Rate


def test_rate_is_growth_over_the_sampled_interval_and_max_keeps_the_peak():
    rate = Rate(since=100.0)
    assert rate.sample(30, 101.0) == 30 and (rate.current, rate.max) == (30.0, 30.0)
    assert rate.sample(40, 103.0) == 10 and (rate.current, rate.max) == (5.0, 30.0)
    assert rate.sample(40, 104.0) == 0 and (rate.current, rate.max) == (0.0, 30.0)


def test_a_first_sample_without_a_start_only_starts_counting_and_a_shrink_is_zero():
    rate = Rate()
    assert rate.sample(500, 10.0) == 0 and rate.current == 0.0
    assert rate.sample(10, 11.0) == 0 and rate.current == 0.0  # a replaced counter
    assert rate.sample(13, 12.0) == 3 and rate.max == 3.0
