"""Front-door routing end to end (SPEC §13): backup servers, the queue, SNI routing.

Real `lbproxy run` processes, real name-saying servers on loopback, real HTTP to the
admin endpoint; every wait is bounded in count and time.
"""

from __future__ import annotations

import json
import time

from tests.integration.conftest import vs_config
from tests.integration.harness import NameServer, ask_name, free_port, open_and_read_name
from tests.integration.test_admin import http, with_admin

FAST_CHECKS = "health_check: {type: tcp, interval: 0.1s, timeout: 0.5s, rise: 1, fall: 1}"


def names_until(port: int, wanted: str, timeout: float = 10.0) -> str:
    """Ask for names until `wanted` answers (the health checks need a moment)."""
    deadline = time.monotonic() + timeout
    name = ""
    while time.monotonic() < deadline:
        try:
            name = ask_name(port, timeout=2.0)
        except OSError:
            name = ""
        if name == wanted:
            return name
        time.sleep(0.05)
    return name


# -- backup servers ---------------------------------------------------------------------


def test_a_primary_fails_over_to_the_backups_and_takes_over_again(name_servers, lbproxy):
    primary, backup1, backup2 = name_servers("p", "b1", "b2")
    port, admin_port = free_port(), free_port()
    config = vs_config(
        port,
        [primary, backup1, backup2],
        "rr",
        FAST_CHECKS,
        rs_extra={"b1": "backup: true", "b2": "backup: true"},
    )
    lbproxy(with_admin(config, admin_port), wait_ports=[port])
    assert [ask_name(port) for _ in range(4)] == ["p"] * 4

    primary.stop()  # the real server goes away; the health check sees it
    assert names_until(port, "b1") == "b1"
    # the scheduler (rr) applies among the backups
    served = [ask_name(port) for _ in range(4)]
    assert sorted(served) == ["b1", "b1", "b2", "b2"]
    held, name = open_and_read_name(port)  # a backup connection stays open
    assert name in ("b1", "b2")

    back = NameServer("p", port=primary.port)  # the primary returns on its address
    try:
        assert names_until(port, "p") == "p"
        assert [ask_name(port) for _ in range(4)] == ["p"] * 4
        held.sendall(b"still here\n")
        assert held.recv(100) == b"still here\n"  # finished on its own, not cut
        status, body = http("GET", f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers/web")
        assert status == 200
        document = json.loads(body)
        flags = {rs["name"]: rs["backup"] for rs in document["real_servers"]}
        assert flags == {"p": False, "b1": True, "b2": True}
        active = {rs["name"]: rs["active_connections"] for rs in document["real_servers"]}
        assert active[name] == 1
    finally:
        held.close()
        back.stop()
