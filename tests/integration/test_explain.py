"""Explain (SPEC §24): `GET .../explain?client=IP` and `lbproxy explain VS IP` through real
`lbproxy run` processes. Every answer is checked against the real thing: right after
asking, a connection from that client address (bound to 127.0.0.x) goes through the
proxy, and the real server that answers it names itself.
"""

from __future__ import annotations

import json
import socket
import urllib.parse

from tests.integration.agents import Agent
from tests.integration.harness import (
    free_port,
    get_json,
    http,
    read_name,
    run_cli,
    servers_of,
    vs_config,
    wait_for,
    with_admin,
    workers_config,
)

NO_HEALTH = "health_check: {type: none}"
FAST_HEALTH = "health_check: {type: tcp, interval: 100ms, timeout: 200ms, rise: 1, fall: 1}"


class Named:
    """What vs_config needs of a real server: a name and a port (nothing listening)."""

    def __init__(self, name: str, port: int) -> None:
        self.name, self.port = name, port


def explain(admin_port: int, client: str, vs: str = "web") -> dict:
    query = urllib.parse.urlencode({"client": client})
    return get_json(admin_port, f"/api/v1/virtual-servers/{vs}/explain?{query}")


def connect_from(port: int, source: str) -> tuple[socket.socket, str]:
    """A held connection from loopback address `source`, and the server it reached."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    try:
        return s, read_name(s)
    except BaseException:
        s.close()
        raise


def ask_from(port: int, source: str) -> str:
    s, name = connect_from(port, source)
    s.close()
    return name


def predicted_then_reached(port: int, admin_port: int, source: str) -> tuple[dict, str]:
    """Explain for `source`, then a real connection from it: the answer must name the
    server that connection reaches."""
    answer = explain(admin_port, source)
    reached = ask_from(port, source)
    assert answer["pick"] == reached, (answer, reached)
    return answer, reached


def verdicts(answer: dict) -> dict[str, dict]:
    return {rs["name"]: rs for rs in answer["servers"]}


TOKEN = "explain-test-token"


def token_file(folder) -> str:
    path = folder / "admin.token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return str(path)


def drain(admin_port: int, name: str) -> None:
    url = f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers/web/real-servers/{name}"
    status, body = http("PATCH", url, {"state": "drain"}, token=TOKEN)
    assert status == 200, body


def connections_total(admin_port: int) -> float:
    return sum(rs["connections_total"] for rs in servers_of(admin_port).values())


def test_rr_explain_names_each_next_pick_and_asking_twice_moves_nothing(name_servers, lbproxy):
    servers = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    lbproxy(with_admin(vs_config(port, servers, "rr", NO_HEALTH), admin_port), [port])
    reached = []
    for i in range(6):
        source = f"127.0.0.{2 + i}"
        first = explain(admin_port, source)
        again = explain(admin_port, source)  # asking does not take rr's turn
        assert again == first
        answer, name = predicted_then_reached(port, admin_port, source)
        assert answer["by"] == "scheduler" and answer["client"] == source
        assert all(v["eligible"] and v["why"] is None for v in answer["servers"])
        assert all(v["score"] is not None for v in answer["servers"])
        reached.append(name)
    assert sorted(reached[:3]) == ["a", "b", "c"] and reached[3:] == reached[:3]  # rr's cycle


def test_wlc_scores_are_active_plus_one_over_weight(name_servers, lbproxy):
    servers = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    config = vs_config(port, servers, "wlc", NO_HEALTH, {"a": "weight: 1", "b": "weight: 3"})
    lbproxy(with_admin(config, admin_port), [port])
    held = []
    try:
        for _ in range(5):
            answer = explain(admin_port, "127.0.0.2")
            sock, name = connect_from(port, "127.0.0.2")
            held.append(sock)
            assert answer["pick"] == name
        active = {n: rs["active_connections"] for n, rs in servers_of(admin_port).items()}
        assert active == {"a": 1, "b": 4}  # (1+1)/1 = 2 ties (4+1)/3 ~ 1.67 ... as wlc says
        answer = explain(admin_port, "127.0.0.3")
        scores = {v["name"]: v["score"] for v in answer["servers"]}
        assert scores["a"].startswith(f"({(1 + 1) / 1:.4g}, ")
        assert scores["b"].startswith(f"({(4 + 1) / 3:.4g}, ")
        assert answer["pick"] == "b"
        sock, name = connect_from(port, "127.0.0.3")
        held.append(sock)
        assert name == "b"
    finally:
        for sock in held:
            sock.close()


def test_maglev_explain_matches_each_client_address(name_servers, lbproxy):
    servers = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    lbproxy(with_admin(vs_config(port, servers, "maglev", NO_HEALTH), admin_port), [port])
    reached = set()
    for i in range(2, 14):
        answer, name = predicted_then_reached(port, admin_port, f"127.0.0.{i}")
        assert answer["by"] == "maglev"
        assert all(v["score"].endswith(" slots") for v in answer["servers"])
        reached.add(name)
    assert len(reached) >= 2  # twelve addresses spread over the table


def test_a_persistence_hit_is_explained_as_persistence(name_servers, lbproxy):
    servers = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    extra = f"{NO_HEALTH}\npersistence: {{timeout: 60s}}"
    lbproxy(with_admin(vs_config(port, servers, "rr", extra), admin_port), [port])
    answer, first = predicted_then_reached(port, admin_port, "127.0.0.2")
    assert answer["by"] == "scheduler"
    ask_from(port, "127.0.0.3")  # rr moves on; 127.0.0.2 stays on its server
    for _ in range(3):
        answer, name = predicted_then_reached(port, admin_port, "127.0.0.2")
        assert (answer["by"], name) == ("persistence", first)
    answer, name = predicted_then_reached(port, admin_port, "127.0.0.4")  # a new client
    assert answer["by"] == "scheduler" and name != first


def test_drained_full_and_down_servers_say_why(name_servers, lbproxy, tmp_path):
    a, b, c = name_servers("a", "b", "c")
    dead = Named("dead", free_port())  # nothing listens: its health check fails
    port, admin_port = free_port(), free_port()
    config = vs_config(port, [a, b, c, dead], "rr", FAST_HEALTH, {"b": "max_connections: 1"})
    lbproxy(with_admin(config, admin_port, token_file(tmp_path)), [port])
    wait_for(
        lambda: verdicts(explain(admin_port, "127.0.0.2"))["dead"]["why"] == "down",
        what="dead's check to fail",
    )
    drain(admin_port, "a")
    held = None
    try:
        for _ in range(4):  # b and c alternate; hold b's connection: b is then full
            sock, name = connect_from(port, "127.0.0.2")
            if name == "b" and held is None:
                held = sock
                break
            sock.close()
        assert held is not None
        answer = explain(admin_port, "127.0.0.5")
        why = {name: v["why"] for name, v in verdicts(answer).items()}
        assert why == {"a": "drain", "b": "full", "c": None, "dead": "down"}
        assert [v["name"] for v in answer["servers"] if v["eligible"]] == ["c"]
        for _ in range(3):
            answer, name = predicted_then_reached(port, admin_port, "127.0.0.5")
            assert name == "c"
    finally:
        if held is not None:
            held.close()


def test_an_ejected_server_says_ejected(name_servers, lbproxy):
    servers = name_servers("a", "b")
    refusing = Named("refusing", free_port())
    port, admin_port = free_port(), free_port()
    extra = (
        "retries: 3\nconnect_timeout: 300ms\nhealth_check: {type: none, fall: 1000}\n"
        "outlier_detection: {consecutive_failures: 2, base_ejection_time: 60s, "
        "max_ejection_time: 60s, max_ejection_percent: 100}"
    )
    config = vs_config(port, [*servers, refusing], "rr", extra)
    lbproxy(with_admin(config, admin_port), [port])
    wait_for(
        lambda: (
            ask_from(port, "127.0.0.2")
            and servers_of(admin_port)["refusing"]["ejected_until"] is not None
        ),
        what="refusing to be ejected",
    )
    answer = explain(admin_port, "127.0.0.2")
    assert verdicts(answer)["refusing"] == {
        "name": "refusing",
        "eligible": False,
        "why": "ejected",
        "score": None,
    }
    for _ in range(3):
        answer, name = predicted_then_reached(port, admin_port, "127.0.0.2")
        assert name in ("a", "b")


def test_an_agent_drained_server_says_agent_drain(name_servers, lbproxy):
    a, b = name_servers("a", "b")
    agents = [Agent(b"ready\n"), Agent(b"drain\n")]
    port, admin_port = free_port(), free_port()
    rs_extra = {
        s.name: f"agent_check: {{port: {g.port}}}" for s, g in zip((a, b), agents, strict=True)
    }
    extra = f"{NO_HEALTH}\nagent_check: {{interval: 100ms, timeout: 1s}}"
    try:
        lbproxy(with_admin(vs_config(port, [a, b], "rr", extra, rs_extra), admin_port), [port])
        wait_for(
            lambda: verdicts(explain(admin_port, "127.0.0.2"))["b"]["why"] == "agent drain",
            what="b's agent to say drain",
        )
        assert verdicts(explain(admin_port, "127.0.0.2"))["a"]["eligible"]
        for _ in range(3):
            _, name = predicted_then_reached(port, admin_port, "127.0.0.2")
            assert name == "a"
    finally:
        for agent in agents:
            agent.stop()


def test_hostile_client_parameters_get_400_and_change_nothing(name_servers, lbproxy):
    servers = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    lbproxy(with_admin(vs_config(port, servers, "rr", NO_HEALTH), admin_port), [port])
    before = explain(admin_port, "127.0.0.2")
    connections_before = connections_total(admin_port)
    base = f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers/web/explain"
    hostile = {
        "?client=not-an-address": "is not an IPv4 or IPv6 address",
        "?client=" + "1" * 5000: "too long",
        "?client=fe80::1%25eth0": "zone",
        "?client=256.1.1.1": "is not an IPv4 or IPv6 address",
        "": "client=IP is required",
        "?client=127.0.0.1&client=127.0.0.2": "once",
        "?client=127.0.0.1&x=1": "unknown query parameter",
        "?client=%ff%fe": "not an IPv4 or IPv6 address",
        "?client=127.0.0.1&port=99999": "not a port",
    }
    for query, message in hostile.items():
        status, body = http("GET", base + query)
        assert status == 400, (query, body)
        assert message in json.loads(body)["error"], (query, body)
    status, body = http(
        "GET", f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers/nope/explain?client=127.0.0.1"
    )
    assert status == 404 and "nope" in json.loads(body)["error"]
    ipv6 = explain(admin_port, "2001:db8::7")  # IPv6 is a client address like any other
    assert ipv6["client"] == "2001:db8::7" and ipv6["pick"] == before["pick"]
    assert connections_total(admin_port) == connections_before
    assert explain(admin_port, "127.0.0.2") == before  # nothing moved
    assert ask_from(port, "127.0.0.2") == before["pick"]


def test_lbproxy_explain_prints_a_table_and_json(name_servers, lbproxy, tmp_path):
    a, b = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    config = vs_config(port, [a, b], "wlc", NO_HEALTH)
    lbproxy(with_admin(config, admin_port, token_file(tmp_path)), [port])
    drain(admin_port, "a")
    admin = ("--admin", f"http://127.0.0.1:{admin_port}")
    shown = run_cli("explain", "web", "127.0.0.9", *admin)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == "web: a new connection from 127.0.0.9 would go to b (by scheduler)"
    assert lines[1].split() == ["SERVER", "ELIGIBLE", "WHY", "SCORE"]
    assert lines[2].split() == ["a", "no", "drain", "-"]
    assert lines[3].split()[:3] == ["b", "yes", "-"] and lines[3].endswith("<- pick")
    as_json = run_cli("explain", "web", "127.0.0.9", "--json", *admin)
    document = json.loads(as_json.stdout)
    assert document["pick"] == "b" and document["by"] == "scheduler"
    assert ask_from(port, "127.0.0.9") == "b"
    bad = run_cli("explain", "web", "999.1.1.1", *admin)
    assert bad.returncode != 0 and "not an IPv4 or IPv6 address" in bad.stderr


def test_with_workers_one_worker_answers_and_is_named(name_servers, lbproxy):
    servers = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    lbproxy(workers_config(port, servers, admin_port, workers=2), [port])
    answer = explain(admin_port, "127.0.0.2")
    assert answer["worker"] == 1 and answer["pick"] in ("a", "b")
    assert {v["name"] for v in answer["servers"]} == {"a", "b"}
    status, body = http(
        "GET", f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers/web/explain?client=x"
    )
    assert status == 400 and "not an IPv4 or IPv6 address" in json.loads(body)["error"]
    shown = run_cli("explain", "web", "127.0.0.2", "--admin", f"http://127.0.0.1:{admin_port}")
    assert "answered by worker 1" in shown.stdout


def rejected(admin_port: int) -> dict[str, int]:
    """The virtual server's refusals so far, by reason (the reasons counted at all)."""
    vs = get_json(admin_port, "/api/v1/virtual-servers")["virtual_servers"][0]
    return {reason: n for reason, n in vs["rejected"].items() if n}


def test_denied_and_per_source_limited_clients_are_explained_as_rejected(name_servers, lbproxy):
    """Explain runs the accept's admission checks without counting: a denied client and
    a client network at its per_source limit get `by: reject` with the reason their
    real connection is then refused (and counted) under."""
    servers = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    extra = f"{NO_HEALTH}\ndeny: [127.0.0.9/32]\nper_source: {{max_connections: 1}}"
    lbproxy(with_admin(vs_config(port, servers, "rr", extra), admin_port), [port])
    denied = explain(admin_port, "127.0.0.9")
    assert (denied["pick"], denied["by"], denied["reason"]) == (None, "reject", "acl")
    assert {v["name"] for v in denied["servers"] if v["eligible"]} == {"a", "b"}
    admin = ("--admin", f"http://127.0.0.1:{admin_port}")
    shown = run_cli("explain", "web", "127.0.0.9", *admin)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[0] == (
        "web: a new connection from 127.0.0.9 would be refused"
        " (acl: the address is outside allow or in deny)"
    )
    with socket.create_connection(
        ("127.0.0.1", port), timeout=5, source_address=("127.0.0.9", 0)
    ) as s:
        assert read_name(s) == ""  # closed: the answer was right
    wait_for(lambda: rejected(admin_port) == {"acl": 1}, what="the acl refusal")

    free = explain(admin_port, "127.0.0.4")
    assert (free["by"], free["reason"]) == ("scheduler", None)
    held, name = connect_from(port, "127.0.0.4")  # the network's one connection
    try:
        assert name == free["pick"]
        for _ in range(3):  # asking again and again is no arrival
            limited = explain(admin_port, "127.0.0.4")
            assert (limited["pick"], limited["by"], limited["reason"]) == (
                None,
                "reject",
                "per_source",
            )
        as_json = json.loads(run_cli("explain", "web", "127.0.0.4", "--json", *admin).stdout)
        assert (as_json["by"], as_json["reason"]) == ("reject", "per_source")
        assert rejected(admin_port) == {"acl": 1}  # explain counted nothing
        assert explain(admin_port, "127.0.0.5")["reason"] is None  # another network
        refused, second = connect_from(port, "127.0.0.4")
        refused.close()
        assert second == ""  # refused, as explained
        wait_for(
            lambda: rejected(admin_port) == {"acl": 1, "per_source": 1},
            what="the per_source refusal",
        )
    finally:
        held.close()
    wait_for(
        lambda: explain(admin_port, "127.0.0.4")["reason"] is None,
        what="the network's connection to end",
    )
