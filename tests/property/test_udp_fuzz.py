"""Fuzz the UDP datagram path (lbproxy/dataplane/udp.py) on real loopback sockets:
bursts of datagrams of any size a UDP payload can have (0 to 65,507 bytes) from a few
clients come back byte-exact and in order, and the relay's counts add up; with a real
server answering each datagram three times, `responses: 1` passes on exactly one reply
per datagram sent (a session counts its requests and replies: no amplification)."""

from __future__ import annotations

import random
import socket

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lbproxy.dataplane.udp import MAX_DATAGRAM
from tests.integration.harness import OPEN_UDP_SOCKETS, relay_for, udp_socket

BUFFER = 1 << 20  # each burst must fit in a socket buffer: UDP has no flow control
BURST_BYTES = 120_000

sizes = st.one_of(
    st.integers(0, 16),
    st.integers(0, MAX_DATAGRAM),
    st.sampled_from([0, 1, 512, 1232, 1472, 1473, 9000, 65_000, MAX_DATAGRAM]),
)


@st.composite
def bursts(draw):
    """A few bursts, each of a few datagrams (client index, size) under BURST_BYTES."""
    out = []
    for _ in range(draw(st.integers(1, 4))):
        burst, total = [], 0
        for client, size in draw(st.lists(st.tuples(st.integers(0, 2), sizes), max_size=12)):
            if total + size <= BURST_BYTES:
                burst.append((client, size))
                total += size
        out.append(burst)
    return out


def big_buffers(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
    return sock


async def echo(sock: socket.socket, copies: int) -> None:
    tsock = trio.socket.from_stdlib_socket(sock)
    while True:
        data, peer = await tsock.recvfrom(MAX_DATAGRAM + 1)
        for _ in range(copies):
            await tsock.sendto(data, peer)


async def relay_bursts(plan, seed: int, copies: int, responses) -> None:
    rng = random.Random(seed)
    server = big_buffers(udp_socket())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo, server, copies)
        relay = relay_for({"a": server}, responses=responses)
        await nursery.start(relay.serve)
        address = relay.sock.getsockname()
        clients = [trio.socket.from_stdlib_socket(big_buffers(udp_socket())) for _ in range(3)]
        sent = 0
        for burst in plan:
            payloads = [(c, rng.randbytes(size)) for c, size in burst]
            for c, payload in payloads:
                await clients[c].sendto(payload, address)
            with trio.fail_after(5):
                if responses is None:  # every copy comes back, in each client's order
                    for c, payload in payloads:
                        for _ in range(copies):
                            data, _ = await clients[c].recvfrom(MAX_DATAGRAM + 1)
                            assert data == payload
                else:  # one reply per datagram sent, each one the server sent
                    for c in {c for c, _ in payloads}:
                        mine = [payload for d, payload in payloads if d == c]
                        for _ in mine:
                            data, _ = await clients[c].recvfrom(MAX_DATAGRAM + 1)
                            assert data in mine
            sent += len(payloads)
        counters = relay.counters
        assert counters.datagrams["a", "in"] == sent
        expected_out = sent * copies if responses is None else sent
        assert counters.datagrams["a", "out"] == expected_out
        assert counters.bytes["a", "in"] == sum(size for burst in plan for _, size in burst)
        if responses is not None:  # no amplification: never more than that
            for client in clients:
                with trio.move_on_after(0.02) as nothing:
                    await client.recvfrom(MAX_DATAGRAM + 1)
                assert nothing.cancelled_caught
        nursery.cancel_scope.cancel()


def run(plan, seed, copies, responses) -> None:
    try:
        trio.run(relay_bursts, plan, seed, copies, responses)
    finally:
        while OPEN_UDP_SOCKETS:
            OPEN_UDP_SOCKETS.pop().close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bursts(), st.integers(0, 2**32))
def test_any_size_and_burst_comes_back_byte_exact(plan, seed):
    run(plan, seed, copies=1, responses=None)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bursts(), st.integers(0, 2**32))
def test_responses_1_passes_one_reply_per_datagram_of_three(plan, seed):
    run(plan, seed, copies=3, responses=1)


# -- the session table: any order of datagrams and ends, against a model --------------

CLIENTS = 80  # more than a recvmmsg batch (32) and than the table's first size's half

steps = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.lists(st.integers(0, CLIENTS - 1), min_size=1, max_size=60)),
        st.tuples(st.just("close"), st.lists(st.integers(0, CLIENTS - 1), min_size=1, max_size=30)),
    ),
    min_size=1,
    max_size=8,
)


async def sessions_against_a_model(plan) -> None:
    """Clients send (each its own datagram, answered by the echo) and sessions are closed
    as `disable` closes them, in any order: each client's session is the one the model
    says (kept while open, a new one after its end), and the counts add up."""
    server = big_buffers(udp_socket())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo, server, 1)
        relay = relay_for({"a": server}, max_sessions_per_source=CLIENTS, idle_timeout=60)
        await nursery.start(relay.serve)
        address = relay.sock.getsockname()
        clients = [
            trio.socket.from_stdlib_socket(big_buffers(udp_socket())) for _ in range(CLIENTS)
        ]
        names = [c.getsockname() for c in clients]
        model: dict[int, object] = {}  # client -> its session object, while open
        opened = sent = 0
        for kind, which in plan:
            if kind == "close":
                for i in which:
                    if i in model:
                        model.pop(i).close()
                continue
            burst = list(dict.fromkeys(which))  # each client once per burst: one answer each
            for i in burst:
                await clients[i].sendto(b"%d" % i, address)
            with trio.fail_after(5):
                for i in burst:
                    data, _ = await clients[i].recvfrom(100)
                    assert data == b"%d" % i
            sent += len(burst)
            now = relay.sessions
            for i in burst:
                session = now[names[i]]
                if i in model:
                    assert session is model[i]  # found again, whatever moved around it
                else:
                    model[i] = session
                    opened += 1
            assert set(now) == {names[i] for i in model}
        assert relay.counters.sessions_total["a"] == opened
        assert relay.counters.datagrams["a", "in"] == relay.counters.datagrams["a", "out"] == sent
        assert relay.pool.active == len(model)
        nursery.cancel_scope.cancel()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps)
def test_sessions_opened_and_closed_in_any_order_are_found_as_a_model_says(plan):
    try:
        trio.run(sessions_against_a_model, plan)
    finally:
        while OPEN_UDP_SOCKETS:
            OPEN_UDP_SOCKETS.pop().close()
