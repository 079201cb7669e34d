"""What decides a UDP session's real server, through a real `lbproxy` (SPEC §19): every
scheduler, persistence by source address, `max_connections` counting sessions, and the
drops a user reads in /metrics, the JSON document and `lbproxy status` (`acl`,
`no_server`); `lbproxy check` and `run` refusing TCP-only keys at FILE:LINE."""

from __future__ import annotations

import json

import pytest

from lbproxy.core.schedulers import available
from lbproxy.core.udp_stats import DROP_REASONS
from tests.integration.harness import (
    Echo,
    free_port,
    metrics,
    run_cli,
    sample,
    udp_ask,
    udp_client,
    wait_for,
)

# What each scheduler needs beyond its name to run with no agent or report around.
EXTRA = {
    "dwd": "    snmp: {{port: {snmp}, interval: 1s, timeout: 100ms, on_no_answer: static}}\n",
    "dwr": "    snmp: {{port: {snmp}, interval: 1s, timeout: 100ms, on_no_answer: static}}\n",
    "least-load": "    load_source: snmp\n"
    "    snmp: {{port: {snmp}, interval: 1s, timeout: 100ms, on_no_answer: static}}\n",
}


def test_every_scheduler_opens_sessions_and_keeps_each_client_on_its_server(lbproxy):
    """One process, one UDP virtual server per scheduler in the registry, two echo real
    servers: six client addresses each get every answer byte-exact from one server
    (the session), and the schedulers that share by count or turn share 3 and 3."""
    servers = {"a": Echo(b"a:"), "b": Echo(b"b:")}
    admin = free_port()
    schedulers = available()
    assert {"rr", "wrr", "lc", "wlc", "first", "maglev", "sap"} <= set(schedulers)
    ports = {name: free_port() for name in schedulers}
    text = (
        f"global:\n  admin: {{listen: 127.0.0.1:{admin}}}\n  drain_timeout: 1s\nvirtual_servers:\n"
    )
    for name, port in ports.items():
        text += (
            f"  - name: vs-{name}\n    protocol: udp\n    listen: 127.0.0.1:{port}\n"
            f"    scheduler: {name}\n    udp: {{idle_timeout: 30s}}\n"
            + EXTRA.get(name, "").format(snmp=free_port())
            + "    real_servers:\n"
            + "".join(
                f"      - {{name: {rs}, address: 127.0.0.1:{echo.port}}}\n"
                for rs, echo in servers.items()
            )
        )
    clients = [udp_client(f"127.0.0.{20 + i}") for i in range(6)]
    try:
        with lbproxy(text):
            for name, port in ports.items():
                picked = []
                for i, sock in enumerate(clients):
                    first = udp_ask(sock, port, b"%d-0" % i)
                    assert first is not None and first[2:] == b"%d-0" % i, (name, first)
                    server = first[:2]
                    # Later datagrams of the client: the same session, the same server.
                    for j in (1, 2):
                        assert udp_ask(sock, port, b"%d-%d" % (i, j)) == server + b"%d-%d" % (i, j)
                    picked.append(server)
                shares = sorted((picked.count(b"a:"), picked.count(b"b:")))
                if name in ("rr", "wrr", "lc", "wlc", "sap"):
                    assert shares == [3, 3], (name, picked)
                if name == "first":
                    assert picked == [b"a:"] * 6  # the first available server, always
                samples = metrics(admin)
                opened = sum(
                    sample(
                        samples, "lbproxy_udp_sessions_total", virtual_server=f"vs-{name}",
                        real_server=rs,
                    )
                    for rs in servers
                )  # fmt: skip
                assert opened == 6, name  # one session per client address
    finally:
        for sock in clients:
            sock.close()
        for echo in servers.values():
            echo.close()


def test_persistence_sends_a_source_address_back_to_its_server(lbproxy):
    """`persistence` keys on the client's address: a new session from another port of
    the same host (here each DNS-like session ends with its one reply) goes back to the
    server the host used, where rr alone would alternate."""
    servers = {"a": Echo(b"a:"), "b": Echo(b"b:")}
    port, admin = free_port(), free_port()
    config = (
        f"global:\n  admin: {{listen: 127.0.0.1:{admin}}}\n  drain_timeout: 1s\n"
        "virtual_servers:\n  - name: dns\n    protocol: udp\n"
        f"    listen: 127.0.0.1:{port}\n    scheduler: rr\n    udp: {{responses: 1}}\n"
        "    persistence: {timeout: 60s}\n    real_servers:\n"
        + "".join(
            f"      - {{name: {rs}, address: 127.0.0.1:{echo.port}}}\n"
            for rs, echo in servers.items()
        )
    )
    hosts = [f"127.0.0.{40 + i}" for i in range(4)]
    try:
        with lbproxy(config):
            first = {}
            for host in hosts:
                sock = udp_client(host)
                first[host] = udp_ask(sock, port, b"q")[:2]
                sock.close()
            assert sorted(first.values()) == [b"a:", b"a:", b"b:", b"b:"]  # rr's own picks
            for _ in range(3):
                for host in hosts:
                    sock = udp_client(host)  # a new source port: a new session
                    assert udp_ask(sock, port, b"again")[:2] == first[host], host
                    sock.close()
            samples = metrics(admin)

            def lookups(result: str) -> float:
                return sample(
                    samples, "lbproxy_persistence_lookups_total", virtual_server="dns",
                    result=result,
                )  # fmt: skip

            assert (lookups("miss"), lookups("hit")) == (4, 12)
            opened = {
                rs: sample(
                    samples, "lbproxy_udp_sessions_total", virtual_server="dns", real_server=rs
                )
                for rs in servers
            }
            assert opened == {"a": 8, "b": 8}  # 16 sessions, each ended after its reply
    finally:
        for echo in servers.values():
            echo.close()


def test_max_connections_counts_sessions_and_drops_are_counted_by_reason(lbproxy):
    """`max_connections: 2` on each of two servers: four sessions fill them, a fifth
    client gets nothing (`no_server`), a denied source gets nothing (`acl`), and every
    reason is in /metrics, the JSON document and `lbproxy status`."""
    servers = {"a": Echo(b"a:"), "b": Echo(b"b:")}
    port, admin = free_port(), free_port()
    config = (
        f"global:\n  admin: {{listen: 127.0.0.1:{admin}}}\n  drain_timeout: 1s\n"
        "virtual_servers:\n  - name: game\n    protocol: udp\n"
        f"    listen: 127.0.0.1:{port}\n    scheduler: rr\n    udp: {{idle_timeout: 30s}}\n"
        "    deny: [127.0.0.9/32]\n    real_servers:\n"
        + "".join(
            f"      - {{name: {rs}, address: 127.0.0.1:{echo.port}, max_connections: 2}}\n"
            for rs, echo in servers.items()
        )
    )
    held = [udp_client() for _ in range(4)]
    late = udp_client(timeout=0.3)
    denied = udp_client("127.0.0.9", timeout=0.3)
    url = f"http://127.0.0.1:{admin}"
    try:
        with lbproxy(config):
            samples = metrics(admin)
            for reason in DROP_REASONS:  # every reason exported from the start
                assert sample(
                    samples, "lbproxy_udp_dropped_total", virtual_server="game", reason=reason
                ) == 0, reason  # fmt: skip
            answers = sorted(udp_ask(sock, port, b"hi") for sock in held)
            assert answers == [b"a:hi", b"a:hi", b"b:hi", b"b:hi"]
            assert udp_ask(late, port, b"hi") is None  # both servers hold their 2 sessions
            assert udp_ask(denied, port, b"hi") is None  # deny: 127.0.0.9
            samples = metrics(admin)
            dropped = {
                reason: sample(
                    samples, "lbproxy_udp_dropped_total", virtual_server="game", reason=reason
                )
                for reason in DROP_REASONS
            }
            assert dropped == {reason: 0 for reason in DROP_REASONS} | {"no_server": 1, "acl": 1}
            for rs in servers:
                labels = {"virtual_server": "game", "real_server": rs}
                assert sample(samples, "lbproxy_udp_active_sessions", **labels) == 2
                assert sample(samples, "lbproxy_active_connections", **labels) == 2
            # The held sessions still relay.
            assert (
                sorted(udp_ask(sock, port, b"on") for sock in held) == [b"a:on"] * 2 + [b"b:on"] * 2
            )
            document = json.loads(run_cli("status", "--admin", url, "--json").stdout)
            (vs,) = document["virtual_servers"]
            assert vs["udp"]["dropped"] == dropped
            lines = run_cli("status", "--admin", url).stdout.splitlines()
            header = next(i for i, line in enumerate(lines) if line.startswith("UDP_"))
            # sessions open, opened, datagrams in, out, dropped
            assert lines[header + 1].split() == ["game", "4", "4", "8", "8", "2"]
    finally:
        for sock in [*held, late, denied]:
            sock.close()
        for echo in servers.values():
            echo.close()


@pytest.mark.parametrize("command", ["check", "run"])
def test_tcp_only_keys_refused_at_file_and_line_tcp_and_udp_share_a_port(tmp_path, command):
    config = tmp_path / "lb.yaml"
    config.write_text(
        "virtual_servers:\n"
        "  - name: dns\n"
        "    protocol: udp\n"
        "    listen: 127.0.0.1:5300\n"
        "    sni: [a.example]\n"  # 5
        "    accept_proxy: true\n"  # 6
        "    send_proxy: v2\n"  # 7
        "    queue: {max: 10}\n"  # 8
        "    real_servers: [{name: a, address: 127.0.0.1:5301}]\n"
        "  - name: dns-tcp\n"  # the same address and port over TCP: no clash
        "    listen: 127.0.0.1:5300\n"
        "    real_servers: [{name: a, address: 127.0.0.1:5301}]\n"
    )
    out = run_cli(command, str(config))
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr
    for line, key in ((5, "sni"), (6, "accept_proxy"), (7, "send_proxy"), (8, "queue")):
        assert f"{config}:{line}: {key} is for TCP; a UDP virtual server refuses it" in out.stderr
    assert "clash" not in out.stderr
    # Without them, the same file is valid: a TCP and a UDP virtual server on one port.
    lines = config.read_text().splitlines(keepends=True)
    config.write_text("".join(lines[:4] + lines[8:]))
    if command == "check":
        out = run_cli("check", str(config))
        assert out.returncode == 0, out
        assert "dns-tcp" in out.stdout and "udp " in out.stdout


def test_max_sessions_per_source_counts_by_source_prefix(lbproxy):
    """`source_prefix: {v4: 24}`, `max_sessions_per_source: 2`: clients on 127.0.0.2 and
    127.0.0.3 take the two sessions of 127.0.0.0/24, a third address of that /24 is
    dropped (`per_source`), one of 127.0.1.0/24 is not. (IPv6's /64 default is a unit
    test, tests/unit/core/test_client_address.py: all of IPv6 loopback is ::1.)"""
    servers = {"a": Echo(b"a:")}
    port, admin = free_port(), free_port()
    config = (
        f"global:\n  admin: {{listen: 127.0.0.1:{admin}}}\n  drain_timeout: 1s\n"
        "virtual_servers:\n  - name: game\n    protocol: udp\n"
        f"    listen: 127.0.0.1:{port}\n    scheduler: rr\n"
        "    udp: {idle_timeout: 30s, max_sessions_per_source: 2, source_prefix: {v4: 24}}\n"
        f"    real_servers:\n      - {{name: a, address: 127.0.0.1:{servers['a'].port}}}\n"
    )

    def per_source() -> float:
        return sample(
            metrics(admin), "lbproxy_udp_dropped_total", virtual_server="game", reason="per_source"
        )

    two, three, four = udp_client("127.0.0.2"), udp_client("127.0.0.3"), udp_client("127.0.0.4")
    other = udp_client("127.0.1.5")
    try:
        with lbproxy(config):
            assert udp_ask(two, port, b"hi") == b"a:hi"
            assert udp_ask(three, port, b"hi") == b"a:hi"
            four.sendto(b"hi", ("127.0.0.1", port))
            wait_for(lambda: per_source() == 1, what="127.0.0.4 dropped per_source")
            assert udp_ask(other, port, b"hi") == b"a:hi"  # another /24
            assert udp_ask(two, port, b"again") == b"a:again"  # its session goes on
            assert per_source() == 1
    finally:
        for sock in (two, three, four, other):
            sock.close()
        servers["a"].close()
