"""lbproxy.net.deadlines on trio's mock clock: when targets ring, cancelling, compaction."""

from __future__ import annotations

import trio
import trio.testing

from lbproxy.net.deadlines import deadlines


class Bell:
    def __init__(self, name: str, log: list[tuple[str, float]]) -> None:
        self.name = name
        self.log = log

    def ring(self) -> None:
        self.log.append((self.name, trio.current_time()))


def run(main) -> None:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_rings_in_deadline_order_at_the_deadline():
    log: list[tuple[str, float]] = []

    async def main() -> None:
        heap = deadlines()
        start = trio.current_time()
        for name, after in [("c", 3.0), ("a", 1.0), ("b", 2.0), ("a2", 1.0)]:
            heap.at(start + after, Bell(name, log))
        await trio.sleep(10)
        assert [(n, round(t - start, 6)) for n, t in log] == [
            ("a", 1.0),
            ("a2", 1.0),  # a tie rings in the order it was scheduled
            ("b", 2.0),
            ("c", 3.0),
        ]
        assert len(heap) == 0

    run(main)


def test_an_earlier_deadline_wakes_the_sleeping_task():
    log: list[tuple[str, float]] = []

    async def main() -> None:
        heap = deadlines()
        start = trio.current_time()
        heap.at(start + 100, Bell("late", log))
        await trio.sleep(1)  # the task now sleeps until start + 100
        heap.at(start + 2, Bell("early", log))
        await trio.sleep(5)
        assert [(n, round(t - start, 6)) for n, t in log] == [("early", 2.0)]

    run(main)


def test_cancelled_deadlines_never_ring_and_do_not_pile_up():
    log: list[tuple[str, float]] = []

    async def main() -> None:
        heap = deadlines()
        start = trio.current_time()
        keep = heap.at(start + 50, Bell("kept", log))
        for i in range(10_000):  # short connections: scheduled, then ended at once
            heap.at(start + 60 + i, Bell(f"gone{i}", log)).cancel()
            assert len(heap._heap) <= 2 * len(heap) + 66  # compaction keeps it bounded
        assert len(heap) == 1
        await trio.sleep(20_000)
        assert [n for n, _ in log] == ["kept"]
        keep.cancel()  # after it rang: harmless
        assert len(heap) == 0

    run(main)
