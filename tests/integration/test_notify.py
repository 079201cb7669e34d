"""systemd's notify protocol against a real AF_UNIX datagram socket bound by the test.

The test plays systemd: it binds the socket, passes it to a real `lbproxy run` as
$NOTIFY_SOCKET, and reads each datagram with the sender's credentials (SO_PASSCRED),
so it can tell the supervisor's messages from a worker's.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.harness import (
    NotifySocket,
    free_port,
    local_http,
    open_and_read_name,
    vs_config,
    with_admin,
    workers,
    workers_config,
)


@pytest.fixture
def notify_path(tmp_path):
    listener = NotifySocket(str(tmp_path / "notify.sock"))
    yield listener
    listener.close()


@pytest.fixture
def notify_abstract():
    listener = NotifySocket(f"@lbproxy-test/{uuid.uuid4().hex}")
    yield listener
    listener.close()


def monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def test_notify_one_process_path_socket(name_servers, lbproxy, notify_path, monkeypatch):
    servers = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    config = with_admin(vs_config(port, servers, "rr", "health_check: {type: none}"), admin_port)
    monkeypatch.setenv("NOTIFY_SOCKET", notify_path.address)
    proxy = lbproxy(config, start=False)
    proxy.start()
    ready = notify_path.wait_for("READY")
    assert ready == {"READY": "1", "STATUS": "1 virtual server, 0 active connections"}
    # READY=1 means every listener is bound: the first connection goes through now.
    held, name = open_and_read_name(port)
    try:
        assert name == "a"

        before = monotonic_usec()
        proxy.signal(signal.SIGHUP)
        reloading = notify_path.wait_for("RELOADING")
        assert reloading["RELOADING"] == "1"
        assert before <= int(reloading["MONOTONIC_USEC"]) <= monotonic_usec()
        assert notify_path.wait_for("READY") == {
            "READY": "1",
            "STATUS": "1 virtual server, 1 active connection",
        }

        # A reload through the API is announced the same way, and so is a refused one.
        status, _ = local_http("POST", f"http://127.0.0.1:{admin_port}/api/v1/reload", {})
        assert status == 200
        notify_path.wait_for("READY")
        proxy.config_path.write_text("virtual_servers: [{name: x}]\n")
        status, _ = local_http("POST", f"http://127.0.0.1:{admin_port}/api/v1/reload", {})
        assert status == 400
        notify_path.wait_for("READY")
    finally:
        held.close()

    proxy.signal(signal.SIGTERM)
    stopping = notify_path.wait_for("STOPPING")
    assert stopping["STOPPING"] == "1"
    assert "draining" in stopping["STATUS"]
    assert proxy.proc.wait(10) == 0
    notify_path.drain()
    assert notify_path.events() == [
        "READY", "RELOADING", "READY", "RELOADING", "READY", "RELOADING", "READY", "STOPPING",
    ]  # fmt: skip
    assert {pid for pid, _ in notify_path.messages} == {proxy.proc.pid}


def test_notify_two_workers_abstract_socket(name_servers, lbproxy, notify_abstract, monkeypatch):
    servers = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    monkeypatch.setenv("NOTIFY_SOCKET", notify_abstract.address)
    proxy = lbproxy(workers_config(port, servers, admin_port), start=False)
    proxy.start()
    ready = notify_abstract.wait_for("READY", timeout=20)
    assert ready["STATUS"] == "1 virtual server, 2/2 workers ready"

    pids = [worker["pid"] for worker in workers(admin_port)]
    assert len(pids) == 2 and proxy.proc.pid not in pids
    for pid in pids:  # the workers do not even know the socket
        assert b"NOTIFY_SOCKET=" not in Path(f"/proc/{pid}/environ").read_bytes()

    proxy.signal(signal.SIGHUP)
    reloading = notify_abstract.wait_for("RELOADING")
    assert abs(int(reloading["MONOTONIC_USEC"]) - monotonic_usec()) < 10_000_000
    notify_abstract.wait_for("READY")

    proxy.signal(signal.SIGTERM)
    notify_abstract.wait_for("STOPPING")
    assert proxy.proc.wait(15) == 0
    notify_abstract.drain()
    assert notify_abstract.events() == ["READY", "RELOADING", "READY", "STOPPING"]
    # Only the main process speaks (what NotifyAccess=main accepts).
    assert {pid for pid, _ in notify_abstract.messages} == {proxy.proc.pid}


def test_notify_socket_gone_is_harmless(name_servers, lbproxy, tmp_path, monkeypatch):
    servers = name_servers("a")
    port = free_port()
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens.sock"))
    proxy = lbproxy(vs_config(port, servers, "rr", "health_check: {type: none}"), [port])
    sock, name = open_and_read_name(port)
    sock.close()
    assert name == "a"
    proxy.signal(signal.SIGTERM)
    assert proxy.proc.wait(10) == 0
    log = proxy.log()
    assert log.count("cannot notify") == 1, log
    assert "Traceback" not in log
    assert not os.path.exists(tmp_path / "nobody-listens.sock")


def test_notifier_recovers_when_the_socket_comes_back_and_pops_the_variable(
    tmp_path, monkeypatch, caplog
):
    from lbproxy.runtime.notify import Notifier

    path = tmp_path / "later.sock"
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    notifier = Notifier.from_environment()
    assert "NOTIFY_SOCKET" not in os.environ  # children started from now on never see it
    assert notifier.enabled
    with caplog.at_level("INFO", logger="lbproxy.notify"):
        assert notifier.ready("x") is False
        assert notifier.status("y") is False
        listener = NotifySocket(str(path))
        try:
            assert notifier.stopping("z") is True
            listener.wait_for("STOPPING")
            assert listener.messages[-1][1] == {"STOPPING": "1", "STATUS": "z"}
        finally:
            listener.close()
            notifier.close()
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        f"cannot notify {path}",
        f"notifying {path} again",
    ]
    assert not Notifier().enabled and Notifier().send("READY=1") is False
    assert not Notifier("vsock:2:1234").enabled  # not a Unix socket: not for a local daemon
