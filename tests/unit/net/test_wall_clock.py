"""The run's clock as wall-clock time: the same moment reads the same each time."""

from __future__ import annotations

import time

import trio

from lbproxy.net import wall_clock


def test_a_moment_reads_the_same_every_time_and_is_the_wall_clock_time():
    async def main() -> tuple[set[float], float]:
        moment = trio.current_time()
        shown = {wall_clock.to_wall(moment) for _ in range(2000)}
        return shown, abs(wall_clock.to_wall(trio.current_time()) - time.time())

    shown, error = trio.run(main)
    assert len(shown) == 1
    assert error < 0.01


def test_a_wall_clock_set_forward_is_followed(monkeypatch):
    async def main() -> tuple[float, float, float]:
        moment = trio.current_time()
        before = wall_clock.to_wall(moment)
        monkeypatch.setattr(wall_clock.time, "time", lambda real=time.time: real() + 60.0)
        after = wall_clock.to_wall(moment)
        monkeypatch.undo()
        return before, after, wall_clock.to_wall(moment)

    before, after, back = trio.run(main)
    assert 59.9 < after - before < 60.1
    assert abs(back - before) < 0.01


def test_each_run_has_its_own_offset():
    """Trio starts each run's clock at a random point: an offset from an earlier run
    would put the times of this one far off."""

    async def main() -> float:
        return abs(wall_clock.to_wall(trio.current_time()) - time.time())

    assert trio.run(main) < 0.01
    assert trio.run(main) < 0.01
