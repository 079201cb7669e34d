"""Health of a UDP virtual server's real servers (SPEC §19), through a real `lbproxy`:
the `dns` check against real dnsmasq servers, the `udp` check against echo servers,
ICMP port unreachable on a session's socket as a passive failure that moves sessions,
and a passively-down server's answered trial session bringing it back (on both relays:
the compiled one and LBPROXY_PURE=1's)."""

from __future__ import annotations

import collections
import json
import socket

import pytest

from tests.integration.dnsmasq import Dnsmasq, requires_dnsmasq
from tests.integration.harness import (
    Echo,
    dig,
    free_port,
    metrics,
    requires_dig,
    run_cli,
    sample,
    wait_for,
)

FAST_CHECK = "interval: 100ms, timeout: 300ms, rise: 1, fall: 1"


@pytest.fixture(params=["default", "pure"])
def path(request, monkeypatch):
    if request.param == "pure":
        monkeypatch.setenv("LBPROXY_PURE", "1")
    return request.param


def up(admin: int, vs: str, rs: str) -> float:
    return sample(metrics(admin), "lbproxy_real_server_up", virtual_server=vs, real_server=rs)


def checked(admin: int, name: str, vs: str, rs: str, result: str) -> float:
    labels = (("real_server", rs), ("result", result), ("virtual_server", vs))
    return metrics(admin).get((name, labels), 0)


@requires_dnsmasq
@requires_dig
def test_dns_check_takes_a_stopped_or_nxdomain_server_out_and_back(tmp_path, lbproxy):
    one = Dnsmasq(tmp_path / "one").start(hosts={"svc.test": ["192.0.2.1"]})
    two = Dnsmasq(tmp_path / "two").start(hosts={"svc.test": ["192.0.2.2"]})
    empty = Dnsmasq(tmp_path / "empty").start(hosts={})  # svc.test: NXDOMAIN
    port, admin = free_port(), free_port()
    config = f"""
        global:
          admin: {{listen: 127.0.0.1:{admin}}}
          drain_timeout: 1s
        virtual_servers:
          - name: dns
            protocol: udp
            listen: 127.0.0.1:{port}
            scheduler: rr
            udp: {{responses: 1}}
            health_check: {{type: dns, query: svc.test, query_type: A, {FAST_CHECK}}}
            real_servers:
              - {{name: one, address: {one.address}}}
              - {{name: two, address: {two.address}}}
              - {{name: empty, address: {empty.address}}}
        """
    try:
        with lbproxy(config):
            wait_for(lambda: up(admin, "dns", "empty") == 0, what="NXDOMAIN: empty down")
            assert up(admin, "dns", "one") == up(admin, "dns", "two") == 1
            samples = metrics(admin)
            labels = {"virtual_server": "dns", "real_server": "empty"}
            assert sample(samples, "lbproxy_health_checks_total", **labels, result="fail") >= 1
            assert (
                sorted(dig(port, "svc.test") for _ in range(4))
                == ["192.0.2.1"] * 2 + ["192.0.2.2"] * 2
            )
            one.stop()  # nothing on its port: ICMP port unreachable, a failed check
            wait_for(lambda: up(admin, "dns", "one") == 0, what="stopped: one down")
            assert [dig(port, "svc.test") for _ in range(4)] == ["192.0.2.2"] * 4
            one.start()
            wait_for(lambda: up(admin, "dns", "one") == 1, what="started again: one up")
            assert (
                sorted(dig(port, "svc.test") for _ in range(4))
                == ["192.0.2.1"] * 2 + ["192.0.2.2"] * 2
            )
    finally:
        one.stop()
        two.stop()
        empty.stop()


def test_udp_check_takes_a_wrong_or_silent_server_out_and_back(lbproxy):
    a, b = Echo(b"pong "), Echo(b"pong ")
    port, admin = free_port(), free_port()
    config = f"""
        global:
          admin: {{listen: 127.0.0.1:{admin}}}
          drain_timeout: 1s
        virtual_servers:
          - name: game
            protocol: udp
            listen: 127.0.0.1:{port}
            scheduler: rr
            udp: {{responses: 1}}
            health_check: {{type: udp, send: "ping\\n", expect: "^pong ping", {FAST_CHECK}}}
            real_servers:
              - {{name: a, address: 127.0.0.1:{a.port}}}
              - {{name: b, address: 127.0.0.1:{b.port}}}
        """
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.settimeout(2)

    def answers(n: int) -> list[bytes]:
        out = []
        for i in range(n):
            client.sendto(b"q%d" % i, ("127.0.0.1", port))
            out.append(client.recvfrom(100)[0])
        return out

    try:
        with lbproxy(config):
            checks = ("lbproxy_health_checks_total", "game", "a", "ok")
            wait_for(lambda: checked(admin, *checks), what="a first check of a")
            a.reply = b"busy "  # a wrong answer: expect is not found
            wait_for(lambda: up(admin, "game", "a") == 0, what="wrong answer: a down")
            assert answers(3) == [b"pong q0", b"pong q1", b"pong q2"]
            a.reply = b"pong "
            wait_for(lambda: up(admin, "game", "a") == 1, what="right again: a up")
            b.close()  # silent port: the check's ICMP port unreachable
            wait_for(lambda: up(admin, "game", "b") == 0, what="closed: b down")
            assert answers(2) == [b"pong q0", b"pong q1"]
    finally:
        client.close()
        a.close()
        b.close()


def test_icmp_port_unreachable_is_a_passive_failure_and_sessions_move(lbproxy):
    a, b = Echo(b"a:"), Echo(b"b:")
    port, admin = free_port(), free_port()
    config = f"""
        global:
          admin: {{listen: 127.0.0.1:{admin}}}
          drain_timeout: 1s
        virtual_servers:
          - name: game
            protocol: udp
            listen: 127.0.0.1:{port}
            scheduler: rr
            real_servers:  # no health_check: passive health only (fall: 3)
              - {{name: a, address: 127.0.0.1:{a.port}}}
              - {{name: b, address: 127.0.0.1:{b.port}}}
        """
    clients = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(4)]
    try:
        with lbproxy(config):
            first = {}
            for client in clients:
                client.settimeout(2)
                client.sendto(b"hello", ("127.0.0.1", port))
                first[client] = client.recvfrom(100)[0][:2]
            assert sorted(first.values()) == [b"a:", b"a:", b"b:", b"b:"]
            a.close()
            # Each session on a: its next datagram is refused (ICMP), the session ends
            # and the client's next datagram opens one on b.
            for client in clients:
                client.settimeout(0.3)
                for _ in range(20):
                    client.sendto(b"again", ("127.0.0.1", port))
                    try:
                        reply = client.recvfrom(100)[0]
                    except TimeoutError:
                        continue
                    if reply == b"b:again":
                        break
                else:
                    raise AssertionError("this client's session never moved to b")
            wait_for(lambda: up(admin, "game", "a") == 0, what="a passively down")
            samples = metrics(admin)
            labels = {"virtual_server": "game", "real_server": "b"}
            assert sample(samples, "lbproxy_udp_active_sessions", **labels) == 4
    finally:
        for client in clients:
            client.close()
        a.close()
        b.close()


def test_a_passively_down_server_restarted_comes_back_once_its_trial_session_is_answered(
    lbproxy, path
):
    """Stopped, `a` goes down on ICMP port unreachable; restarted, the one trial session
    `interval` later is answered, which brings it up (as a TCP server's trial connect
    does), and new clients are shared by rr again."""
    a, b = Echo(b"a:"), Echo(b"b:")
    port, admin = free_port(), free_port()
    config = f"""
        global:
          admin: {{listen: 127.0.0.1:{admin}}}
          drain_timeout: 1s
        virtual_servers:
          - name: echo
            protocol: udp
            listen: 127.0.0.1:{port}
            scheduler: rr
            udp: {{idle_timeout: 30s}}
            health_check: {{type: none, interval: 300ms}}
            real_servers:
              - {{name: a, address: 127.0.0.1:{a.port}}}
              - {{name: b, address: 127.0.0.1:{b.port}}}
        """
    clients: list[socket.socket] = []

    def new_client_asks() -> bytes | None:
        """A new client address (a new session, picked by rr) sends one datagram."""
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        clients.append(client)
        client.settimeout(0.5)
        client.sendto(b"hi", ("127.0.0.1", port))
        try:
            return client.recvfrom(100)[0]
        except TimeoutError:  # a session on a stopped `a`: refused, no answer
            return None

    def answered_by(n: int) -> collections.Counter:
        return collections.Counter((new_client_asks() or b"--")[:2] for _ in range(n))

    try:
        with lbproxy(config) as proxy:
            assert answered_by(4) == {b"a:": 2, b"b:": 2}
            a.close()
            wait_for(
                lambda: [new_client_asks(), up(admin, "echo", "a") == 0][-1],
                what="stopped: a passively down",
            )
            assert "echo/a is down (udp port unreachable)" in proxy.log()
            a.restart()
            # New clients keep coming, as a service's do; one of them, `interval` after
            # the last failure, is a's trial session, and its answer brings a up.
            wait_for(
                lambda: new_client_asks() and up(admin, "echo", "a") == 1,
                timeout=5,
                what="restarted and answered: a up again",
                details=proxy.log,
            )
            assert "echo/a is up (udp reply)" in proxy.log()
            assert answered_by(20) == {b"a:": 10, b"b:": 10}
            status = run_cli("status", "--json", "--admin", f"http://127.0.0.1:{admin}")
            assert status.returncode == 0, status.stderr
            [vs] = json.loads(status.stdout)["virtual_servers"]
            assert {rs["name"]: rs["health"] for rs in vs["real_servers"]} == {
                "a": "up",
                "b": "up",
            }
    finally:
        for client in clients:
            client.close()
        a.close()
        b.close()
