"""The locator through a real `lbproxy run`: load reports and locate over HTTP, the DNS
locator over UDP and TCP with real clients (dig, dnspython), and bad input of every kind
(SPEC §10)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from http.client import HTTPConnection

import dns.exception
import dns.flags
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import dns.resolver
import pytest

from tests import tools
from tests.integration.harness import (
    accept_queue,
    admin_socket_path,
    ask_name,
    free_port,
    http,
    local_http,
    metrics,
    run_cli,
    sample,
    wait_for,
)

DIG = shutil.which("dig")
needs_dig = tools.requires("dig", package="bind9-dnsutils")


def locator_config(admin_port: int, dns_port: int, proxy_port: int, backends, extra="") -> str:
    """`db`: locator only, least-load from reports; `web`: proxied wlc; `empty`: none up."""
    a, b = backends
    return f"""
global:
  admin: {{listen: 127.0.0.1:{admin_port}}}
  drain_timeout: 2s
  locator:
    dns: {{listen: 127.0.0.1:{dns_port}, zone: lb.internal., ttl: 0}}
{extra}
virtual_servers:
  - name: db
    listen: none
    scheduler: least-load
    load_source: report
    health_check: {{type: none}}
    real_servers:
      - {{name: a, address: 127.0.0.1:{a.port}}}
      - {{name: b, address: 127.0.0.1:{b.port}, max_connections: 10}}
  - name: web
    listen: 127.0.0.1:{proxy_port}
    scheduler: wlc
    health_check: {{type: none}}
    real_servers:
      - {{name: a, address: 127.0.0.1:{a.port}}}
  - name: empty
    listen: none
    scheduler: lc
    real_servers:
      - {{name: x, address: "[::1]:{a.port}", state: disabled}}
"""


@pytest.fixture
def locator(name_servers, lbproxy):
    backends = name_servers("a", "b")
    admin_port, dns_port, proxy_port = free_port(), free_port(), free_port()
    proxy = lbproxy(locator_config(admin_port, dns_port, proxy_port, backends))
    return proxy, f"http://127.0.0.1:{admin_port}", dns_port, proxy_port, backends


def put_load(admin: str, rs: str, body, vs: str = "db", **kwargs) -> tuple[int, dict]:
    """A load report: over TCP with `token=` (None: no token), else through the admin
    socket (over TCP a change needs the token, SPEC §21)."""
    url = f"{admin}/api/v1/virtual-servers/{vs}/real-servers/{rs}/load"
    if "token" in kwargs:
        status, answer = http("PUT", url, body, **kwargs)
    else:
        status, answer = local_http("PUT", url, body)
    return status, json.loads(answer)


def locate(admin: str, vs: str = "db", current: str | None = None) -> tuple[int, dict]:
    query = f"?current={current}" if current else ""
    status, answer = http("GET", f"{admin}/api/v1/virtual-servers/{vs}/locate{query}")
    return status, json.loads(answer)


def test_reports_and_locate_give_geodes_arithmetic(locator):
    _, admin, _, _, (_, b) = locator
    assert put_load(admin, "a", {"load": 0.4, "per_connection": 0.1})[0] == 200
    status, answer = put_load(admin, "b", {"load": 0.2, "per_connection": 0.1})
    assert (status, answer["load"], answer["per_connection"]) == (200, 0.2, 0.1)
    answers = [locate(admin)[1] for _ in range(6)]
    assert [x["real_server"] for x in answers] == ["b", "b", "a", "b", "a", "b"]
    assert [x["load"] for x in answers] == [0.3, 0.4, 0.5, 0.5, 0.6, 0.6]
    assert answers[0]["address"] == f"127.0.0.1:{b.port}"
    samples = metrics(int(admin.rsplit(":", 1)[1]))
    answered = "lbproxy_locator_answers_total"
    assert sample(samples, answered, virtual_server="db", real_server="a", via="http") == 2
    assert sample(samples, answered, virtual_server="db", real_server="b", via="http") == 4
    assert sample(samples, "lbproxy_load_reports_total", virtual_server="db", real_server="a") == 1
    assert sample(
        samples, "lbproxy_real_server_load", virtual_server="db", real_server="a"
    ) == pytest.approx(0.6)
    # per_connection left out: 1 / max_connections (b has 10), 0 without (a)
    assert put_load(admin, "b", {"load": 0.0})[1]["per_connection"] == 0.1
    assert put_load(admin, "a", {"load": 0.05})[1]["per_connection"] == 0


def test_head_on_locate_is_405_and_steers_nothing(locator):
    # a locate answer is a pick that is counted; a HEAD (a monitor, a link checker) sends
    # no client anywhere, so it must not count one: 405, and GET is what to use
    _, admin, _, _, _ = locator
    put_load(admin, "a", {"load": 0.0, "per_connection": 0.1})
    put_load(admin, "b", {"load": 0.05, "per_connection": 0.1})
    port = int(admin.rsplit(":", 1)[1])
    for _ in range(2):  # what `curl -I` sends
        connection = HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("HEAD", "/api/v1/virtual-servers/db/locate")
        response = connection.getresponse()
        assert response.status == 405
        assert response.read() == b""  # a HEAD answer has no body
        connection.close()
    samples = metrics(port)
    for rs in "ab":
        key = (
            "lbproxy_locator_answers_total",
            (("real_server", rs), ("via", "http"), ("virtual_server", "db")),
        )
        assert samples.get(key, 0) == 0
    # no estimate was added: the next GET gets a at 0.1, as if no HEAD had come
    status, answer = locate(admin)
    assert (status, answer["real_server"], answer["load"]) == (200, "a", 0.1)
    # HEAD on a read-only route still answers as GET
    assert http("HEAD", f"{admin}/api/v1/virtual-servers/db")[0] == 200


def test_replace_answers_geodes_question(locator):
    _, admin, _, _, _ = locator
    put_load(admin, "a", {"load": 0.3, "per_connection": 0.1})
    put_load(admin, "b", {"load": 0.0, "per_connection": 0.1})
    status, answer = locate(admin, current="a")  # 3 steps apart: tolerated (threshold 10)
    assert (status, answer["real_server"], answer["replace"]) == (200, "a", False)
    put_load(admin, "a", {"load": 1.0, "per_connection": 0.1})  # 10 steps: rebalance
    moves = [locate(admin, current="a")[1]["replace"] for _ in range(6)]
    assert moves == [True] * 5 + [False]
    # 0.5 each now; a server the locator does not know is replaced (tie: a, answered
    # longest ago), and the answer counts
    a_port = locate(admin, current="a")[1]["address"]
    assert locate(admin, current="gone")[1] == {
        "real_server": "a",
        "address": a_port,
        "load": 0.6,
        "replace": True,
    }


@pytest.mark.parametrize(
    "body",
    [
        {"load": -0.1},
        {"load": "0.4"},
        {"load": True},
        {"load": None},
        {"per_connection": 0.1},
        {"load": 0.4, "per_connection": -1},
        {"load": 0.4, "extra": 1},
        [0.4],
        "0.4",
    ],
)
def test_bad_report_is_400_and_changes_nothing(locator, body):
    _, admin, _, _, _ = locator
    put_load(admin, "a", {"load": 0.4, "per_connection": 0.1})
    status, answer = put_load(admin, "a", body)
    assert status == 400 and answer["error"]
    assert locate(admin, current="a")[1]["load"] == 0.4  # unchanged, nothing counted


def test_raw_bad_bodies_and_names(locator):
    _, admin, _, _, _ = locator
    url = f"{admin}/api/v1/virtual-servers/db/real-servers/a/load"
    unix = admin_socket_path(int(admin.rsplit(":", 1)[1]))
    bodies = [(b"{not json", b"400"), (b'{"load": NaN}', b"400"), (b'{"load": Infinity}', b"400")]
    bodies.append((b"x" * (65 * 1024), b"413"))  # over 64 KiB: 413, as a PATCH (and nginx)
    for raw, expected in bodies:
        request = subprocess.run(
            ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "PUT", "--data-binary",
             "@-", "--unix-socket", unix, url],
            input=raw, capture_output=True, timeout=10, check=True,
        )  # fmt: skip
        assert request.stdout == expected, raw[:20]
    assert put_load(admin, "zz", {"load": 1})[0] == 404
    assert put_load(admin, "a", {"load": 1}, vs="nope")[0] == 404
    assert locate(admin, vs="nope")[0] == 404
    assert locate(admin, vs="empty") == (503, {"error": "no real server available"})
    assert http("POST", f"{admin}/api/v1/virtual-servers/db/locate", {})[0] == 405
    samples = metrics(int(admin.rsplit(":", 1)[1]))
    assert sample(samples, "lbproxy_load_reports_total", virtual_server="db", real_server="a") == 0


def test_reports_need_the_token(name_servers, lbproxy, tmp_path):
    backends = name_servers("a", "b")
    admin_port, dns_port, proxy_port = free_port(), free_port(), free_port()
    token_file = tmp_path / "admin.token"
    token_file.write_text("t0ken\n")
    token_file.chmod(0o600)
    config = locator_config(admin_port, dns_port, proxy_port, backends).replace(
        f"listen: 127.0.0.1:{admin_port}}}",
        f"listen: 127.0.0.1:{admin_port}, token_file: {token_file}}}",
    )
    lbproxy(config)
    admin = f"http://127.0.0.1:{admin_port}"
    assert put_load(admin, "a", {"load": 0.4}, token=None)[0] == 401
    assert put_load(admin, "a", {"load": 0.4}, token="wrong")[0] == 403
    assert put_load(admin, "a", {"load": 0.4}, token="t0ken")[0] == 200
    assert locate(admin)[0] == 200  # GETs need no token


def test_reload_keeps_reports_and_check_and_status_show_locator_only(locator):
    proxy, admin, _, _, _ = locator
    put_load(admin, "a", {"load": 0.7, "per_connection": 0.1})
    proxy.reload()
    assert "db: locator only" not in proxy.log().split("reloaded")[-1]
    assert locate(admin, current="a")[1]["load"] == 0.7
    checked = run_cli("check", str(proxy.config_path))
    assert checked.returncode == 0
    assert "listen      none (locator only)" in checked.stdout
    assert "DNS locator 127.0.0.1" in checked.stdout
    # db's a has no max_connections: each answer adds 0 to its load until it reports one
    [warning] = [line for line in checked.stderr.splitlines() if line.startswith("warning: ")]
    assert warning.startswith(f"warning: {proxy.config_path}:") and "db/a has no max_" in warning
    status = run_cli("status", "--admin", admin)
    assert status.returncode == 0, status.stderr
    assert "locator" in status.stdout and "0.7" in status.stdout  # (wrapped at 120 columns)
    document = json.loads(run_cli("status", "--admin", admin, "--json").stdout)
    db = next(vs for vs in document["virtual_servers"] if vs["name"] == "db")
    assert db["listen"] == [] and db["real_servers"][0]["load"] == 0.7
    assert [vs["name"] for vs in document["virtual_servers"]] == ["db", "web", "empty"]


# -- DNS ---------------------------------------------------------------------------------


def dig(port: int, *args: str) -> str:
    out = subprocess.run(
        [DIG, "@127.0.0.1", "-p", str(port), "+time=3", "+tries=1", *args],
        capture_output=True, text=True, timeout=15,
    )  # fmt: skip
    return out.stdout


def status_of(text: str) -> str:
    return text.split("status: ", 1)[1].split(",", 1)[0]


@needs_dig
def test_dig_over_udp_and_tcp(locator):
    _, admin, dns_port, _, (_, b) = locator
    put_load(admin, "a", {"load": 0.1, "per_connection": 0.1})
    put_load(admin, "b", {"load": 0.0, "per_connection": 0.1})
    # b is less loaded: answered; then level, and a (answered longest ago); then b
    short = [dig(dns_port, "+notcp", "+short", "db.lb.internal", "A") for _ in range(2)]
    assert short == ["127.0.0.1\n"] * 2
    srv = dig(dns_port, "+tcp", "_db._tcp.lb.internal", "SRV")
    assert status_of(srv) == "NOERROR" and "flags: qr aa" in srv
    assert f"IN\tSRV\t0 0 {b.port} b.db.lb.internal." in srv
    assert "b.db.lb.internal.\t0\tIN\tA\t127.0.0.1" in srv.split("ADDITIONAL SECTION")[1]
    target = dig(dns_port, "+notcp", "+short", "B.DB.lb.internal", "A")  # no case in DNS
    assert target == "127.0.0.1\n"
    assert status_of(dig(dns_port, "nope.lb.internal", "A")) == "NXDOMAIN"
    assert status_of(dig(dns_port, "+tcp", "example.com", "A")) == "REFUSED"
    assert status_of(dig(dns_port, "empty.lb.internal", "A")) == "SERVFAIL"
    assert status_of(dig(dns_port, "db.lb.internal", "TXT")) == "NOERROR"  # no data
    samples = metrics(int(admin.rsplit(":", 1)[1]))
    answered = "lbproxy_locator_answers_total"
    assert sample(samples, answered, virtual_server="db", real_server="b", via="dns") == 2
    assert sample(samples, answered, virtual_server="db", real_server="a", via="dns") == 1
    assert sample(samples, "lbproxy_dns_queries_total", rcode="NXDOMAIN") == 1
    assert sample(samples, "lbproxy_dns_queries_total", rcode="REFUSED") == 1
    assert sample(samples, "lbproxy_dns_queries_total", rcode="SERVFAIL") == 1


def test_dnspython_resolver(locator):
    _, admin, dns_port, _, (a, b) = locator
    put_load(admin, "a", {"load": 0.0, "per_connection": 0.5})
    put_load(admin, "b", {"load": 0.2, "per_connection": 0.5})
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = ["127.0.0.1"]
    resolver.port = dns_port
    resolver.cache = None
    answer = resolver.resolve("_db._tcp.lb.internal.", "SRV", tcp=True)
    assert [(r.port, str(r.target)) for r in answer] == [(a.port, "a.db.lb.internal.")]
    assert answer.rrset.ttl == 0
    answer = resolver.resolve("_db._tcp.lb.internal.", "SRV")  # a is at 0.5 now: b
    assert [r.port for r in answer] == [b.port]
    assert [r.address for r in resolver.resolve("db.lb.internal.", "A")] == ["127.0.0.1"]
    with pytest.raises(dns.resolver.NXDOMAIN):
        resolver.resolve("nothing.lb.internal.", "A")
    with pytest.raises(dns.resolver.NoAnswer):  # db's servers are IPv4
        resolver.resolve("db.lb.internal.", "AAAA")


def test_garbage_and_truncated_packets_never_hurt(locator):
    _, admin, dns_port, _, _ = locator
    query = dns.message.make_query("db.lb.internal.", "A").to_wire()
    junk = [b"", b"\x00", b"\x12\x34" + b"\xff" * 10, query[:15], query + b"\x00" * 7,
            bytes(range(256)), b"\x00\x01\x81\x00" + b"\x00" * 8]  # fmt: skip
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(0.5)
        for packet in junk:
            sock.sendto(packet, ("127.0.0.1", dns_port))
            try:
                answer = dns.message.from_wire(sock.recv(4096))
            except TimeoutError:
                continue  # dropped: allowed
            assert answer.rcode() in (dns.rcode.FORMERR, dns.rcode.NOERROR)
            assert answer.flags & dns.flags.QR
    # a truncated query over TCP: announced 40 bytes, sends 10, closes
    with socket.create_connection(("127.0.0.1", dns_port), timeout=5) as sock:
        sock.sendall(b"\x00\x28" + query[:10])
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(100) == b""
    reply = dns.query.udp(dns.message.make_query("db.lb.internal.", "A"), "127.0.0.1",
                          port=dns_port, timeout=3)  # fmt: skip
    assert reply.rcode() == dns.rcode.NOERROR and reply.answer
    samples = metrics(int(admin.rsplit(":", 1)[1]))
    assert sample(samples, "lbproxy_dns_queries_total", rcode="FORMERR") >= 1
    assert sample(samples, "lbproxy_dns_queries_total", rcode="dropped") >= 1


def test_a_stalled_tcp_client_is_dropped_and_blocks_nobody(locator):
    _, _, dns_port, _, _ = locator
    query = dns.message.make_query("db.lb.internal.", "A")
    wire = query.to_wire()
    with socket.create_connection(("127.0.0.1", dns_port), timeout=10) as stalled:
        stalled.sendall(len(wire).to_bytes(2, "big") + wire[:5])  # half, then nothing
        started = time.monotonic()
        # meanwhile others are answered at once, over TCP and UDP
        for _ in range(3):
            assert dns.query.tcp(query, "127.0.0.1", port=dns_port, timeout=1).answer
            assert dns.query.udp(query, "127.0.0.1", port=dns_port, timeout=1).answer
        assert stalled.recv(100) == b""  # closed by the server (TCP_TIMEOUT, 2 s)
        waited = time.monotonic() - started
        assert 1.0 < waited < 6.0


# serial: it counts rate-limited queries, and beside other tests the kernel drops some
# before lbproxy reads them (4,550 counted of the 5,000 expected in a parallel CI run).
@pytest.mark.serial
def test_a_flood_of_udp_queries_leaves_the_proxy_serving(locator):
    _, admin, dns_port, proxy_port, _ = locator
    wire = dns.message.make_query("_db._tcp.lb.internal.", "SRV").to_wire()
    answered = 0
    stop = threading.Event()

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.connect(("127.0.0.1", dns_port))
        sock.settimeout(0.2)

        def read() -> None:
            nonlocal answered
            while not stop.is_set():
                try:
                    if dns.message.from_wire(sock.recv(4096)).answer:
                        answered += 1
                except TimeoutError:
                    continue
                except OSError:
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        flood_started = time.monotonic()
        deadline = flood_started + 20
        for i in range(10_000):  # bounded in count and in time
            sock.send(wire)
            if i % 50 == 49:
                time.sleep(0.01)  # at most ~5,000 a second: a flood, not a socket overrun
                # proxied connections and the admin endpoint serve during the flood
                if i % 2500 == 2499:
                    assert ask_name(proxy_port) == "a"
                    assert http("GET", f"{admin}/healthz")[0] == 200
            assert time.monotonic() < deadline
        time.sleep(1.0)  # on purpose: answers still on their way come in (no count to wait for)
        stop.set()
        reader.join(5)
    # One source: the rate limit (100 answers a second per /24 by default) answers a
    # few hundred of them; the rest are dropped or slipped (TC=1, no answer section).
    assert 100 <= answered <= 100 * (time.monotonic() - flood_started + 2)
    assert ask_name(proxy_port) == "a"
    assert http("GET", f"{admin}/healthz")[0] == 200
    reply = dns.query.udp(dns.message.make_query("db.lb.internal.", "A"), "127.0.0.1",
                          port=dns_port, timeout=3)  # fmt: skip
    assert reply.answer
    samples = metrics(int(admin.rsplit(":", 1)[1]))
    assert sample(samples, "lbproxy_dns_queries_total", rcode="NOERROR") >= answered
    assert sample(samples, "lbproxy_dns_queries_total", rcode="ratelimited") > 5000


def test_workers_share_reports_and_locate(name_servers, lbproxy):
    backends = name_servers("a", "b")
    admin_port, dns_port, proxy_port = free_port(), free_port(), free_port()
    config = locator_config(admin_port, dns_port, proxy_port, backends, extra="  workers: 2")
    lbproxy(config)  # ready: /readyz answers 200, in both workers
    admin = f"http://127.0.0.1:{admin_port}"
    assert put_load(admin, "a", {"load": 0.4, "per_connection": 0.1})[0] == 200
    assert put_load(admin, "b", {"load": 0.9, "per_connection": 0.1})[0] == 200
    assert put_load(admin, "b", {"load": -1})[0] == 400
    for index in (1, 2):  # the report reached every worker
        status, body = http("GET", f"{admin}/api/v1/workers/{index}/virtual-servers")
        assert status == 200
        db = next(vs for vs in json.loads(body)["virtual_servers"] if vs["name"] == "db")
        assert [rs["load"] for rs in db["real_servers"]] == [0.4, 0.9]
    # locate goes to one worker at a time, round robin: each its own locator
    loads = [locate(admin)[1] for _ in range(4)]
    assert [x["real_server"] for x in loads] == ["a"] * 4
    assert sorted(x["load"] for x in loads) == [0.5, 0.5, 0.6, 0.6]
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers, resolver.port, resolver.cache = ["127.0.0.1"], dns_port, None
    assert [r.port for r in resolver.resolve("_db._tcp.lb.internal.", "SRV")] == [backends[0].port]


def test_dns_port_in_use_is_exit_1_naming_it(name_servers, lbproxy):
    backends = name_servers("a", "b")
    admin_port, dns_port, proxy_port = free_port(), free_port(), free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", dns_port))
        proxy = lbproxy(locator_config(admin_port, dns_port, proxy_port, backends), start=False)
        with pytest.raises(RuntimeError, match="exited 1"):
            proxy.start()
        assert f"cannot listen on 127.0.0.1:{dns_port} (DNS locator)" in proxy.log()
        proxy.stop()


def test_tcp_clients_are_limited_and_the_limit_frees_up(locator):
    _, _, dns_port, _, _ = locator
    query = dns.message.make_query("db.lb.internal.", "A")
    held = []
    try:
        for i in range(64):  # MAX_TCP_CLIENTS, each silent, 8 per /24 (the cap is 16)
            source = (f"127.{i // 8 + 1}.0.{i % 8 + 1}", 0)
            held.append(socket.create_connection(("127.0.0.1", dns_port), 5, source))
        wait_for(lambda: accept_queue(dns_port) == 0, what="the 64 accepted (and counted)")
        with socket.create_connection(("127.0.0.1", dns_port), 5, ("127.20.0.1", 0)) as extra:
            assert extra.recv(10) == b""  # the 65th is closed at once, from a new source
        assert dns.query.udp(query, "127.0.0.1", port=dns_port, timeout=2).answer
    finally:
        for sock in held:
            sock.close()

    def answered_over_tcp() -> bool:  # once their tasks have ended
        try:
            return bool(dns.query.tcp(query, "127.0.0.1", port=dns_port, timeout=2).answer)
        except (OSError, EOFError, dns.exception.DNSException):
            return False

    wait_for(answered_over_tcp, what="a TCP client admitted again")


def test_simulate_locate_from_the_command_line(tmp_path):
    config = tmp_path / "db.yaml"
    config.write_text(
        "virtual_servers:\n"
        "  - {name: db, listen: none, scheduler: least-load, load_source: report,\n"
        "     real_servers: [{name: a, address: 127.0.0.1:7001},"
        " {name: b, address: 127.0.0.1:7002}]}\n"
    )
    events = tmp_path / "events.yaml"
    events.write_text(
        "- {before: 1, report: {a: {load: 0.4, per_connection: 0.1},"
        " b: {load: 0.2, per_connection: 0.1}}}\n"
    )
    args = ["simulate", str(config), "-n", "6", "--events", str(events)]
    out = run_cli(*args, "--locate", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["sequence"] == ["b", "b", "a", "b", "a", "b"]
    explained = run_cli(*args, "--locate", "--explain").stdout
    assert "#6 t=0.50s -> b  [a=0.6, b=0.5]" in explained
    refused = run_cli(*args, "--locate", "--hold")
    assert refused.returncode == 2 and "exclude each other" in refused.stderr


# -- affinity for the asking client: maglev and persistence (SPEC §10, §12) -------------

SOURCES = [f"127.0.0.{n}" for n in range(2, 34)]  # 32 loopback source addresses


def affinity_config(admin_port: int, dns_port: int, ports: list[int], extra: str = "") -> str:
    """`cache`: maglev over four servers; `sticky`: rr with persistence; locator only."""
    servers = "".join(
        f"      - {{name: s{i}, address: 127.0.0.1:{port}}}\n" for i, port in enumerate(ports)
    )
    return (
        "global:\n"
        f"  admin: {{listen: 127.0.0.1:{admin_port}}}\n"
        f"  locator:\n    dns: {{listen: 127.0.0.1:{dns_port}, zone: lb.internal., ttl: 0}}\n"
        f"{extra}"
        "virtual_servers:\n"
        "  - name: cache\n    listen: none\n    scheduler: maglev\n"
        "    health_check: {type: none}\n    real_servers:\n" + servers + "  - name: sticky\n"
        "    listen: none\n    scheduler: rr\n    persistence: {timeout: 1m}\n"
        "    health_check: {type: none}\n    real_servers:\n" + servers
    )


def locate_from(admin_port: int, source: str, vs: str, headers=None) -> str:
    """GET .../locate over a connection from `source` (a bound 127.0.0.x address)."""
    connection = HTTPConnection("127.0.0.1", admin_port, timeout=10, source_address=(source, 0))
    try:
        connection.request("GET", f"/api/v1/virtual-servers/{vs}/locate", headers=headers or {})
        response = connection.getresponse()
        assert response.status == 200
        return json.loads(response.read())["real_server"]
    finally:
        connection.close()


def dns_locate_from(dns_port: int, source: str, vs: str, tcp: bool = False) -> str:
    """The SRV target's real server for `_VS._tcp`, asked from `source` (UDP or TCP)."""
    query = dns.message.make_query(f"_{vs}._tcp.lb.internal.", "SRV")
    ask = dns.query.tcp if tcp else dns.query.udp
    answer = ask(query, "127.0.0.1", timeout=5, port=dns_port, source=source)
    (srv,) = answer.answer[0]
    return srv.target.labels[0].decode()


@pytest.fixture
def affinity(name_servers, lbproxy):
    ports = [free_port() for _ in range(4)]  # nothing need listen: a locate only names them
    admin_port, dns_port = free_port(), free_port()
    proxy = lbproxy(affinity_config(admin_port, dns_port, ports))
    return proxy, admin_port, dns_port


def test_maglev_locate_gives_each_asking_address_its_own_server(affinity):
    _, admin_port, dns_port = affinity
    # The same asker, the same answer, over and over (HTTP and DNS alike).
    assert len({locate_from(admin_port, "127.0.0.1", "cache") for _ in range(8)}) == 1
    answers = {}
    for source in SOURCES:
        by_http = [locate_from(admin_port, source, "cache") for _ in range(3)]
        by_udp = [dns_locate_from(dns_port, source, "cache") for _ in range(2)]
        by_tcp = dns_locate_from(dns_port, source, "cache", tcp=True)
        assert len({*by_http, *by_udp, by_tcp}) == 1, (source, by_http, by_udp, by_tcp)
        answers[source] = by_http[0]
    # Different askers are spread over the servers (a fixed hash: this never varies;
    # 32 addresses on one server of four would be a 4^-31 chance).
    assert len(set(answers.values())) >= 2, answers
    # The supervisor's header naming another asker is not heeded from a TCP client.
    mine = locate_from(admin_port, "127.0.0.1", "cache")
    other = next(source for source, name in answers.items() if name != mine)
    spoofed = {"X-Lbproxy-Client": f"{other} 0"}
    assert locate_from(admin_port, "127.0.0.1", "cache", spoofed) == mine


def test_persistence_keeps_a_locating_client_on_its_server(affinity):
    _, admin_port, dns_port = affinity
    samples = metrics(admin_port)
    assert sample(samples, "lbproxy_persistence_entries", virtual_server="sticky") == 0
    # rr alone would alternate; the entry made by each answer keeps its asker in place
    first = [locate_from(admin_port, source, "sticky") for source in SOURCES[:4]]
    assert first == ["s0", "s1", "s2", "s3"]  # one miss each: rr picks
    again = [locate_from(admin_port, source, "sticky") for source in SOURCES[:4] * 3]
    assert again == first * 3  # twelve hits
    assert [dns_locate_from(dns_port, source, "sticky") for source in SOURCES[:4]] == first
    samples = metrics(admin_port)
    lookups = {
        result: sample(
            samples, "lbproxy_persistence_lookups_total", virtual_server="sticky", result=result
        )
        for result in ("hit", "miss", "moved")
    }
    assert lookups == {"hit": 16, "miss": 4, "moved": 0}
    assert sample(samples, "lbproxy_persistence_entries", virtual_server="sticky") == 4


def test_workers_pass_the_asking_address_on(name_servers, lbproxy):
    ports = [free_port() for _ in range(4)]
    admin_port, dns_port = free_port(), free_port()
    # ready: /readyz answers 200, in both workers
    lbproxy(affinity_config(admin_port, dns_port, ports, extra="  workers: 2\n"))
    # maglev: every worker has the same table, so round robin over them changes nothing
    answers = {}
    for source in SOURCES[:8]:
        seen = {locate_from(admin_port, source, "cache") for _ in range(4)}
        assert len(seen) == 1, (source, seen)
        answers[source] = seen.pop()
    assert len(set(answers.values())) >= 2, answers
    # a client's own header is not passed on: the supervisor names its peer
    mine = locate_from(admin_port, "127.0.0.1", "cache")
    other = next(source for source, name in answers.items() if name != mine)
    spoofed = {"X-Lbproxy-Client": f"{other} 0"}
    assert {locate_from(admin_port, "127.0.0.1", "cache", spoofed) for _ in range(2)} == {mine}
    # persistence (a table per worker): a client is asked of one worker, and stays
    for source in SOURCES[:4]:
        assert len({locate_from(admin_port, source, "sticky") for _ in range(4)}) == 1
    samples = metrics(admin_port)  # the supervisor's: the workers' counters added up
    hits = sample(
        samples, "lbproxy_persistence_lookups_total", virtual_server="sticky", result="hit"
    )
    assert hits == 12
