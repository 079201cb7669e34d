"""What `lbproxy check` accepts, the schema accepts: every key's converter against its own
schema fragment, on values drawn near each key's edges (durations, addresses, ranges).

The schema may be looser than the check (a prime table size, a host name's labels), so
only one direction is a property; the other is held by the examples in
tests/unit/config/test_schema.py.
"""

from __future__ import annotations

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lbproxy.config.tables import walk
from lbproxy.config.values import Invalid

KEYS = [
    (f"{path}.{key}", converter)
    for path, section in walk()
    if path and not section.defaults_from
    for key, converter in section.fields.items()
]

numbers = (
    st.integers(-5, 70000)
    | st.floats(-10, 1e6)
    | st.just(float("nan"))
    | st.sampled_from(
        [0, 1, 3, 100, 101, 599, 600, 65535, 65536, 65537, 1000003, 2**31, 0.5, 1.0, -0.0]
    )
)
words = st.sampled_from(
    [
        "none",
        "auto",
        "2c",
        "3",
        "SRV",
        "srv",
        "a",
        "AAAA",
        "text",
        "json",
        "tcp",
        "http",
        "send_expect",
        "source",
        "v1",
        "v2",
        "enabled",
        "drain",
        "wlc",
        "maglev",
        "least-load",
        "zero",
        "hold",
        "SHA",
        "AES",
        "keep",
        "close",
        "",
        " ",
        "x",
        "/healthz",
        "healthz",
    ]
)
durations = st.from_regex(r"\A[ +-]?(\d{1,4}(\.\d{0,3})?|\.\d{1,3}) ?(ms|s|m|h)? ?\Z")
addresses = st.from_regex(
    r"\A(127\.0\.0\.1|0\.0\.0\.0|localhost|\[::1\]|\[::\]|::1|web-1\.example|1\.2\.3)"
    r":(0|1|80|65535|65536|x)?\Z"
) | st.from_regex(r"\A(10\.0\.0\.[0-9]{1,3}|::1|fe80::1|[0-9a-f:]{2,8})(/[0-9]{1,3})?\Z")
names = st.from_regex(r"\A[*.]{0,2}[a-z0-9_.-]{0,12}\.?\Z") | st.text(max_size=6)
oids = st.from_regex(r"\A\.?[0-9]{1,3}(\.[0-9]{1,3}){0,5}\Z")
scalars = numbers | words | durations | addresses | names | oids | st.booleans() | st.none()
values = scalars | st.lists(scalars, max_size=3)


def _accepted(converter, value) -> bool:
    node = yaml.compose(yaml.safe_dump(value))
    try:
        converter(node, "key")
    except Invalid:
        return False
    return True


@pytest.mark.parametrize("key, converter", KEYS, ids=[key for key, _ in KEYS])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=values)
def test_a_value_check_accepts_is_one_the_schema_accepts(key, converter, value):
    if _accepted(converter, value):
        loaded = yaml.safe_load(yaml.safe_dump(value))
        validator = jsonschema.Draft202012Validator(converter.schema)
        errors = [error.message for error in validator.iter_errors(loaded)]
        assert errors == [], f"{key}: check accepts {value!r}, the schema does not"
