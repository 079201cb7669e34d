"""The per-source table as an operator sees it (HAProxy's `show table` and `clear
table`), through real `lbproxy run` processes and loopback clients:

- `GET .../per-source` and `lbproxy per-source web` list each client network with its
  open connections and arrivals, busiest first, and say which one is at its limit;
- `DELETE .../per-source/NETWORK` (`lbproxy per-source web --clear NETWORK`) forgets a
  network's arrivals, so a client locked out by `rate` for a minute is let in at once;
  it never forgets open connections: a network at `max_connections` stays at it until
  its own connections end;
- a DELETE over TCP needs the token exactly as every change does (403 read-only without
  a token_file, 401 / 403 with one), the admin socket needs none;
- with `workers: 2` the supervisor adds the workers' tables up and clears every worker.

Clients bind to other loopback addresses (127.0.0.2, ...) to be other networks.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from tests.integration.harness import (
    free_port,
    http,
    local_http,
    run_cli,
    stop_all,
    vs_config,
    wait_for,
    with_admin,
)
from tests.integration.redis_server import RedisServer, requires_redis
from tests.integration.shared_per_source import (
    cluster_connected,
    connect_from,
    served,
    shared_config,
)

TOKEN = "per-source-token"
LIMITS = "{max_connections: 2, rate: 3, interval: 60s}"


def served_once(source: str, port: int) -> bool:
    with connect_from(source, port) as sock:
        return served(sock)


def knock(source: str, port: int, admin: int) -> bool:
    """One connection from `source`, closed at once: served or not; its end counted
    before the next (else a quick next one would meet `max_connections`, not `rate`)."""
    answer = served_once(source, port)
    wait_for(
        lambda: networks(admin).get(source, {"open": 0})["open"] == 0,
        what=f"{source}'s connection ended",
    )
    return answer


def config(port: int, admin: int, server, token_file: Path | None = None, workers: int = 0):
    text = vs_config(
        port,
        [server],
        extra=f"connect_timeout: 60s\nhealth_check: {{type: none}}\nper_source: {LIMITS}\n",
    )
    text = with_admin(text, admin, token_file=token_file)
    if workers:
        text = text.replace("global:\n", f"global:\n  workers: {workers}\n", 1)
    return text


def url(admin: int, path: str = "") -> str:
    return f"http://127.0.0.1:{admin}/api/v1/virtual-servers/web/per-source{path}"


def listing(admin: int, query: str = "") -> dict:
    status, body = http("GET", url(admin) + query)
    assert status == 200, body
    return json.loads(body)


def networks(admin: int) -> dict[str, dict]:
    return {row["network"]: row for row in listing(admin)["networks"]}


def cli(admin: int, *args: str):
    return run_cli("per-source", "web", *args, "--admin", f"http://127.0.0.1:{admin}")


def test_listed_at_its_limit_and_a_clear_lets_a_rate_limited_client_in(name_servers, lbproxy):
    """127.0.0.2 holds 2 connections (its max_connections), 127.0.0.3 had 3 accepted in
    the last minute (its rate) and is refused; both are listed at their limit, the
    busiest first. `--clear 127.0.0.3` through the admin socket lets 127.0.0.3 in at
    once (else it would wait a minute); a clear of every network keeps 127.0.0.2's open
    connections counted: it is still refused until they end."""
    (server,) = name_servers("a")
    port, admin = free_port(), free_port()
    proxy = lbproxy(config(port, admin, server), [admin])
    held = [connect_from("127.0.0.2", port) for _ in range(2)]
    try:
        assert all(served(sock) for sock in held)
        assert [knock("127.0.0.3", port, admin) for _ in range(4)] == [True] * 3 + [False]
        assert knock("127.0.0.4", port, admin)

        document = listing(admin)
        assert (document["virtual_server"], document["tracked"]) == ("web", 3)
        assert document["limits"] == {
            "max_connections": 2,
            "rate": 3,
            "interval": 60,
            "prefix_v4": 32,
            "prefix_v6": 64,
            "shared": False,
        }
        rows = [
            (r["network"], r["open"], r["arrivals"], r["at_limit"], r["limited_by"])
            for r in document["networks"]
        ]
        assert rows == [
            ("127.0.0.2", 2, 2, True, "max_connections"),
            ("127.0.0.3", 0, 3, True, "rate"),
            ("127.0.0.4", 0, 1, False, None),
        ]
        one = listing(admin, "?limit=1")
        assert [r["network"] for r in one["networks"]] == ["127.0.0.2"] and one["tracked"] == 3

        piped = cli(admin)
        assert piped.returncode == 0, piped.stderr
        assert [line.split() for line in piped.stdout.splitlines()] == [
            ["NETWORK", "OPEN", "ARRIVALS", "AT_LIMIT"],
            ["127.0.0.2", "2", "2", "max_connections"],
            ["127.0.0.3", "0", "3", "rate"],
            ["127.0.0.4", "0", "1", "-"],
        ]
        assert "3 client network(s) tracked" in piped.stderr

        cleared = cli(admin, "--clear", "127.0.0.3")  # the admin socket: no token
        assert cleared.returncode == 0, cleared.stderr
        assert cleared.stdout.strip() == "web: cleared the arrivals of 1 network(s)"
        assert "127.0.0.3" not in networks(admin)  # nothing open: forgotten whole
        assert knock("127.0.0.3", port, admin)  # not a minute later: now
        assert "web: per_source 127.0.0.3 cleared: 1 network(s), 0 kept" in proxy.log()
        assert "(by the admin socket (uid " in proxy.log()

        status, body = local_http("DELETE", url(admin))  # every network
        assert (status, json.loads(body)) == (200, {"cleared": 3, "kept": 1})
        after = networks(admin)
        assert list(after) == ["127.0.0.2"]  # kept: its connections are open
        assert (after["127.0.0.2"]["open"], after["127.0.0.2"]["arrivals"]) == (2, 0)
        assert after["127.0.0.2"]["limited_by"] == "max_connections"
        assert not served_once("127.0.0.2", port)  # still 2 open: still at its limit
    finally:
        for sock in held:
            sock.close()
    # Their ends are still counted through the cleared entry: 127.0.0.2 is let in again.
    wait_for(lambda: networks(admin)["127.0.0.2"]["open"] == 0, what="both ends counted")
    assert served_once("127.0.0.2", port)


def test_a_clear_over_tcp_needs_the_token_as_every_change(tmp_path, name_servers, lbproxy):
    """Without a token_file a DELETE over TCP is 403 (read-only) and changes nothing;
    with one, 401 without it and 403 with a wrong one, 200 with it (and logged with who
    asked). Reads stay open. Bad names are clear errors."""
    (server,) = name_servers("a")
    port, admin = free_port(), free_port()
    lbproxy(config(port, admin, server), [admin])
    assert [knock("127.0.0.3", port, admin) for _ in range(4)] == [True] * 3 + [False]
    status, body = http("DELETE", url(admin, "/127.0.0.3"))
    assert status == 403 and "read-only over TCP" in json.loads(body)["error"]
    assert http("DELETE", url(admin))[0] == 403
    assert networks(admin)["127.0.0.3"]["arrivals"] == 3  # nothing was cleared
    assert not served_once("127.0.0.3", port)

    token_file = tmp_path / "admin.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    port2, admin2 = free_port(), free_port()
    proxy = lbproxy(config(port2, admin2, server, token_file), [admin2], folder=tmp_path / "two")
    assert [knock("127.0.0.3", port2, admin2) for _ in range(4)] == [True] * 3 + [False]
    assert http("DELETE", url(admin2, "/127.0.0.3"))[0] == 401
    assert http("DELETE", url(admin2, "/127.0.0.3"), token="wrong")[0] == 403
    assert not served_once("127.0.0.3", port2)
    status, body = http("DELETE", url(admin2, "/127.0.0.9"), token=TOKEN)  # not tracked
    assert (status, json.loads(body)) == (200, {"cleared": 0, "kept": 0})
    status, body = http("DELETE", url(admin2, "/127.0.0.3/32"), token=TOKEN)
    assert (status, json.loads(body)) == (200, {"cleared": 1, "kept": 0})
    assert served_once("127.0.0.3", port2)
    assert "over TCP with the token)" in proxy.log()
    for bad, says in [("/web", "not an address"), ("/127.0.0.3%2F24", "by /32")]:
        status, body = http("DELETE", url(admin2, bad), token=TOKEN)
        assert status == 400 and says in json.loads(body)["error"], body
    assert http("GET", url(admin2, "?limit=0"))[0] == 400
    assert http("GET", url(admin2, "?limit=10001"))[0] == 400
    assert http("GET", url(admin2, "?top=3"))[0] == 400
    missing = http("GET", f"http://127.0.0.1:{admin2}/api/v1/virtual-servers/nope/per-source")
    assert missing[0] == 404


def test_a_virtual_server_without_per_source_is_a_404_naming_why(name_servers, lbproxy):
    (server,) = name_servers("a")
    port, admin = free_port(), free_port()
    text = with_admin(vs_config(port, [server], extra="health_check: {type: none}\n"), admin)
    lbproxy(text, [admin])
    status, body = http("GET", url(admin))
    assert status == 404 and "has no per_source block" in json.loads(body)["error"]
    out = cli(admin)
    assert out.returncode == 1 and "has no per_source block" in out.stderr


def test_with_two_workers_the_tables_add_up_and_a_clear_reaches_every_worker(name_servers, lbproxy):
    """`workers: 2`: each worker accepts some of 127.0.0.3's connections; the listing
    adds them up (3 arrivals whichever worker took them), and a clear through the admin
    socket (the supervisor's) clears both workers, logged once by the supervisor."""
    (server,) = name_servers("a")
    port, admin = free_port(), free_port()
    proxy = lbproxy(config(port, admin, server, workers=2), [admin])
    # Each worker applies the rate to its own arrivals: up to 3 each.
    verdicts = [knock("127.0.0.3", port, admin) for _ in range(8)]
    accepted = verdicts.count(True)
    assert 3 <= accepted <= 6
    held = [connect_from("127.0.0.2", port) for _ in range(2)]
    try:
        assert all(served(sock) for sock in held)
        wait_for(lambda: networks(admin)["127.0.0.2"]["open"] == 2, what="both open listed")
        rows = networks(admin)
        assert rows["127.0.0.3"]["arrivals"] == accepted
        assert list(rows) == ["127.0.0.2", "127.0.0.3"]
        assert listing(admin)["tracked"] >= 2
        cleared = cli(admin, "--clear", "127.0.0.3", "--json")
        assert cleared.returncode == 0, cleared.stderr
        result = json.loads(cleared.stdout)
        assert 1 <= result["cleared"] <= 2 and result["kept"] == 0
        assert "127.0.0.3" not in networks(admin)
        assert served_once("127.0.0.3", port)
        assert proxy.log().count("web: per_source 127.0.0.3 cleared") == 1
        assert "2 workers)" in proxy.log()
    finally:
        for sock in held:
            sock.close()


@requires_redis
def test_with_shared_the_other_instances_counts_are_listed(tmp_path, name_servers, lbproxy):
    """Two instances with `shared: true` and a real redis-server: 3 connections held
    from 127.0.0.2 through lb1 are listed at lb2 as that network's remote_open, and put
    it at its limit there (max_connections 3); a clear at lb2 keeps the network (held
    elsewhere) and its remote count."""
    redis = RedisServer(tmp_path / "redis").start()
    try:
        (server,) = name_servers("a")
        lb1, lb2 = (SimpleNamespace(port=free_port(), admin=free_port()) for _ in range(2))
        for name, one in (("lb1", lb1), ("lb2", lb2)):
            text = shared_config(redis, name, one.port, one.admin, server, "max_connections: 3")
            lbproxy(text, [one.admin], folder=tmp_path / name)
        held = []
        try:
            wait_for(lambda: cluster_connected(lb1.admin) and cluster_connected(lb2.admin))
            held = [connect_from("127.0.0.2", lb1.port) for _ in range(3)]
            assert all(served(sock) for sock in held)
            wait_for(
                lambda: networks(lb2.admin).get("127.0.0.2", {}).get("remote_open") == 3,
                what="lb1's connections listed at lb2",
            )
            row = networks(lb2.admin)["127.0.0.2"]
            assert (row["open"], row["at_limit"], row["limited_by"]) == (
                0,
                True,
                "max_connections",
            )
            assert row["remote_arrivals"] is None  # no rate: no arrivals kept
            assert listing(lb2.admin)["limits"]["shared"] is True
            status, body = local_http("DELETE", url(lb2.admin, "/127.0.0.2"))
            assert (status, json.loads(body)) == (200, {"cleared": 1, "kept": 1})
            assert networks(lb2.admin)["127.0.0.2"]["remote_open"] == 3
        finally:
            for sock in held:
                sock.close()
    finally:
        stop_all(lbproxy.started)
        redis.stop()
