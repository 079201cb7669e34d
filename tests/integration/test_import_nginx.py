"""`lbproxy import` of nginx stream configurations, checked against nginx itself (SPEC
§25): real nginx runs the original (tests/data/import/nginx/, configs/*.yaml translated
back by hand), `lbproxy run` the imported one, against the same real servers and with
the same clients; what each client gets must match."""

from __future__ import annotations

import collections
import socket
import ssl
import threading
from pathlib import Path

import pytest
import yaml

from tests.integration.harness import (
    ROOT,
    ask_name,
    closed_without_a_byte,
    free_port,
    open_and_read_name,
    read_name,
    run_cli,
    wait_for,
)
from tests.integration.nginx import Nginx, render, requires_nginx
from tests.integration.tls_servers import Certificates, TlsServer

DATA = ROOT / "tests" / "data" / "import" / "nginx"

pytestmark = requires_nginx


def imported(nginx: Nginx) -> str:
    """`lbproxy import` of the very file nginx runs, with an admin port of the test's
    own; the import must exit 0 and pass `lbproxy check`."""
    result = run_cli("import", str(nginx.conf))
    assert result.returncode == 0, result.stderr
    document = yaml.safe_load(result.stdout)
    document.setdefault("global", {})["admin"] = {"listen": f"127.0.0.1:{free_port()}"}
    text = yaml.safe_dump(document, sort_keys=False)
    checked_path = nginx.folder / "imported.yaml"
    checked_path.write_text(text)
    checked = run_cli("check", str(checked_path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    return text


def names_from(port: int, count: int) -> list[str]:
    return [ask_name(port) for _ in range(count)]


def ask_name_from(source: str, port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)) as s:
        return read_name(s)


def both(tmp_path, lbproxy, template: str, ports: dict[str, int], run) -> tuple:
    """What `run(port)` sees through nginx on the original, then through lbproxy on the
    import (one after the other, so neither's connections count in the other's)."""
    nginx_port, lbproxy_port = free_port(), free_port()
    conf = render(DATA / template, LB=nginx_port, **ports)
    with Nginx(tmp_path / "nginx", conf).start(wait_ports=[nginx_port]) as nginx:
        through_nginx = run(nginx_port)
        config = imported(nginx).replace(f":{nginx_port}", f":{lbproxy_port}")
    proxy = lbproxy(config, [lbproxy_port])
    through_lbproxy = run(lbproxy_port)
    proxy.stop()
    return through_nginx, through_lbproxy


def test_weighted_round_robin_gives_nginx_s_sequence(tmp_path, name_servers, lbproxy):
    s1, s2, spare = name_servers("s1", "s2", "spare")
    ports = {"S1": s1.port, "S2": s2.port, "SPARE": spare.port}
    seen_nginx, seen_lbproxy = both(
        tmp_path, lbproxy, "wrr.conf", ports, lambda port: names_from(port, 12)
    )
    # nginx's smooth weighted round robin: 1 and 5 interleaved, the down server never
    assert seen_nginx.count("s1") == 2 and seen_nginx.count("s2") == 10
    assert seen_lbproxy == seen_nginx


def test_nginx_s_documented_weights_give_the_same_counts_every_cycle(
    tmp_path, name_servers, lbproxy
):
    s1, s2, s3 = name_servers("s1", "s2", "s3")
    ports = {"S1": s1.port, "S2": s2.port, "S3": s3.port}
    seen_nginx, seen_lbproxy = both(
        tmp_path, lbproxy, "weights.conf", ports, lambda port: names_from(port, 14)
    )
    # two whole cycles of the total weight (7) after the readiness probe's s1: the same
    # count per server in every cycle (nginx's order within a cycle, smooth weighted
    # round robin, is a a b a c a a; lbproxy's wrr, earliest deadline first, a a a b c a a)
    for seen in (seen_nginx, seen_lbproxy):
        assert collections.Counter(seen[:6]) == {"s1": 4, "s2": 1, "s3": 1}, seen
        assert collections.Counter(seen[6:13]) == {"s1": 5, "s2": 1, "s3": 1}, seen


def test_round_robin_gives_nginx_s_sequence(tmp_path, name_servers, lbproxy):
    s1, s2, s3 = name_servers("s1", "s2", "s3")
    ports = {"S1": s1.port, "S2": s2.port, "S3": s3.port}
    seen_nginx, seen_lbproxy = both(
        tmp_path, lbproxy, "rr.conf", ports, lambda port: names_from(port, 9)
    )
    assert sorted(collections.Counter(seen_nginx).values()) == [3, 3, 3]
    assert seen_lbproxy == seen_nginx


def test_least_conn_with_weights_spreads_held_connections_as_nginx(tmp_path, name_servers, lbproxy):
    s1, s2 = name_servers("s1", "s2")

    def hold_eight(port: int) -> collections.Counter:
        held = [open_and_read_name(port) for _ in range(8)]
        counts = collections.Counter(name for _sock, name in held)
        for sock, _name in held:
            sock.close()
        return counts

    ports = {"S1": s1.port, "S2": s2.port}
    seen_nginx, seen_lbproxy = both(tmp_path, lbproxy, "lc.conf", ports, hold_eight)
    assert seen_nginx == {"s1": 2, "s2": 6}  # connections / weight kept even: 2/1, 6/3
    assert seen_lbproxy == seen_nginx


def test_allow_and_deny_decide_as_nginx(tmp_path, name_servers, lbproxy):
    s1, s2 = name_servers("s1", "s2")

    def decisions(port: int) -> dict[str, bool]:
        return {
            source: ask_name_from(source, port) in ("s1", "s2")
            for source in ("127.0.0.1", "127.0.0.2", "127.0.0.3")
        }

    ports = {"S1": s1.port, "S2": s2.port}
    seen_nginx, seen_lbproxy = both(tmp_path, lbproxy, "lc.conf", ports, decisions)
    assert seen_nginx == {"127.0.0.1": True, "127.0.0.2": False, "127.0.0.3": True}
    assert seen_lbproxy == seen_nginx


def test_hash_keeps_each_client_on_one_server_and_spreads_clients_as_nginx(
    tmp_path, name_servers, lbproxy
):
    s1, s2, s3 = name_servers("s1", "s2", "s3")
    clients = [f"127.0.0.{i}" for i in range(10, 40)]

    def servers_per_client(port: int) -> dict[str, set[str]]:
        seen: dict[str, set[str]] = collections.defaultdict(set)
        for _ in range(3):
            for client in clients:
                seen[client].add(ask_name_from(client, port))
        return seen

    ports = {"S1": s1.port, "S2": s2.port, "S3": s3.port}
    seen_nginx, seen_lbproxy = both(tmp_path, lbproxy, "maglev.conf", ports, servers_per_client)
    for seen in (seen_nginx, seen_lbproxy):
        assert all(len(servers) == 1 for servers in seen.values()), seen
        clients_per_server = collections.Counter(next(iter(s)) for s in seen.values())
        # every server has clients; s3 (weight 2) about half of them in both
        assert set(clients_per_server) == {"s1", "s2", "s3"}, clients_per_server
        assert 5 <= clients_per_server["s3"] <= 25, clients_per_server


def test_one_upstream_behind_two_servers_keeps_one_max_conns_as_nginx(
    tmp_path, name_servers, lbproxy
):
    """Two server { } blocks proxying to one upstream share its max_conns in nginx: the
    import is one virtual server on both addresses, so a client held on one address
    fills the real server for a client of the other, which is turned away (no queue,
    as in nginx) until the first leaves."""
    (s1,) = name_servers("s1")

    def second_address_while_first_held(ports: tuple[int, int]) -> bool:
        first, second = ports
        held: list[socket.socket] = []

        def served_and_held() -> bool:
            # the readiness probe's connection may hold the one slot a moment
            s = socket.create_connection(("127.0.0.1", first), timeout=5)
            if read_name(s) == "s1":
                held.append(s)
                return True
            s.close()
            return False

        wait_for(served_and_held, 10, "a client on the first address to be served")
        try:
            turned_away = closed_without_a_byte(second)
        finally:
            held[0].close()
        wait_for(lambda: ask_name(second) == "s1", 10, "the second address to serve again")
        return turned_away

    nginx_ports, lbproxy_ports = (free_port(), free_port()), (free_port(), free_port())
    conf = render(DATA / "shared-upstream.conf", LB=nginx_ports[0], LB2=nginx_ports[1], S1=s1.port)
    with Nginx(tmp_path / "nginx", conf).start(wait_ports=list(nginx_ports)) as nginx:
        through_nginx = second_address_while_first_held(nginx_ports)
        config = imported(nginx)
    for nginx_port, lbproxy_port in zip(nginx_ports, lbproxy_ports, strict=True):
        config = config.replace(f":{nginx_port}", f":{lbproxy_port}")
    [vs] = yaml.safe_load(config)["virtual_servers"]
    assert (vs["name"], vs["listen"]) == ("one", [f"127.0.0.1:{p}" for p in lbproxy_ports])
    proxy = lbproxy(config, list(lbproxy_ports))
    through_lbproxy = second_address_while_first_held(lbproxy_ports)
    proxy.stop()
    assert through_nginx is True
    assert through_lbproxy == through_nginx


def test_limit_conn_per_client_address_as_nginx(tmp_path, name_servers, lbproxy):
    (s1,) = name_servers("s1")

    def admitted(port: int) -> list[str]:
        held: list[socket.socket] = []

        def served_and_held() -> bool:
            # the previous connections (the readiness probe's) may hold the slot a moment
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if read_name(s) == "s1":
                held.append(s)
                return True
            s.close()
            return False

        wait_for(served_and_held, 10, "a connection from 127.0.0.1 to be served")
        try:
            # a second one from the same address is refused, another address is served
            return [ask_name_from("127.0.0.1", port), ask_name_from("127.0.0.3", port)]
        finally:
            held[0].close()

    seen_nginx, seen_lbproxy = both(tmp_path, lbproxy, "limit-conn.conf", {"S1": s1.port}, admitted)
    assert seen_nginx == ["", "s1"]
    assert seen_lbproxy == seen_nginx


def test_proxy_protocol_in_and_out_as_nginx(tmp_path, name_servers, lbproxy):
    (s1,) = name_servers("s1")

    def through(port: int) -> tuple[str, str, str]:
        def from_client(address: str) -> str:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(f"PROXY TCP4 {address} 127.0.0.1 40001 443\r\n".encode())
                return read_name(s).split("\n")[0]  # (the server echoes the header)

        s1.received.clear()
        served, denied = from_client("192.0.2.7"), from_client("192.0.2.66")
        wait_for(lambda: s1.received, 10, "the server to read the PROXY header")
        header = b"".join(s1.received).split(b"\r\n")[0].decode().split()
        # what the server learns: the protocol, the client's address and port (the
        # destination is each proxy's own address)
        return served, denied, " ".join(header[:3] + header[4:5])

    seen_nginx, seen_lbproxy = both(
        tmp_path, lbproxy, "proxy-protocol.conf", {"S1": s1.port}, through
    )
    assert seen_nginx == ("s1", "", "PROXY TCP4 192.0.2.7 40001")
    assert seen_lbproxy == seen_nginx


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Certificates:
    return Certificates(tmp_path_factory.mktemp("certs"))


def test_sni_routes_as_nginx_ssl_preread(tmp_path, lbproxy, certificates):
    cert = certificates.signed("any", "example.com", "api.example.com", "www.example.com")
    names = ("api1", "api2", "sorry", "web1", "web2", "fallback")
    servers = {name: TlsServer(name, cert, answer=f"{name}\n".encode()) for name in names}
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE

    def served(port: int, server_name: str | None) -> str:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            client.wrap_socket(raw, server_hostname=server_name) as tls,
        ):
            tls.sendall(b"?")
            return read_name(tls)

    def routes(port: int) -> list[str]:
        asked = ["api.example.com", "www.example.com", "example.com", "other.test", None]
        return [served(port, name) for name in asked for _ in range(2)]

    try:
        ports = {name.upper(): server.port for name, server in servers.items()}
        seen_nginx, seen_lbproxy = both(tmp_path, lbproxy, "front-door.conf", ports, routes)
    finally:
        for server in servers.values():
            server.stop()
    assert {seen_nginx[0], seen_nginx[1]} == {"api1", "api2"}
    assert set(seen_nginx[2:6]) == {"web1", "web2"}
    assert seen_nginx[6:] == ["fallback"] * 4
    assert {seen_lbproxy[0], seen_lbproxy[1]} == {"api1", "api2"}
    assert seen_lbproxy[2:] == seen_nginx[2:]


def test_a_killed_server_gets_no_more_clients_in_either(tmp_path, name_servers, lbproxy):
    s1, s3 = name_servers("s1", "s3")
    ports = {"S1": s1.port, "S2": free_port(), "S3": s3.port}  # S2: nothing listens

    def answers(port: int) -> list[str]:
        return names_from(port, 9)

    seen_nginx, seen_lbproxy = both(tmp_path, lbproxy, "passive.conf", ports, answers)
    for seen in (seen_nginx, seen_lbproxy):
        # the first client sent to the dead server is closed (no retry: one failure
        # marks it failed); nothing more goes there for fail_timeout, the others share
        assert seen[0] == "", seen  # the harness's readiness probe took s1
        assert "" not in seen[1:], seen
        assert set(seen[1:]) == {"s1", "s3"}, seen
    # (after a failure nginx's round robin lowers the failed server's effective
    # weight, which shifts its order; lbproxy's carries on: the order may differ)


def test_udp_round_robin_and_one_answer_per_request_as_nginx(tmp_path, lbproxy):
    echoes = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    for echo in echoes:
        echo.bind(("127.0.0.1", 0))
        echo.settimeout(0.2)

    stop = threading.Event()

    def serve(echo: socket.socket, name: bytes) -> None:
        while not stop.is_set():
            try:
                data, peer = echo.recvfrom(2048)
            except OSError:
                continue
            echo.sendto(name + b":" + data, peer)

    threads = [
        threading.Thread(target=serve, args=(echo, name), daemon=True)
        for echo, name in zip(echoes, (b"s1", b"s2"), strict=True)
    ]
    for thread in threads:
        thread.start()

    def ask(port: int) -> list[str]:
        return [ask_udp(port, f"q{i}".encode()) for i in range(4)]

    ports = {"S1": echoes[0].getsockname()[1], "S2": echoes[1].getsockname()[1]}
    try:
        seen_nginx, seen_lbproxy = both_udp(tmp_path, lbproxy, ports, ask)
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
        for echo in echoes:
            echo.close()
    assert sorted(a.split(":")[0] for a in seen_nginx) == ["s1", "s1", "s2", "s2"]
    assert [a.split(":")[1] for a in seen_nginx] == ["q0", "q1", "q2", "q3"]
    assert seen_lbproxy == seen_nginx


def ask_udp(port: int, payload: bytes) -> str:
    """One request from a new client socket (a new session), asked again until the first
    answer (the proxy may still be binding its UDP port)."""
    answers: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
        client.settimeout(1)
        client.connect(("127.0.0.1", port))

        def answered() -> bool:
            client.send(payload)
            try:
                answers.append(client.recv(2048).decode())
            except (TimeoutError, ConnectionRefusedError):
                return False
            return True

        wait_for(answered, 15, "an answer over UDP")
    return answers[0]


def both_udp(tmp_path: Path, lbproxy, ports: dict[str, int], run) -> tuple:
    nginx_port, lbproxy_port = free_port(), free_port()
    conf = render(DATA / "udp.conf", LB=nginx_port, **ports)
    with Nginx(tmp_path / "nginx", conf).start() as nginx:
        through_nginx = run(nginx_port)
        config = imported(nginx).replace(f":{nginx_port}", f":{lbproxy_port}")
    proxy = lbproxy(config)
    through_lbproxy = run(lbproxy_port)
    proxy.stop()
    return through_nginx, through_lbproxy
