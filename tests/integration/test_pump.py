"""lbproxy.net.pump over real loopback TCP connections, splice and fallback paths.

Each test builds two real connections, (client, proxy_client) and (proxy_server,
server), runs a pump between the two proxy-side descriptors as the connection handler
does (the run's reactor's ``open``, which owns both descriptors and reports the end to
``on_end``) and plays client and server itself. Real clock under trio.fail_after; no
mocks.

Every test runs on both implementations (IMPLEMENTATIONS): the C pump (lbproxy/net/
_cpump.c) and the pure-Python one (lbproxy/net/pure_pump.py), in the same process (the
pure one by making it the one new reactors use); under LBPROXY_PURE=1 only the pure one.
"""

from __future__ import annotations

import array
import fcntl
import os
import socket
import struct
import termios
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import trio
import trio.testing
from trio.socket import SocketType

from lbproxy.dataplane.proxy_header_io import read_proxy_header
from lbproxy.net import compiled, pure_pump
from lbproxy.net import pump as pump_mod
from lbproxy.net import reactor as reactor_mod
from lbproxy.net.pump import Flow, Pump, close_idle_pipes, idle_pipes
from lbproxy.wire.proxy_protocol import ProxyProtocolError, encode_v1, encode_v2

pytestmark = pytest.mark.integration

MODES = [
    pytest.param(
        True,
        id="splice",
        marks=pytest.mark.skipif(not hasattr(os, "splice"), reason="no os.splice"),
    ),
    pytest.param(False, id="fallback"),
]
IMPLEMENTATIONS = [
    pytest.param(
        "compiled",
        marks=pytest.mark.skipif(compiled.cpump is None, reason="the C extension is not in use"),
    ),
    pytest.param("pure"),
]


@pytest.fixture(autouse=True, params=IMPLEMENTATIONS)
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which pump runs: "pure" makes the pure one the one new reactors use."""
    if request.param == "pure":
        monkeypatch.setattr(reactor_mod, "_implementation", pure_pump)
    return str(request.param)


# -------------------------------------------------------------------------- helpers


async def connected_pair() -> tuple[SocketType, SocketType]:
    """(connecting side, accepted side) of one loopback TCP connection."""
    listener = trio.socket.socket()
    try:
        await listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        a = trio.socket.socket()
        await a.connect(listener.getsockname())
        b, _ = await listener.accept()
    finally:
        listener.close()
    return a, b


@dataclass
class Rig:
    client: SocketType
    proxy_client: SocketType
    proxy_server: SocketType
    server: SocketType


@asynccontextmanager
async def rig() -> AsyncIterator[Rig]:
    client, proxy_client = await connected_pair()
    proxy_server, server = await connected_pair()
    r = Rig(client, proxy_client, proxy_server, server)
    try:
        yield r
    finally:
        for s in (client, proxy_client, proxy_server, server):
            s.close()


class PumpTask:
    """The pump running as the connection handler runs it, its outcome and when it
    ended: both proxy-side sockets detached to plain descriptors and handed to the
    run's reactor (``open``), whose ``on_end`` reports the end -- and records whether
    both descriptors were closed by then. `flow` is the pump's (``flow.pump``), as a
    connection is. Cancelling run() closes the pump, as the handler's guard does."""

    def __init__(
        self,
        r: Rig,
        flow: Flow,
        use_splice: bool,
        *,
        preamble: bytes = b"",
        initial_client_bytes: bytes = b"",
    ) -> None:
        self.rig = r
        self.flow = flow
        self.use_splice = use_splice
        self.preamble = preamble
        self.initial = preamble + initial_client_bytes
        self.outcome: str | None = None
        self.started = trio.current_time()
        self.ended: float | None = None
        self.done = trio.Event()
        self.fds: tuple[int, int] | None = None
        self.pump: Pump | None = None
        self.closed_at_end: bool | None = None  # both fds closed at on_end

    async def run(self) -> None:
        self.fds = (self.rig.proxy_client.detach(), self.rig.proxy_server.detach())
        p = self.pump = pump_mod.reactor().open(
            *self.fds,
            self.initial,
            self.flow.idle_timeout,
            self._on_end,
            len(self.preamble),
            self.use_splice,
        )
        self.flow.pump = p
        try:
            await self.done.wait()
        finally:
            p.close()  # cancelled: what the handler's guard does; nothing once ended
        assert self.closed_at_end, "on_end was called before both descriptors were closed"

    def _on_end(self, p: Pump) -> None:
        assert self.fds is not None
        self.closed_at_end = all(_closed(fd) for fd in self.fds)
        self.outcome = p.outcome
        self.ended = trio.current_time()
        self.done.set()

    @property
    def error(self) -> BaseException | None:
        assert self.pump is not None
        return self.pump.error

    @property
    def elapsed(self) -> float:
        assert self.ended is not None
        return self.ended - self.started


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


async def send_all(sock: SocketType, data: bytes, *, shut: bool = True) -> None:
    view = memoryview(data)
    while view:
        n = await sock.send(view[: 1 << 16])
        view = view[n:]
    if shut:
        sock.shutdown(socket.SHUT_WR)


async def recv_all(sock: SocketType) -> bytes:
    parts = []
    while chunk := await sock.recv(1 << 16):
        parts.append(chunk)
    return b"".join(parts)


async def recv_exactly(sock: SocketType, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await sock.recv(n - len(data))
        assert chunk, "unexpected EOF"
        data += chunk
    return data


def linger0_close(sock: SocketType) -> None:
    """close() that sends RST instead of FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def pipe_bytes(fd: int) -> int:
    buf = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return buf[0]


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("use_splice", MODES)
def test_20mb_both_ways_byte_exact(use_splice: bool) -> None:
    size = 20 << 20
    up, down = os.urandom(size), os.urandom(size)

    async def main() -> None:
        got: dict[str, bytes] = {}

        async def collect(name: str, sock: SocketType) -> None:
            got[name] = await recv_all(sock)

        async with rig() as r:
            flow = Flow(idle_timeout=10)
            p = PumpTask(r, flow, use_splice)
            with trio.fail_after(30):
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)
                    n.start_soon(send_all, r.client, up)
                    n.start_soon(send_all, r.server, down)
                    n.start_soon(collect, "server", r.server)
                    n.start_soon(collect, "client", r.client)
        assert got["server"] == up
        assert got["client"] == down
        assert (flow.bytes_in, flow.bytes_out) == (size, size)
        assert p.outcome == "closed"
        assert p.error is None

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
def test_small_chunks_are_copied_and_a_bulk_transfer_is_spliced(use_splice: bool) -> None:
    """splice-auto: a request and a response smaller than COPY_CHUNK are
    copied -- no pipe is ever made for them -- and a transfer whose reads fill it goes
    through pipes from then on (they are in the pool afterwards); without splice, never."""
    request, response = b"q" * 1000, b"r" * (pump_mod.COPY_CHUNK - 1)
    bulk = os.urandom(4 << 20)

    async def main() -> None:
        close_idle_pipes()
        async with rig() as r:
            flow = Flow(idle_timeout=10)
            p = PumpTask(r, flow, use_splice)
            with trio.fail_after(20):
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)
                    for _ in range(3):  # a keep-alive connection: small both ways
                        await send_all(r.client, request, shut=False)
                        assert await recv_exactly(r.server, len(request)) == request
                        await send_all(r.server, response, shut=False)
                        assert await recv_exactly(r.client, len(response)) == response
                    assert idle_pipes() == [], "a pipe was made for small chunks"

                    async def stream() -> None:
                        await send_all(r.server, bulk, shut=False)

                    n.start_soon(stream)
                    assert await recv_exactly(r.client, len(bulk)) == bulk
                    if use_splice:
                        assert idle_pipes(), "the bulk transfer was not spliced"
                    else:
                        assert idle_pipes() == []
                    # back to small chunks: both ways still work, FINs and all
                    await send_all(r.client, request)
                    assert await recv_all(r.server) == request
                    r.server.shutdown(socket.SHUT_WR)
                    assert await recv_all(r.client) == b""
        assert p.outcome == "closed"
        assert (flow.bytes_in, flow.bytes_out) == (
            4 * len(request),
            3 * len(response) + len(bulk),
        )
        close_idle_pipes()

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
def test_half_close_then_reply(use_splice: bool) -> None:
    request = b"GET /big\r\n\r\n"
    reply = os.urandom(3 << 20)

    async def main() -> None:
        async with rig() as r:
            flow = Flow(idle_timeout=10)
            p = PumpTask(r, flow, use_splice)
            with trio.fail_after(10):
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)
                    await send_all(r.client, request)  # then SHUT_WR: client sent FIN
                    # The server sees the request and then EOF: the FIN was passed on...
                    assert await recv_all(r.server) == request
                    # ...yet the way back is still open: the client receives all of it.
                    await send_all(r.server, reply, shut=False)
                    r.server.close()
                    assert await recv_all(r.client) == reply
                    await p.done.wait()
        assert p.outcome == "closed"
        assert (flow.bytes_in, flow.bytes_out) == (len(request), len(reply))

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
def test_half_close_server_first(use_splice: bool) -> None:
    """The mirror case: the server finishes first, the client keeps sending."""

    async def main() -> None:
        async with rig() as r:
            p = PumpTask(r, Flow(idle_timeout=10), use_splice)
            with trio.fail_after(10):
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)
                    await send_all(r.server, b"banner\n")
                    assert await recv_all(r.client) == b"banner\n"
                    await send_all(r.client, b"late upload")
                    assert await recv_all(r.server) == b"late upload"
                    await p.done.wait()
        assert p.outcome == "closed"

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
def test_upload_after_both_fins_reaches_a_slow_server(use_splice: bool) -> None:
    """The server half-closes first; the client then uploads a lot and sends its FIN
    while the server reads slowly. When the client's FIN arrives the client socket has
    both halves shut (a hang-up) with upload bytes still unread behind a blocked write:
    every one of them must still reach the server."""
    upload = os.urandom(8 << 20)

    async def main() -> None:
        async with rig() as r:
            flow = Flow(idle_timeout=10)
            p = PumpTask(r, flow, use_splice)
            with trio.fail_after(20):
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)
                    await send_all(r.server, b"")  # FIN first
                    assert await recv_all(r.client) == b""
                    n.start_soon(send_all, r.client, upload)
                    parts = []
                    while chunk := await r.server.recv(1 << 16):
                        parts.append(chunk)
                        if len(parts) % 4 == 0:
                            await trio.sleep(0.01)  # slow reader: the pump blocks writing
                    await p.done.wait()
        assert b"".join(parts) == upload
        assert p.outcome == "closed"
        assert flow.bytes_in == len(upload)

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
def test_server_reset_closes_client_promptly(use_splice: bool) -> None:
    async def main() -> None:
        async with rig() as r:
            flow = Flow(idle_timeout=10)
            p = PumpTask(r, flow, use_splice)
            with trio.fail_after(5):
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)
                    await send_all(r.client, b"hello", shut=False)
                    assert await recv_exactly(r.server, 5) == b"hello"
                    await send_all(r.server, b"partial answer", shut=False)
                    assert await recv_exactly(r.client, 14) == b"partial answer"
                    t0 = trio.current_time()
                    linger0_close(r.server)
                    await p.done.wait()
                    assert trio.current_time() - t0 < 1.0
            assert p.outcome == "server_reset"
            assert isinstance(p.error, ConnectionResetError)
            assert p.closed_at_end
            with trio.fail_after(1):
                # An orderly close, at once: what the client already has stays valid.
                assert await r.client.recv(100) == b""

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
def test_client_reset_while_server_streams(use_splice: bool) -> None:
    async def main() -> None:
        async with rig() as r:
            flow = Flow(idle_timeout=10)
            p = PumpTask(r, flow, use_splice)
            with trio.fail_after(5):
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)

                    async def stream() -> None:
                        block = b"x" * 65536
                        try:
                            while True:
                                await r.server.send(block)
                        except OSError:
                            pass  # the proxy closed us after the client's reset

                    n.start_soon(stream)
                    await recv_exactly(r.client, 100_000)
                    linger0_close(r.client)
                    await p.done.wait()
                    assert p.outcome == "client_reset"
                    assert p.closed_at_end
        assert flow.bytes_out >= 100_000

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
def test_reset_after_half_close_is_noticed_at_once(use_splice: bool) -> None:
    """The client sends its request and FIN, the server thinks; then the client resets.
    Nothing is read from the client any more, yet the pump ends at once, well before
    the idle timeout, and the server's socket is closed."""

    async def main() -> None:
        async with rig() as r:
            p = PumpTask(r, Flow(idle_timeout=10), use_splice)
            with trio.fail_after(5):
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)
                    await send_all(r.client, b"request")
                    assert await recv_all(r.server) == b"request"
                    t0 = trio.current_time()
                    linger0_close(r.client)
                    await p.done.wait()
                    assert trio.current_time() - t0 < 1.0
            assert p.outcome == "client_reset"

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
def test_idle_timeout(use_splice: bool) -> None:
    async def main() -> None:
        async with rig() as r:
            p = PumpTask(r, Flow(idle_timeout=0.3), use_splice)
            with trio.fail_after(5):
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)
                    await p.done.wait()
        assert p.outcome == "idle_timeout"
        assert 0.29 <= p.elapsed < 1.5

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
def test_idle_timeout_counts_from_last_activity(use_splice: bool) -> None:
    async def main() -> None:
        async with rig() as r:
            p = PumpTask(r, Flow(idle_timeout=0.3), use_splice)
            with trio.fail_after(5):
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)
                    await trio.sleep(0.2)
                    await send_all(r.server, b"tick", shut=False)
                    assert await recv_exactly(r.client, 4) == b"tick"
                    await p.done.wait()
        assert p.outcome == "idle_timeout"
        assert 0.49 <= p.elapsed < 1.5

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
def test_last_activity_is_the_runs_clock(use_splice: bool) -> None:
    """A chunk's time, written to the flow by the pump (the C pump reads trio's
    SystemClock itself), is trio.current_time() between the send and the
    receive: the same clock, offset included, so idle deadlines and the sweep agree."""

    async def main() -> None:
        async with rig() as r:
            flow = Flow(idle_timeout=30.0)
            p = PumpTask(r, flow, use_splice)
            with trio.fail_after(5):
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)
                    await trio.sleep(0.05)
                    for _ in range(3):
                        before = trio.current_time()
                        await send_all(r.client, b"ping", shut=False)
                        assert await recv_exactly(r.server, 4) == b"ping"
                        after = trio.current_time()
                        assert before <= flow.last_activity <= after
                        await trio.sleep(0.01)
                    n.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
@pytest.mark.parametrize("tick_at", [None, 3.0])
def test_long_idle_timeout_is_exact(use_splice: bool, tick_at) -> None:
    """An idle timeout counts from the last activity, neither early nor late, through
    the reactor's idle timer (a trio deadline: the test clock's autojump sees it).
    Virtual time: the clock jumps whenever every task waits."""
    timeout = 5.0

    async def main() -> None:
        async with rig() as r:
            p = PumpTask(r, Flow(idle_timeout=timeout), use_splice)
            last = 0.0
            with trio.fail_after(60):
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)
                    if tick_at is not None:
                        await trio.sleep(tick_at)
                        await send_all(r.server, b"tick", shut=False)
                        assert await recv_exactly(r.client, 4) == b"tick"
                        last = trio.current_time() - p.started
                    await p.done.wait()
        assert p.outcome == "idle_timeout"
        assert abs(p.elapsed - (last + timeout)) < 0.01

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("use_splice", MODES)
def test_idle_timeout_bounds_half_closed(use_splice: bool) -> None:
    async def main() -> None:
        async with rig() as r:
            p = PumpTask(r, Flow(idle_timeout=0.3), use_splice)
            with trio.fail_after(5):
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)
                    await send_all(r.client, b"bye")  # client half-closes, server never does
                    assert await recv_all(r.server) == b"bye"
                    await p.done.wait()
        assert p.outcome == "idle_timeout"
        assert 0.29 <= p.elapsed < 1.5

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
@pytest.mark.parametrize(
    ("initial", "change_at", "new", "low", "high"),
    [
        (float("inf"), 0.2, 0.5, 0.48, 1.5),  # from none to 0.5 s: ends 0.5 s after start
        (10.0, 0.3, 0.1, 0.29, 0.5),  # shortened below the idle time so far: ends at once
        # lengthened well before it fired (a stall of 0.9 s before the change would end
        # the pump first): 1 s no longer applies
        (1.0, 0.1, 1.5, 1.48, 3.0),
    ],
)
def test_changing_idle_timeout_takes_effect(
    use_splice: bool, initial: float, change_at: float, new: float, low: float, high: float
) -> None:
    async def main() -> None:
        async with rig() as r:
            flow = Flow(idle_timeout=initial)
            p = PumpTask(r, flow, use_splice)
            with trio.fail_after(5):
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)
                    await trio.sleep(change_at)
                    assert p.outcome is None
                    flow.idle_timeout = new  # as the throttle monitor does
                    await p.done.wait()
        assert p.outcome == "idle_timeout"
        assert low <= p.elapsed < high

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
def test_cancellation_exits_promptly(use_splice: bool) -> None:
    async def main() -> None:
        async with rig() as r:
            p = PumpTask(r, Flow(), use_splice)
            t0 = trio.current_time()
            with trio.move_on_after(0.2) as scope:
                await p.run()
            assert scope.cancelled_caught
            assert trio.current_time() - t0 < 0.5
            assert p.outcome == "cancelled" and p.closed_at_end

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
def test_cancel_with_bytes_stuck_in_pipe_discards_that_pipe(use_splice: bool) -> None:
    """The server stops reading; the client keeps sending until everything is full and
    pump holds a chunk it cannot write. Cancelling then must close that pipe (it holds
    bytes), never pool it, and leak nothing."""

    async def main() -> None:
        close_idle_pipes()
        pump_mod.reactor()  # the run's shared epoll: one descriptor for every pump
        async with rig() as r:
            baseline = fd_count()
            flow = Flow()
            with trio.fail_after(10):
                async with trio.open_nursery() as n:
                    p = PumpTask(r, flow, use_splice)
                    n.start_soon(p.run)

                    async def flood() -> None:
                        block = b"y" * 65536
                        while True:
                            await r.client.send(block)

                    n.start_soon(flood)
                    # Wait until the pump stops making progress: buffers are full.
                    last = -1
                    while flow.bytes_in != last:
                        last = flow.bytes_in
                        await trio.sleep(0.3)
                    if use_splice:
                        # One borrowed pipe, still holding the chunk it could not write.
                        pooled = len(idle_pipes())
                        assert fd_count() == baseline + 2 * pooled + 2
                    n.cancel_scope.cancel()
            assert p.outcome == "cancelled"  # closed by the cancelled task
            for rfd, _ in idle_pipes():
                assert pipe_bytes(rfd) == 0
            # cancelling closed both proxy-side descriptors too
            baseline -= 2
            assert fd_count() == baseline + 2 * len(idle_pipes())
            close_idle_pipes()
            assert fd_count() == baseline

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
def test_no_fd_leak_over_many_connections(use_splice: bool) -> None:
    payload = os.urandom(300_000)

    async def one() -> None:
        async with rig() as r:
            flow = Flow(idle_timeout=10)
            p = PumpTask(r, flow, use_splice)
            async with trio.open_nursery() as n:
                n.start_soon(p.run)
                n.start_soon(send_all, r.client, payload)
                n.start_soon(send_all, r.server, payload)
                assert await recv_all(r.server) == payload
                assert await recv_all(r.client) == payload
            assert p.outcome == "closed"

    async def main() -> None:
        close_idle_pipes()
        pump_mod.reactor()  # the run's shared epoll: one descriptor for every pump
        baseline = fd_count()
        with trio.fail_after(30):
            for _ in range(4):
                async with trio.open_nursery() as n:
                    for _ in range(40):
                        n.start_soon(one)
                assert len(idle_pipes()) <= pump_mod.MAX_IDLE_PIPES
                assert fd_count() == baseline + 2 * len(idle_pipes())
        if use_splice:
            assert idle_pipes(), "the pool was never used"
        for rfd, _ in idle_pipes():
            assert pipe_bytes(rfd) == 0
        close_idle_pipes()
        assert fd_count() == baseline

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
def test_initial_client_bytes_go_first_and_count(use_splice: bool) -> None:
    async def main() -> None:
        async with rig() as r:
            flow = Flow(idle_timeout=10)
            p = PumpTask(r, flow, use_splice, initial_client_bytes=b"early bytes")
            with trio.fail_after(5):
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)
                    await send_all(r.client, b", then the rest")
                    assert await recv_all(r.server) == b"early bytes, then the rest"
                    r.server.shutdown(socket.SHUT_WR)
                    assert await recv_all(r.client) == b""
                    await p.done.wait()
        assert p.outcome == "closed"
        assert flow.bytes_in == len(b"early bytes, then the rest")

    trio.run(main)


@pytest.mark.parametrize("use_splice", MODES)
def test_preamble_and_initial_bytes_larger_than_the_buffers_wait_and_keep_order(
    use_splice: bool,
) -> None:
    """A PROXY header plus 32 MiB of early client bytes do not fit in the socket buffers:
    the pump waits for the server to take them, reads nothing from the client meanwhile,
    and the server gets header, early bytes, then the rest, in order. Only client bytes
    count."""
    header = b"PROXY TCP4 192.0.2.1 192.0.2.2 1234 80\r\n"
    early = os.urandom(32 << 20)
    rest = os.urandom(1 << 20)

    async def main() -> None:
        async with rig() as r:
            flow = Flow(idle_timeout=10)
            p = PumpTask(r, flow, use_splice, preamble=header, initial_client_bytes=early)
            with trio.fail_after(20):
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)
                    n.start_soon(send_all, r.client, rest)
                    await trio.sleep(0.3)  # the server reads nothing yet: the pump must wait
                    assert flow.bytes_in < len(early)
                    got = await recv_all(r.server)
                    r.server.shutdown(socket.SHUT_WR)
                    assert await recv_all(r.client) == b""
                    await p.done.wait()
        assert got == header + early + rest
        assert p.outcome == "closed"
        assert flow.bytes_in == len(early) + len(rest)

    trio.run(main)


# ------------------------------------------------------------- PROXY header reading


@pytest.mark.parametrize("use_splice", MODES)
def test_read_proxy_header_then_pump_leftover(use_splice: bool) -> None:
    header = encode_v2(("203.0.113.7", 40001), ("198.51.100.1", 443))

    async def main() -> None:
        async with rig() as r:
            with trio.fail_after(5):
                # header and the first payload in one segment: the payload is leftover
                await r.client.send(header + b"first ")
                source, leftover = await read_proxy_header(r.proxy_client)
                assert source == ("203.0.113.7", 40001)
                assert leftover == b"first "
                flow = Flow(idle_timeout=10)
                p = PumpTask(r, flow, use_splice, initial_client_bytes=leftover)
                async with trio.open_nursery() as n:
                    n.start_soon(p.run)
                    await send_all(r.client, b"second")
                    assert await recv_all(r.server) == b"first second"
                    r.server.close()
                    assert await recv_all(r.client) == b""
        assert p.outcome == "closed"
        assert flow.bytes_in == len(b"first second")

    trio.run(main)


def test_read_proxy_header_in_pieces() -> None:
    header = encode_v1(("2001:db8::7", 5555), ("2001:db8::1", 80))

    async def main() -> None:
        async with rig() as r:
            with trio.fail_after(5):
                async with trio.open_nursery() as n:

                    async def dribble() -> None:
                        for i in range(0, len(header), 7):
                            await r.client.send(header[i : i + 7])
                            await trio.sleep(0.01)

                    n.start_soon(dribble)
                    source, leftover = await read_proxy_header(r.proxy_client)
        assert source == ("2001:db8::7", 5555)
        assert leftover == b""

    trio.run(main)


@pytest.mark.parametrize(
    "sent",
    [
        b"GET / HTTP/1.0\r\n\r\n",  # no header at all
        b"PROXY TCP4 1.2.3.4",  # then EOF
    ],
)
def test_read_proxy_header_rejects(sent: bytes) -> None:
    async def main() -> None:
        async with rig() as r:
            await send_all(r.client, sent)
            with trio.fail_after(5), pytest.raises(ProxyProtocolError):
                await read_proxy_header(r.proxy_client)

    trio.run(main)
