"""The DNS locator's answers: one query message in, one answer message (or nothing) out.

PURE: no trio, no sockets, no clock (`now` is passed in). Every message is parsed and
built by dnspython (`dns.message`, `dns.rrset`, the `dns.rdtypes` classes); the only
bytes read here by hand are the two of a query's id and its QR bit, to answer FORMERR
to a query dnspython could not parse. lbproxy/locator/dns_server.py serves this over UDP and TCP.

Names (SPEC §10), ZONE being `global.locator.dns.zone`, matched without case:

    VS.ZONE            A / AAAA   the located server's address (one record); each is a locate
    _VS._tcp.ZONE      SRV        0 0 PORT RS.VS.ZONE, its A/AAAA in the additional section
    RS.VS.ZONE         A / AAAA   that real server's address (the SRV target; not a locate)
    ZONE               -          NOERROR, no records

    other types at those names     NOERROR, no records (NODATA), nothing counted
    any other name in the zone     NXDOMAIN
    a name outside the zone        REFUSED (we are no recursive resolver)
    no available real server       SERVFAIL
    a message dnspython cannot parse, or not exactly one question
                                   FORMERR (when it looks like a query), else dropped
    a response, or shorter than a header
                                   dropped (never answer an answer: no loops)
    an opcode other than QUERY     NOTIMP; a class other than IN: REFUSED

Over UDP an answer fits the client's EDNS size (512 without EDNS, at most 1232); one
that does not is sent empty with TC=1 and is not counted as a locate (the client asks
again over TCP). The source ACL and the rate limit are decided before `handle`
(dns_rate_limit.py); `refuse` and `rate_limited` answer those queries without a pick.

A pick whose address is not of the asked family (an A query, an IPv6 server) answers
NODATA and is not counted; a real server configured by host name has no A/AAAA record
here, and its SRV target is that host name itself. A locate's pick is given the query's
source address as its client (maglev hashes it, persistence remembers the answer).
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Callable
from typing import Any

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
from dns.rdtypes.IN.A import A
from dns.rdtypes.IN.AAAA import AAAA
from dns.rdtypes.IN.SRV import SRV

from lbproxy.core.pool import Pool, RealServer

HEADER_SIZE = 12
UDP_PAYLOAD = 512  # a UDP answer's size without EDNS (RFC 1035)
# The largest UDP answer, whatever the client advertises: DNS Flag Day 2020's 1232,
# which fits an IPv6 minimum MTU without fragments. A `max_size` above it means a
# stream transport (TCP), where the answer is not bounded by the client's EDNS size.
MAX_UDP_PAYLOAD = 1232
DROPPED = "dropped"  # the rcode label of a message that got no answer
RATELIMITED = "ratelimited"  # dropped, or answered empty with TC=1, by the rate limit

_ADDRESS_TYPES = (dns.rdatatype.A, dns.rdatatype.AAAA)
_TCP_LABEL = b"_tcp"
_MAX_RECORDS = 4096  # cached record sets, at most


def _ignore(exc: Exception) -> None:
    pass


class QueryHandler:
    """Answers queries for the virtual servers `find` returns, in `zone`, with `ttl`.

    `find(label)` maps a virtual-server label (bytes, as asked) to its pool, or None.
    `rcodes` counts every query by the rcode answered (or "dropped").
    """

    def __init__(self, zone: str, ttl: int, find: Callable[[str], Pool | None]) -> None:
        self.zone = dns.name.from_text(zone)
        self._zone_labels = tuple(label.lower() for label in self.zone.labels)
        self.ttl = ttl
        self.find = find
        self.rcodes: Counter[str] = Counter()
        # Told of a bug that cost an answer (SERVFAIL): the barrier's count, set by the
        # server (lbproxy/net/barrier.py; not imported here, this module is pure).
        self.on_error: Callable[[Exception], None] = _ignore
        # The records of each (name as asked, type, server, address), built once by
        # dnspython and reused: an answer then costs a parse, a pick and a render.
        self._records: dict[
            tuple[object, ...], tuple[dns.rrset.RRset | None, dns.rrset.RRset | None]
        ] = {}
        self._indexes: dict[str, tuple[object, Pool, dict[str, RealServer]]] = {}
        self._located: tuple[Pool, RealServer] | None = None  # the answer to count

    def handle(
        self,
        wire: bytes,
        now: float,
        max_size: int = UDP_PAYLOAD,
        client: tuple[Any, ...] | None = None,
    ) -> bytes | None:
        """The answer to one query message, or None to drop it. Never raises.

        `client` is the query's source address: a locate's pick is given it, so that
        `maglev` and `persistence` answer the same asker with the same server."""
        try:
            query = dns.message.from_wire(wire)
        except Exception:  # dnspython raises many kinds on garbage: all mean "malformed"
            return self._unparsable(wire)
        if query.flags & dns.flags.QR:
            self.rcodes[DROPPED] += 1
            return None
        try:
            self._located = None
            response = self._respond(query, now, client)
            wire, fits = self._wire(response, _size_limit(query, max_size))
            if fits and self._located is not None:
                # Counted only once it is sent whole: a client given TC=1 asks again
                # over TCP, and that answer is the locate.
                pool, rs = self._located
                pool.locator.answer(rs, now, "dns", client)
            return wire
        except Exception as exc:  # a bug here must cost one answer, never the server
            self.on_error(exc)
            return self._error(query.id, dns.rcode.SERVFAIL)

    def refuse(self, wire: bytes, max_size: int = UDP_PAYLOAD) -> bytes | None:
        """REFUSED to a query from a source not allowed: no name is looked at, no pick."""
        query = self._query(wire)
        if query is None:
            return None
        response = dns.message.make_response(query, our_payload=MAX_UDP_PAYLOAD)
        response.set_rcode(dns.rcode.REFUSED)
        self.rcodes["REFUSED"] += 1
        return response.to_wire(max_size=_size_limit(query, max_size))

    def rate_limited(self, wire: bytes, slip: bool) -> bytes | None:
        """A query over the rate limit: nothing, or (`slip`) an empty answer with TC=1 so
        that a real client asks again over TCP; no pick either way."""
        self.rcodes[RATELIMITED] += 1
        if not slip:
            return None
        query = self._query(wire)
        if query is None:
            return None
        response = dns.message.make_response(query, our_payload=MAX_UDP_PAYLOAD)
        response.flags |= dns.flags.TC | dns.flags.AA
        return response.to_wire(max_size=_size_limit(query, UDP_PAYLOAD))

    @staticmethod
    def _query(wire: bytes) -> dns.message.Message | None:
        try:
            query = dns.message.from_wire(wire)
        except Exception:  # garbage: dropped
            return None
        return None if query.flags & dns.flags.QR else query

    # -- one query ------------------------------------------------------------------

    def _respond(
        self, query: dns.message.Message, now: float, client: tuple[Any, ...] | None = None
    ) -> dns.message.Message:
        response = dns.message.make_response(query, our_payload=MAX_UDP_PAYLOAD)
        response.flags |= dns.flags.AA
        if query.opcode() != dns.opcode.QUERY:
            return self._rcode(response, dns.rcode.NOTIMP)
        if len(query.question) != 1:
            return self._rcode(response, dns.rcode.FORMERR)
        question = query.question[0]
        name, rdtype = question.name, question.rdtype
        labels = self._in_zone(name)
        if question.rdclass != dns.rdataclass.IN or labels is None:
            return self._rcode(response, dns.rcode.REFUSED)
        if not labels:  # the zone itself
            return self._rcode(response, dns.rcode.NOERROR)
        if len(labels) == 1:  # VS.ZONE
            pool = self._pool(labels[0])
            if pool is None:
                return self._rcode(response, dns.rcode.NXDOMAIN)
            if rdtype in _ADDRESS_TYPES:
                rs = pool.pick(now, (), client)
                if rs is None:
                    return self._rcode(response, dns.rcode.SERVFAIL)
                record = self._records_of(name, rdtype, pool, rs)[0]
                if record is not None:
                    self._located = (pool, rs)
                    response.answer.append(record)
            return self._rcode(response, dns.rcode.NOERROR)
        if len(labels) == 2 and labels[1].lower() == _TCP_LABEL and labels[0][:1] == b"_":
            pool = self._pool(labels[0][1:])  # _VS._tcp.ZONE
            if pool is None:
                return self._rcode(response, dns.rcode.NXDOMAIN)
            if rdtype == dns.rdatatype.SRV:
                rs = pool.pick(now, (), client)
                if rs is None:
                    return self._rcode(response, dns.rcode.SERVFAIL)
                self._located = (pool, rs)
                srv, additional = self._records_of(name, rdtype, pool, rs)
                response.answer.append(srv)  # type: ignore[arg-type]  # SRV: always set (_srv)
                if additional is not None:
                    response.additional.append(additional)
            return self._rcode(response, dns.rcode.NOERROR)
        if len(labels) == 2:  # RS.VS.ZONE: the SRV target
            pool = self._pool(labels[1])
            rs = self._real_server(pool, labels[0]) if pool is not None else None
            if rs is None:
                return self._rcode(response, dns.rcode.NXDOMAIN)
            if rdtype in _ADDRESS_TYPES:
                record = self._records_of(name, rdtype, pool, rs)[0]  # type: ignore[arg-type]  # rs: pool too
                if record is not None:
                    response.answer.append(record)
            return self._rcode(response, dns.rcode.NOERROR)
        return self._rcode(response, dns.rcode.NXDOMAIN)

    def _in_zone(self, name: dns.name.Name) -> tuple[bytes, ...] | None:
        """The labels of `name` before the zone, or None when it is not in the zone."""
        labels, zone = name.labels, self._zone_labels
        if len(labels) < len(zone):
            return None
        tail = labels[len(labels) - len(zone) :]
        if tail != zone and tuple(label.lower() for label in tail) != zone:
            return None
        return labels[: len(labels) - len(zone)]

    def _records_of(
        self, name: dns.name.Name, rdtype: int, pool: Pool, rs: RealServer
    ) -> tuple[dns.rrset.RRset | None, dns.rrset.RRset | None]:
        """(answer, additional) for `rs` at `name`: A/AAAA, or SRV and its target's A/AAAA."""
        key = (name, rdtype, pool.name, rs.name, rs.address, self.ttl)
        records = self._records.get(key)
        if records is None:
            if rdtype == dns.rdatatype.SRV:
                records = self._srv(name, pool, rs)
            else:
                records = (self._address_rrset(name, rs, rdtype), None)
            if len(self._records) >= _MAX_RECORDS:  # many names asked in many cases
                self._records.clear()
            self._records[key] = records
        return records

    def _srv(
        self, name: dns.name.Name, pool: Pool, rs: RealServer
    ) -> tuple[dns.rrset.RRset, dns.rrset.RRset | None]:
        host = rs.address.host
        family = _family(host)
        if family is None:  # a host name: the client resolves it itself
            target = dns.name.from_text(host)
        else:
            target = dns.name.Name((rs.name.encode(), pool.name.encode(), *self.zone.labels))
        srv = SRV(dns.rdataclass.IN, dns.rdatatype.SRV, 0, 0, rs.address.port, target)
        additional = None if family is None else self._address_rrset(target, rs, family)
        return dns.rrset.from_rdata(name, self.ttl, srv), additional

    def _address_rrset(
        self, name: dns.name.Name, rs: RealServer, rdtype: int
    ) -> dns.rrset.RRset | None:
        host = rs.address.host
        if _family(host) != rdtype:
            return None
        if rdtype == dns.rdatatype.A:
            rdata: A | AAAA = A(
                dns.rdataclass.IN, rdtype, "127.0.0.1" if host == "localhost" else host
            )
        else:
            rdata = AAAA(dns.rdataclass.IN, rdtype, host)
        return dns.rrset.from_rdata(name, self.ttl, rdata)

    def _pool(self, label: bytes) -> Pool | None:
        try:
            return self.find(label.decode("ascii"))
        except UnicodeDecodeError:
            return None

    def _real_server(self, pool: Pool, label: bytes) -> RealServer | None:
        try:
            name = label.decode("ascii")
        except UnicodeDecodeError:
            return None
        rs = pool.by_name.get(name)
        if rs is None:  # DNS names have no case; ours do: an index by lower-case name
            rs = self._lower_index(pool).get(name.lower())
        return rs

    def _lower_index(self, pool: Pool) -> dict[str, RealServer]:
        """`pool`'s servers by lower-case name, rebuilt when its configuration changes
        (a reload or a discovery round gives the pool a new config object)."""
        cached = self._indexes.get(pool.name)
        if cached is None or cached[0] is not pool.config or cached[1] is not pool:
            index = {rs.name.lower(): rs for rs in pool.servers}
            cached = self._indexes[pool.name] = (pool.config, pool, index)
        return cached[2]

    # -- building and counting --------------------------------------------------------

    def _rcode(self, response: dns.message.Message, rcode: dns.rcode.Rcode) -> dns.message.Message:
        response.set_rcode(rcode)
        return response

    def _wire(self, response: dns.message.Message, max_size: int) -> tuple[bytes, bool]:
        """The answer's bytes, and False when it did not fit (then sent empty, TC=1)."""
        fits = True
        try:
            wire = response.to_wire(max_size=max_size)
        except dns.exception.TooBig:  # over UDP: set TC, the client asks again over TCP
            fits = False
            response.answer.clear()
            response.additional.clear()
            response.flags |= dns.flags.TC
            wire = response.to_wire(max_size=max_size)
        self.rcodes[dns.rcode.to_text(response.rcode())] += 1
        return wire, fits

    def _unparsable(self, wire: bytes) -> bytes | None:
        # Answer FORMERR only to what looks like a query (a whole header, QR clear).
        if len(wire) < HEADER_SIZE or wire[2] & 0x80:
            self.rcodes[DROPPED] += 1
            return None
        return self._error(int.from_bytes(wire[:2], "big"), dns.rcode.FORMERR)

    def _error(self, query_id: int, rcode: dns.rcode.Rcode) -> bytes:
        response = dns.message.Message(id=query_id)
        response.flags = dns.flags.QR
        response.set_rcode(rcode)
        self.rcodes[dns.rcode.to_text(rcode)] += 1
        return response.to_wire()


def _size_limit(query: dns.message.Message, max_size: int) -> int:
    """The largest answer to `query`: over TCP (`max_size` above MAX_UDP_PAYLOAD) the
    transport's; over UDP the size the client advertised with EDNS (512 without EDNS,
    never less than 512 nor more than MAX_UDP_PAYLOAD)."""
    if max_size > MAX_UDP_PAYLOAD:
        return max_size
    if query.edns < 0:
        return UDP_PAYLOAD
    return min(max(query.payload, UDP_PAYLOAD), MAX_UDP_PAYLOAD)


def _family(host: str) -> int | None:
    """A or AAAA for an IP literal (or localhost), None for a host name."""
    if host == "localhost":
        return dns.rdatatype.A
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return dns.rdatatype.A if ip.version == 4 else dns.rdatatype.AAAA
