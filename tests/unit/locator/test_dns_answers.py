"""The DNS locator's answers, message by message (pure: no sockets)."""

from __future__ import annotations

import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rrset

from lbproxy.config.model import Address
from lbproxy.core.pool import Pool
from lbproxy.locator.dns_answers import QueryHandler
from tests.factories import virtual_server


def servers_with(hosts: dict[str, str]):
    """A handler for one rr virtual server `vs` (found without case, as DnsLocator does)."""
    pool = Pool(virtual_server("rr", {name: {} for name in hosts}), 0)
    for rs in pool.servers:
        rs.address = Address(hosts[rs.name], 8000 + rs.index)
    pools = {"vs": pool}
    return QueryHandler("lb.internal", 30, lambda label: pools.get(label.lower())), pool


def ask(handler, name, rdtype="A", **options):
    query = dns.message.make_query(name, rdtype, **options)
    return dns.message.from_wire(handler.handle(query.to_wire(), 0.0))


def test_a_aaaa_and_srv_answers():
    handler, pool = servers_with({"a": "10.0.0.1", "b": "2001:db8::2"})
    answer = ask(handler, "VS.lb.internal.", "A")  # rr: a first
    assert answer.rcode() == dns.rcode.NOERROR and answer.flags & dns.flags.AA
    assert answer.answer[0].to_text() == "VS.lb.internal. 30 IN A 10.0.0.1"
    # rr's next pick is b: an IPv6 server answers no A record, and is not counted
    assert ask(handler, "vs.lb.internal.", "A").answer == []
    assert pool.locator.answers["b", "dns"] == 0
    srv = ask(handler, "_vs._tcp.lb.internal.", "SRV")
    assert srv.answer[0].to_text() == "_vs._tcp.lb.internal. 30 IN SRV 0 0 8001 b.vs.lb.internal."
    assert srv.additional[0].to_text() == "b.vs.lb.internal. 30 IN AAAA 2001:db8::2"
    assert pool.locator.answers["b", "dns"] == 1
    target = ask(handler, "B.vs.lb.internal.", "AAAA")
    assert target.answer[0][0].address == "2001:db8::2"


def test_a_host_name_server_is_its_own_srv_target():
    handler, _ = servers_with({"a": "db1.example.net"})
    srv = ask(handler, "_VS._tcp.lb.internal.", "SRV")
    assert srv.answer[0][0].target.to_text() == "db1.example.net."
    assert srv.additional == []


def test_error_answers():
    handler, pool = servers_with({"a": "10.0.0.1"})
    assert ask(handler, "nope.lb.internal.").rcode() == dns.rcode.NXDOMAIN
    assert ask(handler, "a.b.c.lb.internal.").rcode() == dns.rcode.NXDOMAIN
    assert ask(handler, "lb.internal.", "SOA").rcode() == dns.rcode.NOERROR
    assert ask(handler, "example.org.").rcode() == dns.rcode.REFUSED
    assert ask(handler, "vs.lb.internal.", "A", rdclass="CH").rcode() == dns.rcode.REFUSED
    pool.set_state(pool.by_name["a"], "disabled", 0.0)
    assert ask(handler, "vs.lb.internal.").rcode() == dns.rcode.SERVFAIL
    assert ask(handler, "_vs._tcp.lb.internal.", "SRV").rcode() == dns.rcode.SERVFAIL
    # two questions: FORMERR; another opcode: NOTIMP; a response: dropped
    query = dns.message.make_query("vs.lb.internal.", "A")
    query.question.append(dns.rrset.RRset(query.question[0].name, 1, 28))
    assert dns.message.from_wire(handler.handle(query.to_wire(), 0.0)).rcode() == dns.rcode.FORMERR
    notify = dns.message.make_query("vs.lb.internal.", "A")
    notify.set_opcode(dns.opcode.NOTIFY)
    assert dns.message.from_wire(handler.handle(notify.to_wire(), 0.0)).rcode() == dns.rcode.NOTIMP
    response = dns.message.make_response(dns.message.make_query("vs.lb.internal.", "A"))
    assert handler.handle(response.to_wire(), 0.0) is None
    garbage = handler.handle(b"\xab\xcd\x01\x00" + b"\xff" * 20, 0.0)
    formerr = dns.message.from_wire(garbage)
    assert (formerr.id, formerr.rcode()) == (0xABCD, dns.rcode.FORMERR)
    assert handler.handle(b"\x01\x02", 0.0) is None
    assert handler.rcodes == {
        "NXDOMAIN": 2,
        "NOERROR": 1,
        "REFUSED": 2,
        "SERVFAIL": 2,
        "FORMERR": 2,
        "NOTIMP": 1,
        "dropped": 2,
    }
