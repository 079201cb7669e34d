"""The state file's codec (lbproxy/wire/state_file.py) under any input: a file spoilt by a
crash, a full disk or a hand is one StateFileError, never another exception; whatever
`encode` writes decodes to itself, and every cut of it short is refused."""

from __future__ import annotations

import json

from hypothesis import example, given, settings
from hypothesis import strategies as st

from lbproxy.config.model import MAX_WEIGHT
from lbproxy.core.pool import STATES
from lbproxy.wire.state_file import (
    MAX_BYTES,
    ServerState,
    State,
    StateFileError,
    StickyEntry,
    VirtualServerState,
    decode,
    encode,
)

NAME_CHARS = "abcXYZ019_.-"
names = st.text(NAME_CHARS, min_size=1, max_size=12)
times = st.floats(0, 1e10, allow_nan=False)
loads = st.floats(0, 1e6, allow_nan=False)
clients = st.ip_addresses().map(str)
servers = st.builds(
    ServerState,
    names,
    st.text("0123456789.:[]ab", min_size=1, max_size=30),
    st.none() | st.sampled_from(STATES),
    st.none() | st.integers(0, MAX_WEIGHT),
    st.none() | st.tuples(loads, loads),
    st.none() | st.booleans(),
    st.none()
    | st.tuples(
        st.sampled_from(("ok", "fail", "timeout")),
        st.text(max_size=100),
        times,
        st.floats(0, 100, allow_nan=False),
    ),
    st.none() | times,
    st.none() | times,
)
entries = st.builds(StickyEntry, clients, names, times)
addresses = st.text("0123456789.:[]ab", min_size=1, max_size=30)
plain = st.none() | st.booleans() | st.integers() | st.text(max_size=20)
added = st.builds(
    lambda name, address, more: {**more, "name": name, "address": address},
    names,
    addresses,
    st.dictionaries(
        st.text(max_size=8),
        plain | st.dictionaries(st.text(max_size=8), plain, max_size=3),
        max_size=4,
    ),
)
virtual_servers = st.builds(
    VirtualServerState,
    names,
    st.lists(servers, max_size=4).map(tuple),
    st.lists(entries, max_size=6).map(tuple),
    st.lists(added, max_size=2).map(tuple),
    st.lists(st.tuples(names, addresses), max_size=2).map(tuple),
)
states = st.builds(State, times, st.lists(virtual_servers, max_size=3).map(tuple))


def decoded_or_refused(data: bytes) -> State | None:
    try:
        state = decode(data)
    except StateFileError as exc:
        assert str(exc)  # says why
        return None
    assert isinstance(state, State)
    return state


@given(st.binary(max_size=400))
@example(b"")
@example(b"[" * 100_000)  # deeper than json's recursion limit
@example(b'{"lbproxy_state": 1, "written": 1e400, "virtual_servers": []}')
@example(b'{"lbproxy_state": true, "written": 1, "virtual_servers": []}')
@example(b'{"lbproxy_state": 1, "written": NaN, "virtual_servers": []}')
@example(b'{"lbproxy_state": 1, "written": 1' + b"0" * 5000 + b', "virtual_servers": []}')
@example(b"\xff\xfe")
def test_any_bytes_are_a_state_or_one_clear_error(data):
    decoded_or_refused(data)


@settings(max_examples=100)
@given(states)
def test_what_encode_writes_decodes_to_itself(state):
    assert decode(encode(state)) == state


@settings(max_examples=60)
@given(states, st.data())
def test_a_file_cut_short_is_refused(state, data):
    encoded = encode(state)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    try:
        decode(encoded[:cut])
    except StateFileError:
        return
    raise AssertionError(f"a cut at {cut} of {len(encoded)} bytes was accepted")


@settings(max_examples=150)
@given(states, st.data())
def test_any_change_of_a_good_file_is_a_state_or_one_error(state, data):
    """JSON that parses but breaks a rule (a key, a type, a range) deep inside."""
    document = json.loads(encode(state))
    junk = data.draw(
        st.none()
        | st.booleans()
        | st.integers(-(2**70), 2**70)
        | st.floats()
        | st.text(max_size=10)
        | st.lists(st.integers(), max_size=3)
        | st.dictionaries(st.text(max_size=5), st.integers(), max_size=2)
    )
    target = document
    path = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=5))
    for step in path[:-1]:
        children = list(target.values()) if isinstance(target, dict) else target
        if not isinstance(children, list) or not children:
            break
        child = children[step % len(children)]
        if not isinstance(child, dict | list):
            break
        target = child
    if isinstance(target, dict):
        keys = [*target, "extra"]
        target[keys[path[-1] % len(keys)]] = junk
    elif isinstance(target, list):
        target.append(junk) if not target else target.__setitem__(path[-1] % len(target), junk)
    text = json.dumps(document, allow_nan=True).encode()
    decoded_or_refused(text)


def test_an_oversized_file_is_refused_unread():
    try:
        decode(b" " * (MAX_BYTES + 1))
    except StateFileError as exc:
        assert "at most" in str(exc)
    else:
        raise AssertionError("accepted")
