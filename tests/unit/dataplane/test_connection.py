"""The connection lifecycle: every state and every transition, driven
through a real handler with real loopback sockets (a client, an echo real server).

Each scenario runs one client through `Handler.accept` (the accept loop's call) or
`Handler.handle` (a shared address's route) and checks the states it went through
against `JOURNEYS`, each step against the machine's own table (`TRANSITIONS`), what was
spawned (a task only while a state waits), and what `end()` counted: pool.clients and
the lease back to zero, the rejected reason, the access-log line -- exactly once.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import itertools
import logging
import re
import socket
from typing import ClassVar

import pytest
import trio
import trio.testing

from lbproxy.config.model import Address, HealthCheckConfig, QueueConfig
from lbproxy.core.pool import Pool
from lbproxy.dataplane import connection, lifecycle
from lbproxy.dataplane.connection import ClientConnection, Handler
from lbproxy.dataplane.lifecycle import (
    ADMITTED,
    CLOSING,
    CONNECTING,
    ENDED,
    ESTABLISHED,
    PICKED,
    PREREAD,
    QUEUED,
    STATES,
    TRANSITIONS,
    WAITING,
)
from lbproxy.dataplane.queue import Queue
from lbproxy.dataplane.virtual_server import VirtualServer
from lbproxy.net.barrier import internal_errors
from lbproxy.net.pump import Flow
from tests.factories import real_server, virtual_server

A, PR, Q, P, C, E, CL, EN = (
    ADMITTED,
    PREREAD,
    QUEUED,
    PICKED,
    CONNECTING,
    ESTABLISHED,
    CLOSING,
    ENDED,
)

# Scenario -> the states its connection goes through, in order.
JOURNEYS = {
    "fast": [A, P, C, E, CL, EN],
    "closed_by_proxy": [A, P, C, E, CL, EN],
    "throttle": [A, CL, EN],
    "acl": [A, CL, EN],
    "proxy_header": [A, PR, P, C, E, CL, EN],
    "proxy_header_bad": [A, PR, CL, EN],
    "proxy_header_denied": [A, PR, CL, EN],
    "proxy_header_queued": [A, PR, Q, P, C, E, CL, EN],
    "proxy_header_direct": [A, PR, P, C, E, CL, EN],
    "queued": [A, Q, P, C, E, CL, EN],
    "queue_full": [A, Q, CL, EN],
    "drained_while_queued": [A, Q, CL, EN],
    "no_server": [A, CL, EN],
    "retry": [A, P, C, P, C, E, CL, EN],
    "retries_exhausted": [A, P, C, CL, EN],
    "resolving": [A, P, C, E, CL, EN],
    "bug_in_pick": [A, CL, EN],
    "bug_in_connect": [A, P, CL, EN],
    "max_connections": [A, CL, EN],
    "connect_timeout": [A, P, C, CL, EN],
    "bug_in_c_connect": [A, P, C, CL, EN],
}


def test_the_scenarios_cover_every_transition():
    table = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    driven = {(a, b) for journey in JOURNEYS.values() for a, b in itertools.pairwise(journey)}
    assert driven == table, [(STATES[a], STATES[b]) for a, b in table ^ driven]
    assert set(TRANSITIONS) == set(range(len(STATES)))


_state_slot = ClientConnection.state  # the slot's descriptor, wrapped below


class Recorded(ClientConnection):
    """A ClientConnection that records every state written to its slot, wherever the
    write comes from (the production class stores it in a plain slot): the first,
    __init__'s admitted, then each change, which must be made through the table --
    `c.state = INTO[new][c.state]`, the lookup just before the write (`Looked`). A
    write that is not the table's, or not in TRANSITIONS, is a violation, failing the
    test at its end (an assertion here would be caught by the connection's own
    exception barrier)."""

    __slots__ = ("journey",)
    journeys: ClassVar[list[list[int]]] = []
    violations: ClassVar[list[str]] = []

    @property
    def state(self) -> int:  # type: ignore[override]
        return _state_slot.__get__(self)

    @state.setter
    def state(self, new: int) -> None:
        try:
            old = _state_slot.__get__(self)
        except AttributeError:  # the first: __init__
            if new != ADMITTED:
                self.violations.append(f"began as {STATES[new]}")
            self.journey = [new]
            self.journeys.append(self.journey)
        else:
            change = f"{STATES[old]} -> {STATES[new]}"
            if Looked.last != (old, new):
                self.violations.append(f"{change}, not looked up in INTO")
            if new not in TRANSITIONS[old]:
                self.violations.append(f"{change}, not in TRANSITIONS")
            self.journey.append(new)
        Looked.last = None
        _state_slot.__set__(self, new)


class Looked(dict):
    """One of INTO's tables, as the connection module sees it in these tests: the same
    mapping, remembering the last transition looked up (and raising KeyError for a
    missing one, as the plain dict does)."""

    last: ClassVar[tuple[int, int] | None] = None

    def __getitem__(self, old: int) -> int:
        new = dict.__getitem__(self, old)
        Looked.last = (old, new)
        return new


LOOKED = tuple(Looked(table) for table in lifecycle.INTO)


_opened: list = []  # the test's own sockets, closed at the end of its trio run


@pytest.fixture(autouse=True)
def recorded(monkeypatch):
    Recorded.journeys = []
    Recorded.violations = []
    Looked.last = None
    monkeypatch.setattr(connection, "ClientConnection", Recorded)
    monkeypatch.setattr(connection, "INTO", LOOKED)
    yield Recorded.journeys
    assert Recorded.violations == []


async def echo(stream: trio.SocketStream) -> None:
    async with stream:
        while data := await stream.receive_some(4096):
            await stream.send_all(data)


def closed_port() -> int:
    """A port that refuses connections until the test ends: bound but not listening, so
    the kernel answers a SYN with a reset and cannot hand the port to the rig's listener
    or a connect's source (which would make the "down" server answer)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _opened.append(s)
    return s.getsockname()[1]


class Rig:
    """A handler for one virtual server, an echo real server, and a way to make
    accepted client descriptors (a listening socket the test connects to)."""

    def __init__(self, nursery: trio.Nursery, vs: VirtualServer) -> None:
        self.nursery = nursery
        self.vs = vs
        self.pool = vs.pool
        self.handler = Handler(vs)
        self.spawned: list[str] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        _opened.append(self.listener)

    def spawn(self, fn, *args) -> None:
        self.spawned.append(fn.__name__)
        if fn.__name__ == "_waiting" and args[0].state not in WAITING:  # a task to wait
            Recorded.violations.append(f"a task for a connection {args[0].state_name}")
        self.nursery.start_soon(fn, *args)

    async def client(self) -> tuple[trio.socket.SocketType, int, tuple]:
        """A connected client, and the accepted end's descriptor and peer address."""
        client = trio.socket.socket()
        _opened.append(client)
        await client.connect(self.listener.getsockname())
        fd, peer = self.listener._accept()
        s = socket.socket(fileno=fd)
        s.setblocking(False)
        return client, s.detach(), peer

    async def accept(self) -> trio.socket.SocketType:
        client, fd, peer = await self.client()
        self.handler.accept(fd, peer, self.spawn)
        return client


async def rig(nursery, servers=None, **options) -> Rig:
    """A rig whose servers default to one echo server named "a"."""
    if servers is None:
        (listener,) = await nursery.start(
            functools.partial(trio.serve_tcp, echo, 0, host="127.0.0.1")
        )
        servers = [real_server("a", listener.socket.getsockname()[1])]
    config = virtual_server("rr", {}, health_check=HealthCheckConfig(type="none"), **options)
    config = dataclasses.replace(config, real_servers=tuple(servers))
    vs = VirtualServer(Pool(config, trio.current_time()))
    vs.access_log = True
    if config.queue is not None:
        vs.queue = Queue(vs.pool, config.queue, vs.queue_stats)
    return Rig(nursery, vs)


async def echo_server_port(nursery) -> int:
    (listener,) = await nursery.start(functools.partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
    return listener.socket.getsockname()[1]


async def round_trip(client: trio.socket.SocketType, data: bytes = b"ping") -> bytes:
    await client.send(data)
    with trio.fail_after(5):
        return await client.recv(100)


async def closed(client: trio.socket.SocketType) -> bool:
    """True: the proxy closed the client (EOF or reset)."""
    with trio.fail_after(5):
        try:
            return await client.recv(100) == b""
        except ConnectionResetError:
            return True


async def settled(r: Rig) -> None:
    """Wait until every connection has ended (bounded)."""
    with trio.fail_after(5):
        while r.pool.clients or r.pool.active:
            await trio.sleep(0.01)
    await trio.sleep(0)


async def until(condition) -> None:
    """Wait for `condition()` to hold (bounded): the handler's tasks run meanwhile."""
    with trio.fail_after(5):
        while not condition():
            await trio.sleep(0.005)


def access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lbproxy.access"]


def run(body) -> None:
    async def main():
        try:
            async with trio.open_nursery() as nursery:
                with trio.fail_after(10):
                    await body(nursery)
                nursery.cancel_scope.cancel()
        finally:
            while _opened:
                _opened.pop().close()

    trio.run(main)


@pytest.fixture(autouse=True)
def _access_log(caplog):
    caplog.set_level(logging.INFO, logger="lbproxy.access")


async def warm_up(r: Rig, recorded: list) -> None:
    """One connection first: a handler resolves a server's address once, in a task,
    before its first connect; the connections after it find it cached."""
    client = await r.accept()
    assert await round_trip(client) == b"ping"
    client.close()
    await settled(r)
    assert recorded == [JOURNEYS["resolving"]] and "_waiting" in r.spawned
    recorded.clear()
    r.spawned.clear()
    r.pool.servers[0].counters.bytes_in = r.pool.servers[0].counters.bytes_out = 0


# -- the fast path: no task ---------------------------------------------------------------


def test_fast_path_runs_to_established_with_no_task_and_ends_once(recorded, caplog):
    async def body(nursery):
        r = await rig(nursery)
        await warm_up(r, recorded)
        caplog.clear()
        client = await r.accept()
        assert recorded[0] == [A, P, C, E]  # established within accept(): no task
        assert r.spawned == []  # the warm-up's guardian still stands for the pumps
        assert await round_trip(client) == b"ping"
        client.close()
        await settled(r)
        assert recorded == [JOURNEYS["fast"]]
        (rs,) = r.pool.servers
        assert (rs.counters.bytes_in, rs.counters.bytes_out) == (4, 4)
        assert r.pool.durations.count == 2  # with the warm-up's
        (line,) = access_lines(caplog)
        assert " vs=vs rs=a in=4 out=4 " in line and line.endswith("end=closed")

    run(body)


def test_end_is_idempotent(recorded, caplog):
    async def body(nursery):
        r = await rig(nursery)
        client = await r.accept()
        assert await round_trip(client) == b"ping"
        ((lease, c),) = [(lease, lease.handle) for lease in r.pool.servers[0].leases]
        assert c.state == ESTABLISHED and r.pool.clients == 1
        c.end("twice")  # ended early, by hand: counted now...
        c.end("thrice")  # ...and never again
        assert c.state == ENDED and r.pool.clients == 0 and r.pool.active == 0
        client.close()
        await until(lambda: c.pump.outcome is not None)  # the pump's end calls end() again
        await trio.sleep(0)
        assert r.pool.clients == 0 and r.pool.active == 0 and r.pool.durations.count == 1
        assert [line.rsplit("end=", 1)[1] for line in access_lines(caplog)] == ["twice"]
        assert lease not in r.pool.servers[0].leases

    run(body)


def test_closed_by_the_proxy_while_established(recorded, caplog):
    async def body(nursery):
        r = await rig(nursery)
        client = await r.accept()
        assert await round_trip(client) == b"ping"
        (lease,) = r.pool.servers[0].leases
        lease.handle.close()  # on_down: close, a disabled server
        assert await closed(client)
        await settled(r)
        assert recorded == [JOURNEYS["closed_by_proxy"]]
        assert access_lines(caplog)[0].endswith("end=cancelled")

    run(body)


# -- admitted -> closing: refused before anything waits -----------------------------------


def test_throttle_digg_refuses_at_admission(recorded, caplog):
    class Digg:
        def arrival(self) -> bool:
            return True

        def idle_timeout_for(self, own: float) -> float:
            return own

    async def body(nursery):
        r = await rig(nursery)
        r.vs.throttle = Digg()
        client = await r.accept()
        assert await closed(client)
        assert recorded == [JOURNEYS["throttle"]] and r.spawned == []
        assert r.pool.rejected["throttle"] == 1 and r.pool.clients == 0
        assert access_lines(caplog) == [
            f"127.0.0.1:{client.getsockname()[1]} vs=vs rs=- in=0 out=0 "
            "duration=0.000s end=rejected:throttle"
        ]

    run(body)


def test_acl_refuses_at_admission(recorded):
    async def body(nursery):
        r = await rig(nursery, deny=(ipaddress.ip_network("127.0.0.0/8"),))
        client = await r.accept()
        assert await closed(client)
        assert recorded == [JOURNEYS["acl"]]
        assert r.pool.rejected["acl"] == 1 and r.pool.clients == 0

    run(body)


def test_no_server_ends_at_admission(recorded, caplog):
    async def body(nursery):
        r = await rig(nursery, [])  # no real server at all
        client = await r.accept()
        assert await closed(client)
        assert recorded == [JOURNEYS["no_server"]]
        assert r.pool.rejected["no_server"] == 1 and r.pool.clients == 0
        # Ended in the accept's own call: its duration is the time between two clock
        # reads there, 0.000s unless a loaded machine preempted it in between.
        line = access_lines(caplog)[0]
        assert re.search(r" rs=- in=0 out=0 duration=0\.0\d\ds end=no_server$", line), line

    run(body)


# -- preread: the PROXY header -------------------------------------------------------------


def test_proxy_header_is_read_in_a_task_then_the_source_it_names_is_used(recorded, caplog):
    async def body(nursery):
        r = await rig(nursery, accept_proxy=True)
        client = await r.accept()
        assert recorded[0] == [A, PR] and r.spawned == ["_waiting"]
        await client.send(b"PROXY TCP4 192.0.2.7 127.0.0.1 5555 80\r\nhello")
        with trio.fail_after(5):
            assert await client.recv(100) == b"hello"  # what followed the header
        client.close()
        await settled(r)
        assert recorded == [JOURNEYS["proxy_header"]]
        assert access_lines(caplog)[0].startswith("192.0.2.7:5555 vs=vs rs=a in=5 out=5 ")

    run(body)


def test_a_bad_proxy_header_closes_uncounted(recorded, caplog):
    async def body(nursery):
        r = await rig(nursery, accept_proxy=True)
        client = await r.accept()
        await client.send(b"GET / HTTP/1.0\r\n\r\n")
        assert await closed(client)
        await settled(r)
        assert recorded == [JOURNEYS["proxy_header_bad"]]
        assert sum(r.pool.rejected.values()) == 0 and access_lines(caplog) == []

    run(body)


def test_the_acl_applies_to_the_source_the_proxy_header_names(recorded):
    async def body(nursery):
        r = await rig(nursery, accept_proxy=True, deny=(ipaddress.ip_network("192.0.2.0/24"),))
        client = await r.accept()
        await client.send(b"PROXY TCP4 192.0.2.7 127.0.0.1 5555 80\r\n")
        assert await closed(client)
        await settled(r)
        assert recorded == [JOURNEYS["proxy_header_denied"]]
        assert r.pool.rejected["acl"] == 1

    run(body)


def test_a_preread_route_goes_straight_to_the_pick(recorded):
    """handle() with the bytes a shared address's route read: no PROXY header to read
    (it had one, already read), the route's own task and no other."""

    async def body(nursery):
        r = await rig(nursery, accept_proxy=True)
        client, fd, _ = await r.client()
        done = trio.Event()

        async def route():  # the listener's route task, in the handlers nursery
            await r.handler.handle(fd, ("192.0.2.8", 6666), b"hello")
            done.set()

        nursery.start_soon(route)
        with trio.fail_after(5):
            await done.wait()
        assert recorded == [[A, P, C, E]] and r.spawned == []  # established: returned
        with trio.fail_after(5):
            assert await client.recv(100) == b"hello"
        client.close()
        await settled(r)

    run(body)


# -- queued ------------------------------------------------------------------------------


def one_slot(**options):
    """Rig options: one server that takes one connection, and a queue."""
    return {"queue": QueueConfig(max=options.pop("max", 10), timeout=5.0), **options}


async def one_slot_rig(nursery, **options) -> Rig:
    port = await echo_server_port(nursery)
    return await rig(nursery, [real_server("a", port, max_connections=1)], **one_slot(**options))


def test_a_full_server_queues_and_the_freed_slot_serves_the_waiter(recorded):
    async def body(nursery):
        r = await one_slot_rig(nursery)
        first = await r.accept()
        assert await round_trip(first) == b"ping"
        second = await r.accept()
        await until(lambda: r.vs.queue.waiting == 1)
        assert recorded[1] == [A, Q]
        first.close()  # its end gives the slot to the waiter
        assert await round_trip(second, b"next") == b"next"
        second.close()
        await settled(r)
        assert recorded[1] == JOURNEYS["queued"]
        assert r.vs.queue_stats.waits.count == 1

    run(body)


def test_a_full_queue_refuses(recorded, caplog):
    async def body(nursery):
        r = await one_slot_rig(nursery, max=0)
        first = await r.accept()
        assert await round_trip(first) == b"ping"
        second = await r.accept()
        assert await closed(second)
        assert recorded[1] == JOURNEYS["queue_full"]
        assert r.pool.rejected["queue_full"] == 1
        assert access_lines(caplog)[0].endswith("end=rejected:queue_full")
        first.close()
        await settled(r)

    run(body)


def test_proxy_header_then_queue(recorded):
    async def body(nursery):
        r = await one_slot_rig(nursery, accept_proxy=True)
        first = await r.accept()
        await first.send(b"PROXY TCP4 192.0.2.7 127.0.0.1 5555 80\r\n")
        assert await round_trip(first) == b"ping"
        second = await r.accept()
        await second.send(b"PROXY TCP4 192.0.2.9 127.0.0.1 5556 80\r\n")
        with trio.fail_after(5):
            while r.vs.queue.waiting != 1:
                await trio.sleep(0.01)
        first.close()
        assert await round_trip(second) == b"ping"
        second.close()
        await settled(r)
        assert recorded == [JOURNEYS["proxy_header_direct"], JOURNEYS["proxy_header_queued"]]

    run(body)


def test_the_drain_deadline_ends_a_queued_connection_unlogged(recorded, caplog):
    async def body(nursery):
        r = await one_slot_rig(nursery)
        first = await r.accept()
        assert await round_trip(first) == b"ping"
        scope = trio.CancelScope()  # the handlers nursery's, as the drain deadline

        async def handlers(task_status=trio.TASK_STATUS_IGNORED):
            with scope:
                async with trio.open_nursery() as inner:
                    task_status.started(inner)
                    await trio.sleep_forever()

        r.nursery = await nursery.start(handlers)
        second = await r.accept()
        await until(lambda: r.vs.queue.waiting == 1)
        assert recorded[1] == [A, Q]
        scope.cancel()
        await until(lambda: recorded[1] == JOURNEYS["drained_while_queued"])
        assert await closed(second)
        assert r.pool.clients == 1  # the first only
        first.close()
        await settled(r)
        assert len(access_lines(caplog)) == 1  # the first's

    run(body)


# -- connecting: retries, resolving --------------------------------------------------------


def test_a_refused_connect_is_retried_on_another_server(recorded):
    async def body(nursery):
        port = await echo_server_port(nursery)
        servers = [real_server("down", closed_port()), real_server("a", port)]
        r = await rig(nursery, servers)
        client = await r.accept()
        assert await round_trip(client) == b"ping"
        client.close()
        await settled(r)
        assert recorded == [JOURNEYS["retry"]]
        assert r.pool.by_name["down"].counters.connect_failures["refused"] == 1

    run(body)


def test_no_retry_left_ends_connecting(recorded, caplog):
    async def body(nursery):
        servers = [real_server("down", closed_port())]
        r = await rig(nursery, servers, retries=0)
        client = await r.accept()
        assert await closed(client)
        await settled(r)
        assert recorded == [JOURNEYS["retries_exhausted"]]
        assert r.pool.rejected["connect_failed"] == 1
        assert access_lines(caplog)[0].endswith("end=no_server")

    run(body)


def test_a_name_is_resolved_in_a_task_then_cached(recorded):
    async def body(nursery):
        port = await echo_server_port(nursery)
        server = dataclasses.replace(real_server("a", port), address=Address("localhost", port))
        r = await rig(nursery, [server])
        for _ in range(2):
            client = await r.accept()
            assert await round_trip(client) == b"ping"
            client.close()
            await settled(r)
        assert recorded == [JOURNEYS["resolving"]] * 2
        assert r.spawned.count("_waiting") == 1  # the second found the name cached

    run(body)


# -- the barrier: a bug in any state ends that connection only -----------------------------


@pytest.mark.parametrize(
    ("scenario", "method"), [("bug_in_pick", "_pick"), ("bug_in_connect", "_connect")]
)
def test_a_bug_in_a_step_ends_that_connection_only(recorded, monkeypatch, scenario, method):
    def broken(*args):
        raise RuntimeError("injected")

    async def body(nursery):
        r = await rig(nursery)
        before = internal_errors().counts["connection"]
        if method == "_connect":  # picked, then the bug: the lease must come back
            monkeypatch.setattr(Handler, method, broken)
        else:
            monkeypatch.setattr(r.pool, "pick", broken)
        client = await r.accept()
        assert await closed(client)
        assert recorded == [JOURNEYS[scenario]]
        assert r.pool.clients == 0 and r.pool.active == 0
        assert internal_errors().counts["connection"] == before + 1
        monkeypatch.undo()
        monkeypatch.setattr(connection, "ClientConnection", Recorded)
        monkeypatch.setattr(connection, "INTO", LOOKED)
        client = await r.accept()  # and the next one is served
        assert await round_trip(client) == b"ping"
        client.close()
        await settled(r)

    run(body)


@pytest.mark.parametrize(
    ("path", "step", "wrong", "journey"),
    [
        ("accept", "_connect", QUEUED, [A, P, CL, EN]),  # picked -> queued
        ("waiting", "_admit", ESTABLISHED, [A, PR, CL, EN]),  # preread -> established
    ],
)
def test_a_transition_missing_from_the_table_is_a_bug_counted_by_the_barrier(
    recorded, monkeypatch, caplog, path, step, wrong, journey
):
    """A step that makes a state change TRANSITIONS lacks: the table's lookup raises
    (KeyError: the state it was in), and the barrier of the accept (no task) or of the
    connection's task counts it and ends that connection only, lease and descriptors
    given back; the next one is served."""

    def wrong_step(self, c, *args):
        c.state = connection.INTO[wrong][c.state]

    async def body(nursery):
        r = await rig(nursery, accept_proxy=path == "waiting")
        before = internal_errors().counts["connection"]
        monkeypatch.setattr(Handler, step, wrong_step)
        client = await r.accept()
        if path == "waiting":
            await client.send(b"PROXY TCP4 192.0.2.7 127.0.0.1 5555 80\r\n")
        assert await closed(client)
        await settled(r)
        assert recorded == [journey]
        assert r.pool.clients == 0 and r.pool.active == 0
        assert internal_errors().counts["connection"] == before + 1
        (error,) = [r for r in caplog.records if r.name == "lbproxy.internal"]
        assert error.exc_info is not None and error.exc_info[0] is KeyError
        assert error.exc_info[1].args == (journey[-3],)  # the state it was in
        monkeypatch.undo()
        monkeypatch.setattr(connection, "ClientConnection", Recorded)
        monkeypatch.setattr(connection, "INTO", LOOKED)
        client = await r.accept()  # and the next one is served
        if path == "waiting":
            await client.send(b"PROXY TCP4 192.0.2.7 127.0.0.1 5555 80\r\n")
        assert await round_trip(client) == b"ping"
        client.close()
        await settled(r)

    run(body)


def test_a_bug_while_waiting_ends_that_connection_only(recorded, monkeypatch):
    async def broken(self, sock, timeout):
        raise RuntimeError("injected")

    monkeypatch.setattr(Handler, "_read_proxy_header", broken)

    async def body(nursery):
        r = await rig(nursery, accept_proxy=True)
        before = internal_errors().counts["connection"]
        client = await r.accept()
        assert await closed(client)
        assert recorded == [[A, PR, CL, EN]]
        assert r.pool.clients == 0
        assert internal_errors().counts["connection"] == before + 1

    run(body)


def test_a_client_connection_starts_as_a_flow_does():
    """ClientConnection sets Flow's fields itself (a call less per connection): all of
    them, as Flow.__init__ would."""

    async def main():
        config = virtual_server("rr", {"a": {}}, health_check=HealthCheckConfig(type="none"))
        handler = Handler(VirtualServer(Pool(config, trio.current_time())))
        c = connection.ClientConnection(handler, -1, ("192.0.2.1", 5), config, 0.0)
        flow = Flow(config.idle_timeout)
        assert {name: getattr(c, name) for name in Flow.__slots__} == {
            name: getattr(flow, name) for name in Flow.__slots__
        }
        assert handler.pool.clients == 1 and c.state == ADMITTED
        c.end()
        assert handler.pool.clients == 0 and c.state == ENDED

    trio.run(main)


# -- the fast path: admitted to established within accept() -----------------------------
#
# With the address cached (after a warm-up), a connection that waits for nothing runs
# every step in accept()'s call, with no task; these drive each branch of the steps there
# (max_connections, a failed connect, the C connect, a reload), on both paths.

compiled_only = pytest.mark.skipif(
    connection._c_connect is None, reason="the C connect: the compiled path only"
)


def test_the_fast_path_refuses_beyond_max_connections(recorded, caplog):
    async def body(nursery):
        r = await rig(nursery, max_connections=1)
        await warm_up(r, recorded)
        first = await r.accept()
        assert await round_trip(first) == b"ping"
        second = await r.accept()
        assert await closed(second)
        assert recorded == [JOURNEYS["fast"][:4], JOURNEYS["max_connections"]]
        assert r.pool.rejected["max_connections"] == 1 and r.pool.clients == 1
        assert access_lines(caplog)[-1].endswith("end=rejected:max_connections")
        first.close()
        await settled(r)
        assert recorded[0] == JOURNEYS["fast"]

    run(body)


def test_the_fast_path_retries_a_refused_connect_on_another_server(recorded):
    async def body(nursery):
        port = await echo_server_port(nursery)
        servers = [real_server("down", closed_port()), real_server("a", port)]
        r = await rig(nursery, servers)
        for _ in range(2):  # the second finds both addresses cached
            client = await r.accept()
            assert await round_trip(client) == b"ping"
            client.close()
            await settled(r)
        assert recorded == [JOURNEYS["retry"]] * 2
        assert r.pool.by_name["down"].counters.connect_failures["refused"] == 2
        assert r.pool.by_name["a"].counters.connections_total == 2

    run(body)


def test_a_connect_that_fails_at_once_is_retried_on_another_server(recorded):
    """A connect the kernel fails before it starts (no route to a broadcast address):
    counted as an error, then the next server."""

    async def body(nursery):
        port = await echo_server_port(nursery)
        broadcast = dataclasses.replace(
            real_server("bad", 80), address=Address("255.255.255.255", 80)
        )
        r = await rig(nursery, [broadcast, real_server("a", port)])
        for _ in range(2):
            client = await r.accept()
            assert await round_trip(client) == b"ping"
            client.close()
            await settled(r)
        assert recorded == [JOURNEYS["retry"]] * 2
        assert r.pool.by_name["bad"].counters.connect_failures["error"] == 2

    run(body)


def test_a_connect_left_unanswered_times_out(recorded, caplog):
    """A real server whose accept queue is full drops the SYN: the connect is in
    progress, waited for in a task, and ends at connect_timeout."""

    async def body(nursery):
        full = socket.create_server(("127.0.0.1", 0), backlog=0)
        _opened.append(full)
        r = await rig(
            nursery,
            [real_server("full", full.getsockname()[1])],
            connect_timeout=0.3,
            retries=0,
        )
        client = await r.accept()  # the warm-up: resolved, and connected (queued)
        with trio.fail_after(5):
            while r.pool.by_name["full"].counters.connections_total != 1:
                await trio.sleep(0.01)
        server, _ = full.accept()
        server.close()
        client.close()
        await settled(r)
        filler = socket.create_connection(full.getsockname())  # the queue full again
        _opened.append(filler)
        recorded.clear()
        r.spawned.clear()
        client = await r.accept()
        assert recorded == [[A, P, C]] and r.spawned == ["_waiting"]
        assert await closed(client)
        await settled(r)
        assert recorded == [JOURNEYS["connect_timeout"]]
        assert r.pool.by_name["full"].counters.connect_failures["timeout"] == 1
        assert r.pool.rejected["connect_failed"] == 1
        assert access_lines(caplog)[-1].endswith("end=no_server")

    run(body)


@compiled_only
def test_a_bug_in_the_fast_paths_connect_ends_that_connection_only(recorded, monkeypatch):
    def broken(sockaddr):
        raise RuntimeError("injected")

    async def body(nursery):
        r = await rig(nursery)
        await warm_up(r, recorded)
        before = internal_errors().counts["connection"]
        monkeypatch.setattr(connection, "_c_connect", broken)
        client = await r.accept()
        assert await closed(client)
        assert recorded == [JOURNEYS["bug_in_c_connect"]]
        assert r.pool.clients == 0 and r.pool.active == 0
        assert internal_errors().counts["connection"] == before + 1

    run(body)


def test_a_throttle_that_admits_still_imposes_its_idle_timeout(recorded, caplog):
    class High:
        def arrival(self) -> bool:
            return False

        def idle_timeout_for(self, own: float) -> float:
            return 0.2

    async def body(nursery):
        r = await rig(nursery)
        await warm_up(r, recorded)
        r.vs.throttle = High()
        client = await r.accept()
        assert await round_trip(client) == b"ping"
        assert await closed(client)  # idle for 0.2 s
        await settled(r)
        assert recorded == [JOURNEYS["fast"]]
        assert access_lines(caplog)[-1].endswith("end=idle_timeout")

    run(body)


def test_a_reload_applies_to_the_next_connection(recorded):
    """The configuration is read per connection: a reload that adds an ACL refuses the
    next client; one that moves the server sends the next one to its new address."""

    async def hello(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.send_all(b"moved")

    async def body(nursery):
        r = await rig(nursery)
        await warm_up(r, recorded)
        config = r.pool.config
        r.pool.reconfigure(
            dataclasses.replace(config, deny=(ipaddress.ip_network("127.0.0.0/8"),)),
            trio.current_time(),
        )
        client = await r.accept()
        assert await closed(client)
        assert r.pool.rejected["acl"] == 1
        (listener,) = await nursery.start(
            functools.partial(trio.serve_tcp, hello, 0, host="127.0.0.1")
        )
        moved = real_server("a", listener.socket.getsockname()[1])
        r.pool.reconfigure(dataclasses.replace(config, real_servers=(moved,)), trio.current_time())
        client = await r.accept()
        with trio.fail_after(5):
            assert await client.recv(100) == b"moved"
        client.close()
        await settled(r)
        assert recorded == [JOURNEYS["acl"], JOURNEYS["resolving"]]

    run(body)


def test_the_fast_path_explains_its_pick_at_debug(recorded, caplog):
    async def body(nursery):
        r = await rig(nursery)
        await warm_up(r, recorded)
        caplog.set_level(logging.DEBUG, logger="lbproxy.proxy")
        client = await r.accept()
        assert await round_trip(client) == b"ping"
        client.close()
        await settled(r)
        assert recorded == [JOURNEYS["fast"]]
        assert any(
            record.name == "lbproxy.proxy" and record.getMessage().startswith("vs: rr picked a [")
            for record in caplog.records
        )

    run(body)


def test_servers_renamed_by_reloads_are_not_remembered_for_ever(recorded):
    """Each reload here replaces the one server by a new one (a new name, the same
    address): every connection is served, and the handler forgets the servers gone."""

    async def body(nursery):
        r = await rig(nursery)
        port = r.pool.servers[0].address.port
        for i in range(40):
            server = real_server(f"s{i}", port)
            r.pool.reconfigure(
                dataclasses.replace(r.pool.config, real_servers=(server,)), trio.current_time()
            )
            client = await r.accept()
            assert await round_trip(client) == b"ping"
            client.close()
            await settled(r)
        assert sum(rs.counters.connections_total for rs in r.pool.servers) == 1
        assert len(r.handler._targets) <= 2 * len(r.pool.servers) + 17

    run(body)


# -- the guardian: one task per handler, not per idle-to-busy transition ------------------


def test_one_guardian_stands_for_connections_that_come_one_at_a_time(recorded):
    async def body(nursery):
        r = await rig(nursery)
        await warm_up(r, recorded)  # its connection started the guardian
        for _ in range(3):  # each finds the handler with no connection live
            client = await r.accept()
            assert await round_trip(client) == b"ping"
            client.close()
            await settled(r)
        assert r.spawned == []
        assert recorded == [JOURNEYS["fast"]] * 3

    run(body)


async def rig_in_handlers_nursery(nursery) -> tuple[Rig, trio.Event, trio.Event]:
    """A rig whose handler runs in a handlers nursery of its own, as the server's: set
    `stopping` and the nursery closes once its tasks end, which sets `drained`."""
    port = await echo_server_port(nursery)
    stopping, drained = trio.Event(), trio.Event()

    async def handlers_nursery(task_status=trio.TASK_STATUS_IGNORED):
        async with trio.open_nursery() as handlers:
            task_status.started(await rig(handlers, [real_server("a", port)]))
            await stopping.wait()
        drained.set()

    return await nursery.start(handlers_nursery), stopping, drained


def test_a_retired_handler_is_drained_once_its_last_connection_ends(recorded):
    """retire() (the listener closed): the handlers nursery, which the drain waits for,
    finishes when the last task-less connection ends, and not before."""

    async def body(nursery):
        r, stopping, drained = await rig_in_handlers_nursery(nursery)
        await warm_up(r, recorded)
        held = await r.accept()
        assert await round_trip(held) == b"ping"
        r.handler.retire()  # as the listener's close() does when the drain starts
        stopping.set()
        await trio.testing.wait_all_tasks_blocked()
        assert not drained.is_set()  # the guardian stands for the held connection
        held.close()
        with trio.fail_after(5):
            await drained.wait()
        assert recorded == [JOURNEYS["fast"]]

    run(body)


def test_a_retired_idle_handler_is_drained_at_once(recorded):
    async def body(nursery):
        r, stopping, drained = await rig_in_handlers_nursery(nursery)
        await warm_up(r, recorded)  # its guardian stays while the handler serves
        stopping.set()
        await trio.testing.wait_all_tasks_blocked()
        assert not drained.is_set()
        r.handler.retire()
        with trio.fail_after(5):
            await drained.wait()

    run(body)
