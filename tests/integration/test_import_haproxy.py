"""`lbproxy import` against the real thing: HAProxy 2.6 runs a configuration of
tests/data/import/haproxy/ (examples of its manual, lbproxy's own configs/ written back)
and `lbproxy run` runs what `lbproxy import` made of it, both in front of the same real
servers (that say their name); the same clients, in the same order, must meet the same
servers (SPEC §25): round robin in the same sequence, leastconn with the same counts,
`balance source` keeping each client on one server, the same SNI routes for real TLS
ClientHellos, the same ACL decisions for 127.0.0.1 and 127.0.0.2, and a killed server
taken out by both."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.factories import real_hello
from tests.integration.harness import (
    NameServer,
    free_port,
    http,
    listening,
    wait_for,
)
from tests.integration.real_haproxy import Haproxy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

DATA = Path(__file__).resolve().parents[1] / "data" / "import" / "haproxy"


class Pair:
    """HAProxy on a configuration of DATA and lbproxy on its import, with the same real
    servers: every `127.0.0.1:PORT` of the file is moved to a free port (HAProxy's and
    lbproxy's listeners each to their own, the servers' to the NameServers')."""

    def __init__(
        self,
        tmp_path: Path,
        name: str,
        servers: dict[str, NameServer],
        lbproxy,
        started: list[Haproxy],
        edit: tuple[str, str] = ("", ""),
    ):
        text = (DATA / name).read_text().replace(*edit) if edit[0] else (DATA / name).read_text()
        server_ports = {
            f"127.0.0.1:{p}" for p in re.findall(r"server \S+ 127\.0\.0\.1:(\d+)", text)
        }
        self.listen_ports: dict[int, tuple[int, int]] = {}  # the file's: (haproxy, lbproxy)
        for port in sorted({int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", text)}):
            if f"127.0.0.1:{port}" not in server_ports:
                self.listen_ports[port] = (free_port(), free_port())
        by_port = {}
        for match in re.finditer(r"server (\S+) 127\.0\.0\.1:(\d+)", text):
            by_port[match.group(2)] = servers[match.group(1)].port

        def moved(which: int) -> str:
            def to(match: re.Match) -> str:
                port = match.group(1)
                if port in by_port:
                    return f"127.0.0.1:{by_port[port]}"
                return f"127.0.0.1:{self.listen_ports[int(port)][which]}"

            return re.sub(r"127\.0\.0\.1:(\d+)", to, text)

        for folder in (tmp_path, tmp_path / "haproxy"):  # the `-f` lists, beside each
            folder.mkdir(exist_ok=True)
            for listed in DATA.iterdir():
                if listed.suffix not in (".cfg", ".md"):
                    (folder / listed.name).write_text(listed.read_text())
        self.haproxy = Haproxy(
            tmp_path / "haproxy", moved(0), [p for p, _ in self.listen_ports.values()]
        )
        started.append(self.haproxy)  # stopped by the fixture, whatever fails below
        self.haproxy.start()
        source = tmp_path / "lbproxy-side.cfg"
        source.write_text(moved(1))
        imported = subprocess.run(
            [sys.executable, "-m", "lbproxy", "import", str(source)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert imported.returncode == 0, imported.stderr
        document = yaml.safe_load(imported.stdout)
        self.admin_port = free_port()
        document.setdefault("global", {})["admin"] = {"listen": f"127.0.0.1:{self.admin_port}"}
        self.lbproxy = lbproxy(yaml.safe_dump(document, sort_keys=False))
        wait_for(
            lambda: all(listening(p) for _, p in self.listen_ports.values()),
            20,
            "lbproxy to listen",
        )

    def ports(self, file_port: int) -> tuple[int, int]:
        """HAProxy's and lbproxy's port for the file's listener `file_port`."""
        return self.listen_ports[file_port]

    def lbproxy_servers(self, virtual_server: str) -> dict[str, dict]:
        status, body = http("GET", f"http://127.0.0.1:{self.admin_port}/api/v1/virtual-servers")
        assert status == 200
        for vs in json.loads(body)["virtual_servers"]:
            if vs["name"] == virtual_server:
                return {rs["name"]: rs for rs in vs["real_servers"]}
        raise AssertionError(f"no virtual server {virtual_server}")


@pytest.fixture
def pair(tmp_path, lbproxy):
    started: list[Haproxy] = []

    def make(name: str, servers: dict[str, NameServer], edit=("", "")) -> Pair:
        return Pair(tmp_path, name, servers, lbproxy, started, edit)

    yield make
    for haproxy in started:
        haproxy.stop()


def servers_named(name_servers, *names: str) -> dict[str, NameServer]:
    return dict(zip(names, name_servers(*names), strict=True))


def first_line(s: socket.socket) -> str:
    """The real server's name: its first line. (The echo of what the client sent may
    follow in the same read: harness.read_name would wait for a line end after it.)"""
    data = b""
    while b"\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode() if b"\n" in data else ""


def name_from(port: int, source: str = "127.0.0.1", hello: bytes = b"") -> str:
    """The name of the real server a new connection from `source` meets ("" when the
    balancer closes it before a byte), after sending `hello` first."""
    with socket.socket() as s:
        s.settimeout(10)
        s.bind((source, 0))
        try:
            s.connect(("127.0.0.1", port))
            if hello:
                s.sendall(hello)
            return first_line(s)
        except ConnectionResetError:
            return ""


@pytest.mark.parametrize("balance", ["roundrobin", "static-rr"])
def test_round_robin_gives_the_same_sequence(pair, name_servers, balance):
    servers = servers_named(name_servers, "s1", "s2", "s3")
    both = pair("configs-rr.cfg", servers, ("balance roundrobin", f"balance {balance}"))
    wait_for(
        lambda: all(rs["health"] == "up" for rs in both.lbproxy_servers("rr-web").values()),
        30,
        "lbproxy's first checks",
    )
    haproxy_port, lbproxy_port = both.ports(8081)
    haproxy = [name_from(haproxy_port) for _ in range(9)]
    lbproxy = [name_from(lbproxy_port) for _ in range(9)]
    assert haproxy == ["s1", "s2", "s3"] * 3
    assert lbproxy == haproxy


def test_weighted_round_robin_gives_the_same_counts_each_cycle(pair, name_servers):
    # configs/wrr.yaml written back: weights 1 and 5, the spare disabled; HAProxy's
    # slowstart applies only to a server coming back, so no connection is made before
    # lbproxy's start-up ramp (10 s) is over: the weights, not the ramp, decide.
    servers = servers_named(name_servers, "s1", "s2", "spare")
    both = pair("configs-wrr.cfg", servers)
    wait_for(
        lambda: (
            [both.lbproxy_servers("wrr-web")[name]["weight"]["effective"] for name in ("s1", "s2")]
            == [1, 5]
        ),
        30,
        "lbproxy's slow start to end",
    )
    haproxy_port, lbproxy_port = both.ports(8082)
    for port in (haproxy_port, lbproxy_port):
        for _ in range(2):  # two whole cycles of 1 + 5
            cycle = [name_from(port) for _ in range(6)]
            assert sorted(cycle) == ["s1", "s2", "s2", "s2", "s2", "s2"], (port, cycle)


def test_leastconn_with_held_connections_gives_the_same_counts(pair, name_servers):
    servers = servers_named(name_servers, "api1", "api2", "api-sorry", "web1", "web2", "fallback")
    both = pair("configs-front-door.cfg", servers)
    haproxy_port, lbproxy_port = both.ports(8443)
    hello = real_hello("api.example.com")
    counts = {}
    for side, port in (("haproxy", haproxy_port), ("lbproxy", lbproxy_port)):
        opened = []
        for _ in range(6):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(hello)
            opened.append((s, first_line(s)))
        first = sorted(name for _, name in opened)
        # the first two api1 connections end; the next four fill api1 back up first
        closing = [s for s, name in opened if name == "api1"][:2]
        for s in closing:
            s.close()
        if side == "haproxy":
            wait_for(lambda: both.haproxy.active("tls-api", "api1") == 1, 20, "haproxy's count")
        else:
            wait_for(
                lambda: both.lbproxy_servers("tls-api")["api1"]["active_connections"] == 1,
                20,
                "lbproxy's count",
            )
        later = []
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(hello)
            later.append((s, first_line(s)))
        counts[side] = (first, sorted(name for _, name in later))
        for s, _ in opened + later:
            s.close()
    assert counts["haproxy"] == (["api1"] * 3 + ["api2"] * 3, ["api1"] * 3 + ["api2"])
    assert counts["lbproxy"] == counts["haproxy"]


def test_first_fills_each_server_to_its_maxconn_alike(pair, name_servers):
    servers = servers_named(name_servers, "s1", "s2", "s3")
    both = pair("configs-first.cfg", servers, ("maxconn 100", "maxconn 2"))
    for port in both.ports(8085):
        opened = []
        for _ in range(5):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            opened.append((s, first_line(s)))
        assert [name for _, name in opened] == ["s1", "s1", "s2", "s2", "s3"], port
        for s, _ in opened:
            s.close()


def test_sni_routes_real_client_hellos_alike(pair, name_servers):
    servers = servers_named(name_servers, "api1", "api2", "api-sorry", "web1", "web2", "fallback")
    both = pair("configs-front-door.cfg", servers)
    groups = {
        "api.example.com": {"api1", "api2"},
        "API.example.com": {"api1", "api2"},
        "example.com": {"web1", "web2"},
        "www.example.com": {"web1", "web2"},
        "other.example.org": {"fallback"},
        None: {"fallback"},
    }
    for port in both.ports(8443):
        for server_name, expected in groups.items():
            met = {name_from(port, hello=real_hello(server_name)) for _ in range(2)}
            assert met <= expected and met, (port, server_name, met)


def test_the_manuals_sni_list_routes_alike(pair, name_servers):
    servers = servers_named(name_servers, "allowed1", "allowed2", "sorry")
    both = pair("manual-sni.cfg", servers)
    for port in both.ports(8444):
        for server_name in ("www.example.com", "shop.example.com"):
            met = {name_from(port, hello=real_hello(server_name)) for _ in range(2)}
            assert met == {"allowed1", "allowed2"}, (port, server_name, met)
        for server_name in ("example.com", "mail.example.com", None):
            assert name_from(port, hello=real_hello(server_name)) == "sorry", (port, server_name)
    # the one difference, in the guide: without -i HAProxy matches the case as written,
    # lbproxy any case (DNS names are case-insensitive; clients send them in lower case)
    haproxy_port, lbproxy_port = both.ports(8444)
    assert name_from(haproxy_port, hello=real_hello("SHOP.example.com")) == "sorry"
    assert name_from(lbproxy_port, hello=real_hello("SHOP.example.com")).startswith("allowed")


def test_balance_source_keeps_each_client_on_one_server(pair, name_servers):
    servers = servers_named(name_servers, "s1", "s2", "i1", "i2")
    both = pair("manual-stick-src.cfg", servers)
    clients = [f"127.0.0.{n}" for n in range(1, 17)]
    for port in both.ports(8143):  # imap: balance source, hash-type consistent
        seen = {client: {name_from(port, client) for _ in range(3)} for client in clients}
        assert all(len(names) == 1 for names in seen.values()), (port, seen)
        assert set().union(*seen.values()) == {"i1", "i2"}, (port, seen)
    for port in both.ports(8443):  # https: roundrobin, stick on src
        seen = {client: {name_from(port, client) for _ in range(3)} for client in clients[:4]}
        assert all(len(names) == 1 for names in seen.values()), (port, seen)
        assert set().union(*seen.values()) == {"s1", "s2"}, (port, seen)
    # pop only stores (for smtp's lookups): its clients are not kept, in either
    haproxy_pop, lbproxy_pop = both.ports(8110)
    assert [name_from(haproxy_pop, "127.0.0.5") for _ in range(4)] == ["s1", "s2", "s1", "s2"]
    assert [name_from(lbproxy_pop, "127.0.0.5") for _ in range(4)] == ["s1", "s2", "s1", "s2"]


def test_src_acls_decide_alike(pair, name_servers):
    servers = servers_named(name_servers, "s1", "s2")
    both = pair("manual-src-acl.cfg", servers)
    for port in both.ports(8084):  # reject if banned (127.0.0.2)
        assert name_from(port, "127.0.0.1") in ("s1", "s2")
        assert name_from(port, "127.0.0.2") == ""
        assert name_from(port, "127.0.0.3") in ("s1", "s2")
    for port in both.ports(8087):  # accept if trusted (127.0.0.1), reject the rest
        assert name_from(port, "127.0.0.1") in ("s1", "s2")
        assert name_from(port, "127.0.0.2") == ""
        assert name_from(port, "127.0.0.3") == ""


def test_a_killed_server_goes_down_in_both(pair, name_servers):
    servers = servers_named(name_servers, "s1", "s2", "s3")
    both = pair("configs-rr.cfg", servers)
    wait_for(
        lambda: all(rs["health"] == "up" for rs in both.lbproxy_servers("rr-web").values()),
        30,
        "lbproxy's first checks",
    )
    servers["s2"].stop()
    wait_for(lambda: both.haproxy.server_status("rr-web", "s2").startswith("DOWN"), 30, "haproxy")
    wait_for(lambda: both.lbproxy_servers("rr-web")["s2"]["health"] == "down", 30, "lbproxy")
    for port in both.ports(8081):
        names = [name_from(port) for _ in range(4)]
        assert sorted(names) == ["s1", "s1", "s3", "s3"], (port, names)
        assert names[0] != names[1] and names[:2] == names[2:], (port, names)


def test_frontends_sharing_a_backend_share_its_servers_limits(pair, name_servers):
    # balance first with maxconn 2: clients coming in turn through ft_a and ft_b fill s1
    # with 2, then s2, in HAProxy; copies of the backend per frontend would let s1 take 4
    servers = servers_named(name_servers, "s1", "s2", "m1")
    both = pair("frontends-shared-backend.cfg", servers)
    for side in (0, 1):
        ft_a, ft_b = both.ports(8091)[side], both.ports(8092)[side]
        opened = []
        for port in (ft_a, ft_b, ft_a, ft_b):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            opened.append((s, first_line(s)))
        assert [name for _, name in opened] == ["s1", "s1", "s2", "s2"], side
        for s, _ in opened:
            s.close()


def test_accept_proxy_on_one_bind_leaves_the_other_plain(pair, name_servers):
    servers = servers_named(name_servers, "s1", "s2", "m1")
    both = pair("frontends-shared-backend.cfg", servers)
    for side in (0, 1):
        plain, with_proxy = both.ports(8093)[side], both.ports(8094)[side]
        assert name_from(plain) == "m1", side  # a plain client, no PROXY header
        header = f"PROXY TCP4 192.0.2.7 127.0.0.1 40000 {with_proxy}\r\n".encode()
        assert name_from(with_proxy, hello=header) == "m1", side
