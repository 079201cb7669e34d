"""The body of POST .../real-servers (network input) under any bytes and any JSON: a
real server the configuration reader accepts, or a 400 with every problem; never another
exception. The same entry read again (state file, cluster, workers) gives the same server.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from lbproxy.admin.api import parse_server_entry
from lbproxy.admin.routes import HTTPError
from lbproxy.config.model import AgentCheckConfig, RealServerConfig, SnmpConfig, VirtualServerConfig
from lbproxy.config.reader import read_real_server
from lbproxy.config.tables import REAL_SERVER_FIELDS, REAL_SERVER_SECTIONS

VIRTUAL_SERVERS = [
    VirtualServerConfig("web", (), ()),
    VirtualServerConfig("web", (), (), snmp=SnmpConfig(), agent_check=AgentCheckConfig(port=1)),
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(["127.0.0.1:80", "[::1]:8080", "web-1", "drain", "10s"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)
keys = st.sampled_from([*REAL_SERVER_FIELDS, *REAL_SERVER_SECTIONS, "colour", ""])
bodies = st.dictionaries(keys | st.text(max_size=8), json_values, max_size=6)


def check(body: bytes) -> None:
    try:
        entry = parse_server_entry(body)
    except HTTPError as exc:
        assert exc.status == 400 and exc.message
        return
    for vs in VIRTUAL_SERVERS:
        read = read_real_server(entry, vs)
        if isinstance(read, list):
            assert read and all(isinstance(message, str) and message for message in read)
            continue
        assert isinstance(read, RealServerConfig)
        assert read.name == entry["name"] and read_real_server(entry, vs) == read


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=200))
def test_any_bytes(body):
    check(body)


@settings(max_examples=500, deadline=None)
@given(document=bodies | json_values)
def test_any_json_document(document):
    check(json.dumps(document).encode())


@settings(max_examples=200, deadline=None)
@given(
    name=st.from_regex(r"[a-z][a-z0-9._-]{0,20}", fullmatch=True),
    port=st.integers(1, 65535),
    weight=st.integers(0, 65535),
    max_connections=st.integers(0, 10**6),
    backup=st.booleans(),
)
def test_every_valid_entry_is_read_as_given(name, port, weight, max_connections, backup):
    entry = {
        "name": name,
        "address": f"127.0.0.1:{port}",
        "weight": weight,
        "max_connections": max_connections,
        "backup": backup,
    }
    read = read_real_server(parse_server_entry(json.dumps(entry).encode()), VIRTUAL_SERVERS[0])
    assert isinstance(read, RealServerConfig), read
    assert (read.name, read.address.port, read.weight) == (name, port, weight)
    assert (read.max_connections, read.backup) == (max_connections, backup)


def test_every_problem_is_reported():
    entry = {"name": "a b", "address": "x", "weight": -1, "colour": 1, "state": "on"}
    read = read_real_server(entry, VIRTUAL_SERVERS[0])
    assert isinstance(read, list) and len(read) == 5, read
