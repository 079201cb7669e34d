"""Fuzz the DNS locator's query handler: any bytes in, an answer or nothing out, never a
crash (SPEC §10: "a malformed message -> FORMERR or dropped, never a crash")."""

from __future__ import annotations

import dns.edns
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
from hypothesis import given, settings
from hypothesis import strategies as st

from lbproxy.config.model import PersistenceConfig
from lbproxy.core.pool import Pool
from lbproxy.locator.dns_answers import QueryHandler
from tests.factories import virtual_server


def handler() -> QueryHandler:
    pools = {
        "db": Pool(virtual_server("least-load", {"a": {}, "b": {}}, load_source="report"), 0),
        "off": Pool(virtual_server("lc", {"x": {"state": "disabled"}}), 0),
    }
    return QueryHandler("lb.internal.", 0, pools.get)


HANDLER = handler()


def check(answer: bytes | None, query_id: int | None = None) -> dns.message.Message | None:
    if answer is None:
        return None
    message = dns.message.from_wire(answer)  # what we send, dnspython can read
    assert message.flags & dns.flags.QR
    if query_id is not None:
        assert message.id == query_id
    return message


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes(wire):
    check(HANDLER.handle(wire, 0.0))


VALID = [
    dns.message.make_query(name, rdtype, use_edns=edns).to_wire()
    for name in ("db.lb.internal.", "_db._tcp.lb.internal.", "a.db.lb.internal.", "x.y.z.")
    for rdtype in ("A", "AAAA", "SRV")
    for edns in (None, 0)
]


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(VALID),
    st.lists(st.tuples(st.integers(0, 600), st.integers(0, 255)), max_size=6),
    st.integers(0, 600),
)
def test_mutated_queries(wire, flips, cut):
    data = bytearray(wire)
    for position, value in flips:
        if position < len(data):
            data[position] = value
    check(HANDLER.handle(bytes(data[:cut] if cut < len(data) else data), 0.0))


LABEL = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=20)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(LABEL, min_size=0, max_size=4),
    st.sampled_from(["lb.internal.", "LB.Internal.", "example.com.", "."]),
    st.sampled_from(["A", "AAAA", "SRV", "TXT", "ANY", "MX"]),
    st.booleans(),
)
def test_well_formed_queries_get_one_of_the_spec_answers(labels, zone, rdtype, tcp):
    origin = dns.name.from_text(zone)
    name = dns.name.from_text(".".join(labels), origin=origin) if labels else origin
    query = dns.message.make_query(name, rdtype)
    answer = check(HANDLER.handle(query.to_wire(), 0.0, 65535 if tcp else 512), query.id)
    assert answer is not None
    in_zone = name.is_subdomain(dns.name.from_text("lb.internal."))
    expected = (
        {dns.rcode.NOERROR, dns.rcode.NXDOMAIN, dns.rcode.SERVFAIL}
        if in_zone
        else {dns.rcode.REFUSED}
    )
    assert answer.rcode() in expected
    for rrset in answer.answer:
        assert rrset.name == name


AFFINITY = QueryHandler(
    "lb.internal.",
    0,
    {
        "cache": Pool(virtual_server("maglev", {"a": {}, "b": {}}, table_size=101), 0),
        "sticky": Pool(
            virtual_server(
                "rr", {"a": {}, "b": {}}, persistence=PersistenceConfig(timeout=1, max_entries=4)
            ),
            0,
        ),
    }.get,
)
CLIENTS = st.one_of(
    st.tuples(st.ip_addresses(v=4).map(str), st.integers(0, 65535)),
    st.tuples(st.ip_addresses(v=6).map(str), st.integers(0, 65535), st.just(0), st.just(0)),
)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["cache", "sticky"]),
    st.sampled_from(["SRV", "A", "AAAA"]),
    CLIENTS,
    st.floats(0, 100),
)
def test_a_locate_from_any_source_address_is_answered(vs, rdtype, client, now):
    name = f"_{vs}._tcp.lb.internal." if rdtype == "SRV" else f"{vs}.lb.internal."
    query = dns.message.make_query(name, rdtype)
    message = check(AFFINITY.handle(query.to_wire(), now, 512, client), query.id)
    assert message.rcode() == dns.rcode.NOERROR


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["db.lb.internal.", "_db._tcp.lb.internal.", "a.db.lb.internal."]),
    st.sampled_from(["A", "SRV", "TXT"]),
    st.one_of(st.none(), st.integers(0, 65535)),
    st.lists(st.tuples(st.integers(0, 65535), st.binary(max_size=40)), max_size=4),
)
def test_edns_sizes_and_options_bound_a_udp_answer(name, rdtype, payload, options):
    """Any advertised EDNS size and options: a UDP answer within 512..1232 bytes of the
    client's size (512 without EDNS), TC=1 and no records when it does not fit."""
    query = dns.message.make_query(name, rdtype)
    if payload is not None:
        query.use_edns(
            0, 0, payload, options=[dns.edns.GenericOption(code, data) for code, data in options]
        )
    wire = HANDLER.handle(query.to_wire(), 0.0, 512)
    answer = check(wire, query.id)
    assert answer is not None
    limit = 512 if payload is None else min(max(payload, 512), 1232)
    assert len(wire) <= limit
    if answer.flags & dns.flags.TC:
        assert not answer.answer
