"""The per-source table against a plain model: every timestamp kept, scanned each time;
and its bound, under random arrivals, ends and remote counts. Its key parser never
raises on hostile text (it is fed PROXY header addresses)."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from lbproxy.core.per_source import Limits, PerSourceTable, SourceEntry, network_key

HOSTS = [f"10.0.{i // 4}.{i}" for i in range(12)] + ["2001:db8::1", "2001:db8::2", "::1"]

steps = st.lists(
    st.tuples(
        st.sampled_from(["arrive", "arrive", "arrive", "end"]),
        st.integers(0, len(HOSTS) - 1),
        st.floats(0.0, 0.7),  # time passing before the step
    ),
    max_size=150,
)


@settings(max_examples=300, deadline=None)
@given(
    steps=steps,
    max_connections=st.integers(0, 4),
    rate=st.integers(0, 5),
    interval=st.floats(0.1, 2.0),
    prefix_v4=st.sampled_from([32, 24, 16]),
)
def test_verdicts_match_a_model_that_keeps_everything(
    steps, max_connections, rate, interval, prefix_v4
):
    limits = Limits(max_connections, rate, interval, prefix_v4, 64, 1_000_000)
    table = PerSourceTable(limits)
    opened: dict[object, int] = {}
    accepted: dict[object, list[float]] = {}
    held: list[SourceEntry] = []
    now = 0.0
    for op, index, dt in steps:
        now += dt
        host = HOSTS[index]
        key = network_key(host, prefix_v4, 64)
        if op == "end":
            if held:
                entry = held.pop(index % len(held))
                table.release(entry)
                opened[entry.key] -= 1
            continue
        within = [t for t in accepted.get(key, []) if now - t < interval]
        refuse = (max_connections and opened.get(key, 0) >= max_connections) or (
            rate and len(within) >= rate
        )
        got = table.admit(host, now)
        assert (got is None) == bool(refuse), (host, now)
        if got is not None:
            assert isinstance(got, SourceEntry)
            held.append(got)
            opened[key] = opened.get(key, 0) + 1
            accepted.setdefault(key, []).append(now)
    for entry in table.entries():
        assert entry.open == opened.get(entry.key, 0)
        # what the cluster is told: the accepted arrivals within the last interval
        within = [t for t in accepted.get(entry.key, []) if now - t < interval]
        assert entry.recent(now, interval) == (min(len(within), rate) if rate else 0)


@settings(max_examples=300, deadline=None)
@given(
    steps=steps,
    max_tracked=st.integers(1, 6),
    remote=st.dictionaries(
        st.sampled_from(HOSTS[:8]), st.tuples(st.integers(0, 3), st.integers(0, 3))
    ),
)
def test_bounded_busy_networks_kept_idle_ones_forgotten_least_recent_first(
    steps, max_tracked, remote
):
    table = PerSourceTable(Limits(max_connections=2, rate=3, max_tracked=max_tracked))
    table.set_remote(remote)
    held: list[SourceEntry] = []
    # The model of what is remembered: busy keys, and idle keys in the order last seen.
    idle: OrderedDict[object, None] = OrderedDict((e.key, None) for e in table.entries())
    busy: dict[object, int] = {}
    now = 0.0
    for op, index, dt in steps:
        now += dt
        if op == "end":
            if held:
                entry = held.pop(index % len(held))
                table.release(entry)
                if entry.key in busy:
                    busy[entry.key] -= 1
                    if busy[entry.key] == 0:
                        del busy[entry.key]
                        idle[entry.key] = None
            continue
        host = HOSTS[index]
        key = network_key(host, 32, 64)
        known = key in busy or key in idle
        if not known and len(busy) + len(idle) >= max_tracked and not idle:
            assert table.admit(host, now) is True  # full of busy networks: untracked
            continue
        if not known and len(busy) + len(idle) >= max_tracked:
            idle.popitem(last=False)
        if key in idle:
            idle.move_to_end(key)
        elif key not in busy:
            idle[key] = None
        got = table.admit(host, now)
        if isinstance(got, SourceEntry):
            held.append(got)
            idle.pop(key, None)
            busy[key] = busy.get(key, 0) + 1
        assert len(table) <= max_tracked
        assert {e.key for e in table.entries()} == set(busy) | set(idle)
        assert [e.key for e in table.entries() if e.open == 0] == list(idle)


@settings(max_examples=500, deadline=None)
@given(host=st.text(max_size=60), v4=st.integers(1, 32), v6=st.integers(1, 128))
def test_network_key_never_raises(host, v4, v6):
    network_key(host, v4, v6)
    PerSourceTable(Limits(max_connections=1, prefix_v4=v4, prefix_v6=v6)).admit(host, 0.0)
