"""Slow start seen live, through a real `lbproxy run` process, real sockets and HTTP.

wrr with real servers a and b, weight 10 each, `slow_start: 4s`. b is down (nothing
listens on its port) until the test starts it; its health comes back at the next check
and the ramp begins: effective weight 10 x max(0.1, elapsed / 4).

- The weight shown (`lbproxy_real_server_weight{kind="effective"}`, the JSON document,
  `lbproxy status --json`) is the one the scheduler uses at the moment of the read,
  with no connection arriving meanwhile: 10 x 1.6 / 4 = 4 at 1.6 s.
- The scheduler follows the ramp second by second: b goes down and comes back, and its
  share of short connections grows in each second of the new ramp, as the weights say.

One process for both (a's own start-up ramp is waited out once).
"""

from __future__ import annotations

import json
import time

from tests.integration.harness import (
    NameServer,
    ask_name,
    free_port,
    http,
    metrics,
    run_cli,
    sample,
    vs_config,
    wait_for,
    with_admin,
)

RAMP = 4.0
EXTRA = (
    f"slow_start: {RAMP:g}s\n"
    "health_check: {type: tcp, interval: 100ms, timeout: 100ms, rise: 1, fall: 1}"
)
STEP = RAMP / 50  # the pool recomputes a ramping weight every T / 50 (pool.py)


class Absent:
    """A real server's place before it runs: a port nothing listens on yet."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()


def _gauge(admin_port: int, name: str, rs: str = "b", **labels) -> float:
    return sample(metrics(admin_port), name, virtual_server="web", real_server=rs, **labels)


def _wait_gauge(admin_port: int, name: str, value: float, rs: str = "b", **labels) -> None:
    wait_for(lambda: _gauge(admin_port, name, rs, **labels) == value, 10, f"{name} {rs} {value}")


def _bring_up(admin_port: int, name_servers, port: int) -> tuple[NameServer, tuple[float, float]]:
    """Start b on `port`; returns it and when its health came back: within [up_at[0],
    up_at[1]] (monotonic seconds), as the metric shows it."""
    (b,) = name_servers("b", port=port)
    before = time.monotonic()  # the last poll that saw it down

    def up_within() -> tuple[float, float] | None:
        nonlocal before
        polled = time.monotonic()
        if _gauge(admin_port, "lbproxy_real_server_up") == 1:
            return before, time.monotonic()
        before = polled
        return None

    return b, wait_for(up_within, 10, "b up", interval=0.01)


def _bracket(up_at: tuple[float, float], read_at: tuple[float, float]) -> tuple[float, float]:
    """The effective weight b may show for a read made within `read_at`: the ramp at
    the earliest and latest possible elapsed time, less one step for the lower bound."""
    low = (read_at[0] - up_at[1] - STEP) / RAMP
    high = (read_at[1] - up_at[0]) / RAMP
    return 10 * min(1.0, max(0.1, low)), 10 * min(1.0, max(0.1, high))


def test_slow_start_is_shown_live_and_followed_second_by_second(name_servers, lbproxy):
    (a,) = name_servers("a")
    absent = Absent("b")
    port, admin_port = free_port(), free_port()
    config = vs_config(
        port, [a, absent], "wrr", EXTRA, rs_extra={"a": "weight: 10", "b": "weight: 10"}
    )
    started = time.monotonic()
    proxy = lbproxy(with_admin(config, admin_port), [port])
    # b is down; a's own start-up ramp (servers ramp at start-up too) is over.
    _wait_gauge(admin_port, "lbproxy_real_server_up", 0)
    time.sleep(max(0.0, started + RAMP + 0.1 - time.monotonic()))  # on purpose: a's ramp ends

    # 1. The weight shown, with no connection arriving during the ramp.
    b, up_at = _bring_up(admin_port, name_servers, absent.port)
    seen = []  # (where, shown, lowest allowed, highest allowed)
    time.sleep(max(0.0, up_at[1] + 1.6 - time.monotonic()))  # on purpose: 1.6 s into b's ramp
    read_at = time.monotonic()
    shown = _gauge(admin_port, "lbproxy_real_server_weight", kind="effective")
    seen.append(("/metrics", shown, *_bracket(up_at, (read_at, time.monotonic()))))
    # ~4 = 10 x 1.6 / 4; tolerance 0.5 = 0.2 s of ramp (polling, the 80 ms step, load)
    assert abs(shown - 4.0) <= 0.5, (shown, proxy.log())

    read_at = time.monotonic()
    status, body = http("GET", f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers")
    assert status == 200
    (vs,) = json.loads(body)["virtual_servers"]
    (doc,) = (rs for rs in vs["real_servers"] if rs["name"] == "b")
    seen.append(("JSON", doc["weight"]["effective"], *_bracket(up_at, (read_at, time.monotonic()))))

    read_at = time.monotonic()
    out = run_cli("status", "--json", "--admin", f"http://127.0.0.1:{admin_port}")
    assert out.returncode == 0, out.stderr
    (vs,) = json.loads(out.stdout)["virtual_servers"]
    (doc,) = (rs for rs in vs["real_servers"] if rs["name"] == "b")
    seen.append(
        ("status", doc["weight"]["effective"], *_bracket(up_at, (read_at, time.monotonic())))
    )

    print("\nslow start 4 s, weight 10: effective weight shown [allowed range]")
    for where, value, low, high in seen:
        print(f"  {where:9} {value:6.3f}  [{low:.3f}, {high:.3f}]")
    for where, value, low, high in seen:
        assert low - 1e-3 <= value <= high + 1e-3, (where, value, low, high)
    assert seen[0][1] < seen[2][1] < 10  # still ramping, and moving

    # 2. b goes down and comes back: a new ramp, and the scheduler follows it.
    b.stop()
    _wait_gauge(admin_port, "lbproxy_real_server_up", 0)
    _, up_at = _bring_up(admin_port, name_servers, absent.port)
    picks: list[tuple[float, str]] = []  # (seconds since b came up, server)
    while True:  # short connections, each closed before the next, ~50 per second
        at = time.monotonic()
        if at - up_at[1] >= RAMP:
            break
        picks.append((at - up_at[0], ask_name(port)))
        time.sleep(max(0.0, at + 0.02 - time.monotonic()))  # the connections' pace
    shares, expected = [], []
    for second in range(int(RAMP)):
        names = [name for t, name in picks if second <= t < second + 1]
        assert len(names) >= 20, (second, len(names))  # enough to measure a share
        shares.append(names.count("b") / len(names))
        expected.append(_expected_share(second))
    print("b's share in each second of the ramp:", " ".join(f"{s:.2f}" for s in shares))
    print("expected from the weights:           ", " ".join(f"{s:.2f}" for s in expected))
    # each second within 0.1 of what the weights give (0.13, 0.27, 0.38, 0.47), and
    # growing: the ramp, not one step at its end
    assert all(abs(s - e) <= 0.1 for s, e in zip(shares, expected, strict=True)), shares
    assert shares == sorted(shares) and shares[0] < 0.25 < shares[1] and shares[2] > 0.28
    assert proxy.proc.poll() is None


def _expected_share(second: int, samples: int = 1000) -> float:
    """b's share with weights 10 x f(t) and 10, f = max(0.1, t / 4), over one second."""
    total = 0.0
    for i in range(samples):
        f = min(1.0, max(0.1, (second + (i + 0.5) / samples) / RAMP))
        total += f / (1 + f)
    return total / samples
