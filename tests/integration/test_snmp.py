"""The SNMP poller end to end: real `lbproxy run` processes, real net-snmp agents.

Every real server has its own `snmpd` (tests/integration/snmpd.py) answering the weight
OID from a file; the tests change the file, kill agents, and watch where connections go.
Polls are fast here (interval 0.3-0.5 s, timeout 0.2-0.3 s) so the whole file stays
well under a minute.
"""

from __future__ import annotations

import json
import re
import socket
import statistics
import time
import types
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from tests.integration.harness import (
    ask_name,
    free_port,
    metrics,
    open_and_read_name,
    wait_for,
)
from tests.integration.snmpd import (
    V3_AUTH_KEY,
    V3_PRIV_KEY,
    V3_USER,
    V3_USER_STRONG,
    VALUE_OID,
    GarbagePeer,
    requires_snmpd,
    start_agents,
)

pytestmark = [pytest.mark.integration, requires_snmpd]

# Where a test measures shares, a poll lost on a busy machine must change nothing: hold
# keeps the last value (a server that never answered still gets weight 0 at once).
FAST = "interval: 0.4s, timeout: 0.5s, retries: 1, on_no_answer: hold, stale_after: 60s"


@pytest.fixture
def agents(tmp_path):
    """agents(*values) -> running SnmpAgents, stopped after the test."""
    started = []

    def make(*values, **options):
        made = start_agents(tmp_path / f"agents{len(started)}", values, **options)
        started.extend(made)
        return made

    yield make
    for agent in started:
        agent.stop()


def config(
    port: int,
    servers,
    agents,
    scheduler: str = "dwd",
    snmp: str = FAST,
    rs_snmp=None,
    extra: str = "",
    admin_port: int | None = None,
) -> str:
    """One virtual server whose real server i is polled on agents[i]'s port."""
    rs_snmp = rs_snmp or {}
    admin = f"127.0.0.1:{admin_port}" if admin_port else "none"
    lines = [
        "global:",
        f"  admin: {{listen: {admin}}}",
        "  drain_timeout: 2s",
        "virtual_servers:",
        "  - name: web",
        f"    listen: 127.0.0.1:{port}",
        f"    scheduler: {scheduler}",
        f"    snmp: {{oid: {VALUE_OID}, {snmp}}}",
        *(f"    {line}" for line in extra.strip().splitlines() if line.strip()),
        "    real_servers:",
    ]
    for server, agent in zip(servers, agents, strict=True):
        more = rs_snmp.get(server.name, "")
        lines.append(
            f"      - {{name: {server.name}, address: 127.0.0.1:{server.port}, "
            f"snmp: {{port: {agent.port}{', ' + more if more else ''}}}}}"
        )
    return "\n".join(lines) + "\n"


def wait_log(proxy, pattern: str, count: int = 1, timeout: float = 10.0) -> str:
    """Wait until `pattern` (a regular expression) matches `count` times in the log."""

    def matched() -> str | None:
        log = proxy.log()
        return log if len(re.findall(pattern, log)) >= count else None

    return wait_for(matched, timeout, f"{pattern!r} x{count} in the log", details=proxy.log)


def answers(name: str) -> str:
    return rf"web/{name} \(snmp [^)]*\) answers"


def names_of(port: int, n: int) -> Counter:
    return Counter(ask_name(port) for _ in range(n))


def close_all(held) -> None:
    for sock, _ in held:
        sock.close()


def test_adx_dynamic_weighted_direct_and_a_sixth_server_by_reload(
    tmp_path, name_servers, agents, lbproxy
):
    """Brocade ADX: weights 7, 8, 2, 2, 5 -> 7/24, 8/24, ...; a sixth of 10 -> 10/34."""
    servers = name_servers("s1", "s2", "s3", "s4", "s5", "s6")
    polled = agents(7, 8, 2, 2, 5, 10)
    port = free_port()
    proxy = lbproxy(config(port, servers[:5], polled[:5]), wait_ports=[port])
    wait_log(proxy, r"web/s\d \(snmp [^)]*\) answers", count=5)

    held = [open_and_read_name(port) for _ in range(240)]
    try:
        shares = Counter(name for _, name in held)
        for name, expected in {"s1": 70, "s2": 80, "s3": 20, "s4": 20, "s5": 50}.items():
            assert abs(shares[name] - expected) <= 3, shares

        proxy.reload(config(port, servers, polled))
        wait_log(proxy, answers("s6"))
        more = [open_and_read_name(port) for _ in range(100)]
        held += more
        after = Counter(name for _, name in more)
        # 10/34 of 340 held connections is 100: s6 takes (about) all of the next 100
        assert after["s6"] >= 95, after
    finally:
        close_all(held)


def test_silent_agent_gets_weight_zero_then_all_silent_falls_back_to_static(
    name_servers, agents, lbproxy
):
    servers = name_servers("a", "b", "c")
    polled = agents(5, 5, 5)
    port = free_port()
    proxy = lbproxy(
        config(port, servers, polled, snmp="interval: 0.3s, timeout: 0.25s, retries: 1"),
        wait_ports=[port],
    )
    wait_log(proxy, r"web/\w \(snmp [^)]*\) answers", count=3)
    assert set(names_of(port, 9)) == {"a", "b", "c"}

    polled[0].stop()  # a's agent dies: after timeout x (1 + retries) its weight is 0
    log = wait_log(proxy, r"web/a \(snmp [^)]*\): no usable answer")
    assert "on_no_answer zero: dynamic weight 0" in log
    assert "a" not in names_of(port, 20)

    polled[1].stop()
    polled[2].stop()
    log = wait_log(proxy, "every dynamic weight is 0; using static weights")
    assert set(names_of(port, 12)) == {"a", "b", "c"}  # static weights 1:1:1

    polled[1].start()  # b answers again: dynamic weights are back, only b has one
    wait_log(proxy, "dynamic weights in use again", count=2)  # (1: at start-up)
    assert set(names_of(port, 6)) == {"b"}


def test_hold_and_static_policies(name_servers, agents, lbproxy):
    """zero: 0 at once; hold: the last value for stale_after, then 0; static: weight."""
    servers = name_servers("zero", "hold", "static")
    polled = agents(4, 4, 4)
    port = free_port()
    proxy = lbproxy(
        config(
            port,
            servers,
            polled,
            snmp="interval: 0.3s, timeout: 0.25s, retries: 1",
            rs_snmp={
                "zero": "on_no_answer: zero",
                "hold": "on_no_answer: hold, stale_after: 2s",
                "static": "on_no_answer: static",
            },
        ),
        wait_ports=[port],
    )
    wait_log(proxy, r"answers", count=3)
    for agent in polled:
        agent.stop()
    log = wait_log(proxy, r"web/static \(snmp [^)]*\): no usable answer")
    log = wait_log(proxy, r"web/hold \(snmp [^)]*\): no usable answer")
    assert re.search(r"web/hold .*holding weight 4 for up to 2s", log)
    assert re.search(r"web/static .*on_no_answer static: dynamic weight 1", log)
    wait_log(proxy, r"web/zero \(snmp [^)]*\): no usable answer")
    held = [open_and_read_name(port) for _ in range(10)]
    close_all(held)
    assert Counter(name for _, name in held) == {"hold": 8, "static": 2}  # weights 4 : 1

    wait_log(proxy, r"web/hold \(snmp [^)]*\): held value is older than stale_after")
    assert set(names_of(port, 6)) == {"static"}


def test_dwr_twenty_and_sixty_of_a_hundred_is_two_to_one(name_servers, agents, lbproxy):
    servers = name_servers("a", "b")
    polled = agents(20, 60)
    port = free_port()
    proxy = lbproxy(
        config(port, servers, polled, scheduler="dwr", snmp=f"{FAST}, max_value: 100"),
        wait_ports=[port],
    )
    wait_log(proxy, "answers", count=2)
    held = [open_and_read_name(port) for _ in range(30)]
    try:
        assert Counter(name for _, name in held) == {"a": 20, "b": 10}  # weights 80 : 40
    finally:
        close_all(held)


def test_string_answers_and_garbage_are_bad_values_not_crashes(name_servers, agents, lbproxy):
    servers = name_servers("good", "string", "garbage")
    good, string = agents(5, 5)
    string.set_string("busy")
    garbage = GarbagePeer()
    port, admin = free_port(), free_port()
    try:
        proxy = lbproxy(
            config(port, servers, [good, string, garbage], admin_port=admin),
            wait_ports=[port],
        )
        wait_log(proxy, answers("good"))
        log = wait_log(proxy, r"web/string \(snmp [^)]*\): no usable answer \(bad_value")
        assert "not an integer: OctetString 'busy'" in log
        log = wait_log(proxy, r"web/garbage \(snmp [^)]*\): no usable answer \(bad_value")
        assert "undecodable" in log
        assert garbage.received >= 2  # retransmitted: garbage is ignored, not an answer
        assert set(names_of(port, 8)) == {"good"}
        # The API's document has each server's last poll (the dashboard's SNMP column).
        document = json.loads(
            urllib.request.urlopen(f"http://127.0.0.1:{admin}/api/v1/virtual-servers").read()
        )
        last = {rs["name"]: rs["snmp"] for rs in document["virtual_servers"][0]["real_servers"]}
        assert last == {
            "good": {"value": 5, "result": "ok"},
            "string": {"value": None, "result": "bad_value"},
            "garbage": {"value": None, "result": "bad_value"},
        }

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5)
        text = metrics.read().decode()
        for name in ("string", "garbage"):
            line = re.search(
                rf'lbproxy_snmp_polls_total\{{[^}}]*real_server="{name}"[^}}]*'
                rf'result="bad_value"[^}}]*\}} (\S+)',
                text,
            )
            assert line and float(line.group(1)) >= 1, text
        assert "lbproxy_snmp_poll_duration_seconds_bucket" in text

        string.set_value(3)  # the agent mends: its server is back
        wait_log(proxy, answers("string"))
        assert "string" in names_of(port, 12)
        assert proxy.proc.poll() is None
    finally:
        garbage.stop()


def test_snmpv3_auth_priv_and_a_wrong_key(tmp_path, name_servers, agents, lbproxy):
    servers = name_servers("right", "strong", "wrong")
    polled = agents(5, 5, 5)
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "auth").write_text(V3_AUTH_KEY + "\n")
    (keys / "priv").write_text(V3_PRIV_KEY + "\n")
    (keys / "wrong").write_text("not-the-auth-key\n")
    for key in keys.iterdir():  # secret files: no one else may read them
        key.chmod(0o600)
    v3 = (
        f"{FAST}, version: 3, user: {V3_USER}, auth_protocol: SHA, "
        f"auth_key_file: {keys / 'auth'}, priv_protocol: AES, priv_key_file: {keys / 'priv'}"
    )
    port = free_port()
    proxy = lbproxy(
        config(
            port,
            servers,
            polled,
            snmp=v3,
            rs_snmp={
                "strong": f"user: {V3_USER_STRONG}, auth_protocol: SHA256, priv_protocol: AES256",
                "wrong": f"auth_key_file: {keys / 'wrong'}",
            },
        ),
        wait_ports=[port],
    )
    wait_log(proxy, answers("right"))
    wait_log(proxy, answers("strong"))
    log = wait_log(proxy, r"web/wrong \(snmp [^)]*\): no usable answer")
    assert re.search(
        r"ERROR lbproxy.snmp: web/wrong .*SNMPv3: authentication failed \(wrong digest\): "
        r"check auth_key_file",
        log,
    ), log
    assert set(names_of(port, 6)) == {"right", "strong"}


def test_least_load_with_snmp_load(name_servers, agents, lbproxy):
    """Geode: load = reported / max_value + 1/max_value per connection since the report."""
    servers = name_servers("a", "b")
    polled = agents(50, 10)
    port, admin = free_port(), free_port()
    proxy = lbproxy(
        config(
            port,
            servers,
            polled,
            scheduler="least-load",
            snmp="interval: 0.3s, timeout: 0.1s, retries: 0, max_value: 100, "
            "on_no_answer: hold, stale_after: 60s",
            extra="load_source: snmp",
            admin_port=admin,
        ),
        wait_ports=[port],
    )
    wait_log(proxy, "answers", count=2)
    for agent in polled:  # no new reports from now on (hold keeps the last ones)
        agent.stop()
    wait_log(proxy, "holding", count=2)
    held = [open_and_read_name(port) for _ in range(41)]
    try:
        # b: 0.1 + 40 x 0.01 = 0.5 reaches a's 0.5 after 40 connections
        assert Counter(name for _, name in held) == {"b": 40, "a": 1}
        document = json.loads(
            urllib.request.urlopen(f"http://127.0.0.1:{admin}/api/v1/virtual-servers").read()
        )
        loads = {rs["name"]: rs["load"] for rs in document["virtual_servers"][0]["real_servers"]}
        assert loads == {"a": 0.51, "b": 0.5}  # as the API and the dashboard show it
    finally:
        close_all(held)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / __import__("os").sysconf("SC_CLK_TCK")


def _latencies(port: int, n: int) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.recv(100)  # the real server's name line
        out.append(time.perf_counter() - started)
    return out


def _polls(admin: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5).read()
    return sum(
        float(value)
        for value in re.findall(rb"^lbproxy_snmp_polls_total\{[^}]*\} (\S+)", text, re.M)
    )


def test_polling_two_hundred_servers_does_not_disturb_latency(
    tmp_path, name_servers, agents, lbproxy, capsys
):
    """Measure (not assert tightly) short-connection latency with and without 200 polls/s."""
    (web,) = name_servers("web")
    polled = agents(5, 6, 7)
    silent = [free_port() for _ in range(2)]  # nothing listens: ICMP port unreachable
    port, port2, admin = free_port(), free_port(), free_port()
    base = "\n".join(
        [
            "global:",
            f"  admin: {{listen: 127.0.0.1:{admin}}}",
            "  drain_timeout: 2s",
            "virtual_servers:",
            "  - name: web",
            f"    listen: 127.0.0.1:{port}",
            "    scheduler: rr",
            "    real_servers:",
            f"      - {{name: web, address: 127.0.0.1:{web.port}}}",
            "",
        ]
    )
    proxy = lbproxy(base, wait_ports=[port])
    _latencies(port, 50)  # warm up
    without = _latencies(port, 400)

    agent_ports = [agent.port for agent in polled]
    rs_lines = []
    for i in range(200):
        snmp_port = agent_ports[i % 3] if i < 150 else silent[i % 2]
        rs_lines.append(
            f"      - {{name: r{i}, address: 127.0.0.1:{web.port}, snmp: {{port: {snmp_port}}}}}"
        )
    polled_vs = "\n".join(
        [
            "  - name: polled",
            f"    listen: 127.0.0.1:{port2}",
            "    scheduler: dwd",
            f"    snmp: {{oid: {VALUE_OID}, interval: 1s, timeout: 0.2s, retries: 1}}",
            "    real_servers:",
            *rs_lines,
            "",
        ]
    )
    proxy.reload(base + polled_vs)

    def every_server_polled() -> bool:  # each poller starts at a random offset within 1 s
        polled = {
            dict(labels).get("real_server")
            for (name, labels), value in metrics(admin).items()
            if name == "lbproxy_snmp_polls_total" and value
        }
        return polled >= {f"r{i}" for i in range(200)}

    wait_for(every_server_polled, 10, "a poll of each of the 200 servers", interval=0.1)

    # CPU per poll: a quiet window (no connections) with 200 polls/s
    polls0, cpu0, t0 = _polls(admin), _cpu_seconds(proxy.proc.pid), time.monotonic()
    time.sleep(3.0)  # on purpose: the window measured
    polls1, cpu1, t1 = _polls(admin), _cpu_seconds(proxy.proc.pid), time.monotonic()
    with_polls = _latencies(port, 400)

    def pct(xs, q):
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1000

    polls_per_s = (polls1 - polls0) / (t1 - t0)
    cpu_share = (cpu1 - cpu0) / (t1 - t0)
    report = (
        "\nSNMP poll cost (lbproxy process, 150 servers on 3 snmpd + 50 on silent ports):\n"
        f"  {polls_per_s:.0f} polls/s use {cpu_share * 100:.1f}% of one CPU: "
        f"{cpu_share / max(polls_per_s, 1) * 1000:.2f} ms CPU per poll (including the "
        "/metrics scrapes)\n"
        "Latency of short connections through the proxy (connect + first byte, ms):\n"
        f"  without pollers: p50 {pct(without, 0.5):.2f}  p99 {pct(without, 0.99):.2f}  "
        f"mean {statistics.mean(without) * 1000:.2f}\n"
        f"  with 200 polled: p50 {pct(with_polls, 0.5):.2f}  p99 {pct(with_polls, 0.99):.2f}  "
        f"mean {statistics.mean(with_polls) * 1000:.2f}\n"
    )
    with capsys.disabled():
        print(report)
    assert 150 <= polls_per_s <= 260, report  # every poller polls about once a second
    assert pct(with_polls, 0.5) < 50, report  # loose: the proxy keeps serving promptly


def test_an_agent_port_with_nothing_behind_it_is_an_error_not_a_crash(name_servers, lbproxy):
    (a,) = name_servers("a")
    port = free_port()
    nobody = types.SimpleNamespace(port=free_port())  # TCP-free is near enough UDP-free
    proxy = lbproxy(
        config(port, [a], [nobody], snmp="interval: 0.3s, timeout: 0.1s, retries: 1"),
        wait_ports=[port],
    )
    log = wait_log(proxy, r"web/a \(snmp [^)]*\): no usable answer \(error: port unreachable")
    assert "web is on static weights (every dynamic weight is 0)" in log
    assert ask_name(port) == "a"  # the static fallback still serves
