"""UDP through a real `lbproxy` where the compiled relay reads client datagrams in
batches (recvmmsg) and finds sessions in its own table (SPEC §19, lbproxy/net/_cpump_udp.h):
hundreds of clients at once, more sessions than one batch holds, a client coming back
after its session expired, datagrams of every size from empty to the largest, and the
batches themselves under strace. Every test but the last runs on both paths (the pure
rerun of scripts/test)."""

from __future__ import annotations

import collections
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from lbproxy.dataplane.udp import CompiledUdpRelay
from lbproxy.net.compiled import cpump
from tests import tools
from tests.integration.harness import (
    OPEN_UDP_SOCKETS,
    Echo,
    free_port,
    metrics,
    relay_for,
    sample,
    stop_traced,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
# The largest UDP payload over IPv4: 65,535 - 8 (UDP header) - 20 (IPv4 header).
LARGEST = 65507


def config(admin: int, port: int, echoes: dict[str, Echo], udp: str) -> str:
    real = "".join(
        f"      - {{name: {n}, address: 127.0.0.1:{e.port}}}\n" for n, e in echoes.items()
    )
    return (
        f"global:\n  admin: {{listen: 127.0.0.1:{admin}}}\n  drain_timeout: 1s\n"
        "  access_log: true\n"
        "virtual_servers:\n  - name: vs\n    protocol: udp\n"
        f"    listen: 127.0.0.1:{port}\n    scheduler: rr\n    udp: {udp}\n"
        "    health_check: {type: none}\n"
        f"    real_servers:\n{real}"
    )


def clients(n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        s.bind(("127.0.0.1", 0))
        s.settimeout(5)
        socks.append(s)
    return socks


def counted(admin: int, name: str, **labels) -> float:
    return sample(metrics(admin), name, virtual_server="vs", **labels)


def test_300_clients_at_once_more_sessions_than_a_batch_each_answered_by_its_server(lbproxy):
    """300 clients send at once (a burst of many batches); each gets its own answer,
    byte-exact, and keeps its session (and its real server) for its second datagram:
    300 sessions open, none opened twice, every datagram counted."""
    echoes = {"a": Echo(b"a:"), "b": Echo(b"b:")}
    port, admin = free_port(), free_port()
    socks = clients(300)
    try:
        with lbproxy(
            config(admin, port, echoes, "{idle_timeout: 30s, max_sessions_per_source: 1000}")
        ):
            first: dict[int, bytes] = {}
            for round_ in range(2):
                for i, s in enumerate(socks):
                    s.sendto(b"%d:%d" % (i, round_), ("127.0.0.1", port))
                for i, s in enumerate(socks):
                    answer, peer = s.recvfrom(70000)
                    assert peer == ("127.0.0.1", port)
                    server, payload = answer.split(b":", 1)
                    assert payload == b"%d:%d" % (i, round_)
                    if round_ == 0:
                        first[i] = server
                    else:
                        assert server == first[i]  # the same session, the same server
            assert sorted(first.values()).count(b"a") == 150  # rr over 300 sessions
            for rs in ("a", "b"):
                assert counted(admin, "lbproxy_udp_sessions_total", real_server=rs) == 150
                assert counted(admin, "lbproxy_udp_active_sessions", real_server=rs) == 150
                for direction in ("in", "out"):
                    datagrams = counted(
                        admin, "lbproxy_udp_datagrams_total", real_server=rs, direction=direction
                    )
                    assert datagrams == 300
    finally:
        for s in socks:
            s.close()
        for echo in echoes.values():
            echo.close()


def test_a_client_after_its_session_expired_opens_a_new_one_on_the_next_server(lbproxy):
    echoes = {"a": Echo(b"a:"), "b": Echo(b"b:")}
    port, admin = free_port(), free_port()
    (client,) = clients(1)
    try:
        with lbproxy(config(admin, port, echoes, "{idle_timeout: 300ms}")) as lb:
            client.sendto(b"one", ("127.0.0.1", port))
            assert client.recvfrom(100)[0] == b"a:one"
            active = lambda: counted(admin, "lbproxy_udp_active_sessions", real_server="a")  # noqa: E731
            wait_for(lambda: active() == 0, what="the idle session expires")
            client.sendto(b"two", ("127.0.0.1", port))
            assert client.recvfrom(100)[0] == b"b:two"
            for rs in ("a", "b"):
                assert counted(admin, "lbproxy_udp_sessions_total", real_server=rs) == 1
            line = next(line for line in lb.log().splitlines() if " vs=vs rs=a " in line)
            assert line.endswith("end=idle_timeout") and " in=3 out=5 " in line
    finally:
        client.close()
        for echo in echoes.values():
            echo.close()


@pytest.mark.parametrize("size", [0, 1, 1472, 9000, LARGEST])
def test_every_datagram_size_from_empty_to_the_largest_passes_byte_exact(lbproxy, size):
    """An empty datagram is one too, and the largest IPv4 payload is not cut short
    either way; `responses: 1` ends each session with its one answer."""
    echo = Echo(b"")
    port, admin = free_port(), free_port()
    (client,) = clients(1)
    payload = os.urandom(size)
    try:
        with lbproxy(config(admin, port, {"a": echo}, "{responses: 1}")):
            client.sendto(payload, ("127.0.0.1", port))
            assert client.recvfrom(70000)[0] == payload
            wait_for(
                lambda: counted(admin, "lbproxy_udp_active_sessions", real_server="a") == 0,
                what="the session ends with its answer",
            )
            samples = metrics(admin)
            labels = {"virtual_server": "vs", "real_server": "a"}
            assert sample(samples, "lbproxy_udp_datagrams_total", **labels, direction="in") == 1
            assert sample(samples, "lbproxy_udp_datagrams_total", **labels, direction="out") == 1
            assert sample(samples, "lbproxy_bytes_total", **labels, direction="in") == size
            assert sample(samples, "lbproxy_bytes_total", **labels, direction="out") == size
    finally:
        client.close()
        echo.close()


@pytest.mark.skipif(cpump is None, reason="the compiled path is not built (or LBPROXY_PURE=1)")
@tools.requires("strace", package="strace")
def test_a_burst_from_many_clients_is_read_in_batches_not_a_call_per_datagram(tmp_path):
    """200 clients' datagrams at once are read with recvmmsg, several per call, never
    one recvfrom each from the listening socket."""
    echo = Echo(b"")
    port, admin = free_port(), free_port()
    path = tmp_path / "lbproxy.yaml"
    path.write_text(
        config(admin, port, {"a": echo}, "{responses: 1, max_sessions_per_source: 1000}")
    )
    trace = tmp_path / "trace"
    log = (tmp_path / "lbproxy.log").open("wb")
    tracer = subprocess.Popen(
        ["strace", "-f", "-qq", "-e", "trace=recvmmsg,recvfrom", "-o", str(trace),
         sys.executable, "-m", "lbproxy", "run", str(path)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    socks = clients(200)
    (probe,) = clients(1)
    probe.settimeout(0.2)
    try:

        def answers() -> bool:
            probe.sendto(b"ready?", ("127.0.0.1", port))
            try:
                return probe.recvfrom(100)[0] == b"ready?"
            except TimeoutError:
                return False

        wait_for(answers, timeout=60, what="lbproxy answering under strace")
        before = len(trace.read_text().splitlines())
        for s in socks:
            s.sendto(b"burst", ("127.0.0.1", port))
        for s in socks:
            assert s.recvfrom(100)[0] == b"burst"
        calls = trace.read_text().splitlines()[before:]
        batches = [m for line in calls if (m := re.search(r"recvmmsg\((\d+),.*\) = (\d+)", line))]
        sizes = [int(m[2]) for m in batches]
        assert sum(sizes) >= 200, calls[:20]
        assert len(sizes) < 200 and max(sizes) > 1
        listening = {m[1] for m in batches}  # (recvfrom: the real server's answers)
        assert not [line for line in calls if re.search(rf"recvfrom\({'|'.join(listening)},", line)]
    finally:
        for s in [*socks, probe]:
            s.close()
        stop_traced(tracer)
        log.close()
        echo.close()


def test_ipv6_clients_each_get_their_own_session_and_answer(lbproxy):
    """Over IPv6 (::1): each client address its session, answered from the listening
    address; the access log names each client as [host]:port."""
    try:
        probe = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("no IPv6 loopback")
    echo = Echo(b"a:")
    port, admin = free_port("::1"), free_port()
    text = config(admin, port, {"a": echo}, "{responses: 1}")
    text = text.replace(f"listen: 127.0.0.1:{port}", f'listen: "[::1]:{port}"')
    socks = []
    try:
        with lbproxy(text) as lb:
            for i in range(40):
                s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
                s.bind(("::1", 0))
                s.settimeout(5)
                socks.append(s)
                s.sendto(b"%d" % i, ("::1", port))
            for i, s in enumerate(socks):
                answer, peer = s.recvfrom(100)
                assert answer == b"a:%d" % i and peer[:2] == ("::1", port)
            assert counted(admin, "lbproxy_udp_sessions_total", real_server="a") == 40
            wait_for(
                lambda: len([ln for ln in lb.log().splitlines() if "end=responses" in ln]) == 40,
                what="40 sessions ended by their answer",
            )
            assert f"[::1]:{socks[0].getsockname()[1]} vs=vs rs=a" in lb.log()
    finally:
        for s in socks:
            s.close()
        echo.close()


def test_a_real_server_named_by_host_name_is_resolved_for_its_sessions(lbproxy):
    """`address: localhost:PORT`: each session's socket goes to what the name resolves
    to (127.0.0.1 here), as a numeric address's does."""
    echo = Echo(b"a:")
    port, admin = free_port(), free_port()
    text = config(admin, port, {"a": echo}, "{responses: 1}")
    text = text.replace(f"address: 127.0.0.1:{echo.port}", f"address: 'localhost:{echo.port}'")
    socks = clients(3)
    try:
        with lbproxy(text):
            for i, s in enumerate(socks):
                s.sendto(b"%d" % i, ("127.0.0.1", port))
                assert s.recvfrom(100)[0] == b"a:%d" % i
            assert counted(admin, "lbproxy_udp_sessions_total", real_server="a") == 3
    finally:
        for s in socks:
            s.close()
        echo.close()


@pytest.mark.skipif(cpump is None, reason="the compiled path is not built (or LBPROXY_PURE=1)")
def test_a_udp_session_costs_fourteen_python_calls_on_the_compiled_path():
    """On the compiled path Python runs only when a session opens (the decision) and
    when it ends (the accounts). With `responses: 1` every datagram opens a session, so
    those calls are most of lbproxy's user time per datagram (docs/benchmarks.md). rr over
    two servers: 14 calls, the scheduler's pick, take and drop among them; the ACL,
    the caps, the source's key, the server's address and its index cost none. Counted
    under sys.setprofile: exact whatever the load, as a time would not be."""
    echoes = {name: Echo(b"") for name in "ab"}
    calls: collections.Counter[str] = collections.Counter()
    warm_up, sessions = 4, 50  # the first sessions make what later ones find (the ACL...)
    counted = [False]

    def profile(frame, event, arg) -> None:
        if event == "call":
            calls[frame.f_code.co_qualname] += 1

    def counting(callback):
        def call(self, *args):
            if not counted[0]:
                return callback(self, *args)
            sys.setprofile(profile)
            try:
                return callback(self, *args)
            finally:
                sys.setprofile(None)

        return call

    async def serve() -> None:
        relay = relay_for({name: echo.sock for name, echo in echoes.items()}, responses=1)
        assert isinstance(relay, CompiledUdpRelay)
        async with trio.open_nursery() as nursery:
            address = await nursery.start(relay.serve)
            for i in range(warm_up + sessions):
                counted[0] = i >= warm_up
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
                    client.bind(("127.0.0.1", 0))
                    client.setblocking(False)
                    client.sendto(b"q%d" % i, address)
                    with trio.fail_after(5):
                        await trio.lowlevel.wait_readable(client)
                    assert client.recv(100) == b"q%d" % i
                with trio.fail_after(5):
                    while relay.open_sessions:  # ended after its one response
                        await trio.sleep(0)
            nursery.cancel_scope.cancel()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CompiledUdpRelay, "_on_open", counting(CompiledUdpRelay._on_open))
        patch.setattr(CompiledUdpRelay, "_on_end", counting(CompiledUdpRelay._on_end))
        try:
            trio.run(serve)
        finally:
            for echo in echoes.values():
                echo.close()
            while OPEN_UDP_SOCKETS:  # relay_for's listening socket
                OPEN_UDP_SOCKETS.pop().close()
    assert calls["CompiledUdpRelay._on_open"] == calls["CompiledUdpRelay._on_end"] == sessions
    assert calls["Pool.pick"] == calls["Pool.take"] == calls["Pool.drop"] == sessions
    assert sum(calls.values()) == 14 * sessions, sorted(calls.items())
