"""dynamic_weight.py: on_no_answer zero | hold | static, stale_after, smoothing (pure)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lbproxy.core.dynamic_weight import DynamicWeight, Report, SetWeight


def test_is_pure():
    code = "import sys, lbproxy.core.dynamic_weight; print('trio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_answer_is_reported_as_is_without_smoothing():
    dw = DynamicWeight("zero", stale_after=15)
    assert dw.answered(7, 0) == Report(7.0)
    assert dw.answered(3, 5) == Report(3.0)
    assert dw.answering is True


def test_zero_gives_weight_zero_from_the_first_unanswered_poll():
    dw = DynamicWeight("zero", stale_after=15)
    dw.answered(7, 0)
    assert dw.unanswered(5, static_weight=3) == SetWeight(0.0, "zero")
    assert dw.answering is False
    assert dw.hold_until() is None


def test_static_gives_the_static_weight_read_at_each_unanswered_poll():
    dw = DynamicWeight("static", stale_after=15)
    assert dw.unanswered(0, static_weight=3) == SetWeight(3.0, "static")
    assert dw.unanswered(5, static_weight=4) == SetWeight(4.0, "static")  # set-weight followed


def test_hold_keeps_the_last_value_until_stale_after_then_zero():
    dw = DynamicWeight("hold", stale_after=15)
    dw.answered(7, 100)
    assert dw.unanswered(105, static_weight=1) is None  # keep: 5 s old
    assert dw.hold_until() == 115
    assert dw.expire(110) is None  # not yet
    assert dw.expire(115) == SetWeight(0.0, "hold expired")
    assert dw.expire(116) is None  # once
    assert dw.hold_until() is None
    assert dw.unanswered(120, static_weight=1) == SetWeight(0.0, "hold")  # said once


def test_hold_expiry_seen_at_a_failed_poll_when_no_wake_up_came_first():
    dw = DynamicWeight("hold", stale_after=15)
    dw.answered(7, 100)
    assert dw.unanswered(116, static_weight=1) == SetWeight(0.0, "hold expired")
    assert dw.unanswered(121, static_weight=1) == SetWeight(0.0, "hold")


def test_hold_with_nothing_to_hold_is_zero_at_once():
    dw = DynamicWeight("hold", stale_after=15)
    assert dw.unanswered(0, static_weight=5) == SetWeight(0.0, "hold")
    assert dw.hold_until() is None


def test_an_answer_after_a_hold_expiry_starts_again():
    dw = DynamicWeight("hold", stale_after=15)
    dw.answered(7, 0)
    dw.unanswered(20, static_weight=1)
    assert dw.answered(4, 25) == Report(4.0)
    assert dw.unanswered(30, static_weight=1) is None  # holding 4 again
    assert dw.hold_until() == 40


def test_smoothing_is_an_exponential_moving_average():
    dw = DynamicWeight("zero", stale_after=15, smoothing=0.5)
    assert dw.answered(8, 0) == Report(8.0)  # the first value as it is
    assert dw.answered(4, 5) == Report(6.0)  # 0.5 x 4 + 0.5 x 8
    assert dw.answered(4, 10) == Report(5.0)
    assert dw.unanswered(15, static_weight=1) == SetWeight(0.0, "zero")
    assert dw.answered(2, 20) == Report(3.5)  # a short gap: the average goes on


def test_smoothing_restarts_after_a_gap_longer_than_stale_after():
    dw = DynamicWeight("zero", stale_after=15, smoothing=0.5)
    dw.answered(8, 0)
    assert dw.answered(2, 16) == Report(2.0)


@pytest.mark.parametrize(
    ("policy", "stale_after", "smoothing"),
    [("never", 1, 1), ("zero", 0, 1), ("zero", 1, 0), ("zero", 1, 1.5)],
)
def test_bad_parameters_are_refused(policy, stale_after, smoothing):
    with pytest.raises(ValueError):
        DynamicWeight(policy, stale_after, smoothing)
