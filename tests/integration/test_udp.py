"""A real `lbproxy` process with a UDP virtual server (SPEC §19): `dig` through it to two
real dnsmasq servers, and a TCP virtual server on the same address and port."""

from __future__ import annotations

import contextlib
import json
import socket
import threading

import pytest

from tests.integration.dnsmasq import Dnsmasq, requires_dnsmasq
from tests.integration.harness import (
    NameServer,
    ask_name,
    dig,
    free_port,
    metrics,
    requires_dig,
    run_cli,
    sample,
    wait_for,
)


@requires_dnsmasq
@requires_dig
def test_dig_through_udp_to_two_dnsmasq_rr_and_one_answer_per_session(tmp_path, lbproxy):
    one = Dnsmasq(tmp_path / "one").start(hosts={"svc.test": ["192.0.2.1"]})
    two = Dnsmasq(tmp_path / "two").start(hosts={"svc.test": ["192.0.2.2"]})
    port, admin = free_port(), free_port()
    try:
        with (
            NameServer("tcp-a") as tcp_a,
            lbproxy(
                f"""
            global:
              admin: {{listen: 127.0.0.1:{admin}}}
              access_log: true
            virtual_servers:
              - name: dns
                protocol: udp
                listen: 127.0.0.1:{port}
                scheduler: rr
                udp: {{responses: 1}}
                real_servers:
                  - {{name: one, address: {one.address}}}
                  - {{name: two, address: {two.address}}}
              - name: same-port-tcp
                listen: 127.0.0.1:{port}
                real_servers:
                  - {{name: a, address: 127.0.0.1:{tcp_a.server_address[1]}}}
            """,
                [port],
            ) as lb,
        ):
            answers = [dig(port, "svc.test") for _ in range(6)]
            assert sorted(answers) == ["192.0.2.1"] * 3 + ["192.0.2.2"] * 3
            assert answers[0] != answers[1]  # round robin: shared in turn
            # Each session ended with its one answer, one access-log line each.
            wait_for(lambda: lb.log().count("vs=dns ") == 6, what="six session lines")
            assert lb.log().count("end=responses") == 6
            # The TCP virtual server on the same port still serves TCP.
            assert ask_name(port) == "tcp-a"
            # What an operator reads: metrics, the JSON document, `lbproxy status`.
            samples = metrics(admin)
            for rs in ("one", "two"):
                labels = {"virtual_server": "dns", "real_server": rs}
                assert sample(samples, "lbproxy_udp_sessions_total", **labels) == 3
                assert sample(samples, "lbproxy_udp_active_sessions", **labels) == 0
                assert sample(samples, "lbproxy_connections_total", **labels) == 3
                for direction in ("in", "out"):
                    assert (
                        sample(
                            samples, "lbproxy_udp_datagrams_total", **labels, direction=direction
                        )
                        == 3
                    )
                    assert sample(samples, "lbproxy_bytes_total", **labels, direction=direction)
            assert (
                sample(samples, "lbproxy_udp_dropped_total", virtual_server="dns", reason="acl")
                == 0
            )
            assert (
                "lbproxy_udp_sessions_total",
                (("real_server", "a"), ("virtual_server", "same-port-tcp")),
            ) not in samples
            url = f"http://127.0.0.1:{admin}"
            document = json.loads(run_cli("status", "--admin", url, "--json").stdout)
            dns_vs = next(vs for vs in document["virtual_servers"] if vs["name"] == "dns")
            assert dns_vs["protocol"] == "udp"
            assert dns_vs["udp"]["sessions_total"] == 6
            assert dns_vs["udp"]["datagrams_in"] == dns_vs["udp"]["datagrams_out"] == 6
            tcp_vs = next(vs for vs in document["virtual_servers"] if vs["name"] != "dns")
            assert tcp_vs["protocol"] == "tcp" and tcp_vs["udp"] is None
            lines = run_cli("status", "--admin", url).stdout.splitlines()
            header = lines.index(next(line for line in lines if line.startswith("UDP_")))
            assert lines[header + 1].split() == ["dns", "0", "6", "6", "6", "0"]
    finally:
        one.stop()
        two.stop()


def echo_server(name: bytes) -> tuple[socket.socket, threading.Thread]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                data, peer = sock.recvfrom(70000)
                sock.sendto(name + data, peer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return sock, thread


def test_reload_keeps_sessions_and_acl_drops(lbproxy):
    a, _ = echo_server(b"a")
    b, _ = echo_server(b"b")
    port, admin = free_port(), free_port()
    config = """
        global:
          admin: {{listen: 127.0.0.1:{admin}}}
          access_log: true
          drain_timeout: 1s  # the stop waits for the open session at most this long
        virtual_servers:
          - name: echo
            protocol: udp
            listen: 127.0.0.1:{port}
            scheduler: rr
            deny: [{deny}]
            real_servers:
              - {{name: a, address: 127.0.0.1:{a}}}
              - {{name: b, address: 127.0.0.1:{b}}}
        """
    values = {"admin": admin, "port": port, "a": a.getsockname()[1], "b": b.getsockname()[1]}
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.settimeout(3)
    try:
        with lbproxy(config.format(deny="10.0.0.0/8", **values)) as lb:
            client.sendto(b"1", ("127.0.0.1", port))
            first = client.recvfrom(100)[0]
            lb.reload(config.format(deny="192.0.2.0/24", **values))
            client.sendto(b"2", ("127.0.0.1", port))
            # The same session, so the same real server, after the reload.
            assert client.recvfrom(100)[0] == first[:1] + b"2"
            assert "vs=echo " not in lb.log()  # no session ended
            lb.reload(config.format(deny="127.0.0.0/8", **values))
            other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            other.settimeout(0.5)
            other.sendto(b"3", ("127.0.0.1", port))
            with pytest.raises(TimeoutError):  # a new client from a denied network
                other.recvfrom(100)
            other.close()
            # dropped by a live process: the established session still answers
            client.sendto(b"4", ("127.0.0.1", port))
            assert client.recvfrom(100)[0] == first[:1] + b"4"
            acl = sample(metrics(admin), "lbproxy_udp_dropped_total", virtual_server="echo",
                         reason="acl")  # fmt: skip
            assert acl == 1  # the new client's one datagram
    finally:
        client.close()
        a.close()
        b.close()
