"""The ClientHello reader (lbproxy/wire/client_hello.py): real hellos made by Python's ssl,
cut and re-framed every way, and fuzzed with hypothesis."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbproxy.wire.client_hello import LIMIT, NOT_TLS, ClientHelloReader, Hello, parse_hello_body
from tests.factories import real_hello


def read(*chunks: bytes):
    reader = ClientHelloReader()
    result = None
    for chunk in chunks:
        result = reader.feed(chunk)
        if result is not None:
            return result
    return reader.eof() if result is None else result


def reframe(hello: bytes, size: int) -> bytes:
    """The same handshake message in records of at most `size` payload bytes."""
    assert hello[0] == 22
    payload = hello[5:]
    out = b""
    for i in range(0, len(payload), size):
        piece = payload[i : i + size]
        out += bytes([22, 3, 1]) + len(piece).to_bytes(2, "big") + piece
    return out


def test_a_real_hello_gives_its_server_name_in_lower_case():
    assert read(real_hello("API.Example.COM")) == Hello("api.example.com")
    assert read(real_hello(None)) == Hello(None)  # no SNI: the default route


def test_a_hello_fed_one_byte_at_a_time_needs_every_byte_and_no_more():
    hello = real_hello()
    reader = ClientHelloReader()
    for i, byte in enumerate(hello):
        result = reader.feed(bytes([byte]))
        if i < len(hello) - 1:
            assert result is None
    assert result == Hello("api.example.com")


@pytest.mark.parametrize("size", [1, 7, 100, 250])
def test_a_hello_spread_over_several_records(size):
    framed = reframe(real_hello(), size)
    assert read(framed) == Hello("api.example.com")
    assert read(*[framed[i : i + 3] for i in range(0, len(framed), 3)]) == Hello("api.example.com")


def test_bytes_after_the_hello_do_not_matter():
    assert read(real_hello() + b"\x17\x03\x03\x00\x05hello") == Hello("api.example.com")


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\nHost: api.example.com\r\n\r\n",  # plain HTTP
        b"\x80\x2e\x01\x00\x02\x00\x15\x00\x00\x00\x10" + bytes(37),  # an SSLv2 hello
        b"SSH-2.0-OpenSSH_9.6\r\n",
        b"\x16\x02\x01\x00\x10" + bytes(16),  # record version 2
        b"\x16\x03\x01\x00\x00",  # an empty record
        b"\x16\x03\x01\x40\x01",  # longer than 2^14
        b"\x17\x03\x03\x00\x10" + bytes(16),  # application data first
        b"\x16\x03\x01\x00\x04\x02\x00\x00\x00",  # a ServerHello
    ],
)
def test_what_is_not_a_hello_is_said_at_once(data):
    assert ClientHelloReader().feed(data) is NOT_TLS


def test_truncated_hellos_are_not_tls_at_eof():
    hello = real_hello()
    for cut in (1, 4, 5, 9, 50, len(hello) - 1):
        reader = ClientHelloReader()
        assert reader.feed(hello[:cut]) is None
        assert reader.eof() is NOT_TLS


def test_wrong_lengths_inside_the_hello():
    hello = bytearray(real_hello())
    body_start = 9
    session_id_at = body_start + 34
    bad = bytearray(hello)
    bad[session_id_at] = 33  # a session id longer than 32
    assert read(bytes(bad)) is NOT_TLS
    bad = bytearray(hello)
    bad[6:9] = (len(hello) - 9 - 1).to_bytes(3, "big")  # handshake length one short
    assert read(bytes(bad)) is NOT_TLS
    assert parse_hello_body(bytes(34)) is NOT_TLS


def test_more_than_16_kib_without_a_complete_hello():
    # A handshake message that announces 20 000 bytes: it can never fit.
    head = bytes([22, 3, 1, 0x40, 0x00, 1]) + (20000).to_bytes(3, "big")
    assert ClientHelloReader().feed(head) is NOT_TLS
    # Records of one byte each: the headers alone pass the limit first.
    reader = ClientHelloReader()
    message = bytes([1]) + (3000).to_bytes(3, "big") + bytes(3000)
    framed = reframe(bytes([22, 3, 1, 0, 0]) + message, 1)
    result = None
    for i in range(0, len(framed), 600):
        result = reader.feed(framed[i : i + 600])
        if result is not None:
            break
    assert result is NOT_TLS and len(framed) > LIMIT


# -- fuzzing -----------------------------------------------------------------------------

HELLO = real_hello()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000), st.lists(st.integers(1, 64), max_size=30))
def test_random_bytes_never_raise_and_the_result_is_final(data, cuts):
    reader = ClientHelloReader()
    result, pos = None, 0
    for cut in [*cuts, len(data)]:
        result = reader.feed(data[pos : pos + cut])
        pos += cut
        if result is not None:
            assert reader.feed(b"more") is result
            break
    final = reader.eof()
    assert final is NOT_TLS or isinstance(final, Hello)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(HELLO) - 1), st.integers(0, 255)), max_size=6))
def test_a_mutated_hello_never_raises(mutations):
    data = bytearray(HELLO)
    for index, value in mutations:
        data[index] = value
    result = read(bytes(data))
    assert result is NOT_TLS or isinstance(result, Hello)
    if isinstance(result, Hello) and result.server_name is not None:
        name = result.server_name
        assert name == name.lower() and all(c.isalnum() or c in "-_." for c in name)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 400))
def test_any_chunking_and_framing_gives_the_same_answer(cuts, record_size):
    framed = reframe(HELLO, record_size)
    chunks, pos = [], 0
    for cut in cuts:
        chunks.append(framed[pos : pos + cut])
        pos += cut
    chunks.append(framed[pos:])
    assert read(*chunks) == Hello("api.example.com")


# -- the route table of a shared address (listener.Routes) -------------------------------


def test_routes_exact_then_one_label_wildcard_then_default():
    from lbproxy.core.pool import Pool
    from lbproxy.dataplane.listener import Routes
    from lbproxy.dataplane.virtual_server import VirtualServer
    from tests.factories import virtual_server

    def vs(name, sni):
        config = replace(virtual_server("rr", {"a": {}}), name=name, sni=sni)
        return VirtualServer(Pool(config, 0.0))

    api = vs("api", ("api.example.com",))
    wild = vs("wild", ("*.example.com",))
    deep = vs("deep", ("*.b.example.com",))
    default = vs("default", ())
    routes = Routes([api, wild, deep, default])
    assert routes.match("api.example.com") is api  # exact beats the wildcard
    assert routes.match("www.example.com") is wild
    assert routes.match("a.b.example.com") is deep  # the longest matching wildcard
    assert routes.match("x.y.example.com") is default  # one label only
    assert routes.match("example.com") is default
    assert routes.match(None) is default
    assert Routes([api, wild]).match("other.org") is None  # no default: no route
