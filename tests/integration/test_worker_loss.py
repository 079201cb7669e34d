"""`kill -9` of one of two workers under a connection loop (SPEC §17): no client that
was not yet accepted sees a refusal or a reset, because the supervisor owns the listening
sockets and every worker accepts from the same queue; the connections established to the
killed worker are lost, and exactly those."""

from __future__ import annotations

import os
import signal
import socket

import pytest

from tests.integration.client_loop import ClientLoop
from tests.integration.harness import (
    free_port,
    get_json,
    local_http,
    ready,
    wait_for,
    workers,
    workers_config,
)

pytestmark = pytest.mark.integration

HELD = 20


def echo_once(sock: socket.socket, payload: bytes) -> bool:
    """True when `payload` comes back whole on the held connection."""
    try:
        sock.sendall(payload)
        received = b""
        while len(received) < len(payload):
            chunk = sock.recv(65536)
            if not chunk:
                return False
            received += chunk
        return received == payload
    except OSError:
        return False


def test_kill_9_of_a_worker_refuses_and_resets_no_waiting_client(name_servers, lbproxy):
    (echo,) = name_servers("e", greeting=False)
    port, admin_port = free_port(), free_port()
    proxy = lbproxy(workers_config(port, [echo], admin_port), [port, admin_port])
    held: list[socket.socket] = []
    try:
        wait_for(lambda: ready(admin_port), 20, "both workers ready")
        for i in range(HELD):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            held.append(sock)
            assert echo_once(sock, f"held {i}".encode())
        before = {w["index"]: w for w in workers(admin_port)}
        victim = before[1]
        on_victim = victim["active_connections"]
        assert on_victim + before[2]["active_connections"] == HELD

        # Frozen, worker 1 accepts nothing: with an accept queue of its own
        # (SO_REUSEPORT) the kernel would keep putting about half of the new
        # connections there, and SIGKILL would reset every one of them.
        kill_frozen_worker_under_a_loop(port, admin_port, victim)

        # The established connections: those of worker 1 are lost, the others work on.
        alive = [echo_once(sock, b"after") for sock in held]
        assert alive.count(False) == on_victim, (alive, before)
        assert alive.count(True) == HELD - on_victim
        document = get_json(admin_port, "/api/v1/workers")["workers"][0]
        assert document["restarts"] == 1
        assert "Traceback" not in proxy.log()
    finally:
        for sock in held:
            sock.close()


def test_an_address_added_by_a_reload_is_the_supervisors_too(name_servers, lbproxy):
    """A TCP address a reload adds goes through the supervisor's socket as those present at
    start: kill -9 of a frozen worker under a loop on it refuses and resets nobody."""
    (echo,) = name_servers("e", greeting=False)
    port, added, admin_port = free_port(), free_port(), free_port()
    text = workers_config(port, [echo], admin_port)
    proxy = lbproxy(text, [port, admin_port])
    wait_for(lambda: ready(admin_port), 20, "both workers ready")
    more = (
        "  - name: added\n"
        f"    listen: 127.0.0.1:{added}\n"
        "    scheduler: rr\n"
        "    health_check: {type: none}\n"
        "    real_servers:\n"
        f"      - {{name: e, address: 127.0.0.1:{echo.port}}}\n"
    )
    proxy.config_path.write_text(text + more)
    status, body = local_http("POST", f"http://127.0.0.1:{admin_port}/api/v1/reload", {})
    assert status == 200, body
    victim = workers(admin_port)[0]
    kill_frozen_worker_under_a_loop(added, admin_port, victim)
    assert "Traceback" not in proxy.log()


def kill_frozen_worker_under_a_loop(port: int, admin_port: int, victim: dict) -> None:
    """SIGSTOP `victim` (a worker's document), run 20 clients in a connect-echo-close
    loop on `port`, SIGKILL it mid-loop and let the loop go on through both workers
    once it is restarted: no client sees a refusal, a reset or a wrong echo."""
    os.kill(victim["pid"], signal.SIGSTOP)
    with ClientLoop(port, clients=20, limit=60) as loop:
        loop.wait_for(100)
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(
            lambda: (w := workers(admin_port)[0])["pid"] != victim["pid"] and w["ready"],
            20,
            "worker 1 restarted",
        )
        # and the loop goes on through both workers: the new one serves some of it
        wait_for(
            lambda: workers(admin_port)[0]["connections_total"],
            20,
            "the restarted worker 1 to serve a connection",
        )
        loop.wait_for(100)
    counts = loop.counts
    assert counts["ok"] >= 200
    assert counts["refused"] == counts["reset"] == counts["error"] == 0, loop.errors
    assert counts["mismatch"] == 0, loop.errors
