"""lbproxy.control.reconcile: the one "keep my tasks in step with the config" loop."""

from __future__ import annotations

import functools

import trio
import trio.testing

from lbproxy.control.reconcile import Reconciler


class Wants:
    """A stand-in virtual server: `wants` is what it asks the subsystem for."""

    def __init__(self, name: str, wants: dict[str, int]) -> None:
        self.name = name
        self.wants = wants


class Counting(Reconciler[str, int]):
    """Runs a task per wanted key; even specs are retuned in place, odd ones restart."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str, int]] = []
        self.stops: list[str] = []

    def wanted(self, virtual_servers):
        return {key: spec for vs in virtual_servers for key, spec in vs.wants.items()}

    def start(self, key, spec):
        return functools.partial(self._body, key, spec)

    async def _body(self, key: str, spec: int) -> None:
        self.log.append(("run", key, spec))
        try:
            await trio.sleep_forever()
        finally:
            self.log.append(("end", key, spec))

    def retune(self, key, spec):
        return spec % 2 == 0

    def stopped(self, key):
        self.stops.append(key)

    def describe(self, key, event):
        return f"{key} {event}"


def test_starts_stops_restarts_and_retunes_in_step_with_what_is_wanted():
    async def main() -> None:
        subsystem = Counting()
        async with trio.open_nursery() as nursery:
            vs = Wants("vs", {"a": 1, "b": 2})
            assert subsystem.sync([vs], nursery) == ["a added", "b added"]
            await trio.testing.wait_all_tasks_blocked()
            assert sorted(subsystem.log) == [("run", "a", 1), ("run", "b", 2)]
            assert subsystem.sync([vs], nursery) == []  # the same wants: nothing moves
            subsystem.log.clear()

            vs.wants = {"a": 3, "b": 4, "c": 5}  # a restarts (odd), b retunes, c starts
            assert subsystem.sync([vs], nursery) == ["b changed", "a restarted", "c added"]
            await trio.testing.wait_all_tasks_blocked()
            assert sorted(subsystem.log) == [("end", "a", 1), ("run", "a", 3), ("run", "c", 5)]
            assert len(subsystem) == 3 and subsystem.stops == []
            subsystem.log.clear()

            removed = subsystem.sync([], nursery)
            assert sorted(removed) == ["a removed", "b removed", "c removed"]
            await trio.testing.wait_all_tasks_blocked()
            assert sorted(subsystem.log) == [("end", "a", 3), ("end", "b", 2), ("end", "c", 5)]
            assert sorted(subsystem.stops) == ["a", "b", "c"] and len(subsystem) == 0

    trio.run(main)
