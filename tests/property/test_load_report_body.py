"""The load-report body (`PUT .../load`, network input) under any bytes and any JSON.

`parse_load_report` either gives (load, per_connection) for `Locator.report_load`, which
applies it or answers an error with nothing changed, or raises the 400 that names the
problem; never another exception, and a report only ever holds finite numbers >= 0.
"""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from lbproxy.admin.api import parse_load_report
from lbproxy.admin.routes import HTTPError as _HTTPError
from lbproxy.core.pool import Pool
from tests.factories import virtual_server

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
bodies = st.dictionaries(
    st.sampled_from(["load", "per_connection", "extra"]) | st.text(max_size=8),
    json_values | st.floats(min_value=0, max_value=10),
    max_size=3,
)


def check(body: bytes) -> None:
    pool = Pool(virtual_server("least-load", {"a": {}}, load_source="report"), 0)
    rs = pool.by_name["a"]
    pool.locator.report_load(rs, 0.5, 0.1)
    try:
        load, per_connection = parse_load_report(body)
    except _HTTPError as exc:
        assert exc.status == 400 and exc.message
        return
    error = pool.locator.report_load(rs, load, per_connection)
    reported, step = pool.locator.reports[rs]
    if error:
        assert (reported, step) == (0.5, 0.1)  # nothing changed
    else:
        assert reported == load and math.isfinite(reported) and reported >= 0
        assert math.isfinite(step) and step >= 0
    assert math.isfinite(pool.load_of(rs))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes(body):
    check(body)


@settings(max_examples=300, deadline=None)
@given(bodies | json_values)
def test_any_json(document):
    check(json.dumps(document).encode())
