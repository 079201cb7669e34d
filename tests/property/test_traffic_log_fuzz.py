"""Fuzz the traffic-log parsers of `lbproxy simulate --replay` (lbproxy/tools/traffic_log.py):
any text gives a connection, a skip or a Malformed, never an exception; what parses is
sane (a finite start, a duration >= 0, names and a port in range); a well-formed line
of either format, however its values are chosen, parses to what it says; and reading a
whole log of mixed lines never raises and counts every line."""

from __future__ import annotations

import calendar
import json
import math
import time
from datetime import datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from lbproxy.tools.replay import read_log
from lbproxy.tools.traffic_log import (
    Logged,
    Malformed,
    parse_haproxy,
    parse_lbproxy,
    parse_lbproxy_decoding,
)

PARSERS = [parse_lbproxy, parse_haproxy]


def sane(parsed) -> None:
    assert parsed is None or isinstance(parsed, Logged | Malformed)
    if isinstance(parsed, Logged):
        assert math.isfinite(parsed.start)
        assert 0 <= parsed.duration < math.inf
        assert parsed.virtual_server and parsed.client
        assert 0 <= parsed.client_port <= 65535
    if isinstance(parsed, Malformed):
        assert parsed.reason and "\n" not in parsed.reason


@given(st.text(max_size=400))
def test_any_text_never_raises(text):
    for parse in PARSERS:
        sane(parse(text))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
KEYS = ["logger", "start", "duration_s", "client", "client_port", "virtual_server"]


@given(st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), JSON_VALUES, max_size=8))
def test_any_json_object_never_raises(record):
    sane(parse_lbproxy(json.dumps(record)))


@given(
    st.fixed_dictionaries(
        {
            "logger": st.just("lbproxy.access"),
            "start": st.datetimes(
                min_value=datetime(1971, 1, 1), max_value=datetime(2200, 1, 1)
            ).map(lambda d: d.isoformat() + "Z"),
            "duration_s": st.floats(0, 1e6),
            "client": st.text(min_size=1, max_size=40),
            "client_port": st.integers(0, 65535),
            "virtual_server": st.text(min_size=1, max_size=40),
        }
    ),
    st.dictionaries(st.text(max_size=8).filter(lambda k: k not in KEYS), JSON_VALUES, max_size=3),
)
def test_a_well_formed_access_record_parses_to_what_it_says(record, more):
    parsed = parse_lbproxy(json.dumps(more | record))
    assert isinstance(parsed, Logged), parsed
    assert parsed.duration == record["duration_s"]
    assert (parsed.client, parsed.client_port) == (record["client"], record["client_port"])
    assert parsed.virtual_server == record["virtual_server"]


NAME = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="/"),
    min_size=1,
    max_size=20,
)
ADDRESS = st.ip_addresses().map(str)


@given(
    st.text(max_size=60).filter(lambda t: "\n" not in t),  # a syslog header, or anything
    ADDRESS,
    st.integers(0, 65535),
    st.integers(0, 2**33),  # seconds since the epoch
    st.integers(0, 999),
    NAME,
    NAME,
    st.integers(-1, 10**9),  # Tt, ms
    st.booleans(),  # logasap: +Tt
)
def test_a_well_formed_tcplog_line_parses_to_what_it_says(
    header, client, port, seconds, millis, backend, server, total, logasap
):
    date = time.strftime("%d/%b/%Y:%H:%M:%S", time.gmtime(seconds))
    line = (
        f"{header} {client}:{port} [{date}.{millis:03d}] fe {backend}/{server} "
        f"0/0/{'+' if logasap else ''}{total} 100 -- 1/1/1/1/0 0/0"
    )
    parsed = parse_haproxy(line)
    sane(parsed)
    if total < 0:
        assert isinstance(parsed, Malformed)
        return
    assert isinstance(parsed, Logged), (line, parsed)
    expected_second = calendar.timegm(time.gmtime(seconds))
    assert parsed.start == expected_second + millis / 1000
    assert parsed.duration == total / 1000
    assert (parsed.client, parsed.client_port) == (client, port)
    assert parsed.virtual_server == backend


@given(st.lists(st.text(max_size=120), max_size=30), st.sampled_from(["lbproxy", "haproxy"]))
def test_reading_a_log_of_any_lines_never_raises(lines, log_format):
    lines = [line.replace("\n", " ") for line in lines]
    traffic = read_log(lines, log_format)
    assert traffic.lines == len(lines)
    assert len(traffic) + traffic.malformed <= len(lines)
    assert len(traffic.first_malformed) == min(traffic.malformed, 5)
    assert list(traffic.starts) == sorted(traffic.starts)


# Mostly what lbproxy writes (printable ASCII, which may still hold a quote or a
# backslash), sometimes anything: control characters, any code point, empty
PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
TEXT = st.text(PRINTABLE, min_size=1, max_size=20) | st.text(max_size=30)
# A name as lbproxy writes one: no quote, no backslash
NAME_AS_WRITTEN = st.text(
    st.characters(min_codepoint=0x20, exclude_characters='"\\', exclude_categories=["Cs"]),
    min_size=1,
    max_size=20,
)
START = st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(2200, 1, 1)).map(
    lambda d: d.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
)


WRITTEN_ORDER = (
    "time", "level", "logger", "message", "start", "duration_s", "client", "client_port",
    "virtual_server", "real_server", "bytes_in", "bytes_out", "end", "protocol",
)  # fmt: skip


def access_records(name, start, duration, port, text):
    """Access records with lbproxy's keys in its order, their values from these
    strategies (fixed_dictionaries would shuffle the keys)."""
    values = (
        text,
        st.just("info"),
        st.just("lbproxy.access"),
        text,
        start,
        duration,
        name,
        port,
        name,
        st.none() | name,
        st.integers(0, 2**64),
        st.integers(0, 2**64),
        text,
        st.sampled_from(["tcp", "udp"]),
    )
    return st.tuples(*values).map(lambda row: dict(zip(WRITTEN_ORDER, row, strict=True)))


# As lbproxy writes them; and with any values at all
AS_WRITTEN = access_records(NAME_AS_WRITTEN, START, st.floats(0, 1e6), st.integers(0, 65535), TEXT)
ANY_VALUES = access_records(
    TEXT,
    START | TEXT,
    st.floats(allow_nan=False) | st.integers(-(2**70), 2**70),
    st.integers(-5, 70000),
    TEXT,
)


@given(AS_WRITTEN | ANY_VALUES, st.booleans())
@settings(max_examples=300)
def test_the_fast_reading_of_lbproxys_own_lines_agrees_with_json(record, ascii_only):
    """lbproxy's own access lines are read without json's decoder: what that reading
    gives is what decoding the line gives, whatever the values."""
    line = json.dumps(record, ensure_ascii=ascii_only)
    assert parse_lbproxy(line) == parse_lbproxy_decoding(line)
