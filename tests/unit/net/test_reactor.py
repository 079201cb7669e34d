"""The pump reactor's batches as other tasks see them: a reader that is always ready
(a pipe never drained: the set is level-triggered) is served several batches per
wake-up, never more than REPOLL_ROUNDS per wake-up, and other tasks keep running in between."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import trio

from lbproxy.net import pump


class AlwaysReady:
    """An EventReader on a pipe with a byte in it that nobody reads."""

    def __init__(self) -> None:
        self.calls = 0
        self.errors: list[BaseException] = []

    def on_event(self, fd: int, events: int) -> None:
        self.calls += 1

    def crashed(self, exc: BaseException) -> None:
        self.errors.append(exc)


@contextlib.contextmanager
def always_ready() -> Iterator[tuple[int, AlwaysReady]]:
    """A pipe with a byte nobody reads, its read end listened to by an AlwaysReady."""
    rfd, wfd = os.pipe()
    os.write(wfd, b"x")
    reader = AlwaysReady()
    pump.reactor().listen(rfd, reader)
    try:
        yield rfd, reader
    finally:
        pump.reactor().unlisten(rfd, reader)
        os.close(rfd)
        os.close(wfd)


def test_a_busy_reactor_polls_again_but_lets_other_tasks_run_every_few_batches():
    async def main() -> None:
        with always_ready() as (_, reader):
            calls_between: list[int] = []
            for _ in range(50):  # another task's turns, each one scheduler round apart
                before = reader.calls
                await trio.lowlevel.checkpoint()
                calls_between.append(reader.calls - before)
        assert reader.errors == []
        # Served (the reactor's wake-ups poll again while a batch finds events) ...
        assert sum(calls_between) >= 50
        assert max(calls_between) > 1
        # ... but at most REPOLL_ROUNDS batches per wake-up, so at most two wake-ups'
        # worth between two turns of this task (trio runs the tasks of a scheduler round
        # in random order: the reactor may run after this task in one round and before
        # it in the next).
        assert max(calls_between) <= 2 * pump._Reactor.REPOLL_ROUNDS

    trio.run(main)


def test_unlisten_takes_a_reader_out_of_the_set_at_once():
    async def main() -> None:
        reactor = pump.reactor()
        with always_ready() as (rfd, reader):
            await trio.sleep(0.01)
            reactor.unlisten(rfd, reader)
            reactor.unlisten(rfd, reader)  # idempotent
            seen = reader.calls
            await trio.sleep(0.05)
            assert seen > 0
            assert reader.calls == seen
            assert reactor.epoll.poll(0) == []

    trio.run(main)
