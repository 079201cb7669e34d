"""Outlier ejection and panic (SPEC §23) through real `lbproxy run` processes, on both
connection paths (compiled and LBPROXY_PURE=1).

Real servers here are NameServers (they say their name, then echo, or only echo), a
closed port (a connect is refused), a Resetter (accepts, then resets before a byte) and a
black hole: a listener with `listen(0)` whose one-connection
accept queue the test fills and never accepts, so the kernel drops every further SYN
and a connect times out.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import socket
import struct
import threading
import time
from collections import Counter

import pytest

from tests.integration.harness import (
    NameServer,
    ask_name,
    closed_without_a_byte,
    counted,
    free_port,
    get_json,
    open_and_read_name,
    read_name,
    run_cli,
    servers_of,
    vs_config,
    wait_for,
    with_admin,
)

EJECTIONS = "lbproxy_outlier_ejections_total"
EJECTED = "lbproxy_real_server_ejected"


@pytest.fixture(params=["default", "pure"])
def path(request, monkeypatch):
    if request.param == "pure":
        monkeypatch.setenv("LBPROXY_PURE", "1")
    return request.param


class BlackHole:
    """A listener whose accept queue is full: connects to it time out."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.port = self.listener.getsockname()[1]
        self.fillers: list[socket.socket] = []
        # listen(0) holds one established connection; a few more are half-open until
        # the kernel drops the SYNs: fill until a connect no longer completes.
        for _ in range(8):
            filler = socket.socket()
            filler.settimeout(0.3)
            try:
                filler.connect(("127.0.0.1", self.port))
            except OSError:
                filler.close()
                break
            self.fillers.append(filler)

    def close(self) -> None:
        for filler in self.fillers:
            filler.close()
        self.listener.close()


class Resetter:
    """A real server that accepts every connection, reads the client's first bytes and
    resets it (SO_LINGER 0) without a byte of its own: every connect completes (the
    client's bytes came through the proxy), no client is ever served."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):  # the listener closed: done
            while True:
                conn, _ = self.listener.accept()
                self.accepted += 1
                threading.Thread(target=self._reset, args=(conn,), daemon=True).start()

    @staticmethod
    def _reset(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(10)
            conn.recv(100)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.listener.close()
        self._thread.join(5)


def ask_after_hello(port: int) -> str:
    """A client that speaks first: the name line it gets back ("" if none)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"hello\n")
        try:
            return read_name(s).partition("\n")[0]  # (its echo may come with it)
        except ConnectionResetError:
            return ""


@pytest.fixture
def resetter():
    server = Resetter("resetting")
    yield server
    server.close()


@pytest.fixture
def black_hole():
    hole = BlackHole()
    yield hole
    hole.close()


def closed_port() -> int:
    return free_port()  # handed out once, nothing listens on it


class Named:
    """What vs_config needs of a real server: a name and a port."""

    def __init__(self, name: str, port: int) -> None:
        self.name, self.port = name, port


def ejected_until(admin_port: int, name: str) -> datetime.datetime | None:
    value = servers_of(admin_port)[name]["ejected_until"]
    return None if value is None else datetime.datetime.fromisoformat(value)


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def ejections(admin_port: int, name: str) -> float:
    return counted(admin_port, EJECTIONS, virtual_server="web", real_server=name)


def ejected_gauge(admin_port: int, name: str | None = None) -> float:
    labels = {"real_server": name} if name else {}
    return counted(admin_port, EJECTED, virtual_server="web", **labels)


def outlier_config(port: int, admin_port: int, servers, base: str, percent: int = 50) -> str:
    extra = (
        "retries: 3\n"
        "connect_timeout: 300ms\n"
        # passive health only, and a fall it never reaches: health stays up, so what
        # holds these servers back is ejection alone
        "health_check: {type: none, fall: 1000}\n"
        "outlier_detection: {consecutive_failures: 2, "
        f"base_ejection_time: {base}, max_ejection_time: 60s, max_ejection_percent: {percent}}}"
    )
    return with_admin(vs_config(port, servers, "rr", extra), admin_port)


def test_refused_and_black_holed_servers_are_ejected_and_come_back_on_time(
    path, name_servers, lbproxy, black_hole
):
    (a,) = name_servers("a")
    refusing = Named("refusing", closed_port())
    hole = Named("hole", black_hole.port)
    port, admin_port = free_port(), free_port()
    base = 2.0
    proxy = lbproxy(
        outlier_config(port, admin_port, [a, refusing, hole], f"{base:g}s", percent=100)
    )
    # Every client is served (the failed connects are retried on a), and two failures
    # in a row eject each of the two bad servers.
    names = [ask_name(port) for _ in range(6)]
    assert names == ["a"] * 6
    assert ejections(admin_port, "refusing") == 1
    assert ejections(admin_port, "hole") == 1
    assert ejected_gauge(admin_port, "refusing") == 1
    assert ejected_gauge(admin_port, "hole") == 1
    assert ejected_gauge(admin_port, "a") == 0
    until = ejected_until(admin_port, "refusing")
    assert until is not None and until > utc_now()
    assert until - utc_now() <= datetime.timedelta(seconds=base)
    assert servers_of(admin_port)["refusing"]["health"] == "up"  # not health: ejection
    assert ejected_until(admin_port, "a") is None
    failures = counted(admin_port, "lbproxy_connect_failures_total", real_server="refusing")
    # The refusing server starts listening: while it is ejected, nobody reaches it...
    revived = NameServer("refusing", port=refusing.port)
    try:
        if ejected_until(admin_port, "refusing") is not None:
            picked = Counter(ask_name(port) for _ in range(4))
            if ejected_until(admin_port, "refusing") is not None:  # still: none went there
                assert picked == Counter(a=4)
        # ... and once its time is up it gets clients again, no check needed.
        wait_for(
            lambda: ejected_until(admin_port, "refusing") is None,
            timeout=base + 5,
            what="refusing's ejection to end",
            details=proxy.log,
        )
        wait_for(
            lambda: ask_name(port) == "refusing",
            timeout=10,
            what="a client to reach refusing again",
        )
    finally:
        revived.stop()
    assert counted(admin_port, "lbproxy_connect_failures_total", real_server="refusing") == (
        failures
    )
    assert ejected_gauge(admin_port, "refusing") == 0
    # The black hole, back in rotation, times out twice more: ejected a second time in a
    # row, for twice as long.
    wait_for(
        lambda: ask_name(port) and ejections(admin_port, "hole") == 2,
        timeout=30,
        what="hole ejected a second time",
        details=proxy.log,
    )
    left = ejected_until(admin_port, "hole") - utc_now()  # type: ignore[operator]
    assert datetime.timedelta(seconds=base) < left <= datetime.timedelta(seconds=2 * base)
    assert (
        counted(admin_port, "lbproxy_connect_failures_total", real_server="hole", reason="timeout")
        >= 4
    )
    assert "web/hole ejected for 4s: 2 connects failed in a row" in proxy.log()


def test_the_percent_cap_holds_with_three_of_four_failing(path, name_servers, lbproxy):
    (a,) = name_servers("a")
    bad = [Named(f"bad{i}", closed_port()) for i in (1, 2, 3)]
    port, admin_port = free_port(), free_port()
    lbproxy(outlier_config(port, admin_port, [a, *bad], "60s", percent=50))
    for _ in range(20):
        assert ask_name(port) == "a"  # every client served, the failed connects retried
        assert ejected_gauge(admin_port) <= 2
    assert ejected_gauge(admin_port) == 2  # 50 % of 4
    held_back = [s.name for s in bad if ejected_gauge(admin_port, s.name)]
    assert len(held_back) == 2
    (left,) = [s.name for s in bad if s.name not in held_back]
    # the third is still picked (and fails): the cap keeps it in rotation
    assert counted(admin_port, "lbproxy_connect_failures_total", real_server=left) >= 5
    assert ejections(admin_port, left) == 0
    document = get_json(admin_port, "/api/v1/virtual-servers")["virtual_servers"][0]
    assert [rs["name"] for rs in document["real_servers"] if rs["ejected_until"]] == held_back
    # `lbproxy status` lists them with the time their ejection has left (60s at most)
    out = run_cli("status", "--admin", f"http://127.0.0.1:{admin_port}")
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.split("\n\n")[-1].splitlines()]
    assert rows[0] == ["PROTECTION", "VIRTUAL_SERVER", "REAL_SERVER", "LEFT"]
    assert [row[:3] for row in rows[1:]] == [["ejected", "web", name] for name in held_back]
    assert all(50 < float(row[3].removesuffix("s")) <= 60 for row in rows[1:]), rows


def starting(server: NameServer) -> None:
    server.name = f"{server.name}-starting"  # still serves; its check fails


@pytest.mark.parametrize("threshold", [0, 50])
def test_panic_spreads_traffic_over_every_server_when_three_of_four_are_down(
    path, threshold, name_servers, lbproxy
):
    servers = name_servers("a", "b", "c", "d")
    port, admin_port = free_port(), free_port()
    extra = (
        "health_check: {type: send_expect, expect: '^\\w+\\n', interval: 100ms, "
        "timeout: 200ms, rise: 1, fall: 1}\n"
        f"panic_threshold: {threshold}"
    )
    proxy = lbproxy(with_admin(vs_config(port, servers, "rr", extra), admin_port))
    for server in servers[1:]:
        starting(server)
    wait_for(
        lambda: all(servers_of(admin_port)[s]["health"] == "down" for s in "bcd"),
        what="b, c and d down",
        details=proxy.log,
    )
    shares = Counter(ask_name(port).removesuffix("-starting") for _ in range(200))
    vs = get_json(admin_port, "/api/v1/virtual-servers")["virtual_servers"][0]
    panic = counted(admin_port, "lbproxy_panic", virtual_server="web")
    print(f"panic_threshold {threshold}: {dict(shares)}")
    if threshold:
        # 1 of 4 available is under 50 %: every server as if up, a quarter each
        # (round robin: 50 each; within 20 % for any interleaving with the checks)
        assert set(shares) == {"a", "b", "c", "d"}
        assert all(40 <= count <= 60 for count in shares.values()), shares
        assert vs["panic"] is True and panic == 1
        assert "web: panic: 1 of 4 enabled servers available" in proxy.log()
        out = run_cli("status", "--admin", f"http://127.0.0.1:{admin_port}")
        assert out.stdout.rstrip().splitlines()[-1].split() == ["panic", "web", "-", "-"]
    else:
        assert shares == Counter(a=200)
        assert vs["panic"] is False and panic == 0
    # b and c back up: 3 of 4 is not under the threshold, panic ends
    for server in servers[1:3]:
        server.name = server.name.removesuffix("-starting")
    wait_for(
        lambda: counted(admin_port, "lbproxy_panic", virtual_server="web") == 0,
        what="panic over",
    )
    wait_for(
        lambda: sum(servers_of(admin_port)[s]["health"] == "up" for s in "abcd") == 3,
        what="a, b and c up",
    )
    assert {ask_name(port) for _ in range(12)} == {"a", "b", "c"}


SIMULATED = """\
virtual_servers:
  - name: web
    listen: 127.0.0.1:{port}
    retries: 3
    panic_threshold: 50
    outlier_detection: {{consecutive_failures: 3, base_ejection_time: 2s, max_ejection_time: 5s}}
    real_servers:
      - {{name: s1, address: 127.0.0.1:9001}}
      - {{name: s2, address: 127.0.0.1:9002}}
      - {{name: s3, address: 127.0.0.1:9003}}
      - {{name: s4, address: 127.0.0.1:9004}}
"""


def test_simulate_shows_ejections_and_panic_on_its_clock(tmp_path):
    config = tmp_path / "web.yaml"
    config.write_text(SIMULATED.format(port=free_port()))
    events = tmp_path / "events.yaml"
    events.write_text(
        "- {before: 5, fail: s1}\n"
        "- {before: 60, leave: [s2, s3, s4]}\n"
        "- {before: 80, join: [s2, s3, s4], recover: s1}\n"
    )
    args = ["simulate", str(config), "-n", "100", "--rate", "10", "--events", str(events)]
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr
    assert "connect failures: s1 " in out.stdout
    lines = [line.split() for line in out.stdout.splitlines() if "before #" in line]
    # three failures in a row (one in four picks) eject s1 for 2 s; back on time, it fails
    # again and is ejected for 4 s; with s2-s4 gone and s1 ejected, 0 of 4 is under 50 %
    assert lines == [
        ["1.000s", "before", "#11", "s1", "ejected", "until", "3.000s"],
        ["3.000s", "before", "#31", "s1", "returned"],
        ["3.600s", "before", "#37", "s1", "ejected", "until", "7.600s"],
        ["5.900s", "before", "#60", "panic"],
        ["7.600s", "before", "#77", "s1", "returned"],
        ["7.900s", "before", "#80", "panic", "over"],
    ]
    document = json.loads(run_cli(*args, "--json").stdout)
    assert document["protection"][0] == {
        "connection": 11,
        "time": 1.0,
        "event": "ejected",
        "real_server": "s1",
        "until": 3.0,
    }
    assert None not in document["sequence"]  # every failed connect retried on another


def test_bad_outlier_and_panic_settings_are_file_line_errors(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "virtual_servers:\n"
        "  - name: web\n"
        "    listen: 127.0.0.1:18080\n"
        "    panic_threshold: 150\n"
        "    outlier_detection:\n"
        "      base_ejection_time: 60s\n"
        "      max_ejection_time: 30s\n"
        "      max_ejection_percent: 101\n"
        "      consecutive_failures: 0\n"
        "    real_servers:\n"
        "      - {name: a, address: 127.0.0.1:9001}\n"
        "  - name: dns\n"
        "    listen: 127.0.0.1:18053\n"
        "    protocol: udp\n"
        "    outlier_detection: {}\n"
        "    real_servers:\n"
        "      - {name: a, address: 127.0.0.1:9053}\n"
    )
    out = run_cli("check", str(config))
    assert out.returncode == 2
    errors = out.stderr.splitlines()
    assert f"{config}:4: panic_threshold must be an integer from 0 to 100, got 150" in errors
    assert (
        f"{config}:6: outlier_detection.base_ejection_time (60s) must not exceed "
        "outlier_detection.max_ejection_time (30s)"
    ) in errors
    assert (
        f"{config}:8: outlier_detection.max_ejection_percent must be an integer from 0 to "
        "100, got 101"
    ) in errors
    assert any(
        line.startswith(f"{config}:9: outlier_detection.consecutive_failures") for line in errors
    )
    assert f"{config}:15: outlier_detection is for TCP; a UDP virtual server refuses it" in errors


def test_a_queued_client_gets_the_server_whose_ejection_ends(path, name_servers, lbproxy):
    """With every other server full, a client waits in the queue; the ejected server's
    return, on its own timer (no pick runs and nothing reads the state meanwhile), hands
    it the waiting client long before the queue's timeout."""
    (a,) = name_servers("a")
    bad = Named("bad", closed_port())
    port, admin_port = free_port(), free_port()
    extra = (
        "retries: 1\n"
        "health_check: {type: none, fall: 1000}\n"
        "queue: {max: 10, timeout: 20s}\n"
        "outlier_detection: {consecutive_failures: 1, base_ejection_time: 1s}"
    )
    config = vs_config(port, [a, bad], "rr", extra, rs_extra={"a": "max_connections: 1"})
    proxy = lbproxy(with_admin(config, admin_port))
    held, name = open_and_read_name(port)  # a's one slot (bad, if tried first, failed)
    revived = None
    try:
        assert name == "a"
        if not ejections(admin_port, "bad"):
            assert closed_without_a_byte(port)  # a full, bad refused: nowhere to go
        assert ejections(admin_port, "bad") == 1
        revived = NameServer("bad", port=bad.port)
        began = time.monotonic()
        assert ask_name(port, timeout=15) == "bad"  # queued until bad's ejection ended
        waited = time.monotonic() - began
    finally:
        held.close()
        if revived is not None:
            revived.stop()
    print(f"the queued client was served after {waited:.2f}s (ejection 1s, queue timeout 20s)")
    assert waited < 10, proxy.log()
    assert counted(admin_port, "lbproxy_rejected_connections_total", reason="queue_timeout") == 0


def test_a_server_that_accepts_and_resets_is_ejected(path, name_servers, lbproxy, resetter):
    """Its connects all complete, yet it serves nobody: each reset before its first byte
    is a failed connect, and two in a row eject it."""
    (a,) = name_servers("a")
    port, admin_port = free_port(), free_port()
    proxy = lbproxy(outlier_config(port, admin_port, [a, resetter], "60s"))
    wait_for(
        lambda: ask_after_hello(port) == "a" and ejections(admin_port, "resetting") == 1,
        what="resetting ejected",
        details=proxy.log,
    )
    assert ejected_gauge(admin_port, "resetting") == 1
    assert ejected_until(admin_port, "resetting") is not None
    errors = servers_of(admin_port)["resetting"]["errors"]
    assert errors["reset"] == 2 and errors["connect_error"] == 0, errors  # after the connect
    accepted = resetter.accepted
    assert [ask_after_hello(port) for _ in range(6)] == ["a"] * 6  # held back: all served
    assert resetter.accepted == accepted
    assert "web/resetting ejected for 60s: 2 connects failed in a row" in proxy.log()


def echoed(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        return data


def test_servers_that_answer_or_stay_silent_are_never_ejected(path, name_servers, lbproxy):
    """With one failure enough to eject: a server that speaks first, an echo server that
    speaks only when spoken to, and clients that leave before either says a word."""
    (speaks_first,) = name_servers("speaks_first")
    echo = NameServer("echo", greeting=False)
    try:
        port, admin_port = free_port(), free_port()
        extra = (
            "health_check: {type: none, fall: 1000}\n"
            "outlier_detection: {consecutive_failures: 1, base_ejection_time: 60s}"
        )
        proxy = lbproxy(with_admin(vs_config(port, [speaks_first, echo], "rr", extra), admin_port))
        for _ in range(10):
            answer = echoed(port, b"ping\n")
            assert answer in (b"ping\n", b"speaks_first\nping\n"), answer
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass  # gone before a byte either way
        wait_for(  # every one ended: counted (or not) by outlier detection
            lambda: counted(admin_port, "lbproxy_connection_duration_seconds_count") >= 20,
            what="every connection ended",
            details=proxy.log,
        )
        assert ejections(admin_port, "speaks_first") == 0
        assert ejections(admin_port, "echo") == 0
        assert ejected_gauge(admin_port) == 0
    finally:
        echo.stop()
