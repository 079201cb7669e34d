"""The cluster's message codec (lbproxy/wire/cluster_messages.py) under any input: what
Redis hands back is network input, so every decoder either returns a fully validated
object or raises MessageError with one of its reasons — never another exception, never
a half-read message — and everything the encoders write decodes to itself."""

from __future__ import annotations

import json
import math

from hypothesis import example, given, settings
from hypothesis import strategies as st

from lbproxy.config.model import MAX_WEIGHT
from lbproxy.core.pool import STATES, state_error, weight_error
from lbproxy.wire.cluster_messages import (
    KINDS,
    MAX_ENTRIES,
    MAX_LOAD,
    MAX_MESSAGE,
    MAX_TTL_MS,
    MAX_VERSION,
    MEMBER,
    NAME,
    REASONS,
    Change,
    EntryBatch,
    Member,
    MessageError,
    RemoteEntry,
    batches,
    decode_change,
    decode_entries,
    decode_member,
    encode_change,
    encode_entries,
    encode_member,
    entries_prefix,
)

names = st.from_regex(NAME, fullmatch=True)
members = st.from_regex(MEMBER, fullmatch=True)
addresses = st.ip_addresses().map(str)
versions = st.integers(0, MAX_VERSION)
loads = st.floats(0, MAX_LOAD, allow_nan=False)


@st.composite
def changes(draw) -> Change:
    kind = draw(st.sampled_from(KINDS))
    per_connection = None
    if kind == "state":
        value = draw(st.sampled_from(STATES))
    elif kind == "weight":
        value = draw(st.integers(0, MAX_WEIGHT))
    else:
        value = draw(loads)
        per_connection = draw(st.none() | loads)
    return Change(kind, draw(names), draw(names), value, per_connection, draw(versions),
                  draw(members))  # fmt: skip


entry_batches = st.builds(
    EntryBatch,
    members,
    names,
    st.lists(
        st.builds(RemoteEntry, addresses, names, st.integers(1, 10**9)),
        min_size=1,
        max_size=MAX_ENTRIES,
    ).map(tuple),
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
KEYS = ["v", "kind", "vs", "rs", "value", "version", "origin", "per_connection", "entries",
        "name", "last_seen"]  # fmt: skip
documents = st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), json_values, max_size=9)


@given(changes())
def test_every_change_encodes_and_decodes_to_itself(change):
    data = encode_change(change)
    assert len(data) <= MAX_MESSAGE
    assert decode_change(data) == change


@given(entry_batches)
@settings(max_examples=50)
def test_every_batch_encodes_and_decodes_to_itself(batch):
    data = encode_entries(batch)
    assert len(data) <= MAX_MESSAGE
    assert decode_entries(data) == batch


@given(entry_batches)
@settings(max_examples=20)
def test_a_batch_starts_with_its_origins_prefix(batch):
    assert encode_entries(batch).startswith(entries_prefix(batch.origin))
    other = EntryBatch(batch.origin + "x", batch.virtual_server, batch.entries)
    assert not encode_entries(other).startswith(entries_prefix(batch.origin))


@given(members, st.floats(0, 1e11, allow_nan=False))
def test_every_member_encodes_and_decodes_to_itself(name, last_seen):
    assert decode_member(encode_member(Member(name, last_seen))) == Member(name, last_seen)


def test_batches_cut_long_lists_within_the_message_size():
    client = "1234:5678:9abc:def0:1234:5678:9abc:def0%" + "e" * 24  # 64 characters
    entries = [RemoteEntry(client, "n" * 200, MAX_TTL_MS) for i in range(450)]
    cut = batches("m" * 64, "v" * 200, entries)
    assert [len(b.entries) for b in cut] == [200, 200, 50]
    assert all(len(encode_entries(b)) <= MAX_MESSAGE for b in cut)
    assert [e for b in cut for e in b.entries] == entries


def assert_valid_or_refused(decode, data) -> None:
    try:
        decoded = decode(data)
    except MessageError as exc:
        assert exc.reason in REASONS and exc.detail
        return
    if isinstance(decoded, Change):  # valid means valid as the admin API would have it
        assert NAME.fullmatch(decoded.virtual_server) and NAME.fullmatch(decoded.real_server)
        assert MEMBER.fullmatch(decoded.origin) and 0 <= decoded.version <= MAX_VERSION
        if decoded.kind == "weight":
            assert weight_error(decoded.value) is None
        elif decoded.kind == "state":
            assert state_error(decoded.value) is None
        else:
            assert math.isfinite(decoded.value) and 0 <= decoded.value <= MAX_LOAD
        assert decode_change(encode_change(decoded)) == decoded
    elif isinstance(decoded, EntryBatch):
        assert 1 <= len(decoded.entries) <= MAX_ENTRIES
        assert decode_entries(encode_entries(decoded)) == decoded
    else:
        assert decode_member(encode_member(decoded)) == decoded


@given(st.binary(max_size=300))
@example(b"\xff\xfe")
@example(b"[" * 60_000)
@example(b'{"v": 1e400}')
@example(b"x" * (MAX_MESSAGE + 1))
def test_any_bytes_decode_or_are_refused(data):
    for decode in (decode_change, decode_entries, decode_member):
        assert_valid_or_refused(decode, data)


@given(documents)
@example({"v": 1, "kind": "weight", "vs": "web", "rs": "a", "value": True, "version": 1,
          "origin": "x"})  # fmt: skip
@example({"v": True, "kind": "state", "vs": "web", "rs": "a", "value": "drain", "version": 1,
          "origin": "x"})  # fmt: skip
@example({"v": 1, "kind": "load", "vs": "w", "rs": "a", "value": 10**400, "version": 1,
          "origin": "x"})  # fmt: skip
@example({"v": 1, "origin": "x", "vs": "w", "entries": [["::ffff:10.0.0.1", "a", 5]]})
@example({"v": 1, "origin": "x", "vs": "w", "entries": [["010.0.0.1", "a", 5]]})
def test_any_json_object_decodes_or_is_refused(document):
    data = json.dumps(document).encode()
    for decode in (decode_change, decode_entries, decode_member):
        assert_valid_or_refused(decode, data)


@given(changes(), st.sampled_from(["vs", "rs", "origin", "value", "version", "v", "kind"]),
       json_values)  # fmt: skip
def test_a_valid_change_with_one_field_replaced_is_whole_or_refused(change, key, value):
    document = json.loads(encode_change(change))
    document[key] = value
    assert_valid_or_refused(decode_change, json.dumps(document).encode())


def test_the_codec_states_are_the_pools():
    from lbproxy.wire import cluster_messages

    assert cluster_messages.STATES == STATES
