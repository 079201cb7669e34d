"""The cluster's message codec (lbproxy/wire/cluster_messages.py) under any input: what
Redis hands back is network input, so every decoder either returns a fully validated
object or raises MessageError with one of its reasons — never another exception, never
a half-read message — and everything the encoders write decodes to itself. Signed
messages: random bytes, any change to a signed message, another key, another prefix or
another kind are refused ("signature", or "oversized"/"garbage" before the MAC is
looked at), never opened."""

from __future__ import annotations

import json
import math

from hypothesis import example, given, settings
from hypothesis import strategies as st

from lbproxy.config.model import MAX_WEIGHT
from lbproxy.core.pool import STATES, state_error, weight_error
from lbproxy.wire.cluster_messages import (
    INSTANCE,
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
    Signer,
    batches,
    decode_change,
    decode_entries,
    decode_entry_value,
    decode_member,
    encode_change,
    encode_entries,
    encode_entry_value,
    encode_member,
    entries_prefix,
    entry_kind,
    server_entry,
)

names = st.from_regex(NAME, fullmatch=True)
members = st.from_regex(MEMBER, fullmatch=True)
instances = st.none() | st.from_regex(INSTANCE, fullmatch=True)  # None: an older lbproxy's
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
    elif kind == "topology":  # an added server's entry, or None: removed
        plain = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20)
        more = draw(st.dictionaries(st.text(max_size=8), plain, max_size=4))
        value = draw(st.none() | st.just({**more, "name": draw(names), "address": "10.0.0.1:80"}))
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
    st.floats(0, 1e11, allow_nan=False),
    instances,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
KEYS = ["v", "kind", "vs", "rs", "value", "version", "origin", "per_connection", "entries",
        "name", "last_seen", "instance", "time"]  # fmt: skip
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
    own = entries_prefix(batch.origin, batch.instance)
    assert encode_entries(batch).startswith(own)
    other = EntryBatch(batch.origin + "x", batch.virtual_server, batch.entries, 0, batch.instance)
    assert not encode_entries(other).startswith(own)


@given(entry_batches, st.from_regex(INSTANCE, fullmatch=True))
@settings(max_examples=20)
def test_a_batch_of_another_instance_with_the_same_name_is_not_ours(batch, instance):
    """Two instances given one name pass over their own batches, not each other's."""
    mine = EntryBatch(batch.origin, batch.virtual_server, batch.entries, 0, instance)
    others = [None, *({batch.instance} - {None, instance})]
    for other in others:
        theirs = EntryBatch(batch.origin, batch.virtual_server, batch.entries, 0, other)
        assert not encode_entries(theirs).startswith(entries_prefix(batch.origin, instance))
    assert encode_entries(mine).startswith(entries_prefix(batch.origin, instance))


@given(members, st.floats(0, 1e11, allow_nan=False), instances)
def test_every_member_encodes_and_decodes_to_itself(name, last_seen, instance):
    member = Member(name, last_seen, instance)
    assert decode_member(encode_member(member)) == member


@given(
    st.sampled_from([decode_entries, decode_member]),
    entry_batches,
    json_values | st.text(max_size=20),
)
@example(decode_member, EntryBatch("x", "w", ()), "0123456789ABCDEF")  # upper case
@example(decode_member, EntryBatch("x", "w", ()), "0123456789abcde")  # 15 digits
@example(decode_entries, EntryBatch("x", "w", ()), "0123456789abcdef0")  # 17 digits
def test_an_instance_that_is_not_16_hex_digits_is_refused(decode, batch, instance):
    if isinstance(instance, str) and INSTANCE.fullmatch(instance):
        return
    if decode is decode_member:
        document = json.loads(encode_member(Member(batch.origin, 1.0, None)))
    else:
        entries = batch.entries or (RemoteEntry("10.0.0.1", "a", 5),)
        document = json.loads(encode_entries(EntryBatch(batch.origin, "w", entries, 1.0)))
    document["instance"] = instance
    try:
        decode(json.dumps(document).encode())
    except MessageError as exc:
        assert exc.reason in REASONS  # "invalid"; "garbage" for a NaN
    else:
        raise AssertionError(f"instance {instance!r} accepted")


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
        elif decoded.kind == "topology":  # removed (None), or an entry the codec checked
            assert decoded.value is None or decoded.value == server_entry(decoded.value)
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
@example(Change("topology", "w", "a", None, None, 0, "x"), "value", None)  # a removal
def test_a_valid_change_with_one_field_replaced_is_whole_or_refused(change, key, value):
    document = json.loads(encode_change(change))
    document[key] = value
    assert_valid_or_refused(decode_change, json.dumps(document).encode())


def test_the_codec_states_are_the_pools():
    from lbproxy.wire import cluster_messages

    assert cluster_messages.STATES == STATES


# -- signed messages ----------------------------------------------------------------------

KEY = b"0123456789abcdef0123456789abcdef"
SIGNER = Signer(KEY, "lbproxy")
kinds = st.sampled_from(["change", "entries", "member"]) | st.builds(entry_kind, names, addresses)
keys = st.binary(min_size=32, max_size=80)
prefixes = st.from_regex(r"[A-Za-z0-9_.:-]{1,64}", fullmatch=True)


def signed_bodies() -> st.SearchStrategy[bytes]:
    return st.one_of(
        changes().map(encode_change),
        entry_batches.map(encode_entries),
        st.builds(Member, members, st.floats(0, 1e11, allow_nan=False)).map(encode_member),
        st.builds(encode_entry_value, names, st.integers(0, 10**14)),
    )


def opened_or_refused(signer: Signer, kind: str, data: object) -> bytes | None:
    """The body, or None when refused; any other exception fails the test."""
    try:
        return signer.open(kind, data)
    except MessageError as exc:
        assert exc.reason in REASONS and exc.detail
        return None


@given(kinds, signed_bodies())
@settings(max_examples=200)
def test_a_signed_message_opens_to_its_body(kind, body):
    assert SIGNER.open(kind, SIGNER.sign(kind, body)) == body


@given(kinds, st.binary(max_size=400))
@example("change", b"")
@example("change", b"." * 65)
@example("change", b"0" * 64 + b".{}")
@example("change", "\udcff" * 70)
@example("change", b"x" * (MAX_MESSAGE + 100))
def test_random_bytes_are_never_opened(kind, data):
    assert opened_or_refused(SIGNER, kind, data) is None
    for decode in (decode_change, decode_entries, decode_member):
        try:
            decode(SIGNER.open(kind, data))
        except MessageError:
            pass
        else:  # pragma: no cover - a forged MAC
            raise AssertionError(data)


@given(kinds, signed_bodies(), st.data())
@settings(max_examples=300)
def test_any_change_to_a_signed_message_is_refused(kind, body, data):
    message = bytearray(SIGNER.sign(kind, body))
    how = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate", "append"]))
    at = data.draw(st.integers(0, len(message) - 1))
    if how == "flip":
        message[at] ^= data.draw(st.integers(1, 255))
    elif how == "insert":
        message[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    elif how == "delete":
        del message[at : at + data.draw(st.integers(1, 8))]
    elif how == "truncate":
        del message[at:]
    else:
        message += data.draw(st.binary(min_size=1, max_size=8))
    assert opened_or_refused(SIGNER, kind, bytes(message)) is None


@given(kinds, kinds, signed_bodies(), keys, prefixes)
@settings(max_examples=200)
def test_another_key_prefix_or_kind_is_refused(kind, other_kind, body, key, prefix):
    message = SIGNER.sign(kind, body)
    if key != KEY:
        assert opened_or_refused(Signer(key, "lbproxy"), kind, message) is None
    if prefix != "lbproxy":
        assert opened_or_refused(Signer(KEY, prefix), kind, message) is None
    if other_kind != kind:
        assert opened_or_refused(SIGNER, other_kind, message) is None


@given(changes(), st.sampled_from(["vs", "rs", "origin", "value", "version", "v", "kind"]),
       json_values)  # fmt: skip
def test_a_signed_change_with_one_field_replaced_is_whole_or_refused(change, key, value):
    """What a holder of the key could write is still checked whole."""
    document = json.loads(encode_change(change))
    document[key] = value
    message = SIGNER.sign("change", json.dumps(document).encode())
    assert_valid_or_refused(decode_change, SIGNER.open("change", message))


@given(st.binary(max_size=300))
@example(b"123 a")
@example(b"1" * 16 + b" a")
@example(b" a")
@example(b"12 \xff")
@example(b"0123 a")
def test_an_entry_value_decodes_or_is_refused(data):
    try:
        server, expires = decode_entry_value(data)
    except MessageError as exc:
        assert exc.reason in REASONS
        return
    assert NAME.fullmatch(server) and 0 <= expires < 10**15
    assert decode_entry_value(encode_entry_value(server, expires)) == (server, expires)


def test_a_key_shorter_than_32_bytes_is_refused():
    import pytest

    with pytest.raises(ValueError, match="at least 32"):
        Signer(b"x" * 31, "lbproxy")
