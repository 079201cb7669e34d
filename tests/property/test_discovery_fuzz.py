"""Hypothesis over what discovery reads from the network: SRV and address answers.

The records come from a DNS server lbproxy does not control, so their conversion must
never raise and must only ever produce servers lbproxy can use: a `HOST:PORT` name that
parses back, a port in 1..65535, a weight from the record, `backup` exactly for the
priorities above the lowest usable one, no name twice. The second half builds real
dnspython messages (any label bytes, any uint16 fields), sends them through the wire
format and back, and reads them the way the resolver's answer is read.
"""

from __future__ import annotations

import ipaddress

import dns.message
import dns.name
import dns.rdataclass
import dns.rdatatype
import dns.rdtypes.IN.A
import dns.rdtypes.IN.SRV
import dns.rrset
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lbproxy.config.values import parse_address
from lbproxy.control.discovery import glue, srv_records
from lbproxy.core.discovery_model import (
    SrvRecord,
    resolution,
    servers_from_addresses,
    servers_from_srv,
)

LABEL_TEXT = st.text(alphabet=st.sampled_from("abcXYZ019-_.\\ :[]@*é\x00"), min_size=0, max_size=20)
TARGETS = st.one_of(
    LABEL_TEXT,
    st.just("."),
    st.just(""),
    st.from_regex(r"[a-z0-9-]{1,12}(\.[a-z0-9-]{1,12}){0,3}\.?", fullmatch=True),
    st.just("a" * 64 + ".x."),
    st.just(("b" * 63 + ".") * 5),
)
ODD_INTS = st.one_of(st.integers(0, 65535), st.integers(-(2**70), 2**70), st.booleans())
RECORDS = st.builds(SrvRecord, ODD_INTS, ODD_INTS, ODD_INTS, TARGETS)
ADDRESSES = st.dictionaries(
    st.from_regex(r"[a-z0-9.-]{1,12}", fullmatch=True),
    st.one_of(st.ip_addresses().map(str), LABEL_TEXT),
    max_size=5,
)


def check_servers(servers, records: list[SrvRecord]) -> None:
    assert len({rs.name for rs in servers}) == len(servers)
    for rs in servers:
        host, _, port = rs.name.rpartition(":")
        assert parse_address(rs.name) is not None
        assert 1 <= int(port) <= 65535 and rs.address.port == int(port)
        assert 0 <= rs.weight <= 65535
        assert rs.discovered and rs.state == "enabled"
        # its record's weight, or 1 for a record of weight 0 whose priority has only those
        assert any(
            r.port == int(port)
            and rs.weight in (r.weight, 1 if r.weight == 0 else r.weight)
            and r.target.lower().rstrip(".") == host
            for r in records
        )
    if servers:
        primaries = [rs for rs in servers if not rs.backup]
        assert primaries, "there is always a primary"
        assert any(rs.weight for rs in primaries), "the primaries never all have weight 0"


@settings(max_examples=200, deadline=None)
@given(st.lists(RECORDS, max_size=12), ADDRESSES)
# Found by CI: a raw space in a target was stripped by parse_address into another name.
@example([SrvRecord(0, 0, 0, "."), SrvRecord(0, 0, 1, " _")], {})
def test_srv_conversion_never_raises_and_gives_usable_servers(records, addresses):
    servers, skipped = servers_from_srv(records, addresses)
    check_servers(servers, records)
    assert len(servers) + len(skipped) <= len(records)
    outcome = resolution(servers, skipped)
    assert outcome.result == ("ok" if servers else "empty")


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.one_of(st.ip_addresses().map(str), LABEL_TEXT), max_size=12),
    st.integers(1, 65535),
)
def test_address_conversion_never_raises(addresses, port):
    servers, skipped = servers_from_addresses(addresses, port)
    assert len({rs.name for rs in servers}) == len(servers)
    for rs in servers:
        assert parse_address(rs.name) == rs.address
        assert ipaddress.ip_address(rs.address.host)
    assert len(servers) + len(skipped) <= len(addresses)


# -- through real dnspython objects and the wire format -----------------------------------

LABELS = st.lists(
    st.one_of(
        st.binary(min_size=1, max_size=63),  # any bytes: escaped by dnspython, skipped by us
        st.from_regex(rb"[A-Za-z0-9_-]{1,12}", fullmatch=True),  # host-name labels
    ),
    min_size=0,
    max_size=4,
)
UINT16 = st.integers(0, 65535)


def name_of(labels: list[bytes]) -> dns.name.Name:
    return dns.name.Name([*labels, b""])


@st.composite
def srv_messages(draw):
    qname = dns.name.from_text("_web._tcp.service.consul.")
    message = dns.message.make_response(dns.message.make_query(qname, "SRV"))
    answer = dns.rrset.RRset(qname, dns.rdataclass.IN, dns.rdatatype.SRV)
    targets = []
    for _ in range(draw(st.integers(0, 8))):
        labels = draw(LABELS)
        if sum(len(label) + 1 for label in labels) > 250:
            labels = labels[:2]
        target = name_of(labels)
        targets.append(target)
        answer.add(
            dns.rdtypes.IN.SRV.SRV(
                dns.rdataclass.IN,
                dns.rdatatype.SRV,
                draw(UINT16),
                draw(UINT16),
                draw(UINT16),
                target,
            )
        )
    if answer:  # dnspython writes an empty RRset as a record without data
        message.answer.append(answer)
    for target in targets[: draw(st.integers(0, len(targets)))]:
        glue_set = dns.rrset.RRset(target, dns.rdataclass.IN, dns.rdatatype.A)
        glue_set.add(
            dns.rdtypes.IN.A.A(dns.rdataclass.IN, dns.rdatatype.A, str(draw(st.ip_addresses(v=4))))
        )
        message.additional.append(glue_set)
    return message


@settings(max_examples=150, deadline=None)
@given(srv_messages())
def test_answers_read_through_the_wire_give_usable_servers(message):
    received = dns.message.from_wire(message.to_wire())
    rrset = received.answer[0] if received.answer else []
    records = srv_records(rrset)
    addresses = glue(received.additional)
    for ip in addresses.values():
        assert ipaddress.ip_address(ip)
    servers, _ = servers_from_srv(records, addresses)
    check_servers(servers, records)
    for rs in servers:
        host = rs.name.rpartition(":")[0]
        if host in addresses:
            assert rs.address.host == addresses[host]


@given(
    st.ip_addresses().map(str) | st.text(max_size=30),
    st.integers(1, 65535),
    st.lists(st.ip_addresses(), max_size=4),
    st.lists(st.integers(1, 65535), max_size=3),
    st.booleans(),
)
@example("::ffff:127.0.0.1", 9100, [ipaddress.ip_address("127.0.0.1")], [], False)
@example("localhost", 80, [], [80], True)
def test_the_address_policy_answers_for_any_address(host, port, own, wildcard, local):
    """Any address an answer can bring gets a verdict; none raises. An address of a
    listener is refused whatever `allow_addresses` says."""
    from lbproxy.config.model import Address
    from lbproxy.core.discovery_model import REFUSALS, AddressPolicy

    everything = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))
    listeners = frozenset((ip, port) for ip in own)
    policy = AddressPolicy(everything, listeners, frozenset(wildcard))
    verdict = policy.refusal(Address(host, port), lambda ip: local)
    assert verdict is None or verdict in REFUSALS
    if listeners and not (own[0].version == 6 and own[0].ipv4_mapped):
        assert verdict == "self" or host != str(own[0])
