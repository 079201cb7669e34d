"""The per-source counts the cluster shares (`per_source.shared`, wire/cluster_messages.py
`SourceCounts`) under any input: every message the encoder writes decodes to itself and
fits a message; any bytes or JSON either decode to a validated object or raise
MessageError with one of its reasons -- never another exception. The network texts
round-trip through the table's keys (core/per_source.py)."""

from __future__ import annotations

import ipaddress
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from lbproxy.core.per_source import network_key, network_of_text, network_text
from lbproxy.wire.cluster_messages import (
    INSTANCE,
    MAX_MESSAGE,
    MAX_SOURCE_COUNT,
    REASONS,
    MessageError,
    decode_sources,
    encode_sources,
    source_batches,
)

addresses = st.one_of(
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(str),
)
prefixes = st.tuples(st.integers(1, 32), st.integers(1, 128))
counts = st.integers(0, MAX_SOURCE_COUNT)
names = st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True)


@st.composite
def networks(draw) -> str:
    address = draw(addresses)
    v4, v6 = draw(prefixes)
    text = network_text(network_key(address, v4, v6), v4, v6)
    assert text is not None
    return text


@settings(max_examples=200, deadline=None)
@given(
    names,
    names,
    st.floats(0, 1e11),
    st.lists(st.tuples(networks(), counts, counts), max_size=1200),
    st.none() | st.from_regex(INSTANCE, fullmatch=True),
)
def test_every_publication_encodes_within_a_message_and_decodes_to_itself(
    origin, vs, time, rows, instance
):
    for message in source_batches(origin, vs, time, rows, instance):
        data = encode_sources(message)
        assert len(data) <= MAX_MESSAGE
        assert decode_sources(data) == message


@settings(max_examples=300, deadline=None)
@given(addresses, prefixes)
def test_a_network_text_gives_back_its_key(address, prefix):
    v4, v6 = prefix
    key = network_key(address, v4, v6)
    text = network_text(key, v4, v6)
    assert text is not None
    assert network_of_text(text, v4, v6) == key
    parsed = ipaddress.ip_network(text)  # a network, no host bits
    assert str(parsed) == text or "/" not in text


def check(data) -> None:
    try:
        decode_sources(data)
    except MessageError as exc:
        assert exc.reason in REASONS


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_decode_or_are_refused(data):
    check(data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=500, deadline=None)
@given(
    st.fixed_dictionaries(
        {"v": st.just(2) | json_values, "origin": names | json_values, "vs": names | json_values},
        optional={
            "time": st.floats(0, 1e11) | json_values,
            "networks": st.lists(
                st.lists(st.text(max_size=45) | networks() | json_values, max_size=4) | json_values,
                max_size=5,
            ),
        },
    )
)
def test_any_json_object_decodes_or_is_refused(document):
    check(json.dumps(document).encode())


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60), prefixes)
def test_network_of_text_never_raises(text, prefix):
    network_of_text(text, *prefix)
