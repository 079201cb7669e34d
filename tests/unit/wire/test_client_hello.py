"""The ClientHello reader (lbproxy/wire/client_hello.py): real hellos made by Python's ssl,
cut and re-framed every way, and fuzzed with hypothesis."""

from __future__ import annotations

import socket
import subprocess
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbproxy.wire.client_hello import LIMIT, NOT_TLS, ClientHelloReader, Hello, parse_hello_body
from tests import tools
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


def test_a_real_hello_gives_its_alpn_protocols_in_the_clients_order():
    hello = real_hello("example.com", ["acme-tls/1"])
    assert read(hello) == Hello("example.com", (b"acme-tls/1",))
    hello = real_hello("example.com", ["h2", "http/1.1"])
    assert read(hello) == Hello("example.com", (b"h2", b"http/1.1"))
    assert read(real_hello(None, ["xmpp-client"])) == Hello(None, (b"xmpp-client",))
    assert read(real_hello("example.com")).alpn == ()  # no extension: no protocols
    # a long name (RFC 7301 allows 255 bytes), and any bytes, compared exactly
    assert read(real_hello(None, ["x" * 255, "H2"])).alpn == (b"x" * 255, b"H2")


def openssl_hello(*options: str) -> bytes:
    """The first flight of `openssl s_client` with these options, caught on loopback."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        command = ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", *options]
        proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            server.settimeout(10)
            conn, _ = server.accept()
            with conn:
                conn.settimeout(10)
                reader, data = ClientHelloReader(), b""
                while reader.result is None:
                    chunk = conn.recv(65536)
                    assert chunk, "s_client closed before its hello"
                    data += chunk
                    reader.feed(chunk)
                return data
        finally:
            proc.kill()
            proc.communicate(timeout=10)


@tools.requires("openssl", package="openssl")
def test_openssl_s_client_hellos_with_alpn():
    hello = openssl_hello("-alpn", "acme-tls/1", "-servername", "example.com")
    assert read(hello) == Hello("example.com", (b"acme-tls/1",))
    hello = openssl_hello("-alpn", "h2,http/1.1", "-servername", "www.example.com")
    assert read(hello) == Hello("www.example.com", (b"h2", b"http/1.1"))
    assert read(openssl_hello("-servername", "example.com")) == Hello("example.com")


def alpn_extension(list_bytes: bytes, list_length: int | None = None) -> bytes:
    """An ALPN extension (type 16) around these list bytes, its list length given or true."""
    length = len(list_bytes) if list_length is None else list_length
    data = length.to_bytes(2, "big") + list_bytes
    return (16).to_bytes(2, "big") + len(data).to_bytes(2, "big") + data


def body_with(*extensions: bytes) -> bytes:
    """A minimal ClientHello body with these extensions."""
    fields = bytes([3, 3]) + bytes(32) + b"\x00" + b"\x00\x02\x13\x01" + b"\x01\x00"
    joined = b"".join(extensions)
    return fields + len(joined).to_bytes(2, "big") + joined


def test_malformed_alpn_is_not_tls_as_a_malformed_server_name_is():
    good = alpn_extension(b"\x02h2\x08http/1.1")
    assert parse_hello_body(body_with(good)) == Hello(None, (b"h2", b"http/1.1"))
    for bad in (
        alpn_extension(b""),  # an empty list
        alpn_extension(b"\x00"),  # an empty name
        alpn_extension(b"\x02h2\x00"),  # an empty name after a good one
        alpn_extension(b"\x03h2"),  # a name longer than the list
        alpn_extension(b"\x02h2", list_length=4),  # the list longer than the extension
        alpn_extension(b"\x02h2", list_length=2),  # shorter
        (16).to_bytes(2, "big") + b"\x00\x01\x00",  # no room for the list length
        good + good,  # two ALPN extensions
    ):
        assert parse_hello_body(body_with(bad)) is NOT_TLS, bad
    # in a real hello too: the list length of Python's own extension made wrong
    hello = bytearray(real_hello("example.com", ["h2"]))
    at = bytes(hello).index(b"\x00\x10\x00\x05\x00\x03\x02h2")
    hello[at + 5] = 4
    assert read(bytes(hello)) is NOT_TLS


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
ALPN_HELLO = real_hello("example.com", ["acme-tls/1", "h2", "http/1.1"])


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


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(ALPN_HELLO) - 1), st.integers(0, 255)), max_size=6))
def test_a_mutated_hello_with_alpn_never_raises_and_its_names_are_sound(mutations):
    data = bytearray(ALPN_HELLO)
    for index, value in mutations:
        data[index] = value
    result = read(bytes(data))
    assert result is NOT_TLS or isinstance(result, Hello)
    if isinstance(result, Hello):
        assert all(isinstance(p, bytes) and 1 <= len(p) <= 255 for p in result.alpn)
    if not mutations:
        assert result == Hello("example.com", (b"acme-tls/1", b"h2", b"http/1.1"))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=300), max_size=8), st.integers(-2, 2))
def test_any_alpn_list_is_read_exactly_or_refused(names, skew):
    """Hand-built lists: names of 1..255 bytes with true lengths read back exactly;
    any empty or too long name, or a list length off by `skew`, is NOT_TLS."""
    encoded = b"".join(bytes([len(n) % 256]) + n for n in names)
    result = parse_hello_body(body_with(alpn_extension(encoded, max(0, len(encoded) + skew))))
    if names and skew == 0 and all(1 <= len(n) <= 255 for n in names):
        assert result == Hello(None, tuple(names))
    elif skew != 0 or not names or any(len(n) == 0 for n in names):
        assert result is NOT_TLS
    else:
        # a name of 256+ bytes: its length byte is wrong, so the framing is read as
        # other names or refused, never beyond the extension
        assert result is NOT_TLS or all(1 <= len(p) <= 255 for p in result.alpn)


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
    framed = reframe(ALPN_HELLO, record_size)
    chunks = [framed[i : i + cuts[0]] for i in range(0, len(framed), cuts[0])]
    assert read(*chunks) == Hello("example.com", (b"acme-tls/1", b"h2", b"http/1.1"))


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


def test_routes_by_alpn_within_each_tier_then_the_next_tier():
    from lbproxy.core.pool import Pool
    from lbproxy.dataplane.listener import Routes
    from lbproxy.dataplane.virtual_server import VirtualServer
    from tests.factories import virtual_server

    def vs(name, sni, alpn=()):
        config = replace(virtual_server("rr", {"a": {}}), name=name, sni=sni, alpn=alpn)
        return VirtualServer(Pool(config, 0.0))

    certs = vs("certs", ("example.com",), ("acme-tls/1",))
    web = vs("web", ("example.com",))
    h2 = vs("h2", ("*.example.com",), ("h2",))
    only_alpn = vs("only-alpn", ("alpn.example.com",), ("xmpp-client",))
    xmpp = vs("xmpp", (), ("xmpp-client", "xmpp-server"))
    default = vs("default", ())
    routes = Routes([certs, web, h2, only_alpn, xmpp, default])
    match = routes.match
    assert match("example.com", (b"acme-tls/1",)) is certs  # the ACME challenge
    assert match("example.com", (b"h2", b"http/1.1")) is web  # the same name, no alpn
    assert match("example.com") is web  # no ALPN offered
    assert match("example.com", (b"ACME-TLS/1",)) is web  # exact, case-sensitive
    assert match("a.example.com", (b"http/1.1", b"h2")) is h2  # any offered protocol
    assert match("a.example.com", (b"http/1.1",)) is default  # wildcard tier: none fits
    assert match("alpn.example.com", (b"xmpp-client",)) is only_alpn
    # a name tier with only alpn routes passes to the next tiers when none fits
    assert match("alpn.example.com", (b"h2",)) is h2
    assert match("alpn.example.com", (b"xmpp-server",)) is xmpp
    assert match("other.org", (b"xmpp-server",)) is xmpp  # without sni: alpn first
    assert match(None, (b"xmpp-client",)) is xmpp
    assert match(None) is default and match("other.org", (b"h2",)) is default
    # the client's order of preference decides between two alpn routes of a tier
    a, b = vs("a", (), ("a",)), vs("b", (), ("b",))
    assert Routes([a, b]).match(None, (b"b", b"a")) is b
    assert Routes([a, b]).match(None, (b"c",)) is None  # no default: no route
