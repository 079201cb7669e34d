"""Health checks and server lifecycle through real `lbproxy run` processes and sockets.

Every wait is bounded (socket timeouts, deadlines on log polling), so a regression fails
instead of hanging. Timing-sensitive figures (time to mark down, CPU at the descriptor
limit) are printed; run with `-s` to see them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import selectors
import signal
import socket
import sys
import threading
import time
from collections import Counter

import pytest
import trio

from lbproxy.config.model import Address, HealthCheckConfig
from lbproxy.config.reader import load
from lbproxy.control.checks import decode_send, host_header, probe
from lbproxy.runtime.server import Server
from tests.integration.harness import (
    NameServer,
    ask_name,
    counted,
    free_port,
    listening,
    open_and_read_name,
    servers_of,
    vs_config,
    wait_for,
    with_admin,
)

FAST_CHECKS = "health_check: {type: tcp, interval: 200ms, timeout: 200ms, rise: 2, fall: 3}"


def restart(server: NameServer) -> NameServer:
    """A new NameServer with the same name on the same port (SO_REUSEADDR)."""
    return NameServer(server.name, port=server.port)


def hold(port: int, n: int) -> list[tuple[socket.socket, str]]:
    """`n` connections held open, each with the name it was served by; on a failure
    those already open are closed."""
    held: list[tuple[socket.socket, str]] = []
    try:
        for _ in range(n):
            held.append(open_and_read_name(port))
    except BaseException:
        close_all(held)
        raise
    return held


def closed_by_proxy(sock: socket.socket, timeout: float = 3.0) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def close_all(held) -> None:
    for sock, _ in held:
        sock.close()


def health_seen(admin_port: int, name: str, health: str) -> float | None:
    """When the admin API shows real server `name`'s health as `health` ("up",
    "down"): the monotonic time it was read; else None (for `wait_for`)."""
    return time.monotonic() if servers_of(admin_port)[name]["health"] == health else None


def checked(admin_port: int, name: str) -> float:
    """Health checks of real server `name` so far, whatever their result."""
    return counted(admin_port, "lbproxy_health_checks_total", real_server=name)


# -- the check probes, in process ---------------------------------------------------


def test_send_escapes_and_host_header():
    assert decode_send("PING\\r\\n") == b"PING\r\n"
    assert decode_send("PING\r\n") == b"PING\r\n"  # YAML double quotes already decoded
    assert decode_send("a\\x00\\\\b\\q") == b"a\x00\\b\\q"  # unknown escapes stay as typed
    assert decode_send("é") == "é".encode()
    assert host_header(Address("127.0.0.1", 8080)) == "127.0.0.1:8080"
    assert host_header(Address("::1", 80)) == "[::1]"


def _probe_against(answer, check: HealthCheckConfig) -> tuple[tuple[str, str], bytes]:
    """Run `probe` against a one-shot loopback server that reads the request (if any)
    and sends `answer` (None: says nothing, keeps the connection open)."""
    received = bytearray()

    async def main():
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        listener.listen(5)
        address = Address("127.0.0.1", listener.getsockname()[1])

        async def serve():
            conn, _ = await listener.accept()
            with conn:
                with trio.move_on_after(0.05):
                    received.extend(await conn.recv(4096))
                if answer is None:
                    await trio.sleep_forever()
                await conn.send(answer)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            with trio.fail_after(5):
                result = await probe(address, check)
            nursery.cancel_scope.cancel()
        listener.close()
        return result

    return trio.run(main), bytes(received)


def test_probe_tcp_ok_and_refused():
    assert _probe_against(b"", HealthCheckConfig())[0] == ("ok", "")

    async def refused():
        return await probe(Address("127.0.0.1", free_port()), HealthCheckConfig())

    result, reason = trio.run(refused)
    assert result == "fail" and "refused" in reason


def test_probe_send_expect():
    check = HealthCheckConfig(type="send_expect", send="PING\\r\\n", expect="^\\+PONG", timeout=0.5)
    result, sent = _probe_against(b"+PONG\r\n", check)
    assert result == ("ok", "") and sent == b"PING\r\n"
    assert _probe_against(b"-ERR\r\n", check)[0][0] == "fail"
    assert _probe_against(None, check)[0][0] == "timeout"
    # searched in the first 4 KiB only
    assert _probe_against(b"x" * 5000 + b"+PONG", check)[0][0] == "fail"


def test_probe_http():
    check = HealthCheckConfig(type="http", path="/healthz", expect_status=(200, 204), timeout=0.5)
    ok = b"HTTP/1.1 204 No Content\r\n\r\n"
    result, request = _probe_against(ok, check)
    assert result == ("ok", "")
    assert request.startswith(b"GET /healthz HTTP/1.1\r\n")
    assert b"\r\nhost: 127.0.0.1:" in request.lower()
    assert b"\r\nconnection: close\r\n" in request.lower()
    (result, reason), _ = _probe_against(b"HTTP/1.1 503 Busy\r\n\r\n", check)
    assert result == "fail" and "503" in reason
    assert _probe_against(b"SSH-2.0-OpenSSH\r\n", check)[0][0] == "fail"
    assert _probe_against(None, check)[0][0] == "timeout"


def test_check_tasks_follow_reloads(tmp_path):
    """One task per real server; reloads add, cancel and restart them."""
    path = tmp_path / "lbproxy.yaml"
    servers = [NameServer(name) for name in ("a", "b", "c")]
    port = free_port()

    def write(chosen, extra=FAST_CHECKS):
        path.write_text(vs_config(port, chosen, "rr", extra))

    async def main():
        write(servers[:2])
        server = Server(load([str(path)]), [str(path)])
        async with trio.open_nursery() as nursery:
            with trio.fail_after(10):
                await nursery.start(functools.partial(server.serve, handle_signals=False))
                assert len(server.checks) == 2
                write(servers)
                assert server.reload()[0] and len(server.checks) == 3
                scopes = {rs.name: task.cancel_scope for rs, task in server.checks._tasks.items()}
                write(servers[1:])  # a removed: its task is cancelled
                assert server.reload()[0] and len(server.checks) == 2
                assert scopes["a"].cancel_called and not scopes["b"].cancel_called
                write(servers[1:], FAST_CHECKS.replace("200ms, timeout", "300ms, timeout"))
                assert server.reload()[0] and len(server.checks) == 2  # new interval: restarted
                assert scopes["b"].cancel_called and scopes["c"].cancel_called
                write(servers[1:], "health_check: {type: none}")
                assert server.reload()[0] and len(server.checks) == 0
                await trio.sleep(0.1)
                assert all(rs.health.up for rs in server.pools()[0].servers)
                server.stop()

    try:
        trio.run(main)
    finally:
        for server in servers:
            server.stop()


# -- health through a real process -------------------------------------------------


def test_stopped_server_is_marked_down_in_time_and_comes_back_after_rise(name_servers, lbproxy):
    interval, timeout, rise, fall = 0.2, 0.2, 2, 3
    servers = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    # retries: 0, so a connection sent to the stopped server would fail visibly
    config = vs_config(port, servers, "rr", f"retries: 0\n{FAST_CHECKS}")
    proxy = lbproxy(with_admin(config, admin_port))
    wait_for(
        lambda: all(checked(admin_port, server.name) for server in servers),
        what="every check task's first check",
    )
    servers[1].stop()
    stopped = time.monotonic()
    down = wait_for(lambda: health_seen(admin_port, "b", "down"), what="b down", interval=0.005)
    elapsed = down - stopped
    print(f"\ntime to mark down: {elapsed:.3f}s (bound {interval * fall + timeout:.1f}s)")
    assert elapsed <= interval * fall + timeout + 0.1  # + API polling and scheduling
    # why, as the operator reads it: logged with the change the API showed
    assert re.search(r"web/b is down \(tcp check: connection refused\)", proxy.log())
    names = Counter(ask_name(port, timeout=2) for _ in range(30))
    assert names == {"a": 15, "c": 15}  # no new connection went to b

    servers[1] = restart(servers[1])
    name_servers_restarted = servers[1]
    try:
        started = time.monotonic()
        up = wait_for(lambda: health_seen(admin_port, "b", "up"), what="b up", interval=0.005)
        print(f"time to come back: {up - started:.3f}s (rise {rise} x interval {interval}s)")
        assert up - started <= (rise + 1) * interval + 0.2
        assert "b" in {ask_name(port) for _ in range(6)}
    finally:
        name_servers_restarted.stop()


@pytest.mark.parametrize("quiesce", [True, False])
def test_lvs_rejoin_end_to_end(name_servers, lbproxy, quiesce):
    a, b, c = name_servers("A", "B", "C")
    port, admin_port = free_port(), free_port()
    config = vs_config(
        port,
        [a, b, c],
        "wlc",
        f"quiesce: {str(quiesce).lower()}\n"
        "health_check: {type: tcp, interval: 100ms, timeout: 100ms, rise: 1, fall: 1}",
        rs_extra={"C": "weight: 2"},
    )
    c.stop()
    lbproxy(with_admin(config, admin_port))
    wait_for(lambda: health_seen(admin_port, "C", "down"), what="C down")
    held = hold(port, 60)
    try:
        assert Counter(name for _, name in held) == {"A": 30, "B": 30}
        c = restart(c)
        try:
            wait_for(lambda: health_seen(admin_port, "C", "up"), what="C up")
            after = hold(port, 30)
            held += after
            to_c = sum(1 for _, name in after if name == "C")
            if quiesce:  # the table is reset: C gets its weight share, 2 of 4
                assert 13 <= to_c <= 17, Counter(name for _, name in after)
            else:  # C has 0 against 30 and 30: it takes nearly all
                assert to_c >= 28, Counter(name for _, name in after)
        finally:
            close_all(held)
            held = []
            c.stop()
    finally:
        close_all(held)


def test_killing_a_server_costs_the_clients_nothing(name_servers, lbproxy):
    servers = name_servers("a", "b", "c")
    port = free_port()
    config = vs_config(
        port,
        servers,
        "rr",
        "retries: 2\nhealth_check: {type: tcp, interval: 500ms, timeout: 200ms, fall: 3}",
    )
    proxy = lbproxy(config)
    names: Counter[str] = Counter()
    failures = 0
    for i in range(300):
        if i == 100:
            servers[1].stop()  # between two connections: none of b's is in flight
        try:
            name = ask_name(port, timeout=3)
        except OSError:
            name = ""
        if name in ("a", "b", "c"):
            names[name] += 1
        else:
            failures += 1
    assert failures == 0, proxy.log()
    assert names["b"] <= 34  # its share of the first 100, then nothing
    assert names["a"] + names["c"] == 300 - names["b"]
    assert re.search(r"web/b is down \(connect refused\)", proxy.log())


def test_passive_health_only_gives_a_down_server_one_trial_per_interval(name_servers, lbproxy):
    a, b = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    config = vs_config(
        port, [a, b], "first", "health_check: {type: none, interval: 500ms, fall: 2}"
    )
    proxy = lbproxy(with_admin(config, admin_port))
    assert ask_name(port) == "a"  # `first`: a while it is available
    a.stop()
    assert [ask_name(port) for _ in range(2)] == ["b", "b"]  # a refused twice: retried on b
    wait_for(lambda: health_seen(admin_port, "a", "down"), what="a down")
    # why, as the operator reads it: passive health, logged with the change
    assert re.search(r"web/a is down \(connect refused\)", proxy.log())
    assert [ask_name(port) for _ in range(5)] == ["b"] * 5  # a is down: not even tried
    a = restart(a)
    try:
        # on purpose: one interval (500ms) goes by; then a gets one trial connection,
        # which succeeds (nothing to observe before that connection is made)
        time.sleep(0.6)
        assert ask_name(port) == "a"
        wait_for(lambda: health_seen(admin_port, "a", "up"), what="a up")
        assert ask_name(port) == "a"
    finally:
        a.stop()


def test_on_down_close_closes_established_connections(name_servers, lbproxy):
    a, b = name_servers("a", "b")
    port = free_port()
    config = vs_config(
        port,
        [a, b],
        "rr",
        "health_check: {type: tcp, interval: 100ms, timeout: 100ms, fall: 1, on_down: close}",
    )
    lbproxy(config)
    held = hold(port, 4)
    try:
        on_a = [s for s, name in held if name == "a"]
        on_b = [s for s, name in held if name == "b"]
        a.stop()  # its handler threads keep serving the established connections
        for sock in on_a:  # ... but lbproxy closes them when a goes down
            assert closed_by_proxy(sock)
        for sock in on_b:
            sock.sendall(b"ping")
            assert sock.recv(100) == b"ping"
    finally:
        close_all(held)


# -- states ------------------------------------------------------------------------


def test_drain_and_disabled_by_reload(name_servers, lbproxy):
    a, b = name_servers("a", "b")
    port = free_port()
    config = vs_config(port, [a, b], "rr", FAST_CHECKS)
    proxy = lbproxy(config)
    held = hold(port, 4)
    try:
        on_b = [s for s, name in held if name == "b"]
        on_a = [s for s, name in held if name == "a"]
        assert len(on_b) == 2
        proxy.reload(vs_config(port, [a, b], "rr", FAST_CHECKS, rs_extra={"b": "state: drain"}))
        assert {ask_name(port) for _ in range(6)} == {"a"}  # no new connection to b
        for sock in on_b:  # existing ones keep working
            sock.sendall(b"drained")
            assert sock.recv(100) == b"drained"
        proxy.reload(vs_config(port, [a, b], "rr", FAST_CHECKS, rs_extra={"b": "state: disabled"}))
        assert "closed 2 connection(s) of disabled b" in proxy.log()
        for sock in on_b:  # disabled: closed
            assert closed_by_proxy(sock)
        for sock in on_a:
            sock.sendall(b"still")
            assert sock.recv(100) == b"still"
        assert {ask_name(port) for _ in range(6)} == {"a"}
        proxy.reload(config)
        assert "b" in {ask_name(port) for _ in range(6)}
    finally:
        close_all(held)


# -- reload ------------------------------------------------------------------------


class Stream(threading.Thread):
    """A client that streams data through the proxy and checks every echoed byte."""

    BLOCK = 4096

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.sock, self.name = open_and_read_name(port)
        self.sock.settimeout(10)
        self.stop = threading.Event()
        self.sent = self.received = 0
        self.error: str | None = None

    def run(self) -> None:
        try:
            counter = 0
            while not self.stop.is_set():
                block = (f"{counter:08d}".encode() * (self.BLOCK // 8))[: self.BLOCK]
                self.sock.sendall(block)
                self.sent += len(block)
                echo = b""
                while len(echo) < len(block):
                    chunk = self.sock.recv(len(block) - len(echo))
                    if not chunk:
                        raise AssertionError("closed by the proxy")
                    echo += chunk
                if echo != block:
                    raise AssertionError("bytes changed on the way")
                self.received += len(echo)
                counter += 1
                time.sleep(0.005)  # on purpose: the stream's pace, so 20 of them share the CPU
            self.sock.shutdown(socket.SHUT_WR)
            if self.sock.recv(100) != b"":
                raise AssertionError("unexpected bytes after the end")
        except Exception as exc:
            self.error = f"{self.name}: {exc!r}"
        finally:
            self.sock.close()


def test_fifty_reloads_under_traffic_lose_nothing(name_servers, lbproxy):
    """Servers added and removed, weights and schedulers changed, while 20 connections
    stream; then a final configuration, and a broken file."""
    servers = name_servers("s0", "s1", "s2", "s3")
    port = free_port()
    first = vs_config(port, servers[:2], "wrr", FAST_CHECKS)
    proxy = lbproxy(first)
    streams = [Stream(port) for _ in range(20)]
    for stream in streams:
        stream.start()
    rng = random.Random(7)
    try:
        for _ in range(50):
            chosen = rng.sample(servers, rng.randint(1, 4))
            weights = {s.name: f"weight: {rng.randint(1, 5)}" for s in chosen}
            scheduler = rng.choice(["wrr", "wlc", "lc", "rr"])
            proxy.reload(vs_config(port, chosen, scheduler, FAST_CHECKS, rs_extra=weights))
            assert all(stream.is_alive() for stream in streams), [s.error for s in streams]
        assert proxy.log().count("reloaded:") == 50
        # new connections follow the last configuration: s2 and s3, 1 to 3
        final = vs_config(
            port, servers[2:], "wrr", FAST_CHECKS, rs_extra={"s2": "weight: 1", "s3": "weight: 3"}
        )
        proxy.reload(final)
        assert Counter(ask_name(port) for _ in range(40)) == {"s2": 10, "s3": 30}
        # an invalid file: every problem with FILE:LINE, and the old configuration serves
        broken = final.replace("scheduler: wrr", "scheduler: wrrr").replace(
            "drain_timeout: 5s", "drain_timeout: 5s\n  workerz: 2"
        )
        offset = len(proxy.log())
        proxy.reload(broken)  # returns once refused: its problems are logged by then
        errors = proxy.log()[offset:]
        path = re.escape(str(proxy.config_path))
        assert re.search(rf"{path}:\d+: .*workerz", errors), errors
        assert re.search(rf"{path}:\d+: .*wrrr", errors), errors
        assert Counter(ask_name(port) for _ in range(8)) == {"s2": 2, "s3": 6}
    finally:
        for stream in streams:
            stream.stop.set()
        for stream in streams:
            stream.join(15)
    lost = [stream.error for stream in streams if stream.error or stream.is_alive()]
    total = sum(stream.received for stream in streams)
    print(f"\nreload test: 51 reloads, {len(lost)} connection(s) lost, {total} bytes echoed")
    assert lost == []
    assert all(stream.sent == stream.received > 0 for stream in streams)


# -- slow start --------------------------------------------------------------------


def test_slow_start_ramps_a_server_added_by_reload(name_servers, lbproxy):
    a, b = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    extra = f"slow_start: 2s\n{FAST_CHECKS}"

    def ramped(name: str) -> bool:
        """`name` is up and serves at its full weight: its slow-start ramp is over."""
        rs = servers_of(admin_port)[name]
        return rs["health"] == "up" and rs["weight"]["effective"] == rs["weight"]["static"]

    proxy = lbproxy(with_admin(vs_config(port, [a], "wlc", extra), admin_port))
    wait_for(lambda: ramped("a"), what="a's own start-up ramp to end")
    proxy.reload(with_admin(vs_config(port, [a, b], "wlc", extra), admin_port))
    early = hold(port, 20)
    early_b = sum(1 for _, name in early if name == "b")
    close_all(early)
    wait_for(lambda: ramped("b"), what="b's ramp to end")
    # wlc counts what is open: the early connections' ends are seen first
    wait_for(lambda: counted(admin_port, "lbproxy_active_connections") == 0, what="no connection")
    late = hold(port, 20)
    late_b = sum(1 for _, name in late if name == "b")
    close_all(late)
    print(f"\nslow start: b's share {early_b}/20 at once, {late_b}/20 after T")
    assert early_b <= 4  # well below its weight share of 10
    assert 9 <= late_b <= 11


# -- stop and resource exhaustion --------------------------------------------------


def test_sigterm_with_health_checks_running_exits_when_the_last_connection_ends(
    name_servers, lbproxy
):
    servers = name_servers("a", "b")
    port = free_port()
    config = vs_config(port, servers, "rr", FAST_CHECKS).replace(
        "drain_timeout: 5s", "drain_timeout: 30s"
    )
    proxy = lbproxy(config)
    held = hold(port, 4)
    try:
        proxy.signal(signal.SIGTERM)
        wait_for(lambda: not listening(port), what="the listener to close")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        for sock, _ in held:  # held ones still work, health checks or not
            sock.sendall(b"bye")
            assert sock.recv(100) == b"bye"
    finally:
        close_all(held)
    closed = time.monotonic()
    assert proxy.proc.wait(10) == 0
    # the check tasks stop with the accept loops: exit follows the last connection,
    # not the 30 s drain_timeout
    assert time.monotonic() - closed < 3


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_descriptor_limit_backs_off_without_spinning_and_recovers(name_servers, lbproxy):
    (server,) = name_servers("a")
    port = free_port()
    # fall: 1, so a single check failing for lack of descriptors would mark `a` down
    checks = "health_check: {type: tcp, interval: 100ms, timeout: 500ms, fall: 1}"
    # max_clients far above what 64 descriptors hold: the accept itself runs out (the
    # limit's own test, with its reserve, is tests/integration/test_edge.py's)
    config = vs_config(port, [server], "rr", checks).replace(
        "  drain_timeout: 5s\n", "  drain_timeout: 5s\n  max_clients: 1000\n"
    )
    proxy = lbproxy(config, [port], nofile_limit=64)
    with contextlib.ExitStack() as opened:  # every client closed, whatever happens
        selector = opened.enter_context(selectors.DefaultSelector())
        for _ in range(150):  # far more than 64 descriptors allow
            sock = opened.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        served = set()
        deadline = time.monotonic() + 2
        # on purpose: two seconds for lbproxy to answer or close what it can (how many it
        # can is the measure; the excess waits in the backlog)
        while time.monotonic() < deadline:
            for key, _ in selector.select(0.1):
                served.add(key.fileobj)
                selector.unregister(key.fileobj)
        assert 0 < len(served) < 150  # some served, the excess waits in the backlog
        before, started = _cpu_seconds(proxy.proc.pid), time.monotonic()
        time.sleep(2)  # on purpose: the window its CPU use is measured over
        cpu = (_cpu_seconds(proxy.proc.pid) - before) / (time.monotonic() - started)
        print(f"\ndescriptor limit: {len(served)}/150 answered or closed, CPU {cpu:.1%} of a core")
        assert cpu < 0.5
        assert proxy.proc.poll() is None
        assert proxy.log().count("accept failed (Too many open files)") == 1  # once a burst

    def serves_a() -> bool:
        try:
            return ask_name(port, timeout=2) == "a"
        except OSError:
            return False

    # the backlog drains (those clients are gone), then it serves as usual
    wait_for(serves_a, 20, "a served again", interval=0.1, details=proxy.log)
    assert [ask_name(port) for _ in range(5)] == ["a"] * 5
    assert proxy.proc.poll() is None
    assert "web/a is down" not in proxy.log()  # a full table is not a sick server
