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


def test_clean_is_up_with_no_failure_counted_after_every_change():
    # `clean` is an attribute kept by each counter write (the connection path reads it
    # per connection): it must agree with the counter after every kind of change.
    def agrees(h: Health) -> bool:
        return h.clean == (h.counter == h.rise + h.fall - 1)

    h = Health(rise=2, fall=3)
    assert h.clean and agrees(h)
    for ok in (False, False, True, False, False, False, True, True, False, True):
        h.record(ok)
        assert agrees(h)
    h.record(False)
    assert not h.clean
    h.rise, h.fall = 4, 1  # a reload's new settings, then force (Pool._retune_health)
    h.force(h.up)
    assert agrees(h)
    h.counter = h.rise - 1  # Pool.await_first_check
    assert not h.clean and agrees(h)
    assert not Health(rise=2, fall=3, up=False).clean
