"""Health hysteresis: rise/fall as one bounded counter (HAProxy `check-t.h`).

PURE. The counter runs from 0 to rise + fall - 1: values below `rise` mean down, values
from `rise` up mean up. While up, a failure takes one step down and a success restores
the top, so only `fall` failures *in a row* take a server down; while down, a success
takes one step up and a failure restarts from 0, so `rise` successes in a row bring it
back. Active checks and passive connect failures feed the same counter.
"""

from __future__ import annotations


class Health:
    __slots__ = ("counter", "fall", "rise")

    def __init__(self, rise: int, fall: int, up: bool = True) -> None:
        self.rise = rise
        self.fall = fall
        self.counter = rise + fall - 1 if up else 0

    @property
    def clean(self) -> bool:
        """Up with no failure counted: a success would change nothing."""
        return self.counter == self.rise + self.fall - 1

    @property
    def up(self) -> bool:
        return self.counter >= self.rise

    def record(self, ok: bool) -> bool | None:
        """Count one check result; returns the new state if it changed, else None."""
        top = self.rise + self.fall - 1
        if self.up:
            if ok:
                self.counter = top
                return None
            self.counter -= 1
            if self.counter < self.rise:
                self.counter = 0
                return False
            return None
        if not ok:
            self.counter = 0
            return None
        self.counter += 1
        if self.counter >= self.rise:
            self.counter = top
            return True
        return None

    def force(self, up: bool) -> None:
        self.counter = self.rise + self.fall - 1 if up else 0
