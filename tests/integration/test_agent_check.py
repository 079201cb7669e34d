"""The agent check (SPEC §22, HAProxy's agent-check) through a real `lbproxy run`, real
agents on loopback (a thread server answering the line the test chooses, changed
between checks) and real traffic through the proxy.

What a user checks: the share of new connections follows the agent's weight percent;
`drain`/`maint` stop new connections while established ones continue; `down` takes
health down until `up` and the health check bring it back; an agent that talks nonsense,
sends a line over 512 bytes, `9999%`, closes early or says nothing changes nothing and
is counted; the API shows the agent's state beside the operator's.
"""

from __future__ import annotations

import csv
import io
import json
import re

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from lbproxy.config.model import Address, AgentCheckConfig
from lbproxy.control.agent_checks import ask_agent
from lbproxy.wire.agent import LINE_LIMIT, BadAnswer, line_of, parse
from tests.integration.agents import SILENT, Agent
from tests.integration.harness import (
    ask_name,
    counted,
    free_port,
    http,
    open_and_read_name,
    read_name,
    ready,
    run_cli,
    run_in_terminal,
    servers_of,
    vs_config,
    wait_for,
    with_admin,
    worker_servers,
    workers_config,
)


def _agent_config(port, servers, agents, admin_port, scheduler="wrr", extra="", weights=None):
    """`web` on `port` with every real server's agent on its own port."""
    rs_extra = {}
    for server, agent in zip(servers, agents, strict=True):
        weight = f"weight: {weights[server.name]}, " if weights else ""
        rs_extra[server.name] = f"{weight}agent_check: {{port: {agent.port}}}"
    extra = "agent_check: {interval: 100ms, timeout: 1s}\n" + extra
    return with_admin(vs_config(port, servers, scheduler, extra, rs_extra), admin_port)


def _shares(port: int, count: int) -> dict[str, int]:
    shares: dict[str, int] = {}
    for _ in range(count):
        name = ask_name(port)
        shares[name] = shares.get(name, 0) + 1
    return shares


def _agent_of(admin_port: int, name: str) -> dict | None:
    return servers_of(admin_port)[name]["agent"]


def _wait_agent(admin_port: int, name: str, **expected) -> dict:
    """Until the API's agent object of `name` has the `expected` values."""

    def matches():
        agent = _agent_of(admin_port, name)
        if agent is not None and all(agent[key] == value for key, value in expected.items()):
            return agent
        return None

    return wait_for(matches, timeout=10, what=f"agent of {name} to show {expected}")


def _wait_asked(agent: Agent, more: int) -> None:
    """Until lbproxy has asked `agent` `more` more times (each a whole exchange)."""
    target = agent.asked + more
    wait_for(lambda: agent.asked >= target, timeout=10, what=f"{more} more agent checks")


def test_share_of_connections_follows_the_agent_weight(name_servers, lbproxy):
    """wrr, static weights 4 and 4: the agents say 100% and 50%, so the effective weights
    are 4 and 2 and 60 connections split 40/20 (within one, the rotation's phase);
    then `0%` on b sends everything to a. The operator's static weight is untouched."""
    a, b = name_servers("a", "b")
    agents = [Agent(b"100%\n"), Agent(b"50%\n")]
    port, admin_port = free_port(), free_port()
    try:
        config = _agent_config(port, [a, b], agents, admin_port, weights={"a": 4, "b": 4})
        proxy = lbproxy(config, wait_ports=[port])
        _wait_agent(admin_port, "b", weight_percent=50, state="ready")
        servers = servers_of(admin_port)
        assert servers["b"]["weight"] == {"static": 4, "dynamic": None, "effective": 2}
        assert servers["b"]["state"] == "enabled"  # the operator's state
        assert servers["a"]["weight"]["effective"] == 4
        shares = _shares(port, 60)
        assert abs(shares.get("a", 0) - 40) <= 1 and abs(shares.get("b", 0) - 20) <= 1, shares

        agents[1].say(b"0%\n")
        _wait_agent(admin_port, "b", weight_percent=0)
        assert _shares(port, 20) == {"a": 20}
        assert servers_of(admin_port)["b"]["weight"]["static"] == 4

        agents[1].say(b"200%\n")  # above 100%: more than the static weight
        _wait_agent(admin_port, "b", weight_percent=200)
        assert servers_of(admin_port)["b"]["weight"]["effective"] == 8
        assert counted(admin_port, "lbproxy_agent_checks_total", real_server="b", result="ok") > 0
        assert "Traceback" not in proxy.log()
    finally:
        for agent in agents:
            agent.stop()


def test_drain_and_maint_stop_new_connections_not_established_ones(name_servers, lbproxy):
    """The agent of b says drain: new connections go to a only, while a connection
    already on b keeps working; maint the same; ready brings b back. The API shows the
    agent's state beside the operator's, which stays `enabled`."""
    a, b = name_servers("a", "b")
    agents = [Agent(b"ready\n"), Agent(b"ready\n")]
    port, admin_port = free_port(), free_port()
    try:
        lbproxy(_agent_config(port, [a, b], agents, admin_port, scheduler="rr"), wait_ports=[port])
        _wait_agent(admin_port, "b", state="ready")
        held = None
        for _ in range(4):  # rr: one of the first two connections is b's
            sock, name = open_and_read_name(port)
            if name == "b" and held is None:
                held = sock
            else:
                sock.close()
        assert held is not None
        try:
            for word in (b"drain # deploy", b"MAINT,#upgrade\r\n"):
                agents[1].say(word)
                state = word.split(b"#")[0].strip(b" ,").decode().lower()
                agent = _wait_agent(admin_port, "b", state=state)
                assert agent["reason"] in ("deploy", "upgrade")
                servers = servers_of(admin_port)
                assert servers["b"]["state"] == "enabled" and servers["b"]["health"] == "up"
                assert servers["b"]["weight"]["effective"] == 0
                assert _shares(port, 6) == {"a": 6}
                held.sendall(b"still here\n")  # the established connection continues
                assert read_name(held) == "still here"
            agents[1].say(b"ready\n")
            _wait_agent(admin_port, "b", state="ready")
            assert _shares(port, 6) == {"a": 3, "b": 3}
        finally:
            held.close()
    finally:
        for agent in agents:
            agent.stop()


def test_down_holds_health_down_until_up_and_the_checks_pass(name_servers, lbproxy):
    """`down # reason` takes b's health down although its health check passes; passing
    checks do not bring it back while the agent holds it; after `up`, the health check
    (rise) does."""
    a, b = name_servers("a", "b")
    agents = [Agent(b"up\n"), Agent(b"up\n")]
    port, admin_port = free_port(), free_port()
    extra = "health_check: {type: tcp, interval: 100ms, rise: 2, fall: 2}"
    try:
        config = _agent_config(port, [a, b], agents, admin_port, scheduler="rr", extra=extra)
        proxy = lbproxy(config, wait_ports=[port])
        _wait_agent(admin_port, "b", state="ready")
        agents[1].say(b"stopped # disk full\n")
        agent = _wait_agent(admin_port, "b", state="down")
        assert agent["reason"] == "disk full"
        assert servers_of(admin_port)["b"]["health"] == "down"
        assert counted(admin_port, "lbproxy_real_server_up", real_server="b") == 0
        # More passing health checks than `rise`: b stays down while the agent says so.
        checks = counted(admin_port, "lbproxy_health_checks_total", real_server="b", result="ok")
        wait_for(
            lambda: (
                counted(admin_port, "lbproxy_health_checks_total", real_server="b", result="ok")
                >= checks + 4
            ),
            what="4 more passing health checks of b",
        )
        assert servers_of(admin_port)["b"]["health"] == "down"
        assert _shares(port, 4) == {"a": 4}

        agents[1].say(b"up\n")
        wait_for(lambda: servers_of(admin_port)["b"]["health"] == "up", what="b up again")
        assert _agent_of(admin_port, "b")["state"] == "ready"
        assert _shares(port, 4) == {"a": 2, "b": 2}
        assert "web/b is down (agent: disk full)" in proxy.log()
    finally:
        for agent in agents:
            agent.stop()


def test_down_and_up_with_passive_health_only(name_servers, lbproxy):
    """With `health_check.type: none` the agent's `up` brings health back at once."""
    a, b = name_servers("a", "b")
    agents = [Agent(b"up\n"), Agent(b"fail\n")]
    port, admin_port = free_port(), free_port()
    extra = "health_check: {type: none}"
    try:
        config = _agent_config(port, [a, b], agents, admin_port, scheduler="rr", extra=extra)
        lbproxy(config, wait_ports=[port])
        _wait_agent(admin_port, "b", state="down")
        assert servers_of(admin_port)["b"]["health"] == "down"
        assert _shares(port, 4) == {"a": 4}
        agents[1].say(b"up\n")
        wait_for(lambda: servers_of(admin_port)["b"]["health"] == "up", what="b up")
        assert _shares(port, 4) == {"a": 2, "b": 2}
    finally:
        for agent in agents:
            agent.stop()


def test_bad_answers_change_nothing_and_are_counted(name_servers, lbproxy):
    """After a good `50% maxconn:7`, every bad exchange leaves the agent's state, the
    effective weight and the traffic as they were, and is counted by result."""
    a, b = name_servers("a", "b")
    agents = [Agent(b"100%\n"), Agent(b"50% maxconn:7\n", expect_send=True)]
    port, admin_port = free_port(), free_port()
    try:
        config = _agent_config(port, [a, b], agents, admin_port, weights={"a": 2, "b": 2})
        config = config.replace(
            "agent_check: {interval: 100ms, timeout: 1s}",
            'agent_check: {interval: 100ms, timeout: 300ms, send: "state\\n"}',
        )
        proxy = lbproxy(config, wait_ports=[port])
        before = _wait_agent(admin_port, "b", weight_percent=50, max_connections=7)
        assert agents[1].received[0] == b"state\n"
        cases = [
            (b"9999%\n", "bad_answer"),
            (b"ready, bananas\n", "bad_answer"),
            (b"x" * 513 + b"\n", "bad_answer"),
            (b"y" * 100_000, "bad_answer"),  # no LF at all: read no further than 514
            (b"\x00\xff\xfe garbage\n", "bad_answer"),
            (b"", "fail"),  # closed without a line
            (SILENT, "timeout"),
        ]
        for answer, result in cases:
            labels = {"real_server": "b", "result": result}
            seen = counted(admin_port, "lbproxy_agent_checks_total", **labels)
            agents[1].say(answer)
            wait_for(
                lambda labels=labels, seen=seen: (
                    counted(admin_port, "lbproxy_agent_checks_total", **labels) >= seen + 2
                ),
                what=f"{answer!r:.30} counted {result}",
            )
            rs = servers_of(admin_port)["b"]
            assert {k: rs["agent"][k] for k in ("state", "weight_percent", "max_connections")} == {
                k: before[k] for k in ("state", "weight_percent", "max_connections")
            }, answer
            assert rs["agent"]["at"] == before["at"]  # no good answer since
            assert rs["weight"]["effective"] == 1 and rs["health"] == "up"
        shares = _shares(port, 30)
        assert abs(shares.get("a", 0) - 20) <= 1 and abs(shares.get("b", 0) - 10) <= 1, shares
        assert "Traceback" not in proxy.log()
    finally:
        for agent in agents:
            agent.stop()


def test_a_change_of_failure_kind_is_logged_once_at_info(name_servers, lbproxy):
    """A run of failed exchanges is logged once; when the kind of failure changes (the
    agent that closed at once now talks nonsense, then says nothing) that is news, logged
    once again, and the checks in between are not."""
    a, b = name_servers("a", "b")
    agents = [Agent(b"ready\n"), Agent(b"ready\n")]
    port, admin_port = free_port(), free_port()
    try:
        config = _agent_config(port, [a, b], agents, admin_port)
        config = config.replace("timeout: 1s}", "timeout: 300ms}")
        proxy = lbproxy(config, wait_ports=[port])
        _wait_agent(admin_port, "b", state="ready")
        runs = [(b"", "fail"), (b"9999%\n", "bad_answer"), (SILENT, "timeout"), (b"", "fail")]
        for answer, result in runs:
            labels = {"real_server": "b", "result": result}
            seen = counted(admin_port, "lbproxy_agent_checks_total", **labels)
            agents[1].say(answer)
            wait_for(
                lambda labels=labels, seen=seen: (
                    counted(admin_port, "lbproxy_agent_checks_total", **labels) >= seen + 3
                ),
                what=f"3 more {result} checks",
            )
        logged = [line for line in proxy.log().splitlines() if line.endswith("; no change")]
        logged = [line for line in logged if "web/b: agent " in line]
        kinds = [line.split("web/b: agent ", 1)[1].split()[0] for line in logged]
        assert kinds == ["fail", "bad_answer", "timeout", "fail"], logged
        assert all(" INFO " in line for line in logged), logged
    finally:
        for agent in agents:
            agent.stop()


def test_agent_max_connections_limits_the_server(name_servers, lbproxy):
    """`maxconn:1`: b takes one connection at a time, as with max_connections: 1."""
    a, b = name_servers("a", "b")
    agents = [Agent(b"ready\n"), Agent(b"maxconn:1\n")]
    port, admin_port = free_port(), free_port()
    try:
        lbproxy(_agent_config(port, [a, b], agents, admin_port, scheduler="rr"), wait_ports=[port])
        _wait_agent(admin_port, "b", max_connections=1)
        held = [open_and_read_name(port) for _ in range(4)]
        try:
            names = sorted(name for _, name in held)
            assert names == ["a", "a", "a", "b"]
        finally:
            for sock, _ in held:
                sock.close()
    finally:
        for agent in agents:
            agent.stop()


def test_lbproxy_check_describes_the_agent(tmp_path):
    path = tmp_path / "db.yaml"
    path.write_text(
        "virtual_servers:\n"
        "  - name: db\n"
        "    listen: 127.0.0.1:5432\n"
        '    agent_check: {port: 9777, interval: 5s, timeout: 500ms, send: "state\\n"}\n'
        "    real_servers:\n"
        "      - {name: a, address: 10.0.0.1:5432}\n"
        "      - {name: b, address: 10.0.0.2:5432, agent_check: {port: 9778, address: 10.0.9.2}}\n"
    )
    result = run_cli("check", str(path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    expected = (
        '  agent       on port 9777 of each real server every 5s (timeout 0.5s), sends "state\\n"'
    )
    assert expected in lines
    assert any(line.split()[0] == "b" and line.endswith("agent 10.0.9.2:9778") for line in lines)

    path.write_text(path.read_text().replace("port: 9777", "port: 0"))
    result = run_cli("check", str(path))
    assert result.returncode == 2
    assert f"{path}:4: agent_check.port must be an integer from 1 to 65535, got 0" in result.stderr


def test_simulate_replays_agent_answers(tmp_path):
    """`lbproxy simulate` with `agent` events: wrr 4/4, s2's agent says 50% (2 of every
    6 connections), then drain (none), then ready (back to 50%); a bad answer in the
    events file is an error naming its line."""
    config = tmp_path / "wrr.yaml"
    config.write_text(
        "virtual_servers:\n"
        "  - name: web\n"
        "    listen: 127.0.0.1:8080\n"
        "    scheduler: wrr\n"
        "    real_servers:\n"
        "      - {name: s1, address: 127.0.0.1:9001, weight: 4}\n"
        "      - {name: s2, address: 127.0.0.1:9002, weight: 4}\n"
    )
    events = tmp_path / "agent.yaml"
    events.write_text(
        '- {before: 1, agent: {s2: "50%"}}\n'
        '- {before: 13, agent: {s2: "drain # deploy"}}\n'
        '- {before: 19, agent: {s2: "READY"}}\n'
    )
    result = run_cli("simulate", str(config), "-n", "30", "--events", str(events), "--json")
    assert result.returncode == 0, result.stderr
    sequence = json.loads(result.stdout)["sequence"]
    assert sequence[:12] == ["s1", "s2", "s1"] * 4
    assert sequence[12:18] == ["s1"] * 6
    assert sequence[18:].count("s2") == 4 and sequence[18:].count("s1") == 8

    events.write_text('- {before: 1, agent: {s2: "9999%"}}\n- {before: 2, agent: {s2: 50}}\n')
    result = run_cli("simulate", str(config), "-n", "3", "--events", str(events))
    assert result.returncode == 2
    assert f"{events}:1: agent of s2: '9999%' is a bad answer (weight 9999% above 256%)" in (
        result.stderr
    )
    assert f"{events}:2: agent of s2 must be the agent's line as a string" in result.stderr


def test_a_reload_keeps_or_forgets_what_the_agent_said(name_servers, lbproxy, tmp_path):
    """A reload that keeps the agent_check keeps the agent's state; one that removes it
    forgets it (agent null, the configured weight and max_connections again); a bad
    agent_check in the new file is refused and the running one stays."""
    a, b = name_servers("a", "b")
    agents = [Agent(b"ready\n"), Agent(b"25% maxconn:3 drain\n")]
    port, admin_port = free_port(), free_port()
    try:
        config = _agent_config(port, [a, b], agents, admin_port, weights={"a": 4, "b": 4})
        proxy = lbproxy(config, wait_ports=[port])
        _wait_agent(admin_port, "b", state="drain", weight_percent=25)

        proxy.reload(config.replace("agent_check: {interval", "agent_check: {intervall"))
        assert "unknown key 'intervall' in agent_check of virtual server web" in proxy.log()
        assert _agent_of(admin_port, "b")["state"] == "drain"

        proxy.reload(config.replace("weight: 4, agent_check", "weight: 8, agent_check", 1))
        assert _agent_of(admin_port, "b")["state"] == "drain"
        assert servers_of(admin_port)["b"]["weight"]["effective"] == 0

        without = config.replace("    agent_check: {interval: 100ms, timeout: 1s}\n", "")
        for agent in agents:
            without = without.replace(f", agent_check: {{port: {agent.port}}}", "")
        proxy.reload(without)
        assert "agent_check" not in without
        wait_for(lambda: _agent_of(admin_port, "b") is None, what="the agent forgotten")
        assert servers_of(admin_port)["b"]["weight"]["effective"] == 4
        asked = agents[1].asked
        assert _shares(port, 4) == {"a": 2, "b": 2}
        assert agents[1].asked <= asked + 1  # no more checks (one may have been under way)
    finally:
        for agent in agents:
            agent.stop()


def test_workers_each_ask_the_agent_and_the_supervisor_adds_up(name_servers, lbproxy):
    """`workers: 2`: both workers follow the agent (no connection goes to the drained
    server through either), the supervisor's document shows the agent object and its
    /metrics adds up both workers' agent checks."""
    servers = name_servers("a", "b")
    agents = [Agent(b"ready\n"), Agent(b"drain # deploy\n")]
    port, admin_port = free_port(), free_port()
    try:
        config = workers_config(port, servers, admin_port)
        config = config.replace(
            "health_check: {type: none}",
            "health_check: {type: none}\n    agent_check: {interval: 100ms, timeout: 1s}",
        )
        for server, agent in zip(servers, agents, strict=True):
            config = config.replace(
                f"address: 127.0.0.1:{server.port}}}",
                f"address: 127.0.0.1:{server.port}, agent_check: {{port: {agent.port}}}}}",
            )
        lbproxy(config)
        wait_for(lambda: ready(admin_port), what="/readyz")
        for index in (1, 2):
            wait_for(
                lambda index=index: (
                    (worker_servers(admin_port, index)["b"]["agent"] or {}).get("state") == "drain"
                ),
                what=f"worker {index} to hear the agent",
            )
        assert _agent_of(admin_port, "b")["reason"] == "deploy"
        assert _shares(port, 20) == {"a": 20}
        per_worker = [
            worker_servers(admin_port, index)["b"]["agent"]["at"] is not None for index in (1, 2)
        ]
        assert per_worker == [True, True]
        wait_for(
            lambda: (
                counted(admin_port, "lbproxy_agent_checks_total", real_server="b", result="ok") >= 4
            ),
            what="agent checks counted",
        )
    finally:
        for agent in agents:
            agent.stop()


def test_lbproxy_status_shows_the_agent_beside_the_state(name_servers, lbproxy):
    """On a terminal, `lbproxy status` shows what the agent says beside the operator's
    state: `enabled (agent drain 50%: deploy)`; a server whose agent says ready at 100%
    shows its state alone."""
    a, b = name_servers("a", "b")
    agents = [Agent(b"ready 100%\n"), Agent(b"50% drain # deploy\n")]
    port, admin_port = free_port(), free_port()
    try:
        lbproxy(_agent_config(port, [a, b], agents, admin_port), wait_ports=[port])
        _wait_agent(admin_port, "b", state="drain")
        _wait_agent(admin_port, "a", state="ready")
        admin = f"http://127.0.0.1:{admin_port}"
        wide = run_in_terminal(200, "status", "--admin", admin).splitlines()
        (line_b,) = [line for line in wide if "│ b " in line]
        assert "enabled (agent drain 50%: deploy)" in line_b
        (line_a,) = [line for line in wide if "│ a " in line]
        assert "agent" not in line_a
        narrow = run_in_terminal(40, "status", "--admin", admin)
        assert "(agent drain 50%: deploy)" in narrow.replace("\n    ", " ")
        # Piped: the agent's last answer in two one-word columns, on every server's line.
        piped = run_cli("status", "--admin", admin)
        assert piped.returncode == 0, piped.stderr
        header, *lines = (line.split() for line in piped.stdout.splitlines())
        at = header.index("AGENT")
        assert header[at : at + 2] == ["AGENT", "AGENT_DESC"]
        assert {line[3]: line[at : at + 2] for line in lines} == {
            "a": ["ready", "-"],
            "b": ["drain:50%", "deploy"],
        }
        # The CSV: the agent's state, weight percent and reason, as HAProxy's show stat
        # has agent_status and agent_desc.
        csv_text = http("GET", f"{admin}/api/v1/virtual-servers.csv")[1].decode()
        rows = {row["real_server"]: row for row in csv.DictReader(io.StringIO(csv_text))}
        assert [rows["b"][k] for k in ("agent_state", "agent_weight_percent", "agent_reason")] == [
            "drain",
            "50",
            "deploy",
        ]
        assert rows["a"]["agent_state"] == "ready" and rows["a"]["agent_reason"] == ""
        # `at` is written as every other time of the document: ISO 8601 UTC with Z.
        at_b = servers_of(admin_port)["b"]["agent"]["at"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", at_b), at_b
    finally:
        for agent in agents:
            agent.stop()


def test_down_closes_connections_with_on_down_close(name_servers, lbproxy):
    """With `health_check.on_down: close`, the agent's `down` closes b's established
    connections, as a failing health check would; `drain` never does."""
    a, b = name_servers("a", "b")
    agents = [Agent(b"ready\n"), Agent(b"ready\n")]
    port, admin_port = free_port(), free_port()
    extra = "health_check: {type: tcp, interval: 1s, on_down: close}"
    try:
        config = _agent_config(port, [a, b], agents, admin_port, scheduler="rr", extra=extra)
        proxy = lbproxy(config, wait_ports=[port])
        _wait_agent(admin_port, "b", state="ready")
        held = [open_and_read_name(port) for _ in range(2)]
        (on_b,) = [sock for sock, name in held if name == "b"]
        (on_a,) = [sock for sock, name in held if name == "a"]
        try:
            agents[1].say(b"drain\n")
            _wait_agent(admin_port, "b", state="drain")
            on_b.sendall(b"drained, still open\n")
            assert read_name(on_b) == "drained, still open"
            agents[1].say(b"down # oom\n")
            _wait_agent(admin_port, "b", state="down")
            on_b.settimeout(10)
            assert on_b.recv(100) == b""  # closed by lbproxy
            on_a.sendall(b"a is untouched\n")
            assert read_name(on_a) == "a is untouched"
            closed = "web: closed 1 connection(s): b is down (on_down: close)"
            wait_for(lambda: closed in proxy.log(), what="the close logged")
            assert (
                counted(
                    admin_port,
                    "lbproxy_connections_closed_total",
                    virtual_server="web",
                    reason="marked_down",
                )
                == 1
            )
        finally:
            for sock, _ in held:
                sock.close()
    finally:
        for agent in agents:
            agent.stop()


def test_one_exchange_result_and_reason():
    """`ask_agent` (lbproxy/control/agent_checks.py) against a real agent: each result
    with the reason the log shows."""
    agent = Agent(b"")
    check = AgentCheckConfig(port=agent.port, timeout=0.5)
    address = Address("127.0.0.1", agent.port)
    cases = [
        (b"75% drain # deploy\r\n", ("ok", "75% drain # deploy")),
        (b"up 30%", ("ok", "30% up")),  # ended by the close
        (b"", ("fail", "closed without a line")),
        (SILENT, ("timeout", "no whole line within 0.5s")),
        (b"9999%\n", ("bad_answer", "weight 9999% above 256%")),
        (b"z" * 1_000_000, ("bad_answer", "a line longer than 512 bytes")),
    ]
    try:
        for answer, (result, reason) in cases:
            agent.say(answer)
            got, parsed, said = trio.run(ask_agent, address, check)
            assert (got, said) == (result, reason), answer[:20] if answer else answer
            assert (parsed is not None) == (result == "ok")
        port = free_port()  # nothing listens there
        got = trio.run(ask_agent, Address("127.0.0.1", port), check)
        assert got == ("fail", None, "connection refused")
        got = trio.run(ask_agent, Address("no-such-host.invalid", 1), check)
        assert got[0] == "fail" and got[2].startswith("cannot resolve no-such-host.invalid")
    finally:
        agent.stop()


@settings(max_examples=60, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=1200),
        st.lists(
            st.sampled_from(["50%", "9999%", "maxconn:3", "drain", "UP", "x", "#", ",", " "]),
            max_size=8,
        ).map(lambda words: " ".join(words).encode() + b"\n"),
    )
)
def test_any_answer_over_a_real_socket_is_one_result_never_an_error(fuzz_agent, answer):
    """Whatever an agent sends, one exchange gives one of the four results, and `ok`
    exactly when the pure parser accepts the line."""
    fuzz_agent.say(answer)
    check = AgentCheckConfig(port=fuzz_agent.port, timeout=5)
    result, parsed, _ = trio.run(ask_agent, Address("127.0.0.1", fuzz_agent.port), check)
    line = line_of(answer[: LINE_LIMIT + 2], closed=True)
    if not answer:
        assert result == "fail"
    elif isinstance(line, BadAnswer) or isinstance(parse(line), BadAnswer):
        assert result == "bad_answer" and parsed is None
    else:
        assert result == "ok" and parsed == parse(line)


@pytest.fixture(scope="module")
def fuzz_agent():
    agent = Agent(b"")
    yield agent
    agent.stop()
