"""UDP traffic through a real `lbproxy` (SPEC §19): syslog-style fire and forget from
many clients, a thousand concurrent sessions byte-exact both ways, and two processes
with `maglev` agreeing on every client with no shared state."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from collections import Counter

from tests.integration.harness import Echo, free_port, metrics, sample, wait_for


class Collector:
    """A syslog collector: counts every datagram it receives (none answered)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self.sources: set[tuple] = set()  # lbproxy's session sockets: one per session
        thread = threading.Thread(target=self._serve, daemon=True)
        thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                data, peer = self.sock.recvfrom(70000)
                self.received.append(data)
                self.sources.add(peer)
                if data.startswith(b"<13>"):
                    self.sock.sendto(b"unwanted reply", peer)  # responses: 0 drops it

    def close(self) -> None:
        self.sock.close()


def udp_config(admin: int, port: int, scheduler: str, ports: dict[str, int], udp: str) -> str:
    real = "".join(
        f"      - {{name: {name}, address: 127.0.0.1:{p}}}\n" for name, p in ports.items()
    )
    return (
        f"global:\n  admin: {{listen: 127.0.0.1:{admin}}}\n  drain_timeout: 1s\n"
        "virtual_servers:\n  - name: vs\n    protocol: udp\n"
        f"    listen: 127.0.0.1:{port}\n    scheduler: {scheduler}\n    udp: {udp}\n"
        f"    real_servers:\n{real}"
    )


def test_syslog_10000_datagrams_from_100_clients_all_arrive_spread_then_expire(lbproxy):
    collectors = {name: Collector() for name in ("c1", "c2", "c3")}
    port, admin = free_port(), free_port()
    ports = {name: c.port for name, c in collectors.items()}
    config = udp_config(admin, port, "rr", ports, "{responses: 0, idle_timeout: 1s}")
    config = config.replace("drain_timeout: 1s\n", "drain_timeout: 1s\n  access_log: true\n")
    clients = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(100)]
    total = lambda: sum(len(c.received) for c in collectors.values())  # noqa: E731
    try:
        with lbproxy(config) as lb:
            sent = []
            for seq in range(100):
                for i, client in enumerate(clients):
                    message = b"<13>client %d seq %d" % (i, seq)
                    client.sendto(message, ("127.0.0.1", port))
                    sent.append(message)
                # At most ~200 in flight: UDP has no flow control, a socket buffer would.
                sent_now = len(sent)
                wait_for(lambda: total() >= sent_now - 200, what="the collectors")  # noqa: B023
            wait_for(lambda: total() == 10000, what="all 10,000 datagrams")
            received = [m for c in collectors.values() for m in c.received]
            assert Counter(received) == Counter(sent)  # each once, none lost, none extra
            # rr over 100 sessions: 34, 33, 33; each client's datagrams on one collector.
            by_client = {}
            for name, collector in collectors.items():
                for message in collector.received:
                    by_client.setdefault(message.split(b" seq")[0], set()).add(name)
            assert all(len(names) == 1 for names in by_client.values())
            spread = sorted(len(c.received) // 100 for c in collectors.values())
            assert spread == [33, 33, 34]
            samples = metrics(admin)
            for name in collectors:
                labels = {"virtual_server": "vs", "real_server": name}
                assert (
                    sample(samples, "lbproxy_udp_datagrams_total", **labels, direction="out") == 0
                )
            unrequested = sample(
                samples, "lbproxy_udp_dropped_total", virtual_server="vs", reason="unrequested"
            )
            assert unrequested > 0  # the collectors' replies, none passed on

            def open_sessions() -> float:
                now = metrics(admin)
                return sum(
                    sample(now, "lbproxy_udp_active_sessions", virtual_server="vs", real_server=n)
                    for n in collectors
                )

            assert open_sessions() > 0
            wait_for(lambda: open_sessions() == 0, what="sessions idle 1 s expire")
            now = metrics(admin)
            assert (
                sum(
                    sample(now, "lbproxy_udp_sessions_total", virtual_server="vs", real_server=n)
                    for n in collectors
                )
                == 100
            )
            # The access log: one line per session, each ended by its idle timeout, and
            # each client's 100 datagrams (in bytes) on its one line.
            lines = [line for line in lb.log().splitlines() if " vs=vs " in line]
            assert len(lines) == 100
            assert all(line.endswith("end=idle_timeout") and " out=0 " in line for line in lines)
            logged = {}
            for line in lines:
                source, _vs, _rs, bytes_in = line.split("lbproxy.access: ")[1].split()[:4]
                logged[source] = int(bytes_in.removeprefix("in="))
            assert logged == {
                f"127.0.0.1:{c.getsockname()[1]}": sum(
                    len(b"<13>client %d seq %d" % (i, seq)) for seq in range(100)
                )
                for i, c in enumerate(clients)
            }
    finally:
        for client in clients:
            client.close()
        for collector in collectors.values():
            collector.close()


def test_1000_concurrent_sessions_byte_exact_both_ways(lbproxy):
    servers = {"a": Echo(b""), "b": Echo(b"")}
    port, admin = free_port(), free_port()
    ports = {name: e.port for name, e in servers.items()}
    udp = "{idle_timeout: 30s, max_sessions_per_source: 1000}"  # one source address
    config = udp_config(admin, port, "lc", ports, udp)
    rng = random.Random(25)
    clients = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(1000)]
    for c in clients:
        c.settimeout(5)
    try:
        with lbproxy(config):
            for _round in range(2):
                # 50 at a time in flight; every session stays open between the rounds.
                for start in range(0, 1000, 50):
                    batch = clients[start : start + 50]
                    payloads = [rng.randbytes(rng.choice((0, 1, 512, 1472, 9000))) for _ in batch]
                    for client, payload in zip(batch, payloads, strict=True):
                        client.sendto(payload, ("127.0.0.1", port))
                    for client, payload in zip(batch, payloads, strict=True):
                        assert client.recvfrom(70000)[0] == payload
                samples = metrics(admin)
                active = [
                    sample(
                        samples, "lbproxy_udp_active_sessions", virtual_server="vs", real_server=n
                    )
                    for n in servers
                ]
                assert active == [500, 500]  # lc: the open sessions shared evenly
            opened = sum(
                sample(samples, "lbproxy_udp_sessions_total", virtual_server="vs", real_server=n)
                for n in servers
            )
            assert opened == 1000  # the second round reused every session
    finally:
        for client in clients:
            client.close()
        for echo in servers.values():
            echo.close()


def test_maglev_two_processes_agree_on_every_client(tmp_path, lbproxy):
    servers = {name: Echo(name.encode() + b":") for name in ("a", "b", "c", "d")}
    ports = {name: e.port for name, e in servers.items()}
    port1, port2 = free_port(), free_port()
    config1 = udp_config(free_port(), port1, "maglev", ports, "{responses: 1}")
    config2 = udp_config(free_port(), port2, "maglev", ports, "{responses: 1}")
    clients = []
    for i in range(1, 61):  # 60 client addresses: 127.0.0.1 .. 127.0.0.60
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((f"127.0.0.{i}", 0))
        sock.settimeout(3)
        clients.append(sock)
    try:
        with (
            lbproxy(config1, folder=tmp_path / "one"),
            lbproxy(config2, folder=tmp_path / "two"),
        ):
            picks = []
            for sock in clients:
                answers = []
                for port in (port1, port2):
                    sock.sendto(b"?", ("127.0.0.1", port))
                    answers.append(sock.recvfrom(100)[0])
                picks.append(answers)
            assert all(one == two for one, two in picks)  # no shared state, same server
            assert len({one for one, _ in picks}) == 4  # and every server has clients
    finally:
        for sock in clients:
            sock.close()
        for echo in servers.values():
            echo.close()


class Triple:
    """A real server that answers each datagram with three of growing size, and counts
    the bytes it sent to each of lbproxy's session sockets."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = 0
        self.sent_bytes = 0
        thread = threading.Thread(target=self._serve, daemon=True)
        thread.start()

    @staticmethod
    def replies(data: bytes) -> list[bytes]:
        return [b"1:" + data, b"2:" + data * 2, b"3:" + data * 3]

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                data, peer = self.sock.recvfrom(70000)
                self.received += 1
                for reply in self.replies(data):
                    self.sock.sendto(reply, peer)
                    self.sent_bytes += len(reply)

    def close(self) -> None:
        self.sock.close()


def test_responses_1_0_none_pass_on_at_most_what_was_asked_no_amplification(lbproxy):
    """One real server answering each request three times, behind three virtual servers:
    `responses: 1` passes on one reply per request (the first, byte for byte), `none`
    all three, `0` none; no client ever gets a byte the server did not send."""
    upstream = Triple()
    admin = free_port()
    ports = {"one": free_port(), "all": free_port(), "zero": free_port()}
    responses = {"one": "1", "all": "none", "zero": "0"}
    config = f"global:\n  admin: {{listen: 127.0.0.1:{admin}}}\n  drain_timeout: 1s\n"
    config += "virtual_servers:\n"
    for name, port in ports.items():
        config += (
            f"  - name: {name}\n    protocol: udp\n    listen: 127.0.0.1:{port}\n"
            f"    udp: {{responses: {responses[name]}}}\n"
            f"    real_servers: [{{name: echo, address: 127.0.0.1:{upstream.port}}}]\n"
        )
    requests = [b"", b"x", b"dns?" * 25, bytes(range(256)) * 4, b"z" * 9000]
    clients = {name: socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for name in ports}

    def drain(sock: socket.socket, wait: float) -> list[bytes]:
        sock.settimeout(wait)
        got = []
        with contextlib.suppress(TimeoutError):
            while True:
                got.append(sock.recvfrom(70000)[0])
        return got

    try:
        with lbproxy(config):
            got = {}
            for name, sock in clients.items():
                got[name] = []
                for request in requests:
                    sent_before = upstream.received
                    sock.sendto(request, ("127.0.0.1", ports[name]))
                    wait_for(lambda: upstream.received > sent_before, what="the request")  # noqa: B023
                    got[name].append(drain(sock, 0.3))
            assert got["one"] == [Triple.replies(r)[:1] for r in requests]
            assert got["all"] == [Triple.replies(r) for r in requests]
            assert got["zero"] == [[] for _ in requests]
            received_bytes = sum(len(d) for replies in got.values() for r in replies for d in r)
            assert received_bytes < upstream.sent_bytes  # never more than was sent
            samples = metrics(admin)
            for name in ports:
                labels = {"virtual_server": name, "real_server": "echo"}
                out = sample(samples, "lbproxy_udp_datagrams_total", **labels, direction="out")
                assert out == sum(len(r) for r in got[name]), name
                counted = sample(samples, "lbproxy_bytes_total", **labels, direction="out")
                assert counted == sum(len(d) for r in got[name] for d in r), name

            def unrequested(name: str) -> float:
                return sample(
                    metrics(admin), "lbproxy_udp_dropped_total", virtual_server=name,
                    reason="unrequested",
                )  # fmt: skip

            assert unrequested("zero") == 3 * len(requests)  # every reply, none passed on
            assert unrequested("all") == 0
    finally:
        for sock in clients.values():
            sock.close()
        upstream.close()
