"""The stop signals an operator coming from HAProxy (SIGUSR1, its soft stop) or nginx
(SIGQUIT, its graceful shutdown) sends: each drains as SIGTERM does, against real
`lbproxy run` processes, one process and `workers: 2` (the supervisor is signalled)."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from tests.integration.harness import (
    admin_socket_path,
    free_port,
    listening,
    open_and_read_name,
    vs_config,
    wait_for,
    with_admin,
    workers_config,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGQUIT], ids=["SIGUSR1", "SIGQUIT"])
def test_sigusr1_and_sigquit_drain_like_sigterm(name_servers, lbproxy, signum, workers):
    servers = name_servers("a")
    port, admin_port = free_port(), free_port()
    if workers == 1:
        config = with_admin(
            vs_config(port, servers, "rr", "health_check: {type: none}"), admin_port
        )
    else:
        config = workers_config(port, servers, admin_port, workers)
    # longer than the test: the exit follows the held connection's end, not the timeout
    proxy = lbproxy(config.replace("drain_timeout: 5s", "drain_timeout: 60s"))
    admin_socket = Path(admin_socket_path(admin_port))
    assert admin_socket.exists()
    held, _ = open_and_read_name(port)
    try:
        proxy.signal(signum)
        wait_for(lambda: not listening(port), what="the listener to close")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        held.sendall(b"still here")  # the established connection is still served
        assert held.recv(100) == b"still here"
        assert proxy.proc.poll() is None  # drained, not killed
    finally:
        held.close()
    assert proxy.proc.wait(15) == 0
    assert not admin_socket.exists()  # removed, as at any clean stop
    log = proxy.log()
    assert f"received {signal.Signals(signum).name}" in log  # which signal started it
    assert "stopped accepting; draining 1 connection(s)" in log
