"""The pump reactor as other tasks see it, both ways it can be served.

By trio's loop (net/trio_wait.py, where trio's internals are the expected ones): in
trio's place when trio would only wait, one batch per trio round when trio is busy.
By its own task (elsewhere, or once a batch has failed): a reader that is always ready
(a pipe never drained: the set is level-triggered) is served several batches per
wake-up, never more than REPOLL_ROUNDS, and other tasks keep running in between."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import trio
import trio.testing

from lbproxy.net import pump, trio_wait
from lbproxy.net import reactor as reactor_module
from lbproxy.net.barrier import internal_errors

REACTOR_TASK = "lbproxy pump reactor"


@pytest.fixture(params=["trio", "task"])
def served_by(request, monkeypatch) -> str:
    if request.param == "task":  # as where trio's internals are not the expected ones
        monkeypatch.setattr(trio_wait, "install", lambda *args: None)
    return request.param


class AlwaysReady:
    """A reader of the reactor's set (its on_event) on a pipe with a byte in it that
    nobody reads."""

    def __init__(self) -> None:
        self.calls = 0

    def on_event(self, fd: int, events: int) -> None:
        self.calls += 1


@contextlib.contextmanager
def always_ready() -> Iterator[tuple[int, AlwaysReady]]:
    """A pipe with a byte nobody reads, its read end listened to by an AlwaysReady."""
    rfd, wfd = os.pipe()
    os.write(wfd, b"x")
    reader = AlwaysReady()
    pump.reactor().listen(rfd, reader.on_event)
    try:
        yield rfd, reader
    finally:
        pump.reactor().unlisten(rfd, reader.on_event)
        os.close(rfd)
        os.close(wfd)


class Reading:
    """A reader of the reactor's set that reads a socket and notes each read (and may
    act on it)."""

    def __init__(self, sock: socket.socket, then=None) -> None:
        self.sock = sock
        self.then = then
        self.got: list[tuple[float, bytes]] = []

    def on_event(self, fd: int, events: int) -> None:
        data = self.sock.recv(100)
        self.got.append((time.monotonic(), data))
        if self.then is not None:
            self.then(data)


@contextlib.contextmanager
def reading(then=None) -> Iterator[tuple[socket.socket, Reading]]:
    """A socket pair: the reactor reads one end (a Reading), the caller writes the other."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    reader = Reading(ours, then)
    pump.reactor().listen(ours.fileno(), reader.on_event)
    try:
        yield theirs, reader
    finally:
        pump.reactor().unlisten(ours.fileno(), reader.on_event)
        ours.close()
        theirs.close()


class Steps(trio.abc.Instrument):
    """Counts the steps of the reactor's task."""

    def __init__(self) -> None:
        self.reactor = 0

    def before_task_step(self, task) -> None:
        if task.name == REACTOR_TASK:
            self.reactor += 1


def write_later(sock: socket.socket, data: bytes, delay: float) -> threading.Thread:
    """Write `data` from another thread after `delay` seconds: while trio waits."""

    def run() -> None:
        time.sleep(delay)
        sock.send(data)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_busy_trio_still_serves_the_reactor_and_runs_the_other_tasks(served_by):
    async def main() -> None:
        with always_ready() as (_, reader):
            calls_between: list[int] = []
            for _ in range(50):  # another task's turns, each one scheduler round apart
                before = reader.calls
                await trio.lowlevel.checkpoint()
                calls_between.append(reader.calls - before)
        # Served ...
        assert sum(calls_between) >= 49
        if served_by == "task":
            # ... polling again while a batch finds events, but at most REPOLL_ROUNDS
            # batches per wake-up, so at most two wake-ups' worth between two turns of
            # this task (trio runs the tasks of a round in random order: the reactor may
            # run after this task in one round and before it in the next).
            assert max(calls_between) > 1
            assert max(calls_between) <= 2 * reactor_module.REPOLL_ROUNDS
        else:
            # ... one batch per trio round: trio's loop serves it before each I/O check.
            assert calls_between[1:] == [1] * 49

    trio.run(main)


def test_an_idle_trio_waits_in_the_reactor_and_keeps_its_timers_and_sockets(served_by):
    """Bytes for the reactor, a timer and a socket a task waits on, all arriving while
    nothing runs: each is served at once, and with trio's wait the reactor's bytes cost
    its task no step at all."""

    async def main() -> None:
        steps = Steps()
        trio.lowlevel.add_instrument(steps)
        with reading() as (writer, reader):
            await trio.sleep(0.01)  # the reactor's task parks (or waits)
            parked = steps.reactor
            for i in range(5):
                sent = time.monotonic()
                write_later(writer, b"%d" % i, 0.02)
                while len(reader.got) <= i:
                    await trio.sleep(0.001)
                assert reader.got[i][1] == b"%d" % i
                assert reader.got[i][0] - sent < 0.5
            if served_by == "trio":
                assert steps.reactor == parked  # trio's loop itself read them
            else:
                assert steps.reactor >= parked + 5

            # A timer rings on time while the reactor waits in trio's place (not after
            # trio's own wait has blocked for the same timeout again: 1 s).
            started = time.monotonic()
            await trio.sleep(0.5)
            assert 0.5 <= time.monotonic() - started < 0.9

            # A socket a task waits on (trio's own set) wakes it at once.
            a, b = trio.socket.socketpair()
            with a, b:
                write_later(b._sock, b"ping", 0.05)
                started = time.monotonic()
                with trio.fail_after(5):
                    assert await a.recv(10) == b"ping"
                assert time.monotonic() - started < 0.5

            # And a thread's result comes back at once (trio's wake-up socket).
            started = time.monotonic()
            await trio.to_thread.run_sync(time.sleep, 0.05)
            assert time.monotonic() - started < 0.5

    trio.run(main)


def test_a_batch_that_wakes_a_task_hands_the_loop_back_at_once(served_by):
    """The reactor's batch makes a task runnable while trio's next deadline is far: the
    task runs now, not when the deadline comes."""

    async def main() -> None:
        woken = trio.Event()
        with reading(lambda data: woken.set()) as (writer, _):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep, 30)  # trio's next deadline: 30 s away
                await trio.sleep(0.01)
                started = time.monotonic()
                write_later(writer, b"x", 0.02)
                with trio.fail_after(5):
                    await woken.wait()
                assert time.monotonic() - started < 0.5
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_deadline_a_batch_moves_earlier_is_kept(served_by):
    """The reactor's batch brings a cancel scope's deadline forward (no task is woken by
    that): the scope is cancelled at its new deadline, not at the old one."""

    async def main() -> None:
        scope = trio.CancelScope()
        started = time.monotonic()

        def sooner(data: bytes) -> None:
            scope.deadline = trio.current_time() + 0.05

        with reading(sooner) as (writer, _), trio.fail_after(5):
            write_later(writer, b"x", 0.02)
            with scope:
                await trio.sleep_forever()
        assert scope.cancelled_caught
        assert time.monotonic() - started < 1

    trio.run(main)


def test_wait_all_tasks_blocked_still_sees_the_run_idle(served_by):
    """trio idles (a test's wait_all_tasks_blocked cushion) only on a wait that saw no
    event: the reactor must not wake trio when such a timeout is over."""

    async def main() -> None:
        with reading():
            await trio.sleep(0.01)
            started = time.monotonic()
            with trio.fail_after(5):
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            assert time.monotonic() - started < 1

    trio.run(main)


def test_another_clock_keeps_its_timers_and_its_autojump(served_by):
    """trio's loop with a clock of its own (trio.testing.MockClock): at rate 1 a timer
    rings on time while the reactor waits; with autojump_threshold, trio still jumps
    the clock once idle that long (the reactor does not wake it)."""

    async def on_time() -> None:
        with reading() as (writer, reader):
            write_later(writer, b"x", 0.02)
            started = time.monotonic()
            await trio.sleep(0.5)
            assert 0.5 <= time.monotonic() - started < 0.9
            assert [data for _, data in reader.got] == [b"x"]

    trio.run(on_time, clock=trio.testing.MockClock(rate=1.0))

    async def jumps() -> None:
        with reading():
            started = time.monotonic()
            with trio.fail_after(1000):
                await trio.sleep(100)  # in the clock's time: it jumps there
            assert time.monotonic() - started < 2

    trio.run(jumps, clock=trio.testing.MockClock(autojump_threshold=0.05))


def test_a_batch_that_fails_hands_the_set_to_the_reactors_task(monkeypatch):
    """A bug past the per-connection barrier (a batch that raises): counted once, and
    the reactor's task serves the set from then on; nothing else is lost."""
    failed: list[str] = []
    install = trio_wait.install

    def failing_once(wait):
        def run(*args):
            if not failed:
                failed.append(wait.__name__ if hasattr(wait, "__name__") else repr(wait))
                raise RuntimeError("a bug in a batch")
            return wait(*args)

        return run

    def installed(batch, listen, unlisten, compiled_wait=None):
        # the first of the hook's waits to run fails: a batch (the pure path, or trio
        # busy) or the compiled wait
        if compiled_wait is not None:
            compiled_wait = failing_once(compiled_wait)
        return install(failing_once(batch), listen, unlisten, compiled_wait)

    monkeypatch.setattr(trio_wait, "install", installed)

    async def main() -> None:
        steps = Steps()
        trio.lowlevel.add_instrument(steps)
        with reading() as (writer, reader):
            await trio.sleep(0.01)  # the first batch failed; the task took the set over
            assert failed
            assert internal_errors().counts["pump"] == 1
            for i in range(3):
                writer.send(b"%d" % i)
                with trio.fail_after(5):
                    while len(reader.got) <= i:
                        await trio.sleep(0.001)
            assert [data for _, data in reader.got] == [b"0", b"1", b"2"]
            assert steps.reactor > 0  # its task read them

    trio.run(main)


def test_outside_a_trio_run_there_is_no_hook_to_install():
    """Where trio's internals are not there (here: no run), install() says so and the
    reactor's task serves the set."""

    def nothing(fd: int, callback: object) -> None:
        raise AssertionError("no hook: nothing to put in the set")

    assert trio_wait.install(lambda ms: 0, nothing, nothing) is None


def test_unlisten_takes_a_reader_out_of_the_set_at_once():
    async def main() -> None:
        reactor = pump.reactor()
        with always_ready() as (rfd, reader):
            with trio.fail_after(5):
                while reader.calls == 0:  # the reactor has served it
                    await trio.sleep(0.001)
            reactor.unlisten(rfd, reader.on_event)
            reactor.unlisten(rfd, reader.on_event)  # idempotent
            seen = reader.calls
            await trio.sleep(0.05)
            assert seen > 0
            assert reader.calls == seen
            assert select.select([reactor.fileno()], [], [], 0)[0] == []  # nothing ready

    trio.run(main)
