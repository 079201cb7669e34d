"""The asking client's address that the supervisor of `workers: N` passes to a worker
(admin.CLIENT_HEADER): any bytes give an address or None, never an exception."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lbproxy.admin.api import parse_client_header


@given(st.binary(max_size=200))
def test_any_header_value_is_an_address_or_none(value):
    parsed = parse_client_header(value)
    if not value:
        assert parsed is None
    else:
        host, port = parsed
        assert isinstance(host, str) and isinstance(port, int) and port >= 0


@given(
    st.text(st.characters(codec="latin-1", exclude_characters=" "), min_size=1, max_size=60),
    st.integers(0, 65535),
)
def test_what_the_supervisor_writes_is_read_back(host, port):
    assert parse_client_header(f"{host} {port}".encode("latin-1")) == (host, port)
