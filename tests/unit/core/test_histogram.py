"""The fixed-bucket histogram (lbproxy/core/histogram.py) as /metrics exposes it."""

from __future__ import annotations

from lbproxy.core.histogram import DURATION_BUCKETS, Histogram

HOUR = 3600.0


def test_connections_of_hours_fall_in_their_own_buckets_not_in_inf():
    durations = Histogram(DURATION_BUCKETS)
    for seconds in (0.2, 2 * HOUR, 5 * HOUR, 12 * HOUR, 20 * HOUR, 30 * HOUR):
        durations.observe(seconds)
    cumulative = dict(durations.cumulative())
    assert cumulative["3600.0"] == 1
    assert cumulative["14400.0"] == 2  # 2 h
    assert cumulative["43200.0"] == 4  # 5 h, and 12 h exactly (le is "<=")
    assert cumulative["86400.0"] == 5  # 20 h
    assert cumulative["+Inf"] == 6 and durations.count == 6  # only 30 h is beyond a day
    assert durations.total == 0.2 + 69 * HOUR
