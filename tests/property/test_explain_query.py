"""Hypothesis over the explain route's query (`?client=IP[&port=N]`, SPEC §24): any bytes
give either a client address the socket layer could report, or a 400 with a message —
never another exception."""

from __future__ import annotations

import ipaddress
import urllib.parse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbproxy.admin.api import MAX_EXPLAIN_QUERY, parse_explain_client
from lbproxy.admin.routes import HTTPError


def outcome(query: bytes):
    try:
        return parse_explain_client(query)
    except HTTPError as exc:
        assert exc.status == 400 and exc.message
        assert len(exc.message) < 200  # a hostile value is not echoed at length
        return None


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400))
def test_any_bytes_give_an_address_or_a_400(query):
    parsed = outcome(query)
    if parsed is not None:
        host, port = parsed
        assert str(ipaddress.ip_address(host)) == host and "%" not in host
        assert 0 <= port <= 65535


@settings(max_examples=300, deadline=None)
@given(st.ip_addresses(), st.integers(0, 65535))
def test_every_address_is_read_back_as_the_socket_names_it(address, port):
    query = urllib.parse.urlencode({"client": address.exploded, "port": port}).encode()
    assert parse_explain_client(query) == (str(address), port)


@settings(max_examples=200, deadline=None)
@given(
    st.text(st.characters(codec="ascii"), max_size=80).map(
        lambda text: urllib.parse.urlencode({"client": text}).encode()
    )
)
def test_any_text_as_client_gives_an_address_or_a_400(query):
    outcome(query)


@pytest.mark.parametrize(
    "query",
    [b"client=fe80::1%25eth0", b"client=" + b"1" * MAX_EXPLAIN_QUERY, b"", b"client=", b"&&"],
)
def test_zones_huge_and_missing_clients_are_400(query):
    with pytest.raises(HTTPError) as raised:
        parse_explain_client(query)
    assert raised.value.status == 400
