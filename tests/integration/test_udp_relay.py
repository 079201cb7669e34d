"""The UDP session relay (lbproxy/dataplane/udp.py) on real loopback sockets: echo real
servers, byte-exact both ways, sessions shared by the scheduler, `responses` ending
sessions and bounding replies, the idle timeout, the table caps, ICMP as passive failure."""

from __future__ import annotations

import random
import socket

import trio

from lbproxy.dataplane.udp import UdpRelay
from tests.integration.harness import OPEN_UDP_SOCKETS, relay_for, udp_socket


async def echo(sock: socket.socket, name: bytes, copies: int = 1) -> None:
    """A real server that answers each datagram with its name and the payload."""
    tsock = trio.socket.from_stdlib_socket(sock)
    while True:
        data, peer = await tsock.recvfrom(70000)
        for _ in range(copies):
            await tsock.sendto(name + data, peer)


async def ask(relay: UdpRelay, payload: bytes, client: trio.socket.SocketType) -> bytes:
    await client.sendto(payload, relay.sock.getsockname())
    with trio.fail_after(2):
        data, _ = await client.recvfrom(70000)
    return data


def run(test) -> None:
    try:
        trio.run(test)
    finally:
        while OPEN_UDP_SOCKETS:
            OPEN_UDP_SOCKETS.pop().close()


def client_socket() -> trio.socket.SocketType:
    return trio.socket.from_stdlib_socket(udp_socket())


async def _test_byte_exact_rr_and_responses_1_closes_each_session():
    servers = {"a": udp_socket(), "b": udp_socket()}
    async with trio.open_nursery() as nursery:
        for name, sock in servers.items():
            nursery.start_soon(echo, sock, name.encode())
        relay = relay_for(servers, responses=1)
        await nursery.start(relay.serve)
        answers = []
        for i in range(4):
            client = client_socket()
            payload = bytes(range(256)) * (i + 1)
            answer = await ask(relay, payload, client)
            assert answer[1:] == payload
            answers.append(answer[:1])
            await trio.sleep(0.01)
        assert answers == [b"a", b"b", b"a", b"b"]
        assert relay.sessions == {}  # every session ended with its one answer
        assert relay.counters.sessions_total == {"a": 2, "b": 2}
        assert relay.pool.active == 0
        nursery.cancel_scope.cancel()


async def _test_no_amplification_and_idle_timeout():
    servers = {"a": udp_socket()}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo, servers["a"], b"a", 5)  # answers each datagram 5 times
        relay = relay_for(servers, responses=2, idle_timeout=0.3)
        await nursery.start(relay.serve)
        client = client_socket()
        for _ in range(2):  # two requests, two replies each: 5 sent, 2 passed on
            await client.sendto(b"q", relay.sock.getsockname())
            with trio.fail_after(2):
                assert [(await client.recvfrom(100))[0] for _ in range(2)] == [b"aq", b"aq"]
            await trio.sleep(0.1)
        assert relay.counters.datagrams["a", "out"] == 4
        with trio.move_on_after(0.2) as nothing_more:
            await client.recvfrom(100)
        assert nothing_more.cancelled_caught
        relay2 = relay_for(servers, responses=None, idle_timeout=0.3)
        await nursery.start(relay2.serve)
        await client.sendto(b"x", relay2.sock.getsockname())
        await trio.sleep(0.1)
        assert len(relay2.sessions) == 1
        await trio.sleep(0.5)
        assert relay2.sessions == {} and relay2.pool.active == 0
        nursery.cancel_scope.cancel()


async def _test_max_sessions_per_source_and_icmp_refused():
    servers = {"a": udp_socket()}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo, servers["a"], b"a")
        relay = relay_for(servers, max_sessions=3, max_sessions_per_source=2, responses=0)
        await nursery.start(relay.serve)
        clients = [client_socket() for _ in range(4)]
        for client in clients:
            await client.sendto(b"log", relay.sock.getsockname())
        await trio.sleep(0.2)
        assert len(relay.sessions) == 2  # one source, 127.0.0.1: its cap is 2
        assert relay.counters.dropped["per_source"] == 2
        assert relay.counters.datagrams["a", "out"] == 0  # responses: 0 drops replies
        # A real server with nothing listening: ICMP port unreachable, a passive failure
        # per session (fall: 3), then it is down and every new session goes to a.
        gone = udp_socket()
        relay3 = relay_for({"gone": gone, "a": servers["a"]})
        gone.close()
        await nursery.start(relay3.serve)
        answered = []
        for _ in range(12):
            client = client_socket()
            await client.sendto(b"?", relay3.sock.getsockname())
            with trio.move_on_after(0.2):
                answered.append((await client.recvfrom(100))[0])
        assert relay3.pool.by_name["gone"].health.up is False
        assert answered[-6:] == [b"a?"] * 6
        assert relay3.counters.sessions_total["gone"] == 3
        nursery.cancel_scope.cancel()


def test_byte_exact_rr_and_responses_1_closes_each_session():
    run(_test_byte_exact_rr_and_responses_1_closes_each_session)


def test_no_amplification_and_idle_timeout():
    run(_test_no_amplification_and_idle_timeout)


def test_max_sessions_per_source_and_icmp_refused():
    run(_test_max_sessions_per_source_and_icmp_refused)


async def _test_sessions_closed_in_any_order_leave_the_others_found():
    """500 sessions (a table many times a batch), a random half closed as `disable`
    closes them: each closed client's next datagram opens a new session, each other
    client's goes on in its own -- its session found again, whatever was removed
    around it."""
    servers = {"a": udp_socket()}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo, servers["a"], b"a")
        relay = relay_for(servers, max_sessions_per_source=1000, idle_timeout=60)
        await nursery.start(relay.serve)
        clients = [client_socket() for _ in range(500)]
        for round_ in range(2):
            for i, client in enumerate(clients):
                await client.sendto(b"%d" % i, relay.sock.getsockname())
                with trio.fail_after(2):
                    assert (await client.recvfrom(100))[0] == b"a%d" % i
            if round_ == 0:
                before = dict(relay.sessions)  # (a copy: the pure relay's is live)
                assert len(before) == 500
                closed = random.Random(44).sample(sorted(before), 250)
                for address in closed:
                    before[address].close()
                assert len(relay.sessions) == 250
        after = relay.sessions
        assert len(after) == 500
        kept = [a for a in before if a not in closed]
        assert all(after[a] is before[a] for a in kept)  # the same sessions, found again
        assert all(after[a] is not before[a] for a in closed)  # new ones
        assert relay.counters.sessions_total["a"] == 750
        assert relay.counters.datagrams["a", "in"] == relay.counters.datagrams["a", "out"] == 1000
        assert relay.pool.active == 500
        nursery.cancel_scope.cancel()


def test_sessions_closed_in_any_order_leave_the_others_found():
    run(_test_sessions_closed_in_any_order_leave_the_others_found)


async def _test_a_shortened_idle_timeout_applies_to_open_sessions_at_once():
    """What the throttle monitor does in high mode (through each lease's handle, as for a
    TCP connection): a session idle longer than its new timeout ends now, one idle less
    long ends when the new timeout is over; `own_idle_timeout` keeps the configured one."""
    servers = {"a": udp_socket()}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo, servers["a"], b"a")
        relay = relay_for(servers, idle_timeout=60)
        await nursery.start(relay.serve)
        idle, busy = client_socket(), client_socket()
        for client in (idle, busy):
            assert await ask(relay, b"x", client) == b"ax"
        await trio.sleep(0.3)
        assert await ask(relay, b"y", busy) == b"ay"
        handles = {lease.handle.client: lease.handle for lease in relay.pool.by_name["a"].leases}
        assert {h.own_idle_timeout for h in handles.values()} == {60}
        for handle in handles.values():
            handle.flow.idle_timeout = 0.25
        with trio.fail_after(2):
            while idle.getsockname() in relay.sessions:
                await trio.sleep(0.01)
        with trio.fail_after(2):
            while relay.sessions:
                await trio.sleep(0.01)
        assert relay.pool.active == 0
        nursery.cancel_scope.cancel()


def test_a_shortened_idle_timeout_applies_to_open_sessions_at_once():
    run(_test_a_shortened_idle_timeout_applies_to_open_sessions_at_once)
