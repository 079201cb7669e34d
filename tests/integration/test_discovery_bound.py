"""`discovery.dns.max_servers` and the bounded target lookups, against a real
authoritative responder on loopback built on dnspython.

The responder serves one SRV name with 2,000 records over 100 targets and no glue, so
every round must look targets up; it answers each A query after 50 ms on a thread of its
own and counts how many are in flight at once. (2,000 records are about what one DNS message
over TCP can hold: SRV targets are never compressed (RFC 2782), and 5,000 would pass
the 64 KiB a message may have.)
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter

import dns.flags
import dns.message
import dns.name
import dns.rdataclass
import dns.rdatatype
import dns.rrset
from dns.rdtypes.IN.A import A
from dns.rdtypes.IN.SRV import SRV

from tests.integration.harness import counted, free_port, servers_of, wait_for

SRV_NAME = "_web._tcp.svc.test."
RECORDS = [(i % 3, (i * 7) % 11, 10000 + i, f"t{i % 100}.svc.test.") for i in range(2000)]
LOOKUP_DELAY = 0.05


class Responder:
    """An authoritative server for SRV_NAME and the A records of its targets."""

    def __init__(self) -> None:
        self.port = free_port()
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", self.port))
        self.tcp = socket.create_server(("127.0.0.1", self.port))
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight = 0
        self.lookups: Counter[str] = Counter()
        self.stopped = False
        for loop in (self._udp_loop, self._tcp_loop):
            threading.Thread(target=loop, daemon=True).start()

    def answer(self, wire: bytes, tcp: bool) -> bytes:
        query = dns.message.from_wire(wire)
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        question = query.question[0]
        if question.name == dns.name.from_text(SRV_NAME) and question.rdtype == dns.rdatatype.SRV:
            if not tcp:
                response.flags |= dns.flags.TC  # too big: ask over TCP
                return response.to_wire()
            rrset = dns.rrset.RRset(question.name, dns.rdataclass.IN, dns.rdatatype.SRV)
            for priority, weight, port, target in RECORDS:
                rdata = SRV(dns.rdataclass.IN, dns.rdatatype.SRV, priority, weight, port,
                            dns.name.from_text(target))  # fmt: skip
                rrset.add(rdata, 30)
            response.answer.append(rrset)
            return response.to_wire(max_size=65535)
        if question.rdtype == dns.rdatatype.A:
            host = question.name.to_text()
            with self.lock:
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
                self.lookups[host] += 1
            time.sleep(LOOKUP_DELAY)  # on purpose: a slow answer, to count the lookups in flight
            with self.lock:
                self.in_flight -= 1
            number = int(host.split(".", 1)[0][1:])
            rdata = A(dns.rdataclass.IN, dns.rdatatype.A, f"127.0.{number}.1")
            response.answer.append(dns.rrset.from_rdata(question.name, 30, rdata))
        return response.to_wire()

    def _udp_loop(self) -> None:
        while not self.stopped:
            try:
                data, peer = self.udp.recvfrom(4096)
            except OSError:
                return

            def reply(data: bytes = data, peer: tuple = peer) -> None:
                with contextlib.suppress(OSError):
                    self.udp.sendto(self.answer(data, False), peer)

            threading.Thread(target=reply, daemon=True).start()

    def _tcp_loop(self) -> None:
        while not self.stopped:
            try:
                client, _ = self.tcp.accept()
            except OSError:
                return
            threading.Thread(target=self._tcp_client, args=(client,), daemon=True).start()

    def _tcp_client(self, client: socket.socket) -> None:
        with client:
            client.settimeout(5)
            try:
                size = int.from_bytes(client.recv(2), "big")
                data = b""
                while len(data) < size:
                    chunk = client.recv(size - len(data))
                    if not chunk:
                        return
                    data += chunk
                out = self.answer(data, True)
                client.sendall(len(out).to_bytes(2, "big") + out)
            except OSError:
                return

    def stop(self) -> None:
        self.stopped = True
        self.udp.close()
        self.tcp.close()


def expected_kept(max_servers: int) -> set[str]:
    ranked = sorted(
        RECORDS, key=lambda r: (r[0], -r[1], f"{r[3].rstrip('.')}:{r[2]}")
    )  # lowest priority, then highest weight, then name
    return {f"{target.rstrip('.')}:{port}" for _, _, port, target in ranked[:max_servers]}


def test_a_huge_srv_answer_is_bounded_looked_up_16_at_a_time_and_logged_once(lbproxy):
    responder = Responder()
    try:
        admin, port = free_port(), free_port()
        proxy = lbproxy(f"""
global:
  admin: {{listen: 127.0.0.1:{admin}}}
  drain_timeout: 1s
virtual_servers:
  - name: web
    listen: 127.0.0.1:{port}
    scheduler: wrr
    health_check: {{type: none}}
    discovery:
      dns:
        name: {SRV_NAME}
        resolvers: [127.0.0.1:{responder.port}]
        interval: 1s
        timeout: 5s
        allow_addresses: [127.0.0.0/8]
""")
        wanted = expected_kept(1000)

        def kept() -> bool:
            return set(servers_of(admin)) == wanted

        try:
            wait_for(kept, 20, "the 1,000 best servers")
        except AssertionError:
            raise AssertionError(
                f"{len(servers_of(admin))} servers\n{proxy.log()[-3000:]}"
            ) from None
        first_round = sum(responder.lookups.values())
        rounds = counted(admin, "lbproxy_discovery_resolutions_total")
        wait_for(  # two more rounds, with the same answer (a page of 1,000 servers: 5 a second)
            lambda: counted(admin, "lbproxy_discovery_resolutions_total") >= rounds + 2,
            20,
            "two more discovery rounds",
            interval=0.2,
        )
        servers = servers_of(admin)
        assert len(servers) == 1000 and set(servers) == wanted
        # each kept target looked up once per round, at most 16 at a time
        targets = {name.rsplit(":", 1)[0] + "." for name in wanted}
        assert first_round >= len(targets)
        assert set(responder.lookups) == targets
        rounds = max(responder.lookups.values())
        assert rounds >= 2 and all(n <= rounds for n in responder.lookups.values())
        assert 1 < responder.most_in_flight <= 16, responder.most_in_flight
        # the priority-0 ones are primaries, the others (kept) backups
        assert {rs["name"] for rs in servers.values() if rs.get("backup")} == {
            f"{t.rstrip('.')}:{p}" for pr, _, p, t in RECORDS if pr > 0
        } & wanted
        assert proxy.log().count("beyond max_servers 1000") == 1, proxy.log()
    finally:
        responder.stop()
