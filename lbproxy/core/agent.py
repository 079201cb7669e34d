"""What a real server's agent has said (SPEC §22, the agent check), kept apart from
what the operator set.

PURE: no trio, no sockets, no clock — `now` is passed in.

The operator's state (`enabled`, `drain`, `disabled`) and static weight belong to the
operator; the agent has its own: a state (`ready`, `drain`, `maint`, `down`), a weight
percentage, and optionally a max_connections. Neither overwrites the other, and the
server takes new connections only when both allow it:

- `factor` is what the pool multiplies the base weight by (§8 effective weight):
  `weight_percent / 100` while the agent is ready, 0 while it says drain, maint or down
  (a weight of 0 is "no new connections"; established ones continue).
- `down` (the agent said down, fail or stopped) also forces health down; while it holds,
  a passing active check does not count, so health comes back only through `rise`
  checks passing after the agent said `up` (with `health_check.type: none`, at once).
- `max_connections` (from `maxconn:N`), when the agent gave one, replaces the
  configured one (0: unlimited) until the agent check is removed.

`Pool.apply_agent` (pool.py) feeds answers here and applies the outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

READY, DRAIN, MAINT, DOWN = "ready", "drain", "maint", "down"
STATES = (READY, DRAIN, MAINT, DOWN)
RESULTS = ("ok", "fail", "timeout", "bad_answer")  # lbproxy_agent_checks_total{result}


class AgentSays(Protocol):
    """One good answer, as the parser (wire/agent.py `AgentAnswer`) gives it; None: the
    answer did not say it."""

    @property
    def weight_percent(self) -> int | None: ...

    @property
    def max_connections(self) -> int | None: ...

    @property
    def admin(self) -> str | None: ...  # ready | drain | maint

    @property
    def health(self) -> str | None: ...  # "up", or the down word: down | fail | stopped

    @property
    def reason(self) -> str: ...


@dataclass(frozen=True, slots=True)
class AgentChange:
    """What one answer changed, for the pool to act on."""

    went_down: bool = False  # the agent said down, fail or stopped (and did not before)
    came_up: bool = False  # the agent said up after a down
    weight_changed: bool = False  # the factor or max_connections changed


class AgentState:
    """One real server's agent, as far as load balancing cares."""

    __slots__ = ("admin", "at", "down", "max_connections", "reason", "weight_percent")

    def __init__(self) -> None:
        self.admin = READY  # ready | drain | maint
        self.down = False  # said down | fail | stopped, and not up since
        self.weight_percent = 100
        self.max_connections: int | None = None  # None: the configured one
        self.reason = ""
        self.at: float | None = None  # when the last good answer came (wall clock, seconds)

    @property
    def state(self) -> str:
        return DOWN if self.down else self.admin

    @property
    def factor(self) -> float:
        """What the base weight is multiplied by: 0 unless ready."""
        if self.down or self.admin != READY:
            return 0.0
        return self.weight_percent / 100

    def apply(self, answer: AgentSays, wall: float) -> AgentChange:
        """Take in one good answer, received at `wall` (seconds since the epoch)."""
        factor, max_connections, was_down = self.factor, self.max_connections, self.down
        if answer.weight_percent is not None:
            self.weight_percent = answer.weight_percent
        if answer.max_connections is not None:
            self.max_connections = answer.max_connections
        if answer.admin is not None:
            self.admin = answer.admin
        if answer.health == "up":
            self.down = False
        elif answer.health is not None:
            self.down = True
        self.reason = answer.reason or (answer.health or "" if self.down else "")
        self.at = wall
        return AgentChange(
            went_down=self.down and not was_down,
            came_up=was_down and not self.down,
            weight_changed=self.factor != factor or self.max_connections != max_connections,
        )

    def document(self) -> dict[str, Any]:
        """The API's `agent` object."""
        return {
            "state": self.state,
            "weight_percent": self.weight_percent,
            "max_connections": self.max_connections,
            "reason": self.reason,
            "at": None if self.at is None else iso_utc(self.at),
        }


def iso_utc(wall: float) -> str:
    """A wall-clock time as the API writes every time: ISO 8601 UTC to the millisecond,
    with `Z` (2026-12-05T15:04:23.120Z), as a check's `at` is."""
    return (
        datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )
