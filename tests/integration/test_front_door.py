"""Front-door routing end to end (SPEC §13): backup servers, the queue, SNI routing.

Real `lbproxy run` processes, real name-saying servers on loopback, real HTTP to the
admin endpoint; every wait is bounded in count and time.
"""

from __future__ import annotations

import json
import select
import socket
import time

from tests.integration.conftest import vs_config
from tests.integration.harness import NameServer, ask_name, free_port, open_and_read_name
from tests.integration.test_admin import http, metrics, sample, with_admin

FAST_CHECKS = "health_check: {type: tcp, interval: 0.1s, timeout: 0.5s, rise: 1, fall: 1}"


def names_until(port: int, wanted: str, timeout: float = 10.0) -> str:
    """Ask for names until `wanted` answers (the health checks need a moment)."""
    deadline = time.monotonic() + timeout
    name = ""
    while time.monotonic() < deadline:
        try:
            name = ask_name(port, timeout=2.0)
        except OSError:
            name = ""
        if name == wanted:
            return name
        time.sleep(0.05)
    return name


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


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


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
