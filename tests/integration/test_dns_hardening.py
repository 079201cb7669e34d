"""The DNS locator's defences through a real `lbproxy run` (SPEC §16, §21): the source
ACL (REFUSED over UDP, no pick; closed before a byte is read over TCP), the client's
EDNS size (TC=1 and a retry over TCP by real `dig`), response rate limiting per source
prefix under a bounded flood from many loopback sources, and the TCP clients' bounds:
per source prefix, idle and in all."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections import Counter

import dns.flags
import dns.message
import dns.query
import dns.rcode
import pytest

from tests import tools
from tests.integration.harness import ask_name, free_port, metrics, sample, wait_for

DIG = shutil.which("dig")


def need_dig() -> str:
    return tools.need("dig", "bind9-dnsutils")


def dig(port: int, *args: str) -> str:
    out = subprocess.run(
        [need_dig(), "@127.0.0.1", "-p", str(port), "+time=3", "+tries=1", *args],
        capture_output=True, text=True, timeout=15,
    )  # fmt: skip
    return out.stdout


def status_of(text: str) -> str:
    return text.split("status: ", 1)[1].split(",", 1)[0]


def flags_of(text: str) -> set[str]:
    return set(text.split(";; flags: ", 1)[1].split(";", 1)[0].split())


# A zone and a real server host name near DNS's 255-byte limit: the SRV answer (the
# host name is its target and cannot be compressed against the zone) is over 512 bytes.
LONG_ZONE = ".".join(["z" * 60, "y" * 60, "x" * 60, "w" * 50]) + ".lb."
LONG_HOST = ".".join(["h" * 62, "g" * 62, "f" * 62, "e" * 60])


def config(admin: int, dns_port: int, proxy: int, backend: int, dns_extra: str = "") -> str:
    return f"""
global:
  admin: {{listen: 127.0.0.1:{admin}}}
  drain_timeout: 1s
  locator:
    dns:
      listen: 127.0.0.1:{dns_port}
      zone: lb.internal.
{dns_extra}
virtual_servers:
  - name: db
    listen: 127.0.0.1:{proxy}
    scheduler: rr
    health_check: {{type: none}}
    persistence: {{timeout: 10m, max_entries: 1000}}
    real_servers:
      - {{name: a, address: 127.0.0.1:{backend}}}
"""


def answers_counted(admin: int) -> float:
    key = ("lbproxy_locator_answers_total",
           (("real_server", "a"), ("via", "dns"), ("virtual_server", "db")))  # fmt: skip
    return metrics(admin).get(key, 0)


def test_a_source_not_allowed_is_refused_and_moves_nothing(name_servers, lbproxy):
    (a,) = name_servers("a")
    admin, dns_port, proxy = free_port(), free_port(), free_port()
    lbproxy(config(admin, dns_port, proxy, a.port, "      allow: [10.0.0.0/8]"))
    assert status_of(dig(dns_port, "+notcp", "db.lb.internal", "A")) == "REFUSED"
    over_tcp = dig(dns_port, "+tcp", "_db._tcp.lb.internal", "SRV")
    assert "status:" not in over_tcp  # no answer: the connection was closed
    # closed at accept, before a byte is read: a client that sends nothing sees the end
    # at once (not after an idle timeout), and a query sent gets no answer
    with socket.create_connection(("127.0.0.1", dns_port), timeout=5) as client:
        started = time.monotonic()
        assert client.recv(10) == b""
        assert time.monotonic() - started < 1.0
    samples = metrics(admin)
    assert sample(samples, "lbproxy_dns_queries_total", rcode="REFUSED") == 1  # the UDP one
    assert answers_counted(admin) == 0  # no pick, no answer counted
    assert sample(samples, "lbproxy_persistence_entries", virtual_server="db") == 0


def test_an_answer_too_big_for_the_clients_size_is_truncated_and_dig_retries_over_tcp(
    name_servers, lbproxy
):
    (a,) = name_servers("a")
    admin, dns_port, proxy = free_port(), free_port(), free_port()
    text = config(admin, dns_port, proxy, a.port).replace(
        "zone: lb.internal.", f"zone: {LONG_ZONE}"
    )
    text = text.replace(f"address: 127.0.0.1:{a.port}", f"address: {LONG_HOST}:{a.port}")
    lbproxy(text)
    name = f"_db._tcp.{LONG_ZONE}"
    udp_only = dig(dns_port, "+bufsize=512", "+notcp", "+ignore", name, "SRV")
    assert "tc" in flags_of(udp_only) and "ANSWER: 0" in udp_only
    retried = dig(dns_port, "+bufsize=512", name, "SRV")
    assert "Truncated, retrying in TCP mode" in retried
    assert status_of(retried) == "NOERROR" and f"{LONG_HOST}." in retried
    fits = dig(dns_port, "+bufsize=1232", "+notcp", "+ignore", name, "SRV")  # dig's default
    assert "tc" not in flags_of(fits) and f"{LONG_HOST}." in fits
    plain = dig(dns_port, "+noedns", "+notcp", "+ignore", name, "SRV")  # 512 without EDNS
    assert "tc" in flags_of(plain)
    # only the answers sent whole are locates: the one dig got over TCP and `fits`
    assert answers_counted(admin) == 2


# serial: it holds a rate per second, and beside other tests the kernel drops queries
# before lbproxy reads them (10,687 counted of the 11,000 expected in a parallel CI run).
@pytest.mark.serial
def test_a_flood_from_many_sources_is_held_to_the_rate_per_prefix(name_servers, lbproxy):
    (a,) = name_servers("a")
    admin, dns_port, proxy = free_port(), free_port(), free_port()
    limit = 100
    lbproxy(config(admin, dns_port, proxy, a.port,
                   f"      rate_limit: {{responses_per_second: {limit}, slip: 2}}"))  # fmt: skip
    # 50 sources in 10 /24 prefixes (127.0.P.S), 400 queries each, in about 3 s
    sources = [f"127.0.{p}.{s}" for p in range(1, 11) for s in range(1, 6)]
    per_source, rounds = 400, 100
    socks = []
    for source in sources:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", dns_port))
        sock.setblocking(False)
        socks.append(sock)
    wire = dns.message.make_query("db.lb.internal.", "A").to_wire()
    answered: Counter[str] = Counter()
    truncated: Counter[str] = Counter()

    def drain() -> None:
        for source, sock in zip(sources, socks, strict=True):
            while True:
                try:
                    reply = dns.message.from_wire(sock.recv(4096))
                except BlockingIOError:
                    break
                prefix = source.rsplit(".", 1)[0]
                if reply.flags & dns.flags.TC:
                    assert not reply.answer
                    truncated[prefix] += 1
                elif reply.answer:
                    answered[prefix] += 1

    proxied: list[str] = []
    stop = threading.Event()

    def connect_through() -> None:  # proxied connections keep flowing during the flood
        while not stop.is_set() and len(proxied) < 200:
            proxied.append(ask_name(proxy))
            time.sleep(0.01)  # the connections' pace

    connector = threading.Thread(target=connect_through, daemon=True)
    connector.start()
    started = time.monotonic()
    try:
        for _ in range(rounds):  # bounded: 50 x 400 = 20,000 queries
            for _ in range(per_source // rounds):  # interleaved: no source sent last
                for sock in socks:
                    sock.send(wire)
            time.sleep(0.03)  # the flood's pace
            drain()
            assert time.monotonic() - started < 30
        time.sleep(0.5)  # on purpose: answers still on their way come in (no count to wait for)
        drain()
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        connector.join(10)
        for sock in socks:
            sock.close()
    # Windows are whole seconds of the server's clock: a run of `elapsed` seconds
    # touches at most ceil(elapsed) + 1 of them.
    windows = int(elapsed) + 2
    for prefix in {s.rsplit(".", 1)[0] for s in sources}:
        assert answered[prefix] <= limit * windows, (prefix, answered[prefix], elapsed)
        assert answered[prefix] >= limit * 0.5, (prefix, answered[prefix])  # not starved
        assert truncated[prefix] > 0  # every slip-th one over the limit: TC=1
    samples = metrics(admin)
    counted = answers_counted(admin)
    ratelimited = sample(samples, "lbproxy_dns_queries_total", rcode="ratelimited")
    # A locate only for what was answered: not one for a rate-limited query.
    assert counted <= limit * windows * 10
    assert counted >= sum(answered.values())
    assert ratelimited >= len(sources) * per_source - limit * windows * 10 - 2000  # lost UDP
    # Persistence: each locate looks the source up (and may evict another entry when
    # full); only answered queries did, so the churn is bounded by the rate.
    lookups = sum(
        value
        for (name, labels), value in samples.items()
        if name == "lbproxy_persistence_lookups_total" and ("virtual_server", "db") in labels
    )
    assert lookups == counted + len(proxied)  # the proxied connections' picks too
    entries = sample(samples, "lbproxy_persistence_entries", virtual_server="db")
    assert entries <= len(sources) + 1  # and 127.0.0.1, the proxied connections
    assert proxied and set(proxied) == {"a"}
    assert len(proxied) >= 20, len(proxied)


def connect_from(source: str, port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


def answered(sock: socket.socket) -> bool:
    """A query over an open TCP connection: answered with a record?"""
    wire = dns.message.make_query("db.lb.internal.", "A").to_wire()
    sock.sendall(len(wire).to_bytes(2, "big") + wire)
    size = sock.recv(2)
    if len(size) < 2:
        return False
    data = b""
    while len(data) < int.from_bytes(size, "big"):
        chunk = sock.recv(65535)
        if not chunk:
            return False
        data += chunk
    return bool(dns.message.from_wire(data).answer)


def test_tcp_clients_are_capped_per_source_prefix(name_servers, lbproxy):
    (a,) = name_servers("a")
    admin, dns_port, proxy = free_port(), free_port(), free_port()
    lbproxy(config(admin, dns_port, proxy, a.port, "      tcp_clients_per_source: 3"))
    held = []
    try:
        # three from one /24 (other addresses in it count with it)
        for source in ("127.0.0.1", "127.0.0.2", "127.0.0.3"):
            held.append(connect_from(source, dns_port))
            assert answered(held[-1])  # admitted, and counted before the next
        with connect_from("127.0.0.4", dns_port) as extra:  # the 4th of 127.0.0.0/24
            started = time.monotonic()
            assert extra.recv(10) == b""  # closed at once, not after an idle timeout
            assert time.monotonic() - started < 1.0
        with connect_from("127.0.1.2", dns_port) as other:  # another /24 is not
            assert answered(other)
    finally:
        for sock in held:
            sock.close()
    # their places are given back when they close
    wait_for(lambda: answered_once(dns_port, "127.0.0.9"), 5.0, "a place in 127.0.0.0/24")


def answered_once(port: int, source: str) -> bool:
    """A new connection's query answered? (False while the cap still closes it.)"""
    try:
        with connect_from(source, port) as sock:
            return answered(sock)
    except OSError:  # reset: closed at accept with the query unread
        return False


def test_a_tcp_client_is_closed_when_idle_and_after_its_lifetime(name_servers, lbproxy):
    (a,) = name_servers("a")
    admin, dns_port, proxy = free_port(), free_port(), free_port()
    limits = "      tcp_idle_timeout: 500ms\n      tcp_lifetime: 2s"
    lbproxy(config(admin, dns_port, proxy, a.port, limits))
    with socket.create_connection(("127.0.0.1", dns_port), timeout=10) as idle:
        started = time.monotonic()
        assert idle.recv(10) == b""  # nothing sent: closed after the idle timeout
        assert 0.3 < time.monotonic() - started < 1.8
    with socket.create_connection(("127.0.0.1", dns_port), timeout=10) as busy:
        started = time.monotonic()
        deadline = started + 10  # bounded: a query every 200 ms, never idle
        while time.monotonic() < deadline and answered(busy):
            time.sleep(0.2)  # the client's pace (less than the idle timeout), not a wait
        lived = time.monotonic() - started
        assert 1.8 < lived < 3.5, lived  # closed at its lifetime, busy as it was
