"""The harness's own checks: a test that starts lbproxy fails when the process ended by
itself, exited non-zero on a clean stop, or logged a traceback nobody expected; and a
rejection counts only from a live process."""

from __future__ import annotations

import os
import signal
import socket
import threading

import pytest

from tests.integration.harness import (
    Lbproxy,
    closed_without_a_byte,
    free_port,
    tracebacks,
    vs_config,
)

LOG = """\
2026-12-03 07:00:00,000 INFO lbproxy.server: listening on 127.0.0.1:1
2026-12-03 07:00:01,000 ERROR lbproxy.barrier: internal error in pick (web)
Traceback (most recent call last):
  File "lbproxy/dataplane/connection.py", line 1, in accept
    rs = pool.pick(now)
RuntimeError: injected pick failure
2026-12-03 07:00:02,000 INFO lbproxy.server: stopped
"""


def test_tracebacks_are_cut_at_their_exception_line():
    (block,) = tracebacks(LOG)
    assert block.startswith("Traceback (most recent call last):")
    assert block.endswith("RuntimeError: injected pick failure")
    assert tracebacks(LOG.replace("Traceback", "Trace")) == []


class Nowhere:  # a real server nothing listens on: no test here connects
    name = "a"
    port = free_port()


def started(tmp_path) -> Lbproxy:
    config = vs_config(free_port(), [Nowhere], extra="health_check: {type: none}")
    return Lbproxy(tmp_path, config).start()


def test_a_clean_stop_passes_and_a_crash_fails(tmp_path):
    proxy = started(tmp_path)
    assert proxy.stop() == 0  # SIGTERM: exit 0, no traceback: nothing to report

    proxy = started(tmp_path)
    os.kill(proxy.proc.pid, signal.SIGKILL)  # from outside the test's Popen: a "crash"
    proxy.proc.wait(10)
    with pytest.raises(AssertionError, match="exited by itself"):
        proxy.stop()


def test_a_kill_by_the_test_is_fine_only_when_declared(tmp_path):
    proxy = started(tmp_path)
    proxy.signal(signal.SIGKILL)
    proxy.proc.wait(10)
    with pytest.raises(AssertionError, match="exited -9, expected 0"):
        proxy.stop()
    proxy = started(tmp_path)
    proxy.expected_exit = -signal.SIGKILL
    proxy.signal(signal.SIGKILL)
    assert proxy.stop() == -signal.SIGKILL


def test_an_unexpected_traceback_fails_an_expected_one_does_not(tmp_path):
    proxy = started(tmp_path)
    proxy.stop(check=False)
    with open(proxy.log_path, "a") as log:  # as if lbproxy had logged it
        log.write(LOG)
    with pytest.raises(AssertionError, match="1 unexpected traceback"):
        proxy.check()
    proxy.expected_tracebacks = ("RuntimeError: injected",)
    proxy.check()


def test_a_refused_connect_is_not_a_rejection():
    port = free_port()  # nothing listens: a dead proxy
    assert not closed_without_a_byte(port)
    with socket.create_server(("127.0.0.1", port)) as listener:
        # accepted and closed without a byte: what lbproxy does to a client it turns away
        closer = threading.Thread(target=lambda: listener.accept()[0].close())
        closer.start()
        assert closed_without_a_byte(port)
        closer.join(5)
