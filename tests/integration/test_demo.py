"""`lbproxy demo` as a real process: first line, the wlc and dwd splits, the control port,
the table, clean exits."""

from __future__ import annotations

import json
import random
import re
import signal
import socket
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest
import trio

from lbproxy.config.model import SnmpConfig
from lbproxy.control.snmp_client import SnmpClient
from tests.integration.demo_process import NAMES, OID, VALUES, Demo, dwd_line
from tests.integration.harness import ask_name, open_and_read_name, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


def assert_table(out: str) -> None:
    for name in NAMES:
        assert re.search(rf"^\[\s*\w+\] demo\s+{name}\s+127\.0\.0\.1:\d+\s+weight", out, re.M), out
        assert re.search(
            rf"^\[\s*\w+\] demo-dwd\s+{name}\s+127\.0\.0\.1:\d+\s+snmp \d+\s+dynamic \d+"
            r"\s+effective \d+",
            out,
            re.M,
        ), out
    assert out.rstrip().endswith("lbproxy demo: stopped"), out


def final_counts(out: str) -> dict[tuple[str, str], tuple[int, int]]:
    """(virtual server, real server) -> (active, total) from the `[final]` lines."""
    return {
        (m.group(1), m.group(2)): (int(m.group(3)), int(m.group(4)))
        for m in re.finditer(r"^\[final\] (\S+)\s+(\w+) .* active (\d+)\s+total (\d+)", out, re.M)
    }


def control(port: int, data: bytes) -> list[str]:
    """Send lines to the demo's control port the way `printf ... | nc` does (no
    half-close): the demo answers each line, then closes the connection by itself."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(1000):
            received += chunk
    return received.decode().splitlines()


def snmp_get(port: int) -> int | None:
    """What `snmpget -v2c -c public 127.0.0.1:PORT OID` reads."""
    client = SnmpClient(SnmpConfig(host="127.0.0.1", port=port, oid=OID, timeout=1.0))
    return trio.run(client.get).value


def test_held_connections_split_by_weight_and_the_demo_stops_by_itself():
    demo = Demo(duration=5)
    try:
        held = [open_and_read_name(demo.port) for _ in range(12)]
        try:
            names = Counter(name for _, name in held)
            # wlc with every connection still open: active/weight evens out at 2/4/6
            assert names == {"alpha": 2, "bravo": 4, "charlie": 6}
            sock, _ = held[0]
            sock.sendall(b"ping\n")
            assert sock.recv(100) == b"ping\n"  # then it echoes
        finally:
            for sock, _ in held:
                sock.close()
        code, out, err = demo.finish(timeout=15)
    finally:
        demo.stop()
    assert code == 0, err
    assert f"create_connection(('127.0.0.1', {demo.port}))" in out  # the client it suggests
    assert_table(out)
    # the last table has every connection counted and none still open
    final = final_counts(out)
    assert {name: final["demo", name] for name in NAMES} == {
        "alpha": (0, 2),
        "bravo": (0, 4),
        "charlie": (0, 6),
    }, out
    assert "Traceback" not in err


def test_dwd_weights_follow_the_values_the_agents_report():
    demo = Demo(duration=30)  # SIGINT stops it
    try:
        assert f"snmpget -v2c -c public 127.0.0.1:{demo.agents['bravo']} {OID}" in demo.output
        assert {name: snmp_get(port) for name, port in demo.agents.items()} == VALUES
        for name, value in VALUES.items():  # the first polls come within a second
            demo.wait_for(dwd_line(name, value))
        held = [open_and_read_name(demo.dwd_port) for _ in range(12)]
        try:
            # dwd is wlc on the reported values: 12 held at 30/20/10 -> 6/4/2
            assert Counter(name for _, name in held) == {"alpha": 6, "bravo": 4, "charlie": 2}
            mark = len(demo.lines)
            answers = control(demo.control_port, b"bogus 1\nalpha 0\n")
            assert answers[0].startswith("error: expected NAME VALUE"), answers
            assert answers[1:] == ["ok alpha 0"], answers
            assert snmp_get(demo.agents["alpha"]) == 0  # the agent answers the new value
            changed = time.monotonic()
            demo.wait_for(dwd_line("alpha", 0), start=mark, timeout=5)  # the next poll
            assert time.monotonic() - changed < 4.0  # a poll a second, a line a second
            # alpha at weight 0 gets nothing; bravo:charlie 20:10 with 4 and 2 held -> 2, 1
            more = [open_and_read_name(demo.dwd_port) for _ in range(3)]
            held += more
            assert Counter(name for _, name in more) == {"bravo": 2, "charlie": 1}
        finally:
            for sock, _ in held:
                sock.close()
        demo.proc.send_signal(signal.SIGINT)
        code, out, err = demo.finish(timeout=8)
    finally:
        demo.stop()
    assert code == 0, err
    assert "lbproxy demo: alpha now reports 0" in out
    assert_table(out)
    final = final_counts(out)
    assert {name: final["demo-dwd", name] for name in NAMES} == {
        "alpha": (0, 6),
        "bravo": (0, 6),
        "charlie": (0, 3),
    }, out
    assert re.search(r"^\[final\] demo-dwd\s+alpha\s.*\ssnmp 0\s+dynamic 0\s", out, re.M), out
    assert "Traceback" not in err


def test_sigint_stops_everything_with_exit_code_0():
    demo = Demo(duration=60)  # the signal, not the duration, stops it
    try:
        answers = [ask_name(demo.port) for _ in range(6)]
        assert set(answers) <= set(NAMES), answers
        held, name = open_and_read_name(demo.port)  # a connection still open at Ctrl-C
        assert name in NAMES
        try:
            demo.proc.send_signal(signal.SIGINT)
            code, out, err = demo.finish(timeout=8)
        finally:
            held.close()
    finally:
        demo.stop()
    assert code == 0, err
    assert_table(out)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def busy_port() -> socket.socket:
    """A listening socket on loopback whose port - 1 is free.

    Below the ephemeral range (Linux: from 32768), so that no outgoing connection of a
    test running alongside takes port - 1 between this check and the demo binding it.
    """
    for _ in range(100):
        port = random.randrange(20001, 32000)
        taken = socket.socket()
        try:
            taken.bind(("127.0.0.1", port))
            taken.listen()
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port - 1))
            return taken
        except OSError:
            taken.close()
    pytest.fail("no free pair of ports")


@pytest.mark.parametrize("busy", ["demo", "demo-dwd"])
def test_a_port_in_use_is_exit_code_1_naming_the_address(busy):
    # demo-dwd listens on PORT+1: with busy == "demo-dwd", that is the port in use
    with busy_port() as taken:
        port = taken.getsockname()[1]
        demo_port = port if busy == "demo" else port - 1
        result = run_cli("demo", "--port", str(demo_port), "--duration", "5", timeout=20)
    assert result.returncode == 1, result
    assert f"127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
    assert "connect to" not in result.stdout


def _http(
    method: str, url: str, body: dict | None = None, token: str | None = None
) -> tuple[int, str, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=5) as answer:
        return answer.status, answer.headers["Content-Type"], answer.read()


def test_the_printed_dashboard_serves_the_page_and_drains_a_server_while_connections_are_held():
    """The tour of docs/getting-started.md: hold connections, drain charlie from the
    dashboard's API, its connections stay, new ones go elsewhere."""
    demo = Demo(duration=20)
    held = []
    try:
        status, kind, page = _http("GET", demo.dashboard)
        assert status == 200 and kind.startswith("text/html")
        assert b"<title>" in page and b"lbproxy" in page
        held = [open_and_read_name(demo.port) for _ in range(12)]
        assert Counter(name for _, name in held) == {"alpha": 2, "bravo": 4, "charlie": 6}

        # The command the demo prints drains charlie through the admin socket (no token);
        # over TCP the dashboard's buttons need the token the demo prints.
        command = demo.search(r"^  (lbproxy drain demo charlie --admin http://\S+)$").split()
        drained = run_cli(*command[1:])
        assert drained.returncode == 0, drained.stderr
        assert "demo/charlie: state drain" in drained.stdout
        url = demo.dashboard + "api/v1/virtual-servers/demo/real-servers/charlie"
        with pytest.raises(urllib.error.HTTPError) as refused:
            _http("PATCH", url, {"state": "enabled"})
        assert refused.value.code == 401  # the dashboard's token dialog opens on this
        refused.value.close()  # its connection: else closed only when a cycle is collected
        token = demo.search(r"once for this demo's admin token: (\S+)\)")
        status, _, body = _http("PATCH", url, {"state": "drain"}, token)
        assert status == 200 and json.loads(body)["state"] == "drain"

        for sock, name in held:  # every held connection still answers, charlie's too
            sock.sendall(b"ping\n")
            assert sock.recv(64) == b"ping\n", name
        new = [ask_name(demo.port) for _ in range(6)]
        assert "charlie" not in new, new
        _, _, document = _http("GET", demo.dashboard + "api/v1/virtual-servers/demo")
        servers = {rs["name"]: rs for rs in json.loads(document)["real_servers"]}
        assert servers["charlie"]["state"] == "drain"
        assert servers["charlie"]["active_connections"] == 6
    finally:
        for sock, _ in held:
            sock.close()
        demo.stop()
