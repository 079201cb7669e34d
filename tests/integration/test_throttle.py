"""Admission control end to end: a bounded flood against a real `lbproxy run` process.

One virtual server with `throttle: {max_connections: 10, digg_factor: 2, interval: 200ms,
high_idle_timeout: 3s, min_idle_timeout: 1s}` and its own idle_timeout of 60 s, in front
of one echo server. The mode is read from the process log ("web: throttle low -> high").

  phase 1  8 talking + 4 idle connections (load 1.2): high, imposed idle timeout 2.6 s;
           the idle ones are closed after about 2.6 s (not 60 s), load falls to 0.8: low
  phase 2  20 talking connections (load 2.0): digg; new connections are closed at once
           and counted (the "refused N" of the log line that leaves digg)
  phase 3  down to 17 (load 1.7 < 1.8): high; down to 8 (< 0.9): low, new ones served

"Talking" connections send a line and read its echo every 0.1 s all along, from a
thread; the test fails if any exchange fails or any talking connection is closed.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time

from tests.integration.harness import (
    closed_without_a_byte,
    free_port,
    open_and_read_name,
    run_cli,
    vs_config,
    wait_for,
)

THROTTLE = """
idle_timeout: 60s
throttle:
  max_connections: 10
  digg_factor: 2
  interval: 200ms
  high_idle_timeout: 3s
  min_idle_timeout: 1s
"""
MODE_LINE = re.compile(r"web: throttle (\w+) -> (\w+) \(load ([\d.]+), idle timeout (\S+?)(?:;|\))")


class Talkers:
    """Held connections that keep exchanging data: a line out, the same line back."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.socks: list[socket.socket] = []
        self.errors: list[str] = []
        self.exchanges = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def open(self, n: int) -> None:
        for _ in range(n):
            sock, name = open_and_read_name(self.port)
            assert name == "a"
            sock.settimeout(5)
            with self._lock:
                self.socks.append(sock)

    def close(self, n: int) -> None:
        with self._lock:
            closing, self.socks = self.socks[:n], self.socks[n:]
        for sock in closing:
            sock.close()

    def _run(self) -> None:
        seq = 0
        while not self._stop.wait(0.1):
            with self._lock:
                for i, sock in enumerate(self.socks):
                    seq += 1
                    line = f"ping {i} {seq}\n".encode()
                    try:
                        sock.sendall(line)
                        echo = b""
                        while len(echo) < len(line):
                            chunk = sock.recv(len(line) - len(echo))
                            if not chunk:
                                raise ConnectionError("closed by the proxy")
                            echo += chunk
                        if echo != line:
                            raise ConnectionError(f"echo {echo!r} for {line!r}")
                        self.exchanges += 1
                    except OSError as exc:
                        self.errors.append(f"talker {i}: {exc!r}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.close(len(self.socks))


def test_low_high_digg_and_back(name_servers, lbproxy):
    (server,) = name_servers("a")
    port = free_port()
    proxy = lbproxy(vs_config(port, [server], extra=THROTTLE), wait_ports=[port])
    t0 = time.monotonic()
    seen = 0  # mode lines already reported by wait_mode
    timeline: list[tuple[float, str, str, float, str]] = []

    def wait_mode(mode: str, timeout: float = 3.0) -> tuple[str, str, float, str]:
        def changed_to_mode() -> tuple[str, str, float, str] | None:
            nonlocal seen
            lines = MODE_LINE.findall(proxy.log())
            while seen < len(lines):
                old, new, load, idle = lines[seen]
                seen += 1
                timeline.append((time.monotonic() - t0, old, new, float(load), idle))
                if new == mode:
                    return old, new, float(load), idle
            return None

        return wait_for(changed_to_mode, timeout, f"throttle -> {mode}", details=proxy.log)

    talkers = Talkers(port)
    try:
        # Phase 1: wait_port's probe connection has come and gone; 12 held -> high.
        talkers.open(8)
        idle = [open_and_read_name(port) for _ in range(4)]
        opened = time.monotonic()
        assert all(name == "a" for _, name in idle)
        _, _, load, imposed = wait_mode("high")  # within a few 200 ms intervals
        high_at = time.monotonic() - opened
        assert high_at < 1.5
        assert load >= 1.0
        # 10 to 12 connections held: 3 - 2 x (load - 1) = 3, 2.8 or 2.6 s
        assert imposed in ("3s", "2.8s", "2.6s")
        closed_after = []
        for sock, _ in idle:
            sock.settimeout(10)
            assert sock.recv(100) == b""  # closed by the imposed timeout, not the 60 s one
            closed_after.append(time.monotonic() - opened)
            sock.close()
        assert all(2.0 < t < 4.0 for t in closed_after), closed_after
        old, _, load, _ = wait_mode("low")  # 8 held: load 0.8 < 0.9
        assert (old, load) == ("high", 0.8)

        # Phase 2: 20 held -> digg; new connections are closed at once.
        talkers.open(12)
        wait_mode("digg")
        refused_at = time.monotonic()
        # closed by a live process (the talkers keep talking), counted in the log line below
        assert all(closed_without_a_byte(port, timeout=5) for _ in range(5))
        assert time.monotonic() - refused_at < 2.0
        assert not talkers.errors

        # Phase 3: 17 held (< 18) -> high, then 8 (< 9) -> low; new ones are served.
        talkers.close(3)
        wait_mode("high")
        assert re.search(
            r"throttle digg -> high .*; refused 5 connection\(s\) in digg", proxy.log()
        )
        talkers.close(9)
        wait_mode("low")
        sock, name = open_and_read_name(port)
        sock.close()
        assert name == "a"
        exchanges_before = talkers.exchanges
        # still talking after it all
        wait_for(lambda: talkers.exchanges > exchanges_before, 5, "the talkers to talk on")
        assert not talkers.errors, talkers.errors
        assert len(talkers.socks) == 8
    finally:
        talkers.stop()
    print("\nthrottle timeline (s since the first connection, old -> new, load, idle timeout):")
    for at, old, new, load, imposed in timeline:
        print(f"  {at:6.2f}  {old} -> {new}  load {load:.2f}  idle timeout {imposed}")
    print(f"  idle connections closed after {', '.join(f'{t:.2f}' for t in closed_after)} s")


def _closed_within(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(100) == b""
    except TimeoutError:
        return False


def _wait_log(proxy, pattern: str, count: int = 1, timeout: float = 3.0) -> None:
    def seen() -> bool:
        return len(re.findall(pattern, proxy.log())) >= count

    wait_for(seen, timeout, f"{pattern!r} x{count} in the log", details=proxy.log)


RELOADED_THROTTLE = """
idle_timeout: 60s
throttle:
  max_connections: 2
  digg_factor: 3
  interval: 200ms
  high_idle_timeout: 4s
  min_idle_timeout: 1s
"""


def test_reload_adds_and_removes_the_throttle(name_servers, lbproxy):
    (server,) = name_servers("a")
    port = free_port()
    plain = vs_config(port, [server], extra="idle_timeout: 60s")
    throttled = vs_config(port, [server], extra=RELOADED_THROTTLE)
    proxy = lbproxy(plain, wait_ports=[port])
    held = [open_and_read_name(port)[0] for _ in range(3)]
    opened = time.monotonic()
    # Added by a reload: the monitor starts, finds 3 open (load 1.5) and imposes
    # 4 - 3 x 0.5 / 2 = 3.25 s on the connections that were already there.
    proxy.reload(throttled)
    _wait_log(proxy, re.escape("web: throttle low -> high (load 1.50, idle timeout 3.25s)"))
    assert re.search(r"reloaded: .*web: throttle added", proxy.log())
    for sock in held:
        assert _closed_within(sock, 10)
        sock.close()
    assert 2.5 < time.monotonic() - opened < 5.0
    # The three close within one interval of each other: the step down may be seen
    # with one or two of them still open (load 0.5), never above 0.9.
    _wait_log(proxy, r"web: throttle high -> low \(load 0\.[0-8]\d, idle timeout own\)")

    held = [open_and_read_name(port)[0] for _ in range(3)]
    opened = time.monotonic()
    _wait_log(proxy, "throttle low -> high", count=2)
    # Removed by a reload: back to low, and the connections get their own 60 s again.
    proxy.reload(plain)
    _wait_log(proxy, r"web: throttle high -> low \(load [\d.]+, idle timeout own\)", count=2)
    assert re.search(r"reloaded: .*web: throttle removed", proxy.log())
    time.sleep(max(0.0, opened + 4.5 - time.monotonic()))  # on purpose: past the 3.25 s
    assert not any(_closed_within(sock, 0.05) for sock in held)
    for sock in held:
        sock.close()


def test_imposed_idle_timeout_already_exceeded_closes_at_once(name_servers, lbproxy):
    """Connections idle longer than the idle timeout a throttle imposes end at once,
    while the monitor goes through the real servers' connections, and the proxy goes
    on serving."""
    (server,) = name_servers("a")
    port = free_port()
    plain = vs_config(port, [server], extra="idle_timeout: 60s")
    throttled = vs_config(port, [server], extra=RELOADED_THROTTLE)
    proxy = lbproxy(plain, wait_ports=[port])
    held = [open_and_read_name(port)[0] for _ in range(3)]
    time.sleep(3.6)  # on purpose: idle longer than the 3.25 s the throttle will impose
    proxy.reload(throttled)
    _wait_log(proxy, re.escape("web: throttle low -> high (load 1.50, idle timeout 3.25s)"))
    for sock in held:
        assert _closed_within(sock, 1.0)  # now, not 3.25 s from now
        sock.close()
    sock, name = open_and_read_name(port)
    sock.close()
    assert name == "a"
    assert "Traceback" not in proxy.log()


def test_simulate_shows_the_throttle_timeline(tmp_path):
    config = tmp_path / "vs.yaml"
    config.write_text(
        "virtual_servers:\n"
        "  - name: web\n"
        "    listen: 127.0.0.1:8080\n"
        "    throttle: {max_rate: 50, interval: 1s}\n"
        "    real_servers:\n"
        "      - {name: s1, address: 127.0.0.1:9001}\n"
    )
    events = tmp_path / "events.yaml"
    events.write_text("- {before: 21, rate: 200}\n- {before: 421, rate: 5}\n")
    out = run_cli("simulate", str(config), "-n", "430", "--events", str(events), "--json")
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    throttle = document["throttle"]
    timeline = throttle["timeline"]
    assert [step["mode"] for step in timeline] == ["high", "digg", "high", "low"]
    # 10/s until #20 (t=1.9), 200/s from #21 (every 5 ms): the arrival that finds 50
    # in the last second goes high, the one that finds 100 digg, without waiting for
    # the evaluation at t=3 (the 1 s window counts an arrival for 0.95 to 1 s)
    high, digg = timeline[0], timeline[1]
    assert (high["time"], high["connection"], high["load"]) == (2.115, 63, 1.0)
    assert (digg["time"], digg["connection"], digg["idle_timeout"]) == (2.38, 116, 1.0)
    assert throttle["refused"] == document["sequence"].count(None) > 0
    table = run_cli("simulate", str(config), "-n", "430", "--events", str(events))
    assert table.returncode == 0, table.stderr
    assert f"throttle: {throttle['refused']} connection(s) refused in digg" in table.stdout
    assert "digg" in table.stdout and "own" in table.stdout


# -- each limit alone, and both: the mode goes up at the arrival that reaches it ---------


def _with_admin(config: str, admin_port: int) -> str:
    return config.replace("admin: {listen: none}", f"admin: {{listen: 127.0.0.1:{admin_port}}}")


def _metric(admin_port: int, name: str, **labels) -> float:
    from tests.integration.harness import metrics, sample

    return sample(metrics(admin_port), name, virtual_server="web", **labels)


def _burst(port: int, n: int) -> tuple[int, int, float]:
    """`n` short connections, one after the other, as fast as one client opens them:
    (served, refused, connections per second)."""
    served = refused = 0
    started = time.monotonic()
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            if sock.recv(100):
                served += 1
            else:
                refused += 1
    return served, refused, n / (time.monotonic() - started)


def test_rate_only_reaches_digg_during_the_burst(name_servers, lbproxy):
    # SPEC section 5 with only max_rate: load = rate / 5; digg from 10 arrivals within a
    # second. Two slow long-lived connections stay open (and talking) throughout.
    (server,) = name_servers("a")
    port, admin_port = free_port(), free_port()
    extra = "throttle: {max_rate: 5, interval: 500ms}"
    proxy = lbproxy(_with_admin(vs_config(port, [server], extra=extra), admin_port), [port])
    time.sleep(1.1)  # on purpose: wait_port's probe leaves the one-second rate window
    talkers = Talkers(port)
    try:
        talkers.open(2)
        served, refused, rate = _burst(port, 100)
        mode = _metric(admin_port, "lbproxy_throttle_mode")
        print(f"\nrate-only burst: {rate:.0f}/s, {served} served, {refused} refused")
        assert rate > 60
        # 2 talkers + the served ones make the 10 arrivals of the last second that digg
        # starts at (an 11th refused); every later one is refused at once
        assert served <= 8 and refused == 100 - served, proxy.log()
        assert mode == 2
        assert _metric(admin_port, "lbproxy_rejected_connections_total", reason="throttle") == (
            refused
        )
        assert re.search(r"web: throttle \w+ -> digg", proxy.log())
        # the burst is over: digg -> high -> low once the window has emptied
        _wait_log(proxy, r"web: throttle high -> low", timeout=5)
        sock, name = open_and_read_name(port)
        sock.close()
        assert name == "a"
        assert not talkers.errors and len(talkers.socks) == 2 and talkers.exchanges > 0
    finally:
        talkers.stop()


def test_connections_only_reaches_digg_without_waiting_for_the_interval(name_servers, lbproxy):
    # max_connections 4, digg_factor 2: the arrival that finds 8 open is refused, even
    # though the monitor's next evaluation is 10 s away.
    (server,) = name_servers("a")
    port, admin_port = free_port(), free_port()
    extra = "throttle: {max_connections: 4, interval: 10s}"
    proxy = lbproxy(_with_admin(vs_config(port, [server], extra=extra), admin_port), [port])
    wait_for(
        lambda: not _metric(admin_port, "lbproxy_active_connections", real_server="a"),
        5,
        "wait_port's probe connection to end",
    )
    held = [open_and_read_name(port) for _ in range(8)]
    try:
        assert [name for _, name in held] == ["a"] * 8
        assert re.search(r"web: throttle low -> high \(load 1\.00,", proxy.log())  # 5th
        assert closed_without_a_byte(port)
        assert _metric(admin_port, "lbproxy_throttle_mode") == 2
        assert _metric(admin_port, "lbproxy_rejected_connections_total", reason="throttle") == 1
        assert re.search(r"web: throttle high -> digg \(load 2\.00,", proxy.log())
    finally:
        for sock, _ in held:
            sock.close()


def test_connections_and_rate_together(name_servers, lbproxy):
    # load = max(active / 10, rate / 10): 12 held make it high, a burst on top makes it
    # digg, and when the burst has left the window the connections keep it high.
    (server,) = name_servers("a")
    port, admin_port = free_port(), free_port()
    extra = "throttle: {max_connections: 10, max_rate: 10, interval: 300ms}"
    proxy = lbproxy(_with_admin(vs_config(port, [server], extra=extra), admin_port), [port])
    time.sleep(1.1)  # on purpose: wait_port's probe leaves the one-second rate window
    talkers = Talkers(port)
    try:
        for _ in range(12):  # 6 per second: the rate alone stays low
            talkers.open(1)
            time.sleep(0.16)  # the arrivals' pace
        _wait_log(proxy, r"web: throttle low -> high")
        assert "-> digg" not in proxy.log()
        served, refused, rate = _burst(port, 60)
        print(f"\ncombined burst: {rate:.0f}/s, {served} served, {refused} refused")
        assert rate > 60
        # 20 arrivals in the last second make digg: the ~6 held ones of that second and
        # the first ~14 of the burst
        assert served <= 16 and refused == 60 - served, proxy.log()
        assert _metric(admin_port, "lbproxy_throttle_mode") == 2
        _wait_log(proxy, r"web: throttle digg -> high", timeout=5)
        time.sleep(0.7)  # on purpose: two more evaluations; 12 open keep it high (load 1.2)
        assert "high -> low" not in proxy.log()
        assert _metric(admin_port, "lbproxy_throttle_mode") == 1
        assert not talkers.errors and len(talkers.socks) == 12
        talkers.close(12)
        _wait_log(proxy, r"web: throttle high -> low", timeout=5)
    finally:
        talkers.stop()
