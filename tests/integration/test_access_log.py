"""The JSON access log's fields (SPEC §25), read as `lbproxy simulate --replay` and an
operator's log pipeline read them: a real lbproxy, real connections, the lines parsed."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.integration.harness import (
    Echo,
    NameServer,
    compiled_path_expected,
    free_port,
    read_name,
    vs_config,
    wait_for,
    wall_time,
)

pytestmark = pytest.mark.integration

JSON_ACCESS = "  drain_timeout: 5s\n  log_format: json\n  access_log: true"
# A rounding of the start and of the duration to the microsecond, each
ROUNDING = 2e-6


def access_records(log: str) -> list[dict]:
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [r for r in records if r["logger"] == "lbproxy.access"]


def open_connection(port: int, payload: bytes) -> dict:
    began = time.time()
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    name = read_name(s)
    # the proxy accepted it before the real server's name came through
    served = time.monotonic()
    return {"sock": s, "began": began, "name": name, "payload": payload, "served": served}


def finish(conn: dict) -> None:
    """Send the payload, read the echo to its end, close; note how long it was held."""
    s = conn.pop("sock")
    conn["client_port"] = s.getsockname()[1]
    s.sendall(conn["payload"])
    # The proxy ends the connection only after this FIN reaches it, and had it before
    # `served`: at least this long in the proxy. (Not until the client reads the end:
    # the proxy may end it well before a busy client gets to run.)
    conn["held"] = time.monotonic() - conn["served"]
    s.shutdown(socket.SHUT_WR)
    echoed = b""
    while chunk := s.recv(100):
        echoed += chunk
    assert echoed == conn["payload"]
    s.close()
    conn["closed"] = time.time()


def wall(iso: str) -> float:
    assert iso.endswith("Z") and len(iso.split(".")[1]) == 7, iso  # UTC, microseconds
    return wall_time(iso)


@pytest.mark.parametrize("path", ["compiled", "pure"])
def test_json_access_log_carries_each_connections_facts(path, name_servers, lbproxy, monkeypatch):
    if path == "pure":
        monkeypatch.setenv("LBPROXY_PURE", "1")
    elif not compiled_path_expected():
        pytest.skip("the C extension is not built here")
    servers = name_servers("a", "b")
    port = free_port()
    proxy = lbproxy(vs_config(port, servers).replace("  drain_timeout: 5s", JSON_ACCESS))
    # Two connections, the first held open across the whole of the second: each its
    # own bytes, client port and times.
    first = open_connection(port, b"hello")
    second = open_connection(port, b"a longer payload")
    finish(second)
    finish(first)
    seen = [first, second]
    wait_for(lambda: len(access_records(proxy.log())) == 2, 10, "2 lines", details=proxy.log)
    ended = time.time()
    records = {r["client_port"]: r for r in access_records(proxy.log())}
    assert set(records) == {conn["client_port"] for conn in seen}
    for conn in seen:
        record = records[conn["client_port"]]
        assert record["client"] == "127.0.0.1"
        assert record["virtual_server"] == "web"
        assert record["real_server"] == conn["name"]
        assert record["bytes_in"] == len(conn["payload"])
        assert record["bytes_out"] == len(conn["payload"]) + len(conn["name"]) + 1
        assert record["end"] == "closed"
        assert record["protocol"] == "tcp"
        start = wall(record["start"])
        assert conn["began"] - ROUNDING <= start <= conn["closed"] + ROUNDING
        duration = record["duration_s"]
        assert isinstance(duration, float)
        assert conn["held"] - ROUNDING <= duration <= ended - conn["began"] + ROUNDING
        # its end (the record's time, cut to the millisecond) is start + duration
        assert 0 <= start + duration - wall_time(record["time"]) < 0.001 + ROUNDING
        # the text of the line is still there, for a human reading the JSON
        assert f"vs=web rs={conn['name']} in={len(conn['payload'])}" in record["message"]
    # the first connection, held while the second one came and went, lasted longer
    held, inner = records[first["client_port"]], records[second["client_port"]]
    assert held["duration_s"] > inner["duration_s"]
    assert wall(held["start"]) < wall(inner["start"])


def test_json_access_log_names_a_refused_connection(lbproxy):
    port = free_port()
    # a virtual server with no real server up: every client is refused before a pick
    with NameServer("a") as a:
        config = vs_config(port, [a]).replace("  drain_timeout: 5s", JSON_ACCESS)
        proxy = lbproxy(config.replace("address:", "state: disabled, address:"))
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            client_port = s.getsockname()[1]
            assert s.recv(10) == b""
        wait_for(lambda: access_records(proxy.log()), 10, "the access line", details=proxy.log)
    (record,) = access_records(proxy.log())
    assert record["client_port"] == client_port
    assert record["real_server"] is None
    assert record["bytes_in"] == record["bytes_out"] == 0
    assert record["end"] == "no_server"


def test_json_access_log_of_a_udp_session(lbproxy):
    echo = Echo(b"re:")
    port = free_port()
    proxy = lbproxy(
        f"""
        global:
          admin: {{listen: none}}
          log_format: json
          access_log: true
        virtual_servers:
          - name: dns
            protocol: udp
            listen: 127.0.0.1:{port}
            udp: {{responses: 1}}
            real_servers:
              - {{name: one, address: 127.0.0.1:{echo.port}}}
        """
    )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        began = time.time()
        s.sendto(b"ping", ("127.0.0.1", port))
        assert s.recvfrom(100)[0] == b"re:ping"
        client_port = s.getsockname()[1]
    wait_for(lambda: access_records(proxy.log()), 10, "the line", details=proxy.log)
    (record,) = access_records(proxy.log())
    assert record["protocol"] == "udp"
    assert (record["client"], record["client_port"]) == ("127.0.0.1", client_port)
    assert (record["virtual_server"], record["real_server"]) == ("dns", "one")
    assert (record["bytes_in"], record["bytes_out"]) == (4, 7)
    assert record["end"] == "responses"
    assert wall(record["start"]) >= began - ROUNDING
    assert record["duration_s"] >= 0
