"""A per-second rate read from a counter that only grows, and the highest one seen.

PURE: no clock; the caller passes `now` (the control plane samples once a second, so
the connection path only ever increments the counter it already keeps).
"""

from __future__ import annotations

__all__ = ["Rate"]


class Rate:
    """`current`: what the counter grew by per second between the last two samples;
    `max`: the highest `current` so far."""

    __slots__ = ("_at", "_count", "current", "max")

    def __init__(self, since: float | None = None) -> None:
        """`since`: when the counter was 0 (a new server's), so the first sample counts
        from then; None: the first sample is only where counting starts."""
        self.current = 0.0
        self.max = 0.0
        self._count: int | None = None if since is None else 0
        self._at = 0.0 if since is None else since

    def sample(self, count: int, now: float) -> int:
        """Read the counter at `now`; returns by how much it grew since the last sample
        (0 for the first, or if it shrank: a counter replaced by a reload)."""
        grown = 0
        if self._count is not None and now > self._at:
            grown = max(count - self._count, 0)
            self.current = grown / (now - self._at)
            self.max = max(self.max, self.current)
        self._count, self._at = count, now
        return grown

    def set(self, current: float) -> None:
        """Set the current rate from elsewhere (a sum of other rates)."""
        self.current = current
        self.max = max(self.max, current)
