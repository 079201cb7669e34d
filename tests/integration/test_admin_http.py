"""The admin endpoint's HTTP/1.1 server (lbproxy/admin/http_server.py) through a real
`lbproxy run` and raw sockets: what a client of nginx's or HAProxy's admin relies on.

One process serves the whole module (every test leaves it as it found it); each test
asserts the bytes a client sees and that the endpoint goes on serving others."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from lbproxy.admin.http_server import MAX_BODY, MAX_HEAD, REQUEST_TIMEOUT
from tests.integration.harness import (
    HTTP_SERVER_TOKEN,
    Lbproxies,
    ask_name,
    free_port,
    http,
    http_server_config,
    http_server_healthy,
    read_answer,
    vs_config,
    wait_for,
    with_admin,
)

LOAD = "/api/v1/virtual-servers/db/real-servers/a/load"
PATCH = "/api/v1/virtual-servers/db/real-servers/a"
AUTH = f"Authorization: Bearer {HTTP_SERVER_TOKEN}\r\n"


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    port = free_port()
    folder = tmp_path_factory.mktemp("admin-http")
    proxies = Lbproxies(folder)  # one process for the module: every test leaves it as it was
    proxy = proxies(http_server_config(f"127.0.0.1:{port}", folder), [port])
    yield proxy, port
    proxies.stop_all()  # fails on a traceback in the log


def connect(port: int, host: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection((host, port), timeout=10)


def closed(sock: socket.socket, buffer: bytearray | None = None) -> bool:
    """True when the endpoint closes the connection (nothing more was in `buffer`)."""
    assert not buffer
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def test_pipelined_requests_are_answered_in_order_on_one_connection(endpoint):
    _, port = endpoint
    requests = [
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET /nope HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"PUT "
        + LOAD.encode()
        + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + AUTH.encode()
        + b'Content-Length: 13\r\n\r\n{"load": 0.5}',
        b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    ]
    with connect(port) as s:
        s.sendall(b"".join(requests) * 5)  # 20 requests in one write
        buffer = bytearray()
        for _ in range(5):
            answers = [read_answer(s, buffer) for _ in requests]
            assert [status for status, _, _ in answers] == [200, 404, 200, 200]
            assert answers[0][2] == b"ok\n" and answers[3][2] == b"ready\n"
            assert json.loads(answers[2][2])["reported"] == 0.5
            assert all("connection" not in headers for _, headers, _ in answers)
        s.sendall(requests[0])  # still open
        assert read_answer(s, buffer)[0] == 200


def test_http_1_0_closes_unless_it_asks_for_keep_alive(endpoint):
    _, port = endpoint
    with connect(port) as s:
        s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        buffer = bytearray()
        status, headers, body = read_answer(s, buffer)
        assert (status, body, headers["connection"]) == (200, b"ok\n", "close")
        assert closed(s, buffer)
    keep = b"GET /healthz HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n"  # as `ab -k`
    with connect(port) as s:
        buffer = bytearray()
        s.sendall(keep)
        s.sendall(keep + keep)  # pipelined as well
        for _ in range(3):
            status, headers, body = read_answer(s, buffer)
            assert (status, body, headers["connection"]) == (200, b"ok\n", "keep-alive")
            assert headers["content-length"] == "3"
        s.sendall(b"GET /readyz HTTP/1.0\r\n\r\n")  # no keep-alive this time
        status, headers, body = read_answer(s, buffer)
        assert (status, body, headers["connection"]) == (200, b"ready\n", "close")
        assert closed(s, buffer)


def test_connection_close_is_honoured(endpoint):
    _, port = endpoint
    with connect(port) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        buffer = bytearray()
        assert read_answer(s, buffer)[1]["connection"] == "close"
        assert closed(s, buffer)


def test_expect_100_continue_then_the_body(endpoint):
    _, port = endpoint
    body = b'{"load": 0.25}'
    with connect(port) as s:
        s.sendall(
            f"PUT {LOAD} HTTP/1.1\r\nHost: 127.0.0.1\r\n{AUTH}Expect: 100-continue\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += s.recv(100)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        status, _, answer = read_answer(s, bytearray())
        assert status == 200 and json.loads(answer)["reported"] == 0.25


def test_a_chunked_body(endpoint):
    _, port = endpoint
    with connect(port) as s:
        s.sendall(
            f"PUT {LOAD} HTTP/1.1\r\nHost: 127.0.0.1\r\n{AUTH}"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
            + b'5\r\n{"loa\r\n9\r\nd": 0.75}\r\n0\r\n\r\n'
        )
        status, _, answer = read_answer(s, bytearray())
        assert status == 200 and json.loads(answer)["reported"] == 0.75


@pytest.mark.parametrize("method, path", [("PATCH", PATCH), ("PUT", LOAD)])
@pytest.mark.parametrize("framing", ["content-length", "content-length, expect", "chunked"])
def test_a_body_over_64_kib_is_413_for_patch_and_load_alike(endpoint, method, path, framing):
    _, port = endpoint
    change = b'{"weight": 7}' if method == "PATCH" else b'{"load": 9}'
    big = b" " * MAX_BODY + change  # valid JSON: it would change `a` if it were taken
    if framing == "chunked":
        head = b"Transfer-Encoding: chunked\r\n\r\n"
        payload = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (big[:40000], big[40000:]))
        payload += b"0\r\n\r\n"
    else:
        head = b"Content-Length: %d\r\n" % len(big)
        head += b"Expect: 100-continue\r\n\r\n" if "expect" in framing else b"\r\n"
        payload = b"" if "expect" in framing else big  # the client waits; it is refused
    with connect(port) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode() + head + payload)
        buffer = bytearray()
        status, headers, answer = read_answer(s, buffer)
        assert status == 413 and headers["connection"] == "close"
        assert json.loads(answer) == {"error": f"body too large: more than {MAX_BODY} bytes"}
        assert closed(s, buffer)
    with connect(port) as s:  # nothing changed
        s.sendall(b"GET /api/v1/virtual-servers/db HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        a = json.loads(read_answer(s, bytearray())[2])["real_servers"][0]
        assert a["weight"]["static"] == 1 and a["load"] != 9


def test_a_head_over_16_kib_is_431_and_closed(endpoint):
    _, port = endpoint
    with connect(port) as s:
        s.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * MAX_HEAD + b"\r\n\r\n"
        )
        buffer = bytearray()
        status, _, answer = read_answer(s, buffer)
        assert status == 431 and json.loads(answer) == {
            "error": f"request head too large (over {MAX_HEAD // 1024} KiB)"
        }
        assert closed(s, buffer)
    assert http_server_healthy(port)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(40) + b"\r\n\r\n",  # TLS
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: x\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nno colon here\r\n\r\n",
        b"GET  HTTP/1.1\r\n\r\n",
    ],
)
def test_garbage_is_400_and_closed(endpoint, garbage):
    _, port = endpoint
    with connect(port) as s:
        s.sendall(garbage)
        buffer = bytearray()
        status, headers, answer = read_answer(s, buffer)
        assert status == 400 and headers["connection"] == "close"
        assert json.loads(answer)["error"].startswith("bad request: ")
        assert closed(s, buffer)
    assert http_server_healthy(port)


def test_an_http_version_other_than_1_0_and_1_1_is_505(endpoint):
    _, port = endpoint
    for version in (b"2.0", b"1.2", b"0.9"):
        with connect(port) as s:
            s.sendall(b"GET /healthz HTTP/" + version + b"\r\nHost: 127.0.0.1\r\n\r\n")
            buffer = bytearray()
            status, _, answer = read_answer(s, buffer)
            assert status == 505 and version.decode() in json.loads(answer)["error"]
            assert closed(s, buffer)
    with connect(port) as s:  # a refusal of a HEAD request has the head only, too
        s.sendall(b"HEAD /healthz HTTP/2.0\r\nHost: 127.0.0.1\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        assert data.startswith(b"HTTP/1.1 505 ") and data.endswith(b"\r\n\r\n")


def test_a_slow_head_is_closed_while_another_client_is_served(endpoint):
    """Slowloris: one byte every 0.2 s never completes a head; the endpoint closes it
    within REQUEST_TIMEOUT of its first byte and serves a keep-alive client throughout."""
    _, port = endpoint
    stop = threading.Event()
    served = []

    def other() -> None:
        with connect(port) as s:
            buffer = bytearray()
            while not stop.is_set() and len(served) < 2000:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                served.append(read_answer(s, buffer)[0])
                time.sleep(0.005)  # the keep-alive client's pace

    thread = threading.Thread(target=other)
    thread.start()
    try:
        with connect(port) as slow:
            started = time.monotonic()
            request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X: y\r\n" * 100
            for byte in request:
                if time.monotonic() - started > REQUEST_TIMEOUT + 3:
                    break
                try:
                    slow.sendall(bytes([byte]))
                except (BrokenPipeError, ConnectionResetError):
                    break
                slow.settimeout(0.2)
                try:
                    if slow.recv(100) == b"":
                        break
                except TimeoutError:
                    continue
                except ConnectionResetError:
                    break
            elapsed = time.monotonic() - started
        assert REQUEST_TIMEOUT - 0.3 < elapsed < REQUEST_TIMEOUT + 1.5, elapsed
        served_meanwhile = len(served)
    finally:
        stop.set()
        thread.join(10)
    assert served_meanwhile > 50 and set(served) == {200}


def test_clients_vanishing_mid_request_and_mid_answer(endpoint):
    """Resets in the middle of a head, of a body, and before a large answer is read:
    the endpoint goes on and logs nothing."""
    proxy, port = endpoint
    rst = struct.pack("ii", 1, 0)  # SO_LINGER 0: close() sends a reset
    for partial in (
        b"GET /metr",
        f"PUT {LOAD} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{{".encode(),
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 50,  # answers it never reads
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 20,
    ):
        for reset in (True, False):
            s = connect(port)
            if reset:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, rst)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(partial)
            time.sleep(0.02)  # on purpose: the endpoint has begun on it when the client goes
            s.close()
    assert http_server_healthy(port)
    time.sleep(0.2)  # on purpose: time to log an error or die over them (it must not)
    assert proxy.proc.poll() is None
    assert "Traceback" not in proxy.log() and "ERROR" not in proxy.log()


def test_head_requests_get_the_head_only(endpoint):
    _, port = endpoint
    with connect(port) as s:
        s.sendall(
            b"HEAD /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        )
        data = b""
        while data.count(b"ok\n") < 1:
            data += s.recv(65536)
        heads = data.split(b"\r\n\r\n")
        assert heads[0].startswith(b"HTTP/1.1 200") and b"content-length: 3" in heads[0]
        assert heads[1].startswith(b"HTTP/1.1 200") and heads[2] == b"ok\n"


def test_an_ipv6_listen_address(tmp_path, lbproxy):
    port = free_port("::1")
    with lbproxy(http_server_config(f"[::1]:{port}", tmp_path)) as proxy:
        with connect(port, "::1") as s:
            buffer = bytearray()
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert read_answer(s, buffer)[:1] == (200,)
            # a change over TCP, with the token (SPEC §21), loopback or not
            s.sendall(
                f"PUT {LOAD} HTTP/1.1\r\nHost: 127.0.0.1\r\n{AUTH}"
                "Content-Length: 13\r\n\r\n".encode()
                + b'{"load": 0.5}'
            )
            assert read_answer(s, buffer)[0] == 200
        assert proxy.proc.poll() is None


def test_three_thousand_idle_admin_connections_take_no_more_than_max_connections(
    name_servers, lbproxy
):
    """Idle keep-alive clients that send nothing: the endpoint keeps at most
    global.admin.max_connections (256) of them, closing the idlest to admit each new one,
    so proxying, /healthz and a scrape go on and its descriptors stay bounded."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    (a,) = name_servers("a")
    port, admin_port = free_port(), free_port()
    process = lbproxy(with_admin(vs_config(port, [a], "rr"), admin_port), [port, admin_port])
    pid = process.proc.pid
    before = len(os.listdir(f"/proc/{pid}/fd"))
    idle: list[socket.socket] = []
    try:
        for _ in range(3000):
            idle.append(connect(admin_port))
        # The newest are kept; the endpoint answers a probe, a scrape and proxies.
        wait_for(
            lambda: len(os.listdir(f"/proc/{pid}/fd")) <= before + 256 + 2,
            what="at most 256 admin connections held",
        )
        status, _ = http("GET", f"http://127.0.0.1:{admin_port}/healthz")
        assert status == 200
        status, body = http("GET", f"http://127.0.0.1:{admin_port}/metrics")
        assert status == 200 and b"lbproxy_connections_total" in body
        assert ask_name(port) == "a"
        closed = 0
        for s in idle:
            s.setblocking(False)
            try:
                closed += s.recv(1) == b""
            except BlockingIOError:
                pass
            except ConnectionResetError:
                closed += 1
        # All but the newest (at most 256, less the probe's and scrape's own) were closed.
        assert 3000 - 256 <= closed <= 3000, closed
        assert len(os.listdir(f"/proc/{pid}/fd")) <= before + 256 + 2
    finally:
        for s in idle:
            s.close()


# A slowloris: SLOW connections from 127.0.0.1 that each send one byte of a request and
# never more; each one the endpoint closes is opened again at once (the attacker keeps
# the pressure on). It runs in a process of its own, so the probes' timings in this one
# are the endpoint's, not this interpreter's. It prints "held" once SLOW are open, and
# stops when its stdin closes or after MAX_SECONDS.
SLOW = 1000
SLOWLORIS = """
import os, selectors, socket, sys, time
port, count, limit = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
selector = selectors.DefaultSelector()
selector.register(sys.stdin, selectors.EVENT_READ, None)
opened = 0
def open_one():
    global opened
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", port))
    selector.register(s, selectors.EVENT_WRITE, "connecting")
    opened += 1
for _ in range(count):
    open_one()
announced = False
started = time.monotonic()
running = True
while running and time.monotonic() - started < limit:
    for key, events in selector.select(0.5):
        if key.data is None:  # stdin: closed by the test
            running = False
            break
        s = key.fileobj
        if key.data == "connecting":
            selector.unregister(s)
            try:
                s.send(b"G")  # one byte of "GET ...", and never the rest
            except OSError:
                s.close()
                open_one()
                continue
            selector.register(s, selectors.EVENT_READ, "held")
        else:  # the endpoint closed it (or answered): open another
            selector.unregister(s)
            s.close()
            open_one()
    if not announced and opened >= count:
        announced = True
        print("held", flush=True)
print("opened", opened, flush=True)
"""


def timed_probe(port: int, path: str, source: str) -> tuple[float, int]:
    """Seconds from connect to the whole answer of GET `path`, from address `source`.

    It returns once the endpoint has closed its side too: until the endpoint reads this
    client's FIN, the connection still counts against the limits (a newcomer accepted in
    the same wakeup would find it there)."""
    started = time.monotonic()
    with socket.socket() as s:
        s.settimeout(10)
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        status, _, _ = read_answer(s, bytearray())
        elapsed = time.monotonic() - started
        s.shutdown(socket.SHUT_WR)
        with contextlib.suppress(ConnectionResetError):
            while s.recv(4096):
                pass
    return elapsed, status


@pytest.mark.serial  # it measures answer times under load
def test_a_thousand_slow_clients_do_not_keep_probes_from_being_answered(name_servers, lbproxy):
    """SPEC §21: while 1,000 slow clients (one byte each, from 127.0.0.1) hold the
    endpoint, /healthz and /readyz answer within 1 s from another address (127.0.0.2)
    and within 3 s from the slow clients' own; the per-source limit (32) and the
    eviction of the oldest half-read connection are what let them in."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    (a,) = name_servers("a")
    port, admin_port = free_port(), free_port()
    lbproxy(with_admin(vs_config(port, [a], "rr"), admin_port), [port, admin_port])
    attacker = subprocess.Popen(
        [sys.executable, "-c", SLOWLORIS, str(admin_port), str(SLOW), "120"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard)),
    )
    try:
        assert attacker.stdout.readline().strip() == "held"
        times: dict[str, list[float]] = {"127.0.0.2": [], "127.0.0.1": []}
        for _ in range(10):
            for source, probes in times.items():
                for path in ("/healthz", "/readyz"):
                    elapsed, status = timed_probe(admin_port, path, source)
                    assert status == 200, (source, path)
                    probes.append(elapsed)
        assert attacker.poll() is None  # still at it throughout
    finally:
        attacker.stdin.close()
        output = attacker.stdout.read()
        attacker.stdout.close()
        attacker.wait(30)
    opened = int(output.split()[-1])
    assert opened > SLOW  # the endpoint closed slow clients to let others in
    assert max(times["127.0.0.2"]) < 1.0, times
    assert max(times["127.0.0.1"]) < 3.0, times
    assert ask_name(port) == "a"


def half_read(port: int, source: str) -> socket.socket:
    """A connection from `source` that has sent one byte of a request."""
    s = socket.socket()
    s.settimeout(10)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(b"G")
    return s


def is_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        s.setblocking(True)


def evictions_at_the_limits(admin_port: int) -> None:
    """Four half-read connections from 127.0.0.3, a fifth from there (answered), five from
    other addresses, a ninth from yet another (answered): which ones are closed."""
    held: list[socket.socket] = []
    try:
        same = [half_read(admin_port, "127.0.0.3") for _ in range(4)]
        held += same
        wait_for(lambda: all(is_open(s) for s in same), what="four held")  # accepted, kept
        assert timed_probe(admin_port, "/healthz", "127.0.0.3")[1] == 200
        wait_for(lambda: not is_open(same[0]), what="the oldest of 127.0.0.3 closed")
        assert all(is_open(s) for s in same[1:])
        others = [half_read(admin_port, f"127.0.0.{i}") for i in range(10, 15)]
        held += others
        wait_for(lambda: sum(is_open(s) for s in held) == 8, what="eight held")
        assert timed_probe(admin_port, "/readyz", "127.0.0.20")[1] == 200
        wait_for(lambda: not is_open(same[1]), what="the oldest of all closed")
        assert all(is_open(s) for s in same[2:] + others)
    finally:
        for s in held:
            s.close()


def test_at_a_limit_the_oldest_half_read_connection_makes_room(name_servers, lbproxy):
    """`max_connections_per_source: 4`, `max_connections: 8`: a fifth connection from
    one address closes that address's oldest half-read one and is answered; a ninth
    from yet another address closes the oldest half-read one of all.

    REQUEST_TIMEOUT after its connect, the endpoint closes a half-read connection by
    itself; an attempt that took longer than that (a machine stalled for seconds) proves
    nothing either way and is made again, on a fresh process, at most three times."""
    (a,) = name_servers("a")
    outcomes = []
    for _ in range(3):
        port, admin_port = free_port(), free_port()
        config = with_admin(vs_config(port, [a], "rr"), admin_port).replace(
            "admin: {", "admin: {max_connections_per_source: 4, max_connections: 8, ", 1
        )
        proxy = lbproxy(config, [admin_port])
        started = time.monotonic()
        try:
            evictions_at_the_limits(admin_port)
        except AssertionError as failure:
            outcome: AssertionError | None = failure
        else:
            outcome = None
        took = time.monotonic() - started
        proxy.stop()
        if took < REQUEST_TIMEOUT:
            if outcome is not None:
                raise outcome
            return
        outcomes.append(f"{took:.1f}s: {outcome or 'passed'}")
    pytest.fail(f"every attempt outlasted REQUEST_TIMEOUT ({REQUEST_TIMEOUT:g}s): {outcomes}")


def answer_to(port: int, request: bytes) -> tuple[str, dict[str, str], bytes]:
    """Send one request on a new connection: the answer's status line, headers, body."""
    with connect(port) as s:
        s.sendall(request)
        buffer = bytearray()
        while b"\r\n" not in buffer:
            data = s.recv(65536)
            assert data, "closed before an answer"
            buffer += data
        line = bytes(buffer).split(b"\r\n", 1)[0].decode()
        _, headers, body = read_answer(s, buffer)
    return line, headers, body


def test_status_lines_carry_the_standard_reason_phrase(endpoint):
    _, port = endpoint
    for path, line in (
        ("/healthz", "HTTP/1.1 200 OK"),
        ("/nope", "HTTP/1.1 404 Not Found"),
        ("/api/v1/virtual-servers/db", "HTTP/1.1 200 OK"),
    ):
        assert (
            answer_to(port, f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())[0] == line
        )
    # the server's own refusals too
    assert answer_to(port, b"GET /healthz HTTP/3.0\r\nHost: 127.0.0.1\r\n\r\n")[0] == (
        "HTTP/1.1 505 HTTP Version Not Supported"
    )


@pytest.mark.parametrize(
    "method, path, allow",
    [
        ("PUT", PATCH, "GET, DELETE, PATCH, OPTIONS"),
        ("POST", "/metrics", "GET, HEAD, OPTIONS"),
        ("GET", LOAD, "PUT, OPTIONS"),
        ("PATCH", "/api/v1/virtual-servers/db/per-source", "GET, DELETE, OPTIONS"),
    ],
)
def test_a_405_names_every_allowed_method_in_allow(endpoint, method, path, allow):
    _, port = endpoint
    request = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{AUTH}Content-Length: 0\r\n\r\n"
    line, headers, body = answer_to(port, request.encode())
    assert line == "HTTP/1.1 405 Method Not Allowed"
    assert headers["allow"] == allow
    assert json.loads(body) == {"error": f"method {method} not allowed; use {allow}"}


def test_options_is_204_with_allow_and_no_cors(endpoint):
    """OPTIONS needs no token (it changes nothing) and says what the route allows; a
    browser's preflight from another origin gets no Access-Control-* and so goes no
    further."""
    _, port = endpoint
    for path, allow in (
        (PATCH, "GET, DELETE, PATCH, OPTIONS"),
        ("/healthz", "GET, HEAD, OPTIONS"),
        ("/api/v1/reload", "POST, OPTIONS"),
    ):
        request = (
            f"OPTIONS {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://evil.example\r\n"
            "Access-Control-Request-Method: PATCH\r\n\r\nGET /healthz HTTP/1.1\r\n"
            "Host: 127.0.0.1\r\n\r\n"
        )
        with connect(port) as s:
            s.sendall(request.encode())
            buffer = bytearray()
            status, headers, body = read_answer(s, buffer)
            assert (status, body) == (204, b"")
            assert headers["allow"] == allow
            assert "content-length" not in headers and "content-type" not in headers
            assert not [name for name in headers if name.startswith("access-control-")]
            status, _, body = read_answer(s, buffer)  # the connection goes on after it
            assert (status, body) == (200, b"ok\n")
    assert answer_to(port, b"OPTIONS /nope HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")[0] == (
        "HTTP/1.1 404 Not Found"
    )


def test_401_and_403_say_www_authenticate_bearer(endpoint):
    _, port = endpoint
    request = f"PATCH {PATCH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n"
    line, headers, body = answer_to(port, (request + "\r\n{}").encode())
    assert line == "HTTP/1.1 401 Unauthorized"
    assert headers["www-authenticate"] == 'Bearer realm="lbproxy"'
    wrong = request + "Authorization: Bearer not-the-token\r\n\r\n{}"
    line, headers, body = answer_to(port, wrong.encode())
    assert line == "HTTP/1.1 403 Forbidden" and json.loads(body) == {"error": "wrong token"}
    assert headers["www-authenticate"] == 'Bearer realm="lbproxy", error="invalid_token"'


@pytest.mark.parametrize("whole", [True, False])
def test_a_request_line_over_16_kib_is_414_and_headers_over_it_431(endpoint, whole):
    """A 20 KB URI is 414 URI Too Long, whether it came whole or the server saw 16 KiB of
    it with no end of line yet; a head over 16 KiB in its headers stays 431."""
    _, port = endpoint
    line = b"GET /healthz?" + b"a" * 20_000 + b" HTTP/1.1\r\n"
    with connect(port) as s:
        s.sendall(line + b"Host: 127.0.0.1\r\n\r\n" if whole else line[: MAX_HEAD + 100])
        buffer = bytearray()
        status, _, answer = read_answer(s, buffer)
        assert status == 414
        assert json.loads(answer) == {
            "error": f"request line too long (over {MAX_HEAD // 1024} KiB)"
        }
        assert closed(s, buffer)
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n"
    with connect(port) as s:
        s.sendall(head + b"\r\n" if whole else head[: MAX_HEAD + 100])
        buffer = bytearray()
        assert read_answer(s, buffer)[0] == 431
    assert http_server_healthy(port)
