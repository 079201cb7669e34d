"""The PATCH body parser (network input) under any bytes and any JSON: a change or a 400.

`parse_patch` either returns a change that `weight_error` and `state_error` accept,
with no other key, or raises the 400 that names the problem; never another exception.
"""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from lbproxy.admin.api import parse_patch
from lbproxy.admin.routes import HTTPError as _HTTPError
from lbproxy.core.pool import STATES, state_error, weight_error

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(STATES),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)
bodies = st.dictionaries(
    st.sampled_from(["weight", "state", "close_after", "close_rate", "colour", ""])
    | st.text(max_size=8),
    json_values | st.integers(-3, 70000),
    max_size=3,
)


def check(body: bytes) -> None:
    try:
        change = parse_patch(body, "web/a")
    except _HTTPError as exc:
        assert exc.status == 400 and exc.message
        return
    assert change and set(change) <= {"weight", "state", "close_after", "close_rate"}
    assert "weight" not in change or weight_error(change["weight"]) is None
    assert "state" not in change or state_error(change["state"]) is None
    if "close_after" in change or "close_rate" in change:  # a drain's closes, made numbers
        assert change["state"] == "drain"
        after = change["close_after"]
        assert isinstance(after, float) and 0 <= after < math.inf
        rate = change.get("close_rate")
        assert rate is None or (isinstance(rate, float) and 0 < rate < math.inf)


@settings(max_examples=500, deadline=None)
@given(body=st.binary(max_size=200))
def test_any_bytes(body):
    check(body)


@settings(max_examples=500, deadline=None)
@given(document=bodies | json_values)
def test_any_json_document(document):
    check(json.dumps(document).encode())  # NaN and Infinity included (json.dumps writes them)


@given(weight=st.integers(0, 65535), state=st.sampled_from(STATES))
def test_every_valid_change_is_taken_as_is(weight, state):
    for change in ({"weight": weight}, {"state": state}, {"weight": weight, "state": state}):
        assert parse_patch(json.dumps(change).encode(), "web/a") == change


@given(
    weight=st.floats(allow_nan=False, allow_infinity=False) | st.booleans() | st.integers().map(str)
)
def test_no_float_boolean_or_string_is_a_weight(weight):
    try:
        parse_patch(json.dumps({"weight": weight}).encode(), "web/a")
    except _HTTPError as exc:
        assert exc.status == 400 and "weight must be an integer from 0 to 65535" in exc.message
    else:
        raise AssertionError(f"{weight!r} was taken as a weight")


@given(
    after=st.floats(0, 1e6, allow_nan=False) | st.integers(0, 10**6),
    unit=st.sampled_from(["", "s", "ms", "m", "h", None]),
    rate=st.none() | st.integers(1, 10**6) | st.floats(1e-3, 1e6, allow_nan=False),
)
def test_a_drains_closes_are_taken_as_seconds_and_a_rate(after, unit, rate):
    change = {"state": "drain", "close_after": after if unit is None else f"{after:.3f}{unit}"}
    if rate is not None:
        change["close_rate"] = rate
    taken = parse_patch(json.dumps(change).encode(), "web/a")
    assert isinstance(taken["close_after"], float) and taken["close_after"] >= 0
    assert rate is None or taken["close_rate"] == float(rate)


@given(
    state=st.sampled_from(["enabled", "disabled"]),
    key=st.sampled_from(["close_after", "close_rate"]),
)
def test_a_drains_closes_need_a_drain(state, key):
    try:
        parse_patch(json.dumps({"state": state, key: 1}).encode(), "web/a")
    except _HTTPError as exc:
        assert exc.status == 400 and "go with a drain" in exc.message
    else:
        raise AssertionError("taken without a drain")
