"""The data path's edge (SPEC §21): what is decided about a client before a byte of it is
read, through real `lbproxy run` processes and loopback sockets.

- `accept_proxy_from`: a PROXY header is believed only from the listed peers; any other
  peer is closed unread and counted `reason="proxy_untrusted"`.
- `allow`/`deny` before any pre-read: on an SNI address a client that every route
  refuses is closed at once, not after waiting out the ClientHello's `connect_timeout`.
- A PROXY v2 header that arrives a byte per segment is served.
- `global.max_clients` under a lowered RLIMIT_NOFILE: more clients than descriptors,
  and the admin endpoint answers, health checks go on, serving resumes.

Clients that must come from another address bind to another loopback address
(127.0.0.2, ...): all of 127.0.0.0/8 is local on Linux.
"""

from __future__ import annotations

import socket
import struct

import pytest

from lbproxy.wire.proxy_protocol import V2_SIGNATURE, encode_v1
from tests.factories import real_hello
from tests.integration.harness import (
    NameServer,
    ask_name,
    free_port,
    http,
    metrics,
    read_name,
    sample,
    sni_config,
    vs_config,
    wait_for,
    with_admin,
)

REJECTED = "lbproxy_rejected_connections_total"


def rejected(admin: int, reason: str, vs: str = "web") -> float:
    return sample(metrics(admin), REJECTED, virtual_server=vs, reason=reason)


def connect_from(source: str, port: int, timeout: float = 10.0) -> socket.socket:
    """A client connected from the loopback address `source`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return sock


def closed_unread(sock: socket.socket) -> bool:
    """The proxy closed this client (FIN or RST) without sending it a byte. The client
    itself sent nothing: a close that comes within the socket's timeout, while the
    proxy's own deadline for a first read (connect_timeout) is far longer, was decided
    before any byte could be read."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def first_line(sock: socket.socket) -> str:
    """The real server's name line, however much of the echo of what the client sent
    came behind it in the same reads; "" when the connection closes first."""
    data = b""
    while b"\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return ""
        data += chunk
    return data.split(b"\n", 1)[0].decode()


def v2_header(source: tuple[str, int], destination: tuple[str, int], tlv_bytes: int) -> bytes:
    """A PROXY v2 TCP4 header with `tlv_bytes` of TLVs (type 0xE0, custom) after the
    addresses, as an upstream balancer adding its own data sends it."""
    tlv_value = bytes(range(256)) * (tlv_bytes // 256 + 1)
    tlv_value = tlv_value[: tlv_bytes - 3]
    tlv = struct.pack("!BH", 0xE0, len(tlv_value)) + tlv_value
    block = struct.pack(
        "!4s4sHH",
        socket.inet_aton(source[0]),
        socket.inet_aton(destination[0]),
        source[1],
        destination[1],
    )
    body = block + tlv
    return V2_SIGNATURE + bytes([0x21, 0x11]) + struct.pack("!H", len(body)) + body


# -- accept_proxy_from ----------------------------------------------------------------


@pytest.mark.parametrize("layout", ["alone", "sni"])
def test_a_proxy_header_is_believed_only_from_accept_proxy_from(name_servers, lbproxy, layout):
    """A peer outside `accept_proxy_from` is closed before its header is read (it sent
    nothing, and `connect_timeout` is a minute) and one naming a source the ACL lets in
    is not served either: counted `proxy_untrusted`, never `acl`, and the real server
    never hears of them. From the listed peer (127.0.0.2) the same header is believed:
    the ACL, which admits only 10.9.9.0/24, lets it through."""
    server, other = name_servers("a", "other")
    port, admin = free_port(), free_port()
    trust = "accept_proxy: true\naccept_proxy_from: [127.0.0.2/32]\nconnect_timeout: 60s\n"
    acl = "allow: [10.9.9.0/24]\n"
    if layout == "alone":
        config = vs_config(port, [server], extra=trust + acl + "health_check: {type: none}")
        config = with_admin(config, admin)
    else:  # an SNI address: the listener reads the header before the ClientHello
        groups = [("web", ["api.example.com"], [server]), ("other", None, [other])]
        config = sni_config(port, groups, admin, trust + acl)
    lbproxy(config)
    header = encode_v1(("10.9.9.9", 4000), ("127.0.0.1", port))
    # From 127.0.0.1, not listed: closed with nothing sent ...
    with connect_from("127.0.0.1", port) as silent:
        assert closed_unread(silent)
    # ... and with a header that names an allowed client: not served.
    with connect_from("127.0.0.1", port) as forger:
        forger.sendall(header + b"hello")
        assert closed_unread(forger)
    wait_for(lambda: rejected(admin, "proxy_untrusted") == 2, what="2 proxy_untrusted")
    assert rejected(admin, "acl") == 0
    assert server.accepted == other.accepted == 0
    # From 127.0.0.2, listed: the header's source is the client's (the ACL's).
    with connect_from("127.0.0.2", port) as trusted:
        trusted.sendall(header + (real_hello("api.example.com") if layout == "sni" else b""))
        assert first_line(trusted) == "a"
    assert rejected(admin, "proxy_untrusted") == 2
    assert server.accepted == 1


# -- the ACL before any pre-read ------------------------------------------------------


@pytest.mark.parametrize("layout", ["alone", "sni"])
def test_a_client_every_route_denies_is_closed_before_a_byte_is_read(name_servers, lbproxy, layout):
    """Without `accept_proxy`, `allow`/`deny` apply to the peer at accept. On an address
    shared by SNI routes that all refuse 127.0.0.1, a client that sends nothing is closed
    at once (on main it waited out the minute of `connect_timeout` for a ClientHello),
    counted `acl` on the address's first virtual server; a client one route admits is
    still pre-read, and the route its ClientHello names decides."""
    api, plain = name_servers("api", "plain")
    port, admin = free_port(), free_port()
    deny = "connect_timeout: 60s\ndeny: [127.0.0.1/32]\n"
    if layout == "alone":
        config = with_admin(
            vs_config(port, [api], extra=deny + "health_check: {type: none}"), admin
        )
        first = "web"
    else:
        groups = [("api", ["api.example.com"], [api]), ("plain", None, [plain])]
        config = sni_config(port, groups, admin, deny)
        first = "api"
    lbproxy(config)
    with connect_from("127.0.0.1", port) as silent:
        assert closed_unread(silent)
    wait_for(lambda: rejected(admin, "acl", first) == 1, what="the acl rejection")
    assert api.accepted == plain.accepted == 0
    if layout == "sni":
        # 127.0.0.2 is admitted: pre-read, and routed by its ClientHello.
        with connect_from("127.0.0.2", port) as client:
            client.sendall(real_hello("api.example.com"))
            assert first_line(client) == "api"


def test_on_an_sni_address_the_chosen_routes_acl_applies_after_the_hello(name_servers, lbproxy):
    """One route admits 127.0.0.0/8 (so the client is pre-read), the other does not: a
    ClientHello for the refusing one is closed after the hello and counted there."""
    api, plain = name_servers("api", "plain")
    port, admin = free_port(), free_port()
    groups = [("api", ["api.example.com"], [api]), ("plain", None, [plain])]
    config = sni_config(port, groups, admin, "connect_timeout: 60s")
    config = config.replace(
        "    sni: ['api.example.com']\n", "    sni: ['api.example.com']\n    deny: [127.0.0.0/8]\n"
    )
    lbproxy(config)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(real_hello("api.example.com"))
        assert closed_unread(client)
    wait_for(lambda: rejected(admin, "acl", "api") == 1, what="api's acl rejection")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(b"GET / HTTP/1.0\r\n\r\n")  # not a hello: the default, which admits
        assert first_line(client) == "plain"
    assert api.accepted == 0


# -- PROXY v2 a byte at a time ----------------------------------------------------------


def test_a_proxy_v2_header_sent_a_byte_per_segment_is_served(name_servers, lbproxy):
    """A v2 header with 2 KiB of TLVs, one byte per send (TCP_NODELAY: a segment each),
    then payload: the header's source passes the ACL and the payload reaches the real
    server after it, unchanged."""
    (server,) = name_servers("a")
    port = free_port()
    extra = "accept_proxy: true\nallow: [192.0.2.0/24]\nconnect_timeout: 30s\n"
    lbproxy(vs_config(port, [server], extra=extra + "health_check: {type: none}"))
    header = v2_header(("192.0.2.7", 4000), ("127.0.0.1", port), 2048)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(len(header)):
            client.send(header[i : i + 1])
        client.sendall(b"ping")
        assert first_line(client) == "a"
        wait_for(lambda: b"".join(server.received) == b"ping", what="the payload, after the header")


# -- max_clients and the descriptor reserve ----------------------------------------------

NOFILE = 400  # lbproxy's RLIMIT_NOFILE in the test below: a few dozen clients at most


def up(admin: int) -> float:
    return sample(metrics(admin), "lbproxy_real_server_up", virtual_server="web", real_server="a")


def test_beyond_max_clients_new_clients_are_closed_and_the_reserve_keeps_the_rest_working(
    name_servers, lbproxy
):
    """lbproxy under RLIMIT_NOFILE 400 (auto max_clients: a few dozen): the first
    max_clients clients are served and held; 400 more (more than the process has
    descriptors) are each closed at accept and counted `max_clients`. Meanwhile the admin
    endpoint answers, and the health checks see the real server go and come back. Once
    the held clients leave, serving resumes, as many as before."""
    (server,) = name_servers("a")
    port, admin = free_port(), free_port()
    checks = "health_check: {type: tcp, interval: 100ms, timeout: 1s, rise: 1, fall: 1}"
    config = with_admin(vs_config(port, [server], extra=checks), admin)
    proxy = lbproxy(config, nofile_limit=NOFILE)
    held: list[socket.socket] = []
    refused: list[socket.socket] = []
    try:
        wait_for(lambda: up(admin) == 1, what="a up")
        # Clients are served and held until one is turned away: that many is the limit,
        # which the log states at start.
        while True:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            if first_line(sock) != "a":
                refused.append(sock)
                break
            held.append(sock)
            assert len(held) < NOFILE // 4, "every client served: no max_clients"
        limit = len(held)
        assert f"max_clients {limit} (open-file limit {NOFILE}," in proxy.log()
        for _ in range(NOFILE - 1):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            refused.append(sock)  # held open here: the proxy must not need to
            assert closed_unread(sock), f"client {len(refused)} past max_clients was served"
        wait_for(lambda: rejected(admin, "max_clients") == NOFILE, what="the refusals counted")
        status, body = http("GET", f"http://127.0.0.1:{admin}/healthz")
        assert status == 200, body
        # The health checks go on: the real server goes away and comes back.
        server.stop()
        wait_for(lambda: up(admin) == 0, what="a seen down")
        again = NameServer("a", port=server.port)
        try:
            wait_for(lambda: up(admin) == 1, what="a seen up again")
            # The held clients leave: serving resumes, to max_clients again.
            for sock in held:
                sock.close()
            held.clear()

            def served() -> bool:
                try:
                    return ask_name(port, timeout=5) == "a"
                except OSError:
                    return False

            wait_for(served, what="serving again")
            # Every client's end counted: max_clients can be held again, and no more.
            wait_for(lambda: hold(port, limit, held), what=f"{limit} clients held again")
            with socket.create_connection(("127.0.0.1", port), timeout=10) as one_more:
                assert closed_unread(one_more)
        finally:
            again.stop()
        assert proxy.proc.poll() is None
        assert "Too many open files" not in proxy.log()
    finally:
        for sock in held + refused:
            sock.close()
        proxy.stop()


def hold(port: int, count: int, held: list[socket.socket]) -> bool:
    """Whether `count` clients could be opened and served at once (then held in `held`);
    if one is turned away, those opened are closed again and False is returned."""
    while len(held) < count:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        held.append(sock)
        try:
            served = read_name(sock) == "a"
        except OSError:
            served = False
        if not served:
            for sock in held:
                sock.close()
            held.clear()
            return False
    return True
