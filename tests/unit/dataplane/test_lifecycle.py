"""The lifecycle's table (lbproxy/dataplane/lifecycle.py), driven directly: a state change
through `INTO` makes every transition TRANSITIONS lists and refuses every other one,
leaving the state as it was. That every transition production makes goes through `INTO`
(and so is in the table) is checked per path in test_connection.py, which records each
state change of real connections through real sockets.
"""

from __future__ import annotations

import itertools

import pytest

from lbproxy.dataplane.lifecycle import (
    ADMITTED,
    CLOSING,
    ENDED,
    INTO,
    STATES,
    TRANSITIONS,
    WAITING,
)

PAIRS = list(itertools.product(range(len(STATES)), repeat=2))
ALLOWED = [(old, new) for old, new in PAIRS if new in TRANSITIONS[old]]
MISSING = [(old, new) for old, new in PAIRS if new not in TRANSITIONS[old]]
LIVE = range(ADMITTED, CLOSING)


class Connection:
    """What a state change needs of a connection: its state."""

    __slots__ = ("state",)

    def __init__(self, state: int) -> None:
        self.state = state


def name(pair: tuple[int, int]) -> str:
    return f"{STATES[pair[0]]}->{STATES[pair[1]]}"


@pytest.mark.parametrize("pair", ALLOWED, ids=name)
def test_every_transition_in_the_table_is_made(pair):
    old, new = pair
    c = Connection(old)
    c.state = INTO[new][c.state]
    assert c.state == new


@pytest.mark.parametrize("pair", MISSING, ids=name)
def test_every_transition_missing_from_the_table_raises(pair):
    old, new = pair
    c = Connection(old)
    with pytest.raises(KeyError) as raised:
        c.state = INTO[new][c.state]
    assert raised.value.args == (old,)  # the state it was in
    assert c.state == old  # left as it was


def test_into_is_the_table_and_nothing_else():
    assert len(INTO) == len(STATES)
    assert all(type(table) is dict for table in INTO)  # the interpreter's fast lookup
    assert {(old, new) for new, table in enumerate(INTO) for old in table} == set(ALLOWED)


def test_no_state_is_its_own_successor():
    """A step re-entered after a wait (a resolved name) must not re-enter its state."""
    assert all(state not in TRANSITIONS[state] for state in TRANSITIONS)


def test_every_live_state_may_close_and_closing_only_ends():
    """ClientConnection.end() relies on it: from any live state, closing, then ended;
    ended is final."""
    assert all(CLOSING in TRANSITIONS[state] for state in LIVE)
    assert TRANSITIONS[CLOSING] == {ENDED}
    assert TRANSITIONS[ENDED] == frozenset()


def test_every_state_is_reachable_from_admitted():
    reached, frontier = {ADMITTED}, [ADMITTED]
    while frontier:
        for new in TRANSITIONS[frontier.pop()] - reached:
            reached.add(new)
            frontier.append(new)
    assert reached == set(range(len(STATES)))


def test_only_live_states_wait():
    assert WAITING.issubset(LIVE) and ADMITTED not in WAITING
