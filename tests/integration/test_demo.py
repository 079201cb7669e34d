"""`lbproxy demo` as a real process: first line, the wlc split, the table, clean exits."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from collections import Counter

import pytest

from tests.integration.harness import ROOT, ask_name, open_and_read_name, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

NAMES = ("alpha", "bravo", "charlie")
FIRST_LINE = re.compile(r"lbproxy demo: connect to 127\.0\.0\.1:(\d+)\n")


def start_demo(duration: float) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lbproxy", "demo", "--port", "0", "--duration", str(duration)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # flushed by the demo before anything else
    match = FIRST_LINE.fullmatch(first)
    if match is None:
        proc.kill()
        proc.wait()
        pytest.fail(f"unexpected first line {first!r}\nstderr: {proc.stderr.read()}")
    return proc, int(match.group(1))


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    """Wait for the exit, then read the rest of the output.

    Not `communicate()`: it reads the file descriptors directly and would lose what
    `readline()` already buffered. The demo writes little, so the pipes cannot fill.
    """
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the demo did not exit\nstdout: {proc.stdout.read()}")
    return proc.returncode, proc.stdout.read(), proc.stderr.read()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stdout.close()
    proc.stderr.close()


def assert_table(out: str) -> None:
    for name in NAMES:
        assert re.search(rf"^\[\s*\w+\] {name}\s+127\.0\.0\.1:\d+\s+weight", out, re.M), out
    assert out.rstrip().endswith("lbproxy demo: stopped"), out


def test_held_connections_split_by_weight_and_the_demo_stops_by_itself():
    proc, port = start_demo(duration=8)
    try:
        held = [open_and_read_name(port) for _ in range(12)]
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
        code, out, err = finish(proc, timeout=15)
    finally:
        stop(proc)
    assert code == 0, err
    assert f"nc 127.0.0.1 {port}" in out
    assert_table(out)
    # the last table has every connection counted and none still open
    final = {
        m.group(1): (int(m.group(2)), int(m.group(3)))
        for m in re.finditer(r"^\[final\] (\w+) .* active (\d+)\s+total (\d+)", out, re.M)
    }
    assert final == {"alpha": (0, 2), "bravo": (0, 4), "charlie": (0, 6)}, out
    assert "Traceback" not in err


def test_sigint_stops_everything_with_exit_code_0():
    proc, port = start_demo(duration=60)  # the signal, not the duration, stops it
    try:
        answers = [ask_name(port) for _ in range(6)]
        assert set(answers) <= set(NAMES), answers
        held, name = open_and_read_name(port)  # a connection still open at Ctrl-C
        assert name in NAMES
        try:
            proc.send_signal(signal.SIGINT)
            code, out, err = finish(proc, timeout=8)
        finally:
            held.close()
    finally:
        stop(proc)
    assert code == 0, err
    assert_table(out)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def test_a_port_in_use_is_exit_code_1_naming_the_address():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli("demo", "--port", str(port), "--duration", "5", timeout=20)
    assert result.returncode == 1, result
    assert f"127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
    assert "connect to" not in result.stdout
