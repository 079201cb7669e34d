"""UDP sessions through a real `lbproxy` (SPEC §19): drain and disable, the stop waiting
for open sessions, the session table's caps, the throttle counting sessions."""

from __future__ import annotations

import signal
import time

import pytest

from tests.integration.harness import (
    Echo,
    free_port,
    metrics,
    run_cli,
    sample,
    udp_ask,
    udp_client,
    wait_for,
)


def echo_config(admin: int, port: int, servers: dict[str, Echo], extra: str = "") -> str:
    real = "".join(
        f"      - {{name: {name}, address: 127.0.0.1:{echo.port}}}\n"
        for name, echo in servers.items()
    )
    return (
        f"global:\n  admin: {{listen: 127.0.0.1:{admin}}}\n  access_log: true\n"
        "  drain_timeout: 1s\n"  # the stop waits for open sessions at most this long
        "virtual_servers:\n  - name: echo\n    protocol: udp\n"
        f"    listen: 127.0.0.1:{port}\n    scheduler: rr\n{extra}    real_servers:\n{real}"
    )


def dropped(admin: int, reason: str) -> float:
    return sample(metrics(admin), "lbproxy_udp_dropped_total", virtual_server="echo", reason=reason)


def test_drain_keeps_sessions_disable_moves_them(tmp_path, lbproxy):
    servers = {"a": Echo(b"a:"), "b": Echo(b"b:")}
    port, admin = free_port(), free_port()
    clients = [udp_client() for _ in range(4)]
    url = f"http://127.0.0.1:{admin}"
    try:
        with lbproxy(echo_config(admin, port, servers)):
            on_a = [c for c in clients[:2] if udp_ask(c, port, b"1").startswith(b"a:")]
            assert len(on_a) == 1  # rr: one of the first two on a
            (stays,) = on_a
            assert run_cli("drain", "--admin", url, "echo", "a").returncode == 0
            # The session on a goes on to its end; new sessions go to b only.
            assert [udp_ask(stays, port, b"%d" % i) for i in range(3)] == [b"a:0", b"a:1", b"a:2"]
            assert [udp_ask(c, port, b"new") for c in clients[2:]] == [b"b:new"] * 2
            assert run_cli("disable", "--admin", url, "echo", "a").returncode == 0
            # Disabled: its session is closed, the client's next datagram opens one on b.
            wait_for(lambda: "rs=a " in (tmp_path / "lbproxy.log").read_text(), what="end")
            assert udp_ask(stays, port, b"moved") == b"b:moved"
            assert "end=closed" in (tmp_path / "lbproxy.log").read_text()
    finally:
        for c in clients:
            c.close()
        for echo in servers.values():
            echo.close()


def test_stop_lets_open_sessions_finish_and_opens_no_new_one(lbproxy):
    servers = {"a": Echo(b"a:")}
    port, admin = free_port(), free_port()
    config = echo_config(admin, port, servers, "    udp: {idle_timeout: 1s}\n")
    config = config.replace("drain_timeout: 1s", "drain_timeout: 20s")
    old, new = udp_client(), udp_client(timeout=0.3)
    try:
        lb = lbproxy(config)
        assert udp_ask(old, port, b"before") == b"a:before"
        lb.signal(signal.SIGTERM)
        wait_for(lambda: "draining 1 connection" in lb.log(), what="the drain")
        stopped_at = time.monotonic()
        assert udp_ask(old, port, b"during") == b"a:during"  # its session still relays
        assert udp_ask(new, port, b"hello") is None  # a new client opens no session
        # The process ends when its last session does (idle 1 s), not at drain_timeout.
        assert lb.proc.wait(15) == 0
        assert time.monotonic() - stopped_at < 15
        assert "end=idle_timeout" in lb.log()
        lb.stop()
    finally:
        old.close()
        new.close()
        servers["a"].close()


def test_max_sessions_and_per_source_cap_drop_and_count(lbproxy):
    servers = {"a": Echo(b"a:")}
    port, admin = free_port(), free_port()
    extra = "    udp: {max_sessions: 3, max_sessions_per_source: 2}\n"
    first = [udp_client("127.0.0.1", 0.3) for _ in range(3)]
    second = [udp_client("127.0.0.2", 0.3) for _ in range(2)]
    try:
        with lbproxy(echo_config(admin, port, servers, extra)):
            answered = [udp_ask(c, port, b"x") for c in first]
            assert answered == [b"a:x", b"a:x", None]  # 127.0.0.1 holds its 2
            answered = [udp_ask(c, port, b"y") for c in second]
            assert answered == [b"a:y", None]  # the table holds its 3
            assert dropped(admin, "per_source") == 1
            assert dropped(admin, "max_sessions") == 1
            # The sessions in the table go on.
            assert [udp_ask(c, port, b"z") for c in first[:2]] == [b"a:z", b"a:z"]
    finally:
        for c in first + second:
            c.close()
        servers["a"].close()


@pytest.mark.serial  # ten sessions within one second: a loaded machine could spread them
def test_throttle_counts_new_sessions_per_second(lbproxy):
    servers = {"a": Echo(b"a:")}
    port, admin = free_port(), free_port()
    extra = "    throttle: {max_rate: 5}\n"
    clients = [udp_client(timeout=0.3) for _ in range(15)]
    try:
        with lbproxy(echo_config(admin, port, servers, extra)) as lb:
            answers = [udp_ask(c, port, b"q") for c in clients]
            # digg_factor 2: the arrival that finds 10 in the last second is refused,
            # and so is every one after it within that second.
            assert answers.count(None) >= 1 and answers[0] == b"a:q"
            refused = dropped(admin, "throttle")
            assert refused == answers.count(None)
            assert "echo: throttle high -> digg" in lb.log()
            samples = metrics(admin)
            labels = {"virtual_server": "echo", "real_server": "a"}
            assert sample(samples, "lbproxy_udp_sessions_total", **labels) == 15 - refused
    finally:
        for c in clients:
            c.close()
        servers["a"].close()
