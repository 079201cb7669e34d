"""What one real server's SNMP answers mean for its dynamic weight.

PURE: no trio, no sockets, no clock — `now` is passed in. The poller (snmp.py) owns the
sockets and the timing; after every poll it asks this module what to tell the pool, and
the pool is then told through exactly one of its two validated entry points:

- `Report(value)`    -> `pool.report_value(rs, value, now)`: a good (smoothed) value;
                        dwd/dwr turn it into a weight, least-load into a load report.
- `SetWeight(w)`     -> `pool.set_dynamic_weight(rs, w, now)`: an `on_no_answer` policy.
- `None`             -> leave the pool alone (`hold`, while the held value is fresh).

The rules (SPEC §3, "Dynamic weights"):

- A poll is unanswered when every transmission of it (1 + `retries`) went unanswered, or
  the answer was not an integer (string, noSuchObject, noSuchInstance, garbage). From that
  poll on, `on_no_answer` decides:
    zero    weight 0: no new connections (the ADX document: "the default weight is 0
            if it does not receive any SNMP response");
    hold    keep the last good value until `stale_after` has passed since that answer,
            then weight 0 (nothing answered yet: nothing to hold, so 0 at once);
    static  the configured (static) weight, read afresh at every unanswered poll so a
            runtime `set-weight` is followed.
- `smoothing` a (0 < a <= 1) is an exponential moving average of the values:
  s = a * value + (1 - a) * s_previous; a = 1 means none. The average starts afresh from
  the first answer after a gap longer than `stale_after` — a value that old says nothing
  about the server now, whatever the policy did in between.

The "every dynamic weight is 0 -> static weights" fallback is the pool's (it sees every
server of the virtual server at once); this module decides for one server only.
"""

from __future__ import annotations

from dataclasses import dataclass

ZERO, HOLD, STATIC = "zero", "hold", "static"
POLICIES = (ZERO, HOLD, STATIC)


@dataclass(frozen=True, slots=True)
class Report:
    """A good value, smoothed: give it to `pool.report_value`."""

    value: float


@dataclass(frozen=True, slots=True)
class SetWeight:
    """An `on_no_answer` outcome: give it to `pool.set_dynamic_weight`."""

    weight: float
    reason: str  # for the log: "zero", "static", "hold expired"


class DynamicWeight:
    """The answer history of one real server's agent, as far as its weight cares."""

    __slots__ = (
        "answering",
        "expired",
        "last_answer",
        "policy",
        "smoothed",
        "smoothing",
        "stale_after",
    )

    def __init__(self, policy: str, stale_after: float, smoothing: float = 1.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"on_no_answer must be one of {', '.join(POLICIES)}: {policy!r}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1]: {smoothing!r}")
        if stale_after <= 0:
            raise ValueError(f"stale_after must be > 0: {stale_after!r}")
        self.policy = policy
        self.stale_after = stale_after
        self.smoothing = smoothing
        self.smoothed: float | None = None
        self.last_answer: float | None = None  # when the last good value arrived
        self.answering: bool | None = None  # None: not polled yet
        self.expired = False  # hold: the held value has been given up

    def answered(self, value: float, now: float) -> Report:
        """A poll returned an integer `value` at `now`."""
        fresh = self.last_answer is not None and now - self.last_answer <= self.stale_after
        if self.smoothed is None or not fresh:
            self.smoothed = float(value)
        else:
            a = self.smoothing
            self.smoothed = a * value + (1.0 - a) * self.smoothed
        self.last_answer = now
        self.answering = True
        self.expired = False
        return Report(self.smoothed)

    def unanswered(self, now: float, static_weight: float) -> SetWeight | None:
        """A poll went unanswered (after its retries) or answered a non-integer."""
        self.answering = False
        if self.policy == ZERO:
            return SetWeight(0.0, ZERO)
        if self.policy == STATIC:
            return SetWeight(float(static_weight), STATIC)
        until = self.hold_until()
        if until is not None and now < until:
            return None  # hold: the last value stays in the pool
        if self.expired or self.last_answer is None:
            return SetWeight(0.0, HOLD)  # nothing (left) to hold
        self.expired = True
        return SetWeight(0.0, "hold expired")

    def hold_until(self) -> float | None:
        """While holding: when the held value goes stale (the poller wakes then)."""
        if self.policy != HOLD or self.answering or self.last_answer is None or self.expired:
            return None
        return self.last_answer + self.stale_after

    def expire(self, now: float) -> SetWeight | None:
        """Called at `hold_until()`: gives up the held value once it is stale."""
        until = self.hold_until()
        if until is None or now < until:
            return None
        self.expired = True
        return SetWeight(0.0, "hold expired")
