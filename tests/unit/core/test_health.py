"""Rise/fall hysteresis as one bounded counter (HAProxy check-t.h)."""

from __future__ import annotations

from lbproxy.core.health import Health


def test_goes_down_after_fall_failures_in_a_row():
    h = Health(rise=2, fall=3)
    assert h.up
    assert [h.record(False), h.record(False)] == [None, None]
    assert h.record(True) is None  # a success restores the top: the count starts again
    assert [h.record(False), h.record(False), h.record(False)] == [None, None, False]
    assert not h.up


def test_comes_back_after_rise_successes_in_a_row():
    h = Health(rise=2, fall=3, up=False)
    assert h.record(True) is None
    assert h.record(False) is None  # restarts from zero
    assert [h.record(True), h.record(True)] == [None, True]
    assert h.up
    assert h.counter == 4  # rise + fall - 1: three failures needed again


def test_rise_and_fall_of_one_flip_at_once():
    h = Health(rise=1, fall=1)
    assert h.record(False) is False
    assert h.record(True) is True
