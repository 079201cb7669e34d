"""Front-door routing end to end (SPEC §13): backup servers, the queue, SNI routing.

Real `lbproxy run` processes, real name-saying servers on loopback, real HTTP to the
admin endpoint; every wait is bounded in count and time.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import select
import socket
import socketserver
import ssl
import struct
import subprocess
import threading
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests import tools
from tests.integration.harness import (
    NameServer,
    ask_name,
    free_port,
    http,
    metrics,
    open_and_read_name,
    read_name,
    sample,
    sni_config,
    vs_config,
    wait_for,
    with_admin,
)

FAST_CHECKS = "health_check: {type: tcp, interval: 0.1s, timeout: 0.5s, rise: 1, fall: 1}"


def names_until(port: int, wanted: str, timeout: float = 10.0) -> str:
    """Ask for names until `wanted` answers (the health checks need a moment)."""

    def answered() -> str | None:
        try:
            name = ask_name(port, timeout=2.0)
        except OSError:
            return None
        return name if name == wanted else None

    return wait_for(answered, timeout, f"{wanted} to answer", interval=0.05)


# -- backup servers ---------------------------------------------------------------------


def test_a_primary_fails_over_to_the_backups_and_takes_over_again(name_servers, lbproxy):
    primary, backup1, backup2 = name_servers("p", "b1", "b2")
    port, admin_port = free_port(), free_port()
    config = vs_config(
        port,
        [primary, backup1, backup2],
        "rr",
        FAST_CHECKS,
        rs_extra={"b1": "backup: true", "b2": "backup: true"},
    )
    lbproxy(with_admin(config, admin_port), wait_ports=[port])
    assert [ask_name(port) for _ in range(4)] == ["p"] * 4

    primary.stop()  # the real server goes away; the health check sees it
    assert names_until(port, "b1") == "b1"
    # the scheduler (rr) applies among the backups
    served = [ask_name(port) for _ in range(4)]
    assert sorted(served) == ["b1", "b1", "b2", "b2"]
    held, name = open_and_read_name(port)  # a backup connection stays open
    assert name in ("b1", "b2")

    back = NameServer("p", port=primary.port)  # the primary returns on its address
    try:
        assert names_until(port, "p") == "p"
        assert [ask_name(port) for _ in range(4)] == ["p"] * 4
        held.sendall(b"still here\n")
        assert held.recv(100) == b"still here\n"  # finished on its own, not cut
        status, body = http("GET", f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers/web")
        assert status == 200
        document = json.loads(body)
        flags = {rs["name"]: rs["backup"] for rs in document["real_servers"]}
        assert flags == {"p": False, "b1": True, "b2": True}
        active = {rs["name"]: rs["active_connections"] for rs in document["real_servers"]}
        assert active[name] == 1
    finally:
        held.close()
        back.stop()


def full_primaries_proxy(name_servers, lbproxy, queue: str = ""):
    """`web`: primaries p1, p2 and backups b1, b2, one slot each (max_connections: 1)."""
    servers = name_servers("p1", "p2", "b1", "b2")
    port, admin_port = free_port(), free_port()
    one_slot = "max_connections: 1"
    backup = f"backup: true, {one_slot}"
    config = vs_config(
        port,
        servers,
        "rr",
        "health_check: {type: none}" + (f"\nqueue: {queue}" if queue else ""),
        rs_extra={"p1": one_slot, "p2": one_slot, "b1": backup, "b2": backup},
    )
    proxy = lbproxy(with_admin(config, admin_port), wait_ports=[port])
    # wait_port's probe connection took a slot for a moment: let it go
    wait_for(lambda: gauge(admin_port, "lbproxy_active_connections", real_server="p1") == 0)
    return proxy, port, admin_port


def test_backups_serve_while_every_primary_is_full(name_servers, lbproxy):
    # SPEC §3 and §13: a primary at max_connections is not available, so the third
    # client goes to a backup instead of being refused while the backups stay idle.
    proxy, port, admin_port = full_primaries_proxy(name_servers, lbproxy)
    held = []
    try:
        for _ in range(4):
            held.append(open_and_read_name(port))
        assert sorted(name for _, name in held[:2]) == ["p1", "p2"]
        assert sorted(name for _, name in held[2:]) == ["b1", "b2"]  # rr among the backups
        # Every server full and no queue: refused, counted, and the process lives.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            assert s.recv(100) == b""
        wait_for(
            lambda: gauge(admin_port, "lbproxy_rejected_connections_total", reason="no_server") == 1
        )
        # A freed primary slot takes the next new connection, not a freed backup's.
        freed = next(i for i, (_, name) in enumerate(held) if name == "p2")
        held.pop(freed)[0].close()
        wait_for(lambda: gauge(admin_port, "lbproxy_active_connections", real_server="p2") == 0)
        backup_sock, backup_name = held.pop()
        backup_sock.close()
        wait_for(
            lambda: gauge(admin_port, "lbproxy_active_connections", real_server=backup_name) == 0
        )
        held.append(open_and_read_name(port))
        assert held[-1][1] == "p2"
        # The connections on the other backup went on all along.
        (other,) = [sock for sock, name in held if name.startswith("b")]
        other.sendall(b"still here\n")
        assert other.recv(100) == b"still here\n"
        assert proxy.proc.poll() is None
    finally:
        for sock, _ in held:
            sock.close()


def test_every_server_full_queues_and_a_freed_primary_slot_serves_the_waiting_client(
    name_servers, lbproxy
):
    _, port, admin_port = full_primaries_proxy(name_servers, lbproxy, "{max: 5, timeout: 20s}")
    held = []
    try:
        for _ in range(4):
            held.append(open_and_read_name(port))
        assert sorted(name for _, name in held) == ["b1", "b2", "p1", "p2"]
        assert gauge(admin_port, "lbproxy_queued_connections") == 0  # nobody waited
        waiting = socket.create_connection(("127.0.0.1", port), timeout=5)
        held.append((waiting, ""))
        wait_for(lambda: gauge(admin_port, "lbproxy_queued_connections") == 1, what="1 queued")
        freed = next(i for i, (_, name) in enumerate(held) if name == "p1")
        held.pop(freed)[0].close()
        assert read_name(waiting) == "p1"
        assert gauge(admin_port, "lbproxy_queued_connections") == 0
    finally:
        for sock, _ in held:
            sock.close()


# -- the queue --------------------------------------------------------------------------


def queued_proxy(name_servers, lbproxy, queue: str):
    (server,) = name_servers("a")
    port, admin_port = free_port(), free_port()
    config = vs_config(
        port,
        [server],
        "rr",
        f"health_check: {{type: none}}\nqueue: {queue}",
        rs_extra={"a": "max_connections: 1"},
    )
    lbproxy(with_admin(config, admin_port), wait_ports=[port])
    # wait_port's probe connection took the slot for a moment: let it go
    wait_for(lambda: gauge(admin_port, "lbproxy_active_connections", real_server="a") == 0)
    return port, admin_port


def gauge(admin_port: int, name: str, **labels) -> float:
    return sample(metrics(admin_port), name, virtual_server="web", **labels)


def served(sockets: list[socket.socket], timeout: float = 5.0) -> list[int]:
    """Indexes of the sockets that got their real server's name line within `timeout`
    (waiting at most `timeout` for the first, then a short while for any other)."""
    readable, _, _ = select.select(sockets, [], [], timeout)
    if readable:
        time.sleep(0.2)  # would a second client be let in too? (it must not)
        readable, _, _ = select.select(sockets, [], [], 0)
    return [sockets.index(s) for s in readable]


def test_one_slot_five_waiting_clients_are_served_in_arrival_order(name_servers, lbproxy):
    port, admin_port = queued_proxy(name_servers, lbproxy, "{max: 10, timeout: 20s}")
    holder, name = open_and_read_name(port)
    assert name == "a"
    waiting = []
    try:
        for i in range(5):
            waiting.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            # arrival order as lbproxy sees it: the next connects once this one queues
            wait_for(lambda n=i + 1: gauge(admin_port, "lbproxy_queued_connections") == n)
        assert served(waiting, timeout=0.3) == []  # nobody overtakes the holder
        holder.close()
        pending = list(waiting)
        for i in range(5):
            assert [waiting.index(pending[j]) for j in served(pending)] == [i]
            assert waiting[i].recv(100) == b"a\n"
            waiting[i].close()  # frees the slot for the next in line
            pending.remove(waiting[i])
        samples = metrics(admin_port)
        assert sample(samples, "lbproxy_queued_connections", virtual_server="web") == 0
        assert sample(samples, "lbproxy_queue_wait_seconds_count", virtual_server="web") == 5
        assert (
            sample(samples, "lbproxy_connections_total", virtual_server="web", real_server="a") >= 6
        )
    finally:
        holder.close()
        for s in waiting:
            s.close()


def test_a_connection_handed_to_a_task_with_its_lease_does_not_queue_behind_itself(
    name_servers, lbproxy
):
    """With an idle queue a client takes the fast path; one whose real server's name is
    not resolved yet goes on in a task holding the lease it took -- the last slot, so the
    queue is no longer empty -- and must connect, not wait in the queue for itself."""
    (server,) = name_servers("a")
    port, admin_port = free_port(), free_port()
    config = vs_config(
        port,
        [server],
        "rr",
        "health_check: {type: none}\nqueue: {max: 10, timeout: 20s}",
        rs_extra={"a": "max_connections: 1"},
    ).replace(f"address: 127.0.0.1:{server.port}", f"address: localhost:{server.port}")
    lbproxy(with_admin(config, admin_port), wait_ports=[port])
    # wait_port's probe was the first connection: it resolved the name in a task
    wait_for(lambda: gauge(admin_port, "lbproxy_active_connections", real_server="a") == 0)
    assert gauge(admin_port, "lbproxy_queued_connections") == 0
    holder, name = open_and_read_name(port)
    try:
        assert name == "a"
    finally:
        holder.close()


def test_a_client_waits_up_to_the_queue_timeout_then_is_closed(name_servers, lbproxy):
    port, admin_port = queued_proxy(name_servers, lbproxy, "{timeout: 300ms}")
    holder, _ = open_and_read_name(port)
    try:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            assert client.recv(100) == b""  # closed without a byte
        waited = time.monotonic() - started
        assert 0.25 <= waited < 4.0
        samples = metrics(admin_port)
        rejected = "lbproxy_rejected_connections_total"
        assert sample(samples, rejected, virtual_server="web", reason="queue_timeout") == 1
        assert sample(samples, rejected, virtual_server="web", reason="no_server") == 0
        assert sample(samples, "lbproxy_queue_wait_seconds_count", virtual_server="web") == 1
        assert sample(samples, "lbproxy_queue_wait_seconds_sum", virtual_server="web") >= 0.25
        # the holder was never disturbed
        holder.sendall(b"ping\n")
        assert holder.recv(100) == b"ping\n"
    finally:
        holder.close()


def test_beyond_max_waiting_clients_a_newcomer_is_refused_at_once(name_servers, lbproxy):
    port, admin_port = queued_proxy(name_servers, lbproxy, "{max: 2, timeout: 20s}")
    holder, _ = open_and_read_name(port)
    waiting = []
    try:
        for i in range(2):
            waiting.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            wait_for(lambda n=i + 1: gauge(admin_port, "lbproxy_queued_connections") == n)
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as third:
            assert third.recv(100) == b""
        assert time.monotonic() - started < 2.0  # at once, not after the timeout
        rejected = sample(
            metrics(admin_port),
            "lbproxy_rejected_connections_total",
            virtual_server="web",
            reason="queue_full",
        )
        assert rejected == 1
        holder.close()
        assert served(waiting) == [0]  # the queue still works for those in it
    finally:
        holder.close()
        for s in waiting:
            s.close()


def one_slot_taken(name_servers, lbproxy, queue_keys: str):
    """A virtual server whose one real server takes one connection, with a queue
    (`queue_keys` added to its own), and a client holding that slot: the real server,
    the port, the admin port and that client."""
    (server,) = name_servers("a")
    port, admin_port = free_port(), free_port()
    config = vs_config(
        port,
        [server],
        "rr",
        f"health_check: {{type: none}}\nqueue: {{max: 10, timeout: 20s{queue_keys}}}",
        rs_extra={"a": "max_connections: 1"},
    )
    lbproxy(with_admin(config, admin_port), wait_ports=[port])
    wait_for(lambda: gauge(admin_port, "lbproxy_active_connections", real_server="a") == 0)
    holder, _ = open_and_read_name(port)
    return server, port, admin_port, holder


def test_a_queued_client_that_resets_takes_no_slot_one_that_half_closes_is_served(
    name_servers, lbproxy
):
    server, port, admin_port, holder = one_slot_taken(name_servers, lbproxy, "")
    gone = socket.create_connection(("127.0.0.1", port), timeout=5)
    half = socket.socket()
    try:
        gone.sendall(b"from a client that left\n")
        wait_for(lambda: gauge(admin_port, "lbproxy_queued_connections") == 1, what="1 queued")
        half.settimeout(5)
        half.connect(("127.0.0.1", port))  # after it: the oldest waiter is the one that leaves
        half.sendall(b"request\n")
        half.shutdown(socket.SHUT_WR)  # sent its request, awaits the reply: legitimate
        wait_for(lambda: gauge(admin_port, "lbproxy_queued_connections") == 2, what="2 queued")
        # a reset: close() with SO_LINGER 0 sends RST
        gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        gone.close()
        served_before = gauge(admin_port, "lbproxy_connections_total", real_server="a")

        holder.close()  # the slot goes to the oldest waiter: the one that left
        reply = b""
        while chunk := half.recv(100):
            reply += chunk
        assert reply == b"a\nrequest\n"  # served in full after its half-close

        samples = metrics(admin_port)
        served_after = sample(
            samples, "lbproxy_connections_total", virtual_server="web", real_server="a"
        )
        assert served_after == served_before + 1  # the half-closed client only
        rejected = "lbproxy_rejected_connections_total"
        assert sample(samples, rejected, virtual_server="web", reason="queue_abandoned") == 1
        assert sample(samples, "lbproxy_queued_connections", virtual_server="web") == 0
        assert b"from a client that left\n" not in b"".join(server.received)
    finally:
        holder.close()
        gone.close()
        half.close()


def test_with_abort_on_close_a_queued_client_that_half_closes_is_dropped(name_servers, lbproxy):
    """HAProxy's `option abortonclose`: a waiting client that sent its FIN is dropped at
    its turn (queue_abandoned), its request never reaching the server, and the slot goes
    to the next waiter."""
    server, port, admin_port, holder = one_slot_taken(
        name_servers, lbproxy, ", abort_on_close: true"
    )
    half = socket.create_connection(("127.0.0.1", port), timeout=5)
    waiting = socket.socket()
    try:
        half.sendall(b"request\n")
        half.shutdown(socket.SHUT_WR)
        wait_for(lambda: gauge(admin_port, "lbproxy_queued_connections") == 1, what="1 queued")
        waiting.settimeout(5)
        waiting.connect(("127.0.0.1", port))  # after it: the half-closed one is the oldest
        wait_for(lambda: gauge(admin_port, "lbproxy_queued_connections") == 2, what="2 queued")

        holder.close()  # the slot goes to the oldest waiter, which closed: dropped
        assert waiting.recv(100) == b"a\n"  # the next one is served
        # closed without a reply (a reset, since its request was never read)
        with contextlib.suppress(ConnectionResetError):
            assert half.recv(100) == b""

        samples = metrics(admin_port)
        rejected = "lbproxy_rejected_connections_total"
        assert sample(samples, rejected, virtual_server="web", reason="queue_abandoned") == 1
        assert sample(samples, "lbproxy_queued_connections", virtual_server="web") == 0
        assert b"request\n" not in b"".join(server.received)
    finally:
        holder.close()
        half.close()
        waiting.close()


# -- SNI routing (TLS passthrough) ------------------------------------------------------


def self_signed(tmp_path, name: str, dns: str) -> tuple[str, str, bytes]:
    """(certificate file, key file, PEM) for `dns`, made now with `cryptography`."""
    key = ec.generate_private_key(ec.SECP256R1())
    # The server's name in the subject too: two servers of one name (ALPN routes) are
    # two distinct CAs, which a client's trust store tells apart by subject.
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, dns),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, name),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(dns)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    cert_file, key_file = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert_file.write_bytes(pem)
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_file), str(key_file), pem


class TlsNameServer(socketserver.ThreadingTCPServer):
    """A real TLS server on loopback: after the handshake, says its name, then echoes."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, name: str, cert_file: str, key_file: str):
        self.name = name
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert_file, key_file)
        self.server_names: list[str | None] = []  # the SNI each handshake carried
        super().__init__(("127.0.0.1", 0), _TlsHandler)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _TlsHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: TlsNameServer = self.server  # type: ignore[assignment]
        self.request.settimeout(10)
        seen: list[str | None] = []
        server.context.sni_callback = lambda _sock, name, _ctx: seen.append(name)
        try:
            with server.context.wrap_socket(self.request, server_side=True) as tls:
                server.server_names.extend(seen)
                tls.sendall(f"{server.name}\n".encode())
                while data := tls.recv(65536):
                    tls.sendall(data)
        except (OSError, ssl.SSLError):
            pass


@pytest.fixture
def tls_servers(tmp_path):
    made: list[TlsNameServer] = []
    pems: list[bytes] = []

    def make(name: str, dns: str) -> TlsNameServer:
        cert_file, key_file, pem = self_signed(tmp_path, name, dns)
        pems.append(pem)
        server = TlsNameServer(name, cert_file, key_file)
        made.append(server)
        return server

    make.pems = pems  # type: ignore[attr-defined]
    yield make
    for server in made:
        server.stop()


def tls_name(
    port: int,
    server_name: str | None,
    pems,
    verify: bool = True,
    alpn: list[str] | None = None,
) -> str:
    """A real TLS client through lbproxy: the handshake (offering the `alpn` protocols),
    then the server's name line."""
    context = ssl.create_default_context(cadata="".join(p.decode() for p in pems))
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if alpn is not None:
        context.set_alpn_protocols(alpn)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=server_name) as tls,
    ):
        return read_name(tls)


@pytest.fixture
def sni_front(tls_servers, lbproxy):
    api = tls_servers("api", "api.example.com")
    apps = tls_servers("apps", "x.apps.example.com")
    fallback = tls_servers("fallback", "fallback.example.com")
    port, admin_port = free_port(), free_port()
    groups = [
        ("api", ["api.example.com"], [api]),
        ("apps", ["*.apps.example.com"], [apps]),
        ("fallback", None, [fallback]),
    ]
    proxy = lbproxy(sni_config(port, groups, admin_port), wait_ports=[port])
    return proxy, port, admin_port, tls_servers.pems, (api, apps, fallback), groups


def test_tls_handshakes_are_routed_by_server_name(sni_front):
    _, port, admin_port, pems, (api, apps, _), _ = sni_front
    assert tls_name(port, "api.example.com", pems) == "api"
    assert tls_name(port, "API.Example.Com", pems) == "api"  # case-insensitive
    assert tls_name(port, "x.apps.example.com", pems) == "apps"
    # *.apps.example.com is one label: a deeper name goes to the default
    assert tls_name(port, "a.b.apps.example.com", pems, verify=False) == "fallback"
    assert tls_name(port, None, pems, verify=False) == "fallback"  # no SNI
    assert tls_name(port, "fallback.example.com", pems) == "fallback"
    # passthrough: the real servers saw the client's own ClientHello, case and all
    assert api.server_names == ["api.example.com", "API.Example.Com"]
    assert apps.server_names == ["x.apps.example.com"]
    samples = metrics(admin_port)
    # fallback: 3 here, and the start-up probe of wait_port (it sent nothing: EOF)
    for vs, rs, n in (("api", "api", 2), ("apps", "apps", 1), ("fallback", "fallback", 4)):
        assert sample(samples, "lbproxy_connections_total", virtual_server=vs, real_server=rs) == n


@tools.requires("openssl", package="openssl")
def test_openssl_s_client_through_lbproxy(sni_front, tmp_path):
    _, port, _, pems, _, _ = sni_front
    ca_file = tmp_path / "trusted.pem"
    ca_file.write_bytes(b"".join(pems))
    for server_name, expected in (("api.example.com", "api"), ("y.apps.example.com", "apps")):
        command = ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-quiet"]
        command += ["-servername", server_name, "-CAfile", str(ca_file), "-verify_return_error"]
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 10)
            assert ready, "no answer from s_client"
            assert proc.stdout.readline().decode().strip() == expected
        finally:
            proc.kill()
            proc.communicate(timeout=10)


def test_not_tls_a_silent_client_and_a_slow_one_go_to_the_default(name_servers, lbproxy):
    (plain,) = name_servers("plain")  # speaks first, as SSH or SMTP do
    api = NameServer("api-plain")
    port = free_port()
    try:
        groups = [("api", ["api.example.com"], [api]), ("plain", None, [plain])]
        lbproxy(sni_config(port, groups, extra="connect_timeout: 1s"), wait_ports=[port])
        # plain HTTP: not a hello, routed at once, its bytes forwarded unchanged
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            client.sendall(b"GET / HTTP/1.1\r\nHost: api.example.com\r\n\r\n")
            assert client.recv(100).startswith(b"plain\n")
        # a client that waits for the server to speak first: the default after 1 s
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            assert client.recv(100) == b"plain\n"
        assert 0.9 <= time.monotonic() - started < 4
        # one byte every 0.3 s of a real-looking record header: the default, with them
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            for byte in b"\x16\x03\x01\x02":
                client.sendall(bytes([byte]))
                time.sleep(0.3)  # the slow client's pace
            answer = b""
            for _ in range(10):  # the greeting, then the echo of those very bytes
                answer += client.recv(100)
                if len(answer) >= 10:
                    break
            assert answer == b"plain\n\x16\x03\x01\x02"
        assert api.accepted == 0
    finally:
        api.stop()


def test_no_default_closes_and_counts_no_route(tls_servers, lbproxy):
    api = tls_servers("api", "api.example.com")
    other = tls_servers("other", "other.example.com")
    port, admin_port = free_port(), free_port()
    groups = [("api", ["api.example.com"], [api]), ("other", ["other.example.com"], [other])]
    lbproxy(sni_config(port, groups, admin_port, "connect_timeout: 1s"), wait_ports=[port])
    pems = tls_servers.pems
    with pytest.raises((ssl.SSLError, OSError)):
        tls_name(port, "nobody.example.com", pems, verify=False)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        client.sendall(b"\x80\x2e\x01\x00\x02" + bytes(40))  # an SSLv2-style hello
        assert client.recv(100) == b""
    assert tls_name(port, "other.example.com", pems) == "other"  # still routing
    rejected = "lbproxy_rejected_connections_total"
    samples = metrics(admin_port)
    # wait_port's probe sent nothing: a third no_route, after connect_timeout
    assert sample(samples, rejected, virtual_server="api", reason="no_route") >= 2
    assert sample(samples, rejected, virtual_server="other", reason="no_route") == 0


def test_reload_changes_routes_keeps_connections_and_the_listener(sni_front, tls_servers):
    proxy, port, _, pems, (api, apps, _), _ = sni_front
    context = ssl.create_default_context(cadata="".join(p.decode() for p in pems))
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    held = context.wrap_socket(raw, server_hostname="api.example.com")
    try:
        assert held.recv(100) == b"api\n"
        extra = tls_servers("extra", "extra.example.com")
        new_groups = [
            ("api", ["api.example.com", "api2.example.com"], [api]),  # a name added
            ("apps", None, [apps]),  # its name removed: now the default...
            ("extra", ["extra.example.com"], [extra]),  # a virtual server added
        ]  # ...and `fallback` removed
        before = proxy.log().count(f"listening on 127.0.0.1:{port}")
        proxy.reload(sni_config(port, new_groups))
        assert "reloaded" in proxy.log() and "reload failed" not in proxy.log()
        assert f"closed 127.0.0.1:{port}" not in proxy.log()
        assert proxy.log().count(f"listening on 127.0.0.1:{port}") == before  # not rebound
        assert tls_name(port, "api2.example.com", pems, verify=False) == "api"
        assert tls_name(port, "extra.example.com", pems) == "extra"
        assert tls_name(port, "x.apps.example.com", pems, verify=False) == "apps"
        assert tls_name(port, "fallback.example.com", pems, verify=False) == "apps"
        held.sendall(b"still here\n")  # the established connection was kept
        assert held.recv(100) == b"still here\n"
    finally:
        held.close()


def test_reload_adding_and_removing_backup_and_queue_keeps_connections(name_servers, lbproxy):
    a, b = name_servers("a", "b")
    port = free_port()
    plain = vs_config(port, [a, b], "rr", "health_check: {type: none}")
    proxy = lbproxy(plain, wait_ports=[port])
    held = [open_and_read_name(port) for _ in range(2)]
    try:
        assert sorted(name for _, name in held) == ["a", "b"]
        proxy.reload(
            vs_config(
                port,
                [a, b],
                "rr",
                "health_check: {type: none}\nqueue: {max: 5, timeout: 2s}",
                rs_extra={"b": "backup: true"},
            )
        )
        assert "web: queue added" in proxy.log() and "web: changed b" in proxy.log()
        assert [ask_name(port) for _ in range(4)] == ["a"] * 4  # b stands by now
        proxy.reload(plain)
        assert "web: queue removed" in proxy.log()
        assert sorted(ask_name(port) for _ in range(4)) == ["a", "a", "b", "b"]
        for sock, name in held:  # both survived both reloads, the backup's one too
            sock.sendall(name.encode())
            assert sock.recv(10) == name.encode()
    finally:
        for sock, _ in held:
            sock.close()


def test_fuzzed_first_bytes_never_hurt_the_process(name_servers, lbproxy):
    """Whatever a client sends first, the connection ends in the default route or a
    close, and lbproxy keeps routing: hypothesis against a real process."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.factories import real_hello

    (plain,) = name_servers("plain")
    api = NameServer("api")
    port = free_port()
    hello = real_hello("api.example.com")
    try:
        groups = [("api", ["api.example.com"], [api]), ("plain", None, [plain])]
        proxy = lbproxy(sni_config(port, groups, extra="connect_timeout: 300ms"), [port])

        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
        @given(
            st.one_of(
                st.binary(min_size=1, max_size=600),
                st.builds(  # a real hello with a few bytes changed
                    lambda cuts: bytes(cuts.get(i, b) for i, b in enumerate(hello)),
                    st.dictionaries(st.integers(0, len(hello) - 1), st.integers(0, 255)),
                ),
            )
        )
        def first_bytes(data: bytes) -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
                client.sendall(data)
                answer = client.recv(6)  # a server's name first: routed somewhere
                assert answer.startswith((b"plain\n", b"api\n")) or answer == b"", answer

        first_bytes()
        assert proxy.proc.poll() is None  # still running
        assert "Traceback" not in proxy.log() and "routing failed" not in proxy.log()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            client.sendall(hello)
            assert client.recv(4) == b"api\n"
    finally:
        api.stop()


def test_accept_proxy_reads_the_header_before_the_hello_and_its_source_counts(
    name_servers, lbproxy
):
    from lbproxy.wire.proxy_protocol import encode_v1, encode_v2
    from tests.factories import real_hello

    api, plain = name_servers("api", "plain")
    port, admin_port = free_port(), free_port()
    groups = [("api", ["api.example.com"], [api]), ("plain", None, [plain])]
    config = sni_config(port, groups, admin_port, "accept_proxy: true\nconnect_timeout: 1s")
    config = config.replace(
        "    sni: ['api.example.com']\n", "    sni: ['api.example.com']\n    deny: [203.0.113.7]\n"
    )
    lbproxy(config, wait_ports=[port])
    hello = real_hello("api.example.com")
    proxy_address = ("127.0.0.1", port)

    def first_answer(data: bytes) -> bytes:
        with socket.create_connection(proxy_address, timeout=5) as client:
            client.sendall(data)
            return client.recv(4)

    # header and hello in one write, or the hello after a v2 header: routed by the name
    assert first_answer(encode_v1(("198.51.100.1", 4000), proxy_address) + hello) == b"api\n"
    assert first_answer(encode_v2(("198.51.100.2", 4000), proxy_address) + hello) == b"api\n"
    # the source the header names is the one api's ACL sees: refused
    assert first_answer(encode_v1(("203.0.113.7", 4000), proxy_address) + hello) == b""
    # ...while the default (no deny) takes that source's non-TLS bytes
    assert first_answer(encode_v1(("203.0.113.7", 4000), proxy_address) + b"GET /") == b"plai"
    # no PROXY header at all: dropped, as accept_proxy always does
    assert first_answer(hello) == b""
    samples = metrics(admin_port)
    assert sample(samples, "lbproxy_rejected_connections_total", virtual_server="api",
                  reason="acl") == 1  # fmt: skip


def test_sni_routing_with_two_workers(tls_servers, lbproxy):
    api = tls_servers("api", "api.example.com")
    fallback = tls_servers("fallback", "fallback.example.com")
    port = free_port()
    groups = [("api", ["api.example.com"], [api]), ("fallback", None, [fallback])]
    config = sni_config(port, groups).replace(
        "  drain_timeout: 2s\n", "  drain_timeout: 2s\n  workers: 2\n"
    )
    lbproxy(config, wait_ports=[port])  # ready: READY=1 once both workers are
    pems = tls_servers.pems
    for _ in range(4):  # whichever worker the kernel picks routes the same way
        assert tls_name(port, "api.example.com", pems) == "api"
        assert tls_name(port, "fallback.example.com", pems) == "fallback"


# -- ALPN routing on a shared address ---------------------------------------------------


def s_client_name(port: int, pems, tmp_path, *options: str) -> str:
    """`openssl s_client` through lbproxy with these options: the server's name line."""
    ca_file = tmp_path / "trusted.pem"
    ca_file.write_bytes(b"".join(pems))
    command = ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-quiet"]
    command += ["-CAfile", str(ca_file), *options]
    proc = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 10)
        assert ready, "no answer from s_client"
        return proc.stdout.readline().decode().strip()
    finally:
        proc.kill()
        proc.communicate(timeout=10)


@pytest.fixture
def acme_front(tls_servers, lbproxy):
    """example.com: acme-tls/1 to the certificate manager, the rest to the web servers;
    xmpp-client for any other name to xmpp; everything else to the default."""
    certs = tls_servers("certs", "example.com")
    web = tls_servers("web", "example.com")
    xmpp = tls_servers("xmpp", "chat.example.org")
    default = tls_servers("default", "default.example.org")
    port, admin_port = free_port(), free_port()
    groups = [
        ("certs", ["example.com"], [certs], ["acme-tls/1"]),
        ("web", ["example.com"], [web]),
        ("xmpp", None, [xmpp], ["xmpp-client", "xmpp-server"]),
        ("default", None, [default]),
    ]
    proxy = lbproxy(sni_config(port, groups, admin_port), wait_ports=[port])
    return proxy, port, admin_port, tls_servers.pems


def test_acme_tls_alpn_goes_to_the_certificate_manager_the_rest_to_the_web(acme_front):
    _, port, admin_port, pems = acme_front
    assert tls_name(port, "example.com", pems, alpn=["acme-tls/1"]) == "certs"
    assert tls_name(port, "example.com", pems, alpn=["h2", "http/1.1"]) == "web"
    assert tls_name(port, "example.com", pems, alpn=["http/1.1"]) == "web"
    assert tls_name(port, "example.com", pems) == "web"  # no ALPN: the no-alpn route
    assert tls_name(port, "example.com", pems, alpn=["ACME-TLS/1"]) == "web"  # exact
    # the name's routes first; then those without sni: alpn, then the default
    assert tls_name(port, "chat.example.org", pems, alpn=["xmpp-client"]) == "xmpp"
    assert tls_name(port, None, pems, verify=False, alpn=["xmpp-server"]) == "xmpp"
    assert tls_name(port, "default.example.org", pems, alpn=["h2"]) == "default"
    assert tls_name(port, "default.example.org", pems) == "default"
    # acme-tls/1 for a name without an acme route: nothing routes it but the default
    assert tls_name(port, "default.example.org", pems, alpn=["acme-tls/1"]) == "default"
    # the client's preference decides between two routes it could take
    assert tls_name(port, "example.org", pems, verify=False, alpn=["xmpp-client", "h2"]) == ("xmpp")
    samples = metrics(admin_port)
    for vs, n in (("certs", 1), ("web", 4), ("xmpp", 3)):
        assert sample(samples, "lbproxy_connections_total", virtual_server=vs, real_server=vs) == n
    status, body = http("GET", f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers")
    assert status == 200
    documents = {vs["name"]: vs for vs in json.loads(body)["virtual_servers"]}
    assert documents["certs"]["alpn"] == ["acme-tls/1"]
    assert documents["certs"]["sni"] == ["example.com"]
    assert documents["web"]["alpn"] == []


@tools.requires("openssl", package="openssl")
def test_openssl_s_client_alpn_through_lbproxy(acme_front, tmp_path):
    _, port, _, pems = acme_front
    name = ["-servername", "example.com", "-verify_return_error"]
    assert s_client_name(port, pems, tmp_path, "-alpn", "acme-tls/1", *name) == "certs"
    assert s_client_name(port, pems, tmp_path, "-alpn", "h2,http/1.1", *name) == "web"
    assert s_client_name(port, pems, tmp_path, *name) == "web"
    other = ["-servername", "chat.example.org", "-verify_return_error"]
    assert s_client_name(port, pems, tmp_path, "-alpn", "xmpp-client", *other) == "xmpp"


def test_a_malformed_alpn_extension_goes_where_no_hello_would(tls_servers, lbproxy):
    """A hello whose ALPN list is broken is not a ClientHello: the default route, bytes
    and all, even though it names a server that has routes."""
    from tests.factories import real_hello

    (plain,) = [NameServer("plain")]
    certs = tls_servers("certs", "example.com")
    port = free_port()
    try:
        groups = [
            ("certs", ["example.com"], [certs], ["acme-tls/1"]),
            ("plain", None, [plain]),
        ]
        lbproxy(sni_config(port, groups, extra="connect_timeout: 2s"), wait_ports=[port])
        hello = bytearray(real_hello("example.com", ["acme-tls/1"]))
        at = bytes(hello).index(b"\x00\x10\x00\x0d\x00\x0b\x0aacme-tls/1")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            client.sendall(bytes(hello))
            assert client.recv(5)[:2] == b"\x16\x03"  # the TLS server's ServerHello
        hello[at + 5] = 0x0C  # the list one byte longer than its extension
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            client.sendall(bytes(hello))
            assert client.recv(100).startswith(b"plain\n")
    finally:
        plain.stop()


def test_reload_adds_alpn_routes_keeps_connections_and_the_listener(tls_servers, lbproxy):
    certs = tls_servers("certs", "example.com")
    web = tls_servers("web", "example.com")
    port = free_port()
    before_groups = [("web", ["example.com"], [web]), ("certs", ["certs.example.com"], [certs])]
    proxy = lbproxy(sni_config(port, before_groups), wait_ports=[port])
    pems = tls_servers.pems
    assert tls_name(port, "example.com", pems, alpn=["acme-tls/1"]) == "web"
    context = ssl.create_default_context(cadata="".join(p.decode() for p in pems))
    context.set_alpn_protocols(["h2"])
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    held = context.wrap_socket(raw, server_hostname="example.com")
    try:
        assert held.recv(100) == b"web\n"
        listening = proxy.log().count(f"listening on 127.0.0.1:{port}")
        after_groups = [
            ("web", ["example.com"], [web]),
            ("certs", ["certs.example.com", "example.com"], [certs], ["acme-tls/1"]),
        ]
        proxy.reload(sni_config(port, after_groups))
        assert "reloaded" in proxy.log() and "reload failed" not in proxy.log()
        assert proxy.log().count(f"listening on 127.0.0.1:{port}") == listening  # not rebound
        assert tls_name(port, "example.com", pems, alpn=["acme-tls/1"]) == "certs"
        assert tls_name(port, "example.com", pems, alpn=["h2"]) == "web"
        # certs.example.com now routes only acme-tls/1 there; nothing else routes it
        with pytest.raises((ssl.SSLError, OSError)):
            tls_name(port, "certs.example.com", pems, alpn=["h2"])
        held.sendall(b"still here\n")  # the established connection was kept
        assert held.recv(100) == b"still here\n"
    finally:
        held.close()
