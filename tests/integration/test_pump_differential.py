"""Both pump implementations fed the same scripted peers: what each delivers and counts.

The C pump (lbproxy/net/_cpump.c) and the pure one (lbproxy/net/pure_pump.py) have one
API and must behave the same. Each scenario is a sequence of peer actions -- a client
and a real server on real loopback TCP connections, the pump between the two
proxy-side descriptors -- played once against each implementation, in a trio run of its
own; what the peers receive (the bytes each way, in order, and whether a FIN or a reset
ended them) and what the pump reports (bytes_in, bytes_out, outcome) must be the same for
both, and what the scenario expects. Runs whenever the extension is built, whatever
LBPROXY_PURE says (the implementations are imported directly).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import socket
import struct
from dataclasses import dataclass, field
from types import ModuleType

import pytest
import trio
from trio.socket import SocketType

from lbproxy.net import pure_pump, reactor

try:
    from lbproxy.net import _cpump  # type: ignore[attr-defined]  # built C, no stub
except ImportError:  # no compiler at install time: only the pure one to check
    _cpump = None

pytestmark = pytest.mark.integration

IMPLEMENTATIONS: list[tuple[str, ModuleType]] = [("pure", pure_pump)]
if _cpump is not None:
    IMPLEMENTATIONS.insert(0, ("compiled", _cpump))

CHUNK = pure_pump.COPY_CHUNK


def payload(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# -- the peers and what they saw -----------------------------------------------------------


@dataclass
class Seen:
    """What one run of a scenario observed."""

    at_client: bytearray = field(default_factory=bytearray)  # server -> client bytes
    at_server: bytearray = field(default_factory=bytearray)  # client -> server bytes
    client_end: str | None = None  # "fin" or "reset": how the client's stream ended
    server_end: str | None = None
    outcome: str | None = None
    bytes_in: int = -1
    bytes_out: int = -1
    error: str | None = None  # the error's class name
    closed_at_end: bool | None = None  # both descriptors closed when on_end ran
    pipes_used: bool = False  # a pipe went back to the pool: a chunk was spliced
    notes: dict[str, object] = field(default_factory=dict)
    varies: set[str] = field(default_factory=set)  # not compared: timing decides them

    def result(self) -> dict[str, object]:
        """Everything both implementations must agree on."""
        result = {
            "at_client": bytes(self.at_client),
            "at_server": bytes(self.at_server),
            "client_end": self.client_end,
            "server_end": self.server_end,
            "outcome": self.outcome,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "error": self.error,
            "closed_at_end": self.closed_at_end,
            "pipes_used": self.pipes_used,
            **self.notes,
        }
        for key in self.varies:
            result.pop(key)
        return result


async def connected_pair() -> tuple[SocketType, SocketType]:
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


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


class Run:
    """One scenario against one implementation: the peers, the pump, what was seen."""

    def __init__(self, client: SocketType, server: SocketType) -> None:
        self.client = client
        self.server = server
        self.seen = Seen()
        self.ended = trio.Event()
        self.pump: reactor.Pump | None = None
        self.fds: tuple[int, int] = (-1, -1)
        self.opened_at = 0.0  # the run's time just before the pump was opened

    def on_end(self, p: reactor.Pump) -> None:
        self.seen.closed_at_end = all(_closed(fd) for fd in self.fds)
        self.ended.set()

    def side(self, name: str) -> SocketType:
        return self.client if name == "client" else self.server

    async def send(self, name: str, data: bytes) -> None:
        view = memoryview(data)
        sock = self.side(name)
        while view:
            view = view[await sock.send(view[: 1 << 16]) :]

    def shut(self, name: str) -> None:
        self.side(name).shutdown(socket.SHUT_WR)

    def reset(self, name: str) -> None:
        """close() that sends RST instead of FIN."""
        sock = self.side(name)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()

    async def expect(self, name: str, n: int) -> None:
        """Read exactly n bytes at `name` (recorded)."""
        got = self.seen.at_client if name == "client" else self.seen.at_server
        want = len(got) + n
        sock = self.side(name)
        while len(got) < want:
            chunk = await sock.recv(min(1 << 16, want - len(got)))
            assert chunk, f"EOF at the {name} with {want - len(got)} bytes still expected"
            got += chunk

    async def expect_end(self, name: str) -> None:
        """Read at `name` until its stream ends (recorded: the bytes, and FIN or reset)."""
        got = self.seen.at_client if name == "client" else self.seen.at_server
        sock = self.side(name)
        try:
            while chunk := await sock.recv(1 << 16):
                got += chunk
            end = "fin"
        except ConnectionResetError:
            end = "reset"
        if name == "client":
            self.seen.client_end = end
        else:
            self.seen.server_end = end

    async def wait_end(self) -> None:
        await self.ended.wait()


async def play(impl: ModuleType, script, **open_kw: object) -> Seen:
    """Play `script(run)` against a pump of `impl`: a fresh trio run's reactor."""
    impl.close_idle_pipes()
    r = reactor.start(impl)
    client, proxy_client = await connected_pair()
    proxy_server, server = await connected_pair()
    run = Run(client, server)
    kw = {"initial": b"", "idle_timeout": 30.0, **open_kw}
    try:
        with trio.fail_after(60):
            run.fds = (proxy_client.detach(), proxy_server.detach())
            run.opened_at = trio.current_time()
            run.pump = p = r.open(
                run.fds[0],
                run.fds[1],
                kw.pop("initial"),
                kw.pop("idle_timeout"),
                run.on_end,
                **kw,
            )
            await script(run)
            await run.wait_end()
        seen = run.seen
        seen.outcome = p.outcome
        seen.bytes_in, seen.bytes_out = p.bytes_in, p.bytes_out
        seen.error = None if p.error is None else type(p.error).__name__
        seen.pipes_used = bool(impl.idle_pipes())
        return seen
    finally:
        for s in (client, server, proxy_client, proxy_server):
            s.close()
        impl.close_idle_pipes()


def both(script, **open_kw: object) -> dict[str, object]:
    """The scenario's result, the same for every implementation (or the test fails)."""
    results = {}
    for name, impl in IMPLEMENTATIONS:

        async def main(impl: ModuleType = impl) -> Seen:
            return await play(impl, script, **open_kw)

        results[name] = trio.run(main).result()
    first = next(iter(results.values()))
    for name, result in results.items():
        differing = {k: (v, first[k]) for k, v in result.items() if first[k] != v}
        assert not differing, f"{name} differs: {_short(differing)}"
    return first


def _short(d: dict) -> str:
    return repr({k: tuple(_cut(x) for x in v) for k, v in d.items()})


def _cut(x: object) -> object:
    return f"<{len(x)} bytes>" if isinstance(x, bytes | bytearray) and len(x) > 40 else x


# -- the scenarios ---------------------------------------------------------------------------


def test_half_close_by_the_client_then_a_large_reply():
    request, reply = payload(1000, 1), payload(3 << 20, 2)

    async def script(run: Run) -> None:
        await run.send("client", request)
        run.shut("client")
        await run.expect_end("server")  # the request, then the client's FIN
        await run.send("server", reply)
        run.shut("server")
        await run.expect_end("client")

    got = both(script)
    assert got["at_server"] == request and got["server_end"] == "fin"
    assert got["at_client"] == reply and got["client_end"] == "fin"
    assert (got["outcome"], got["bytes_in"], got["bytes_out"]) == ("closed", 1000, len(reply))
    assert got["closed_at_end"] is True and got["error"] is None


def test_half_close_by_the_server_then_an_upload():
    banner, upload = b"220 ready\r\n", payload(2 << 20, 3)

    async def script(run: Run) -> None:
        await run.send("server", banner)
        run.shut("server")
        await run.expect_end("client")
        await run.send("client", upload)
        run.shut("client")
        await run.expect_end("server")

    got = both(script)
    assert (got["at_client"], got["client_end"]) == (banner, "fin")
    assert (got["at_server"], got["server_end"]) == (upload, "fin")
    assert (got["outcome"], got["bytes_in"], got["bytes_out"]) == (
        "closed",
        len(upload),
        len(banner),
    )


@pytest.mark.parametrize("who", ["client", "server"])
def test_a_reset_ends_it_at_once_and_the_other_side_gets_a_fin(who):
    other = "server" if who == "client" else "client"

    async def script(run: Run) -> None:
        await run.send(who, b"hello")
        await run.expect(other, 5)
        run.reset(who)
        await run.wait_end()
        await run.expect_end(other)

    got = both(script)
    assert got["outcome"] == f"{who}_reset"
    assert got["error"] == "ConnectionResetError"
    assert got[f"{other}_end"] == "fin"  # an orderly close, not a reset passed on
    assert got[f"at_{other}"] == b"hello"
    assert (got["bytes_in"], got["bytes_out"]) == ((5, 0) if who == "client" else (0, 5))


@pytest.mark.parametrize("who", ["client", "server"])
def test_a_reset_after_a_half_close_is_noticed_at_once(who):
    """The side that sent FIN is no longer read; its reset still ends the pump now."""
    other = "server" if who == "client" else "client"

    async def script(run: Run) -> None:
        run.shut(who)
        await run.expect_end(other)
        run.reset(who)
        await run.wait_end()

    got = both(script, idle_timeout=20.0)  # ends long before: the reset
    assert got["outcome"] == f"{who}_reset"
    assert got[f"{other}_end"] == "fin"


def test_idle_timeout_ends_it_and_both_sides_get_a_fin():
    async def script(run: Run) -> None:
        await run.send("client", b"x")
        await run.expect("server", 1)
        await run.wait_end()
        await run.expect_end("client")
        await run.expect_end("server")

    got = both(script, idle_timeout=0.2)
    assert (got["outcome"], got["bytes_in"], got["bytes_out"]) == ("idle_timeout", 1, 0)
    assert (got["client_end"], got["server_end"]) == ("fin", "fin")


def test_idle_timeout_bounds_a_half_closed_connection():
    async def script(run: Run) -> None:
        await run.send("client", b"bye")
        run.shut("client")
        await run.expect_end("server")
        await run.wait_end()  # the server never closes its side

    got = both(script, idle_timeout=0.2)
    assert (got["outcome"], got["at_server"], got["server_end"]) == ("idle_timeout", b"bye", "fin")


def test_max_duration_ends_a_busy_connection_and_both_sides_get_a_fin():
    """The lifetime ends it however busy it is: bytes keep moving past the idle timeout
    (so the idle deadline is never reached) and it ends at max_duration, not before."""

    async def script(run: Run) -> None:
        started = trio.current_time()
        assert run.pump is not None
        # A byte every 20 ms each way, for longer than the idle timeout; the last 50 ms
        # before the lifetime ends are quiet, because a byte the pump has not read when
        # it closes turns that side's FIN into a reset.
        while run.pump.outcome is None and trio.current_time() - started < 0.25:
            with contextlib.suppress(OSError):
                await run.send("client", b"c")
                await run.send("server", b"s")
            with trio.move_on_after(0.02):
                await run.ended.wait()
        await run.ended.wait()
        # From before the pump's own clock reading: the script may start later on a
        # loaded machine, and its lifetime is counted from the open.
        run.seen.notes["lasted_at_least"] = trio.current_time() - run.opened_at >= 0.3
        await run.expect_end("client")
        await run.expect_end("server")
        run.seen.varies |= {"at_client", "at_server", "bytes_in", "bytes_out"}

    got = both(script, idle_timeout=0.2, max_duration=0.3)
    assert (got["outcome"], got["error"], got["lasted_at_least"]) == ("max_duration", None, True)
    assert (got["client_end"], got["server_end"], got["closed_at_end"]) == ("fin", "fin", True)


def test_idle_timeout_still_ends_it_before_a_longer_max_duration():
    async def script(run: Run) -> None:
        await run.send("client", b"x")
        await run.expect("server", 1)
        await run.wait_end()

    got = both(script, idle_timeout=0.1, max_duration=30.0)
    assert got["outcome"] == "idle_timeout"


def test_max_duration_without_an_idle_timeout():
    async def script(run: Run) -> None:
        await run.wait_end()
        await run.expect_end("client")

    got = both(script, idle_timeout=math.inf, max_duration=0.1)
    assert (got["outcome"], got["client_end"]) == ("max_duration", "fin")


def test_close_ends_it_on_purpose():
    async def script(run: Run) -> None:
        await run.send("server", b"pong")
        await run.expect("client", 4)
        assert run.pump is not None
        run.pump.close()
        run.pump.close()  # once only
        await run.expect_end("client")
        await run.expect_end("server")

    got = both(script)
    assert (got["outcome"], got["error"], got["bytes_out"]) == ("cancelled", None, 4)
    assert (got["client_end"], got["server_end"]) == ("fin", "fin")


@pytest.mark.parametrize("splice", [True, False], ids=["splice", "copy"])
def test_small_chunks_are_copied_and_a_read_that_fills_a_chunk_switches_to_splice(splice):
    """splice-auto: a keep-alive exchange of small chunks never makes a pipe; a read
    that fills COPY_CHUNK switches that direction to splicing (pipes come back to the
    pool); small chunks after it still go through, FINs and all. Copy only: never."""
    small, reply = payload(1000, 4), payload(CHUNK - 1, 5)
    bulk = payload(4 << 20, 6)

    async def script(run: Run) -> None:
        for _ in range(3):
            await run.send("client", small)
            await run.expect("server", len(small))
            await run.send("server", reply)
            await run.expect("client", len(reply))
        run.seen.notes["pipes_before_bulk"] = bool(run_impl_pipes())
        await run.send("server", bulk)
        await run.expect("client", len(bulk))
        await run.send("client", small)
        run.shut("client")
        await run.expect_end("server")
        run.shut("server")
        await run.expect_end("client")

    got = both(script, splice=splice)
    assert got["pipes_before_bulk"] is False
    assert got["pipes_used"] is (splice and pure_pump.splice_available())
    assert got["at_client"] == reply * 3 + bulk
    assert got["at_server"] == small * 4
    assert (got["outcome"], got["bytes_in"], got["bytes_out"]) == (
        "closed",
        4 * len(small),
        3 * len(reply) + len(bulk),
    )


def run_impl_pipes() -> list[tuple[int, int]]:
    """The pool of the implementation under test (both pools: only one is in use)."""
    found = pure_pump.idle_pipes()
    if _cpump is not None:
        found += _cpump.idle_pipes()
    return found


@pytest.mark.parametrize("splice", [True, False], ids=["splice", "copy"])
def test_backpressure_a_slow_reader_stops_the_pump_reading_and_loses_nothing(splice):
    """The server reads nothing while the client floods: once every buffer on the way is
    full the pump holds one chunk, stops reading the client (the client's sends block),
    and moves on when the server reads again -- every byte, in order."""

    async def script(run: Run) -> None:
        block = payload(1 << 16, 7)
        stream = memoryview(block * 2)  # the flood is `block` repeated
        sent = 0
        client = run.client
        while sent < 256 << 20:  # until the client's sends stop being taken
            try:
                at = sent % len(block)
                sent += client._sock.send(stream[at : at + len(block)])
                continue
            except BlockingIOError:
                pass
            with trio.move_on_after(0.5) as waited:
                await trio.lowlevel.wait_writable(client)
            if waited.cancelled_caught:
                break
        # the flood stopped: the pump no longer reads the client (without back-pressure
        # it would read on, and either lose bytes or hold them all)
        run.seen.notes["client_blocked"] = sent < 256 << 20
        run.shut("client")
        await run.expect_end("server")
        run.shut("server")
        await run.expect_end("client")
        whole, part = divmod(sent, len(block))
        run.seen.notes["all_in_order"] = bytes(run.seen.at_server) == block * whole + block[:part]
        run.seen.at_server.clear()  # compared just above: its size varies with timing
        assert run.pump is not None
        run.seen.notes["counted_all"] = run.pump.bytes_in == sent
        run.seen.varies.add("bytes_in")  # == sent, whose size varies with timing

    got = both(script, splice=splice)
    assert got["client_blocked"] is True
    assert got["all_in_order"] is True and got["counted_all"] is True
    assert got["outcome"] == "closed"


def test_initial_bytes_go_first_and_only_the_clients_count():
    """A PROXY header and bytes read before the connect, larger than the socket
    buffers: the pump reads no client byte until they are out, and the header is not
    counted."""
    header = b"PROXY TCP4 192.0.2.1 192.0.2.2 1234 80\r\n"
    early, rest = payload(8 << 20, 8), payload(1 << 20, 9)

    async def script(run: Run) -> None:
        await run.send("client", rest)
        run.shut("client")
        await run.expect_end("server")
        run.shut("server")
        await run.expect_end("client")

    got = both(script, initial=header + early, uncounted=len(header))
    assert got["at_server"] == header + early + rest
    assert (got["outcome"], got["bytes_in"], got["bytes_out"]) == (
        "closed",
        len(early) + len(rest),
        0,
    )


def test_a_changed_idle_timeout_applies_at_once():
    """Shortened below the time already idle: the pump ends there and then."""

    async def script(run: Run) -> None:
        await run.send("client", b"tick")
        await run.expect("server", 4)
        assert run.pump is not None
        p = run.pump
        while trio.current_time() < p.last_activity + 0.02:  # idle longer than 0.01 s
            await trio.sleep(0.01)
        p.idle_timeout = 0.01
        run.seen.notes["ended_in_the_assignment"] = p.outcome == "idle_timeout"

    got = both(script, idle_timeout=3600.0)
    assert got["ended_in_the_assignment"] is True
    assert got["outcome"] == "idle_timeout"


@pytest.mark.skipif(_cpump is None, reason="the C extension is not built")
def test_both_have_the_same_tuning():
    """splice-auto's threshold and the pipe pool's bound (net/pump.py and
    net/descriptors.py read them from the pure module)."""
    assert _cpump is not None
    assert (_cpump.COPY_CHUNK, _cpump.MAX_IDLE_PIPES, _cpump.PIPE_SIZE) == (
        pure_pump.COPY_CHUNK,
        pure_pump.MAX_IDLE_PIPES,
        pure_pump.PIPE_SIZE,
    )
