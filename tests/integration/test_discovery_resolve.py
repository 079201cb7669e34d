"""One discovery round in process (lbproxy.control.discovery.resolve) against a real dnsmasq:
dnspython's asynchronous resolver on trio, each result class, and the round's bound."""

from __future__ import annotations

import ipaddress
import socket
import threading
from dataclasses import replace

import dns.asyncbackend
import dns.message
import dns.rcode
import pytest
import trio

from lbproxy.config.model import Address, Config, DnsDiscoveryConfig
from lbproxy.control.discovery import resolve, resolve_all
from lbproxy.core.discovery_model import Resolution
from tests.factories import virtual_server
from tests.integration.dnsmasq import Dnsmasq, requires_dnsmasq

pytestmark = [pytest.mark.integration, requires_dnsmasq]


@pytest.fixture(scope="module")
def dns_server(tmp_path_factory):
    server = Dnsmasq(tmp_path_factory.mktemp("dns")).start(
        srv={
            "_web._tcp.svc.test": [
                (0, 2, 8081, "a.node.test"),
                (0, 0, 8082, "b.node.test"),
                (3, 1, 8083, "c.node.test"),
            ],
            "_none._tcp.svc.test": [(0, 0, 0, ".")],  # RFC 2782: decidedly not available
        },
        hosts={
            "a.node.test": ["127.0.0.1"],
            "c.node.test": ["::1"],
            "web.k8s.test": ["127.0.0.3", "127.0.0.2", "::1"],
            "v4only.k8s.test": ["127.0.0.9"],
        },
    )
    yield server
    server.stop()


LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


def dns_config(server: Dnsmasq, name: str, record_type: str = "SRV", **options):
    port = options.pop("port", None if record_type == "SRV" else 80)
    resolvers = options.pop("resolvers", (Address("127.0.0.1", server.port),))
    options.setdefault("allow_addresses", LOOPBACK)  # the test's servers are on loopback
    return DnsDiscoveryConfig(
        name=name, type=record_type, port=port, resolvers=resolvers, timeout=1.0, **options
    )


def run(config: DnsDiscoveryConfig) -> Resolution:
    async def main() -> Resolution:
        # dnspython picks its trio backend through sniffio: nothing to configure.
        assert type(dns.asyncbackend.get_default_backend()).__module__ == "dns._trio_backend"
        return await resolve(config)

    return trio.run(main)


def test_srv_answer_with_and_without_addresses_in_it(dns_server):
    outcome = run(dns_config(dns_server, "_web._tcp.svc.test"))
    assert outcome.result == "ok"
    assert [(rs.name, str(rs.address), rs.weight, rs.backup) for rs in outcome.servers] == [
        ("a.node.test:8081", "127.0.0.1:8081", 2, False),
        ("b.node.test:8082", "b.node.test:8082", 0, False),  # no address anywhere
        ("c.node.test:8083", "[::1]:8083", 1, True),  # looked up: AAAA only
    ]


def test_a_and_aaaa_answers(dns_server):
    a = run(dns_config(dns_server, "web.k8s.test", "A", port=8080))
    assert [rs.name for rs in a.servers] == ["127.0.0.2:8080", "127.0.0.3:8080"]
    aaaa = run(dns_config(dns_server, "web.k8s.test.", "AAAA", port=8080))
    assert [(rs.name, rs.address) for rs in aaaa.servers] == [("[::1]:8080", Address("::1", 8080))]


@pytest.mark.parametrize(
    ("name", "record_type", "result"),
    [
        ("nothing.k8s.test", "A", "nxdomain"),
        ("v4only.k8s.test", "AAAA", "empty"),  # the name exists, without that type
        ("_none._tcp.svc.test", "SRV", "empty"),  # only the "." target
        ("example.com", "A", "error"),  # REFUSED: dnsmasq has no upstream for it
    ],
)
def test_result_classes(dns_server, name, record_type, result):
    assert run(dns_config(dns_server, name, record_type)).result == result


def silent_port() -> tuple[socket.socket, int]:
    """A bound UDP socket nobody reads: queries to it go unanswered."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    return sock, sock.getsockname()[1]


def test_a_silent_resolver_is_an_error_within_the_round_timeout(dns_server):
    sock, port = silent_port()
    with sock:
        config = dns_config(
            dns_server, "web.k8s.test", "A", resolvers=(Address("127.0.0.1", port),)
        )

        async def main() -> tuple[Resolution, float]:
            start = trio.current_time()
            outcome = await resolve(config)
            return outcome, trio.current_time() - start

        outcome, elapsed = trio.run(main)
    assert outcome.result == "error"
    assert elapsed < config.timeout + 0.5  # bounded: the round gives up, it does not hang


def test_a_silent_first_resolver_leaves_time_for_the_second(dns_server):
    sock, port = silent_port()
    with sock:
        resolvers = (Address("127.0.0.1", port), Address("127.0.0.1", dns_server.port))
        outcome = run(dns_config(dns_server, "web.k8s.test", "A", resolvers=resolvers))
    assert outcome.result == "ok" and len(outcome.servers) == 2


def test_check_resolve_asks_every_virtual_server_at_once(dns_server):
    sock, port = silent_port()
    with sock:
        silent = dns_config(
            dns_server, "web.k8s.test", "A", resolvers=(Address("127.0.0.1", port),)
        )
        good = dns_config(dns_server, "_web._tcp.svc.test")
        vs = virtual_server("wlc", {})
        servers = [
            replace(vs, name="slow1", discovery=silent),
            replace(vs, name="slow2", discovery=silent),
            replace(vs, name="fast", discovery=good),
            vs,  # no discovery: not asked
        ]

        async def main():
            start = trio.current_time()
            found = await resolve_all(Config(virtual_servers=tuple(servers)))
            return found, trio.current_time() - start

        found, elapsed = trio.run(main)
    assert [(vs.name, outcome.result) for vs, outcome in found] == [
        ("slow1", "error"),
        ("slow2", "error"),
        ("fast", "ok"),
    ]
    assert elapsed < 1.8 * silent.timeout  # together: one after the other takes 2 timeouts


def test_servfail_is_an_error(dns_server):
    """dnsmasq cannot be told to answer SERVFAIL; a loopback responder built with
    dnspython answers every query with it, and the real resolver reads it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.1)
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            try:
                wire, peer = sock.recvfrom(4096)
            except TimeoutError:
                continue
            response = dns.message.make_response(dns.message.from_wire(wire))
            response.set_rcode(dns.rcode.SERVFAIL)
            sock.sendto(response.to_wire(), peer)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        resolvers = (Address("127.0.0.1", sock.getsockname()[1]),)
        outcome = run(dns_config(dns_server, "web.k8s.test", "A", resolvers=resolvers))
    finally:
        stop.set()
        thread.join(2)
        sock.close()
    assert outcome.result == "error"
    assert "SERVFAIL" in outcome.detail


def test_the_kernel_says_which_addresses_are_this_hosts():
    """A wildcard listener is every address of this host on its port: `is_local` asks
    the kernel (a bind succeeds only on an address of this host)."""
    from lbproxy.control.discovery import is_local

    assert is_local(ipaddress.ip_address("127.0.0.1"))
    assert is_local(ipaddress.ip_address("127.3.2.1"))  # all of 127/8 is this host's
    assert not is_local(ipaddress.ip_address("192.0.2.1"))  # TEST-NET-1: nobody's


def test_an_answer_naming_a_wildcard_listener_through_loopback_is_refused(dns_server):
    from lbproxy.config.model import GlobalConfig
    from lbproxy.config.values import parse_address

    vs = replace(virtual_server("rr", {}), name="web", listen=(parse_address("0.0.0.0:80"),),
                 discovery=dns_config(dns_server, "web.k8s.test", "A"))  # fmt: skip
    config = Config(GlobalConfig(), (vs,))
    ((_, outcome),) = trio.run(resolve_all, config)
    # web.k8s.test's A records, 127.0.0.2 and 127.0.0.3, port 80: the wildcard listener
    assert outcome.servers == ()
    assert sorted(outcome.refused) == [("127.0.0.2:80", "self"), ("127.0.0.3:80", "self")]
