"""The pure throttle model (lbproxy/core/throttle.py) on a fake clock: time is just a float."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbproxy.config.model import ThrottleConfig
from lbproxy.core.throttle import (
    DIGG,
    HIGH,
    LOW,
    RateWindow,
    Throttle,
    imposed_idle_timeout,
    load_of,
    next_mode,
)

DWR = ThrottleConfig(max_connections=100)  # defaults: digg 2, 49 s -> 1 s


def test_module_is_pure():
    code = "import sys, lbproxy.core.throttle; print('trio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- load ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "active", "rate", "load"),
    [
        (ThrottleConfig(max_connections=10), 5, 1000.0, 0.5),  # no max_rate: rate ignored
        (ThrottleConfig(max_rate=100.0), 1000, 50.0, 0.5),  # no max_connections
        (ThrottleConfig(max_connections=10, max_rate=100.0), 5, 150.0, 1.5),  # the larger
        (ThrottleConfig(max_connections=10, max_rate=100.0), 30, 150.0, 3.0),
        (ThrottleConfig(max_connections=10, max_rate=100.0), 0, 0.0, 0.0),
    ],
)
def test_load_is_the_larger_of_the_configured_ratios(config, active, rate, load):
    assert load_of(config, active, rate) == pytest.approx(load)


# -- modes and hysteresis --------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "load", "expected"),
    [
        # going up is immediate
        (LOW, 0.0, LOW),
        (LOW, 0.999, LOW),
        (LOW, 1.0, HIGH),
        (LOW, 1.999, HIGH),
        (LOW, 2.0, DIGG),  # straight to digg
        (HIGH, 2.0, DIGG),
        # leaving high needs load < 0.9
        (HIGH, 0.95, HIGH),
        (HIGH, 0.9, HIGH),
        (HIGH, 0.899, LOW),
        # leaving digg needs load < 1.8, and goes to high first
        (DIGG, 1.9, DIGG),
        (DIGG, 1.8, DIGG),
        (DIGG, 1.799, HIGH),
        (DIGG, 0.0, HIGH),  # one step down per evaluation, even from an empty server
    ],
)
def test_next_mode(mode, load, expected):
    assert next_mode(mode, load, 2.0) == expected


def test_no_flapping_at_the_boundaries():
    # A load wobbling around 1 (and around digg_factor) changes the mode once, not per wobble.
    mode, changes = LOW, 0
    for load in [0.95, 1.0, 0.95, 1.02, 0.93, 0.99, 1.01, 0.91] * 10:
        new = next_mode(mode, load, 2.0)
        changes += new != mode
        mode = new
    assert (mode, changes) == (HIGH, 1)
    for load in [1.95, 2.0, 1.9, 2.05, 1.85, 1.99] * 10:
        new = next_mode(mode, load, 2.0)
        changes += new != mode
        mode = new
    assert (mode, changes) == (DIGG, 2)


# -- the imposed idle timeout ------------------------------------------------------------


def test_dwr_numbers_with_the_defaults():
    assert imposed_idle_timeout(DWR, LOW, 0.5) is None
    assert imposed_idle_timeout(DWR, HIGH, 1.0) == 49.0  # start of high usage
    assert imposed_idle_timeout(DWR, HIGH, 1.5) == pytest.approx(25.0)  # linear
    assert imposed_idle_timeout(DWR, HIGH, 1.75) == pytest.approx(13.0)
    assert imposed_idle_timeout(DWR, DIGG, 2.0) == 1.0  # the floor where digg starts
    assert imposed_idle_timeout(DWR, DIGG, 5.0) == 1.0


def test_linear_shrink_between_the_limits():
    config = ThrottleConfig(
        max_connections=10, digg_factor=3.0, high_idle_timeout=21.0, min_idle_timeout=1.0
    )
    # 21 s at load 1 falling by 10 s per unit of load to 1 s at load 3
    for load, timeout in [(1.0, 21.0), (1.5, 16.0), (2.0, 11.0), (2.5, 6.0), (2.9, 2.0)]:
        assert imposed_idle_timeout(config, HIGH, load) == pytest.approx(timeout)


def test_floor_and_clamps_in_the_hysteresis_bands():
    # high kept by the hysteresis (0.9 <= load < 1) imposes the high timeout, not more
    assert imposed_idle_timeout(DWR, HIGH, 0.92) == 49.0
    # digg kept by the hysteresis (1.8 <= load < 2) imposes the floor
    assert imposed_idle_timeout(DWR, DIGG, 1.85) == 1.0
    # never below the floor, whatever the load
    assert imposed_idle_timeout(DWR, HIGH, 7.0) == 1.0


# -- the rate window -------------------------------------------------------------------


def test_rate_window_slides():
    window = RateWindow(1.0, 20)
    for i in range(10):  # 10 arrivals at 100.01, 100.06, ... 100.46 (one per bucket)
        window.add(100.01 + i * 0.05)
    assert window.count(100.5) == 10
    assert window.count(100.97) == 10  # still all inside the last second
    assert window.count(101.02) == 9  # the arrival at 100.01 slid out
    assert window.count(101.27) == 4
    assert window.count(101.5) == 0
    window.add(200.0)  # a long gap: everything old is gone at once
    assert window.count(200.0) == 1
    assert window.rate(200.5) == 1.0


def test_rate_window_resolution_is_one_bucket():
    window = RateWindow(1.0, 20)
    window.add(10.0)
    assert window.count(10.0 + 0.949) == 1
    assert window.count(10.0 + 1.0) == 0


def test_rate_window_counts_bursts():
    window = RateWindow()
    window.add(5.0, 500)
    window.add(5.5, 250)
    assert window.rate(5.9) == 750.0
    assert window.rate(6.2) == 250.0


# -- the stateful model ------------------------------------------------------------------


def test_rate_drives_the_mode_and_every_arrival_counts():
    throttle = Throttle(ThrottleConfig(max_rate=10.0, interval=0.2))
    now = 50.0
    for _ in range(8):  # 8 arrivals within 0.4 s: load 0.8 by the rate
        assert throttle.arrival(now) is None and not throttle.refusing
        now += 0.05
    assert throttle.evaluate(0, now) is None  # still low
    for _ in range(12):  # refused or not, arrivals count: 20 in the last second
        throttle.window.add(now)
    change = throttle.evaluate(0, now)
    assert (change.mode, throttle.refusing) == (DIGG, True)
    assert throttle.arrival(now) is None and throttle.refusing  # refused, and counted
    assert throttle.rate(now) == 21.0
    # the flood stops: the window empties, digg steps down to high, then low
    assert throttle.evaluate(0, now + 1.1).mode == HIGH
    assert throttle.evaluate(0, now + 1.3).mode == LOW
    assert throttle.idle(0, now + 1.3)


def test_the_arrival_that_reaches_the_rate_threshold_takes_the_mode_up_at_once():
    # max_rate 10, digg_factor 2: no evaluation in between, the arrival that finds 10
    # arrivals in the last second goes high, the one that finds 20 goes digg (refused)
    throttle = Throttle(ThrottleConfig(max_rate=10.0, interval=60.0))
    seen = []
    for i in range(23):  # one every 40 ms (25/s): all within one second
        change = throttle.arrival(50.0 + i * 0.04)
        seen.append((i + 1, change.mode if change else None, throttle.refusing))
    assert [(n, mode) for n, mode, _ in seen if mode] == [(11, HIGH), (21, DIGG)]
    assert [n for n, _, refused in seen if refused] == [21, 22, 23]
    assert throttle.load == 2.0
    assert throttle.rate(50.0 + 22 * 0.04) == 23.0  # the refused ones count too


def test_the_arrival_that_finds_the_connection_threshold_takes_the_mode_up():
    throttle = Throttle(ThrottleConfig(max_connections=4, interval=60.0))
    modes = []
    for open_now in range(10):  # one arrival each time one more connection is open
        change = throttle.arrival(1.0 + open_now, open_now)
        modes.append((open_now, change.mode if change else None, throttle.refusing))
    assert [(n, mode) for n, mode, _ in modes if mode] == [(4, HIGH), (8, DIGG)]
    assert [n for n, _, refused in modes if refused] == [8, 9]
    assert throttle.idle_timeout == 1.0  # digg imposes min_idle_timeout


def test_both_limits_the_larger_load_takes_the_mode_up():
    throttle = Throttle(ThrottleConfig(max_connections=10, max_rate=10.0, interval=60.0))
    change = throttle.arrival(1.0, 10)  # 10 open: load 1 by the connections
    assert (change.mode, change.load) == (HIGH, 1.0)
    for i in range(19):  # 19 more arrivals at 12 open: load 1.2, then the rate
        assert throttle.arrival(1.0 + i * 0.01, 12) is None
    change = throttle.arrival(1.2, 12)  # finds 20 in the last second: load 2
    assert (change.old_mode, change.mode, change.load) == (HIGH, DIGG, 2.0)
    assert throttle.refusing


@given(
    st.floats(0.1, 1000.0),
    st.integers(1, 1000),
    st.floats(1.01, 10.0),
)
def test_the_arrival_triggers_are_exactly_the_thresholds(max_rate, max_connections, digg):
    config = ThrottleConfig(max_rate=max_rate, max_connections=max_connections, digg_factor=digg)
    for threshold, mode in ((1.0, LOW), (digg, HIGH)):
        throttle = Throttle(config)
        throttle.mode = mode
        throttle._set_triggers()
        # the smallest count that reaches the threshold (the load grows with the count)
        rate_n, active_n = throttle._rate_trigger, throttle._active_trigger
        assert load_of(config, 0, float(rate_n)) >= threshold  # window: 1 s
        assert rate_n == 0 or load_of(config, 0, float(rate_n - 1)) < threshold
        assert load_of(config, active_n, 0.0) >= threshold
        assert active_n == 0 or load_of(config, active_n - 1, 0.0) < threshold


def test_entry_and_exit_of_digg_with_held_connections():
    throttle = Throttle(ThrottleConfig(max_connections=10, high_idle_timeout=10.0))
    timeline = []
    for now, active in enumerate([5, 9, 10, 14, 19, 20, 25, 19, 18, 17, 12, 9, 8, 0]):
        change = throttle.evaluate(active, float(now))
        if change and change.mode_changed:
            timeline.append((active, change.mode, change.idle_timeout))
    assert timeline == [
        (10, HIGH, 10.0),
        (20, DIGG, 1.0),
        (17, HIGH, pytest.approx(3.7)),  # 10 - 9 x 0.7  # 19 and 18 are >= 0.9 x 20: still digg
        (8, LOW, None),  # 9 is >= 0.9 x 10: still high
    ]


def test_straight_to_digg_and_one_step_down_at_a_time():
    throttle = Throttle(ThrottleConfig(max_connections=10))
    assert throttle.evaluate(30, 1.0).mode == DIGG
    assert throttle.evaluate(0, 2.0).mode == HIGH
    assert throttle.evaluate(0, 3.0).mode == LOW


def test_idle_timeout_is_announced_when_it_moves_more_than_two_percent():
    throttle = Throttle(ThrottleConfig(max_connections=100, high_idle_timeout=49.0))
    assert throttle.evaluate(100, 0.0).idle_timeout == 49.0
    assert throttle.evaluate(101, 1.0) is None  # 48.52 s: within 2 % of 49
    change = throttle.evaluate(103, 2.0)
    assert not change.mode_changed
    assert change.idle_timeout == pytest.approx(47.56)
    assert throttle.idle_timeout == pytest.approx(47.56)
    assert throttle.evaluate(103, 3.0) is None  # steady load: nothing to re-apply


def test_reset_when_the_virtual_server_empties():
    throttle = Throttle(ThrottleConfig(max_connections=10))
    throttle.arrival(1.0)
    throttle.evaluate(25, 1.0)
    assert not throttle.idle(0, 1.5)  # an arrival within the last second
    assert throttle.idle(0, 2.1)
    change = throttle.reset(2.1)
    assert (change.old_mode, change.mode, change.idle_timeout) == (DIGG, LOW, None)
    assert (throttle.refusing, throttle.idle_timeout) == (False, None)
    assert throttle.reset(2.2) is None  # already low


def test_reconfigure_applies_at_the_next_evaluation():
    throttle = Throttle(ThrottleConfig(max_connections=10))
    throttle.evaluate(12, 1.0)
    assert throttle.mode == HIGH
    throttle.reconfigure(ThrottleConfig(max_connections=100))
    assert throttle.mode == HIGH
    assert throttle.evaluate(12, 2.0).mode == LOW


# -- lbproxy simulate ------------------------------------------------------------------


def _vs(throttle: ThrottleConfig | None, n_servers: int = 2):
    from lbproxy.config.model import Address, RealServerConfig, VirtualServerConfig

    servers = tuple(
        RealServerConfig(f"s{i}", Address("127.0.0.1", 9000 + i)) for i in range(1, n_servers + 1)
    )
    return VirtualServerConfig(
        "web", (Address("127.0.0.1", 8080),), servers, scheduler="rr", throttle=throttle
    )


def _events(text: str):
    from lbproxy.tools.simulate import parse_events

    return parse_events(text, "events.yaml", ["s1", "s2"])


def test_simulate_without_throttle_has_no_timeline():
    from lbproxy.tools.simulate import simulate

    result = simulate(_vs(None), 5)
    assert result.throttle is None
    assert "throttle" not in result.as_json()


def test_simulate_rate_events_advance_time():
    from lbproxy.tools.simulate import simulate

    events = _events("- {before: 3, rate: 2}\n- {before: 5, rate: 100}\n")
    result = simulate(_vs(None), 6, events=events, rate=10, explain=True)
    # 0, 0.1 at 10/s; then 0.5 s gaps at 2/s; then 0.01 s gaps at 100/s
    assert [p.time for p in result.explain] == pytest.approx([0, 0.1, 0.6, 1.1, 1.11, 1.12])


def test_simulate_rate_flood_goes_high_digg_and_back():
    from lbproxy.tools.simulate import simulate

    config = ThrottleConfig(max_rate=50.0, interval=1.0)
    # 30/s for 2 s, 75/s for 2 s (high), 150/s for 2 s (digg), then 5/s
    events = _events(
        "- {before: 61, rate: 75}\n- {before: 211, rate: 150}\n- {before: 511, rate: 5}\n"
    )
    result = simulate(_vs(config), 530, events=events, rate=30)
    timeline = result.throttle.as_json()["timeline"]
    modes = [step["mode"] for step in timeline]
    assert modes[0] == "high"
    assert "digg" in modes
    assert timeline[-1]["mode"] == "low"
    digg = next(step for step in timeline if step["mode"] == "digg")
    back = next(step for step in timeline if step["time"] > digg["time"] and step["mode"] != "digg")
    assert back["mode"] == "high"  # one step down, then low
    # arrivals between entering and leaving digg are refused: null in sequence, counted
    refused = [i + 1 for i, name in enumerate(result.sequence) if name is None]
    assert refused == list(range(digg["connection"], back["connection"]))
    assert result.throttle.refused == len(refused)
    assert result.picks["s1"] + result.picks["s2"] == 530 - len(refused)
    # every step is a time, the first connection under it, a mode, a load, a timeout
    assert set(timeline[0]) == {"time", "connection", "mode", "load", "idle_timeout"}


def test_simulate_held_connections_drive_the_mode():
    from lbproxy.tools.simulate import simulate

    config = ThrottleConfig(
        max_connections=10, interval=1.0, high_idle_timeout=10.0, min_idle_timeout=1.0
    )
    events = _events("- {before: 31, close: {s1: 15, s2: 15}}\n- {before: 31, rate: 0.5}\n")
    result = simulate(_vs(config), 32, hold=True, events=events, rate=4)
    steps = [(s.time, s.connection, s.mode, s.load, s.idle_timeout) for s in result.throttle.steps]
    # 4 connections per second held: the 11th finds 10 open (t=2.5) and goes high at
    # once; the evaluation at t=3 (12 held) re-tunes the imposed timeout ...
    assert steps[0] == (2.5, 11, "high", 1.0, 10.0)
    assert steps[1] == (3.0, 13, "high", pytest.approx(1.2), pytest.approx(8.2))
    assert ("digg", 1.0) in [(s[2], s[4]) for s in steps]
    digg_at = next(s for s in steps if s[2] == "digg")
    assert digg_at[1] == 21  # 20 held at t=5: the 21st connection is refused
    assert result.sequence[20:30] == [None] * 10
    # all closed at t = 7.25 + 2, just before #31: the monitor has not looked yet, so #31
    # is refused too; then digg -> high at t=10, low at t=11 (empty), and #32 is served
    assert result.sequence[30] is None
    assert [s[:3] for s in steps[-2:]] == [(10.0, 32, "high"), (11.0, 32, "low")]
    assert result.sequence[31] is not None
    assert result.throttle.refused == 11


def test_simulate_rate_event_is_checked():
    from lbproxy.tools.simulate import SimulationError

    with pytest.raises(SimulationError, match=r"events.yaml:1: rate must be a number"):
        _events("- {before: 3, rate: 0}\n")
    with pytest.raises(SimulationError, match=r"events.yaml:1: rate must be a number"):
        _events("- {before: 3, rate: {s1: 3}}\n")


# -- the monitor task (trio, on trio's mock clock: no sockets) ----------------------------


def test_monitor_evaluates_while_busy_applies_timeouts_and_sleeps_when_empty():
    import trio
    import trio.testing

    from lbproxy.control.throttle_monitor import Throttles
    from lbproxy.core.pool import Pool
    from lbproxy.dataplane.connection import ClientConnection, Handler
    from lbproxy.dataplane.lifecycle import INTO, PICKED
    from lbproxy.dataplane.virtual_server import VirtualServer

    config = ThrottleConfig(
        max_connections=2, interval=0.5, high_idle_timeout=10.0, min_idle_timeout=1.0
    )

    async def main() -> None:
        vs = VirtualServer(Pool(dataclasses.replace(_vs(config), idle_timeout=60.0), 0.0))
        pool, rs = vs.pool, vs.pool.servers[0]
        handler = Handler(vs)
        leases, flows = [], []

        def connect() -> bool:
            # The handler's connection (no descriptor): counted in pool.clients as it is
            # made, before the throttle is asked; its lease's handle, its own flow.
            c = ClientConnection(handler, -1, ("192.0.2.1", 40000), pool.config, 0.0)
            if vs.throttle.arrival():
                c.end()
                return False
            c.lease = pool.take(rs, trio.current_time(), c, c.source)
            c.state = INTO[PICKED][c.state]
            leases.append(c.lease)
            flows.append(c)
            return True

        def disconnect(n: int) -> None:
            for _ in range(n):
                leases.pop(0)
                flows.pop(0).end()  # gives the lease back, uncounts it from pool.clients

        throttles = Throttles()
        async with trio.open_nursery() as nursery:
            throttles.sync([vs], nursery)
            monitor = vs.throttle
            evaluations = 0

            class Counting(Throttle):
                __slots__ = ()

                def evaluate(self, active, now):
                    nonlocal evaluations
                    evaluations += 1
                    return super().evaluate(active, now)

            monitor.model = Counting(config)  # before the task's first step
            await trio.sleep(60)
            assert (evaluations, vs.throttle_mode) == (0, "low")  # empty: asleep

            assert all(connect() for _ in range(3))  # load 1.5
            await trio.sleep(0.1)
            assert vs.throttle_mode == "high"  # the first arrival woke it; then interval
            await trio.sleep(0.5)
            assert [f.idle_timeout for f in flows] == [5.5] * 3  # 10 - 9 x 0.5
            assert (monitor.idle_timeout_for(60.0), monitor.idle_timeout_for(3.0)) == (5.5, 3.0)

            assert connect()  # 4 held: load 2
            await trio.sleep(0.5)
            assert vs.throttle_mode == "digg"
            assert [f.idle_timeout for f in flows] == [1.0] * 4
            assert not connect()  # refused in digg; established ones are kept
            assert len(leases) == 4

            disconnect(3)  # load 0.5: digg -> high -> low, one step per interval
            await trio.sleep(0.5)
            assert vs.throttle_mode == "high"
            await trio.sleep(0.5)
            assert vs.throttle_mode == "low"
            assert flows[0].idle_timeout == 60.0  # its own timeout again

            disconnect(1)  # empty: evaluations stop once the rate window has emptied
            await trio.sleep(2)
            before = evaluations
            await trio.sleep(600)
            assert evaluations == before
            assert connect()  # woken by the next arrival
            await trio.sleep(0.1)
            assert evaluations == before + 1

            throttles.sync([], nursery)  # the throttle block went away: the task ends
            assert vs.throttle is None

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
