"""What the scheduler property tests share: the random states they explore (server
options and a sequence of operations on a pool)."""

from __future__ import annotations

from hypothesis import strategies as st

server_options = st.fixed_dictionaries(
    {
        "weight": st.integers(0, 5),
        "max_connections": st.integers(0, 4),
        "load_factor": st.sampled_from([1.0, 2.0, 3.0]),
        "state": st.sampled_from(["enabled", "enabled", "drain", "disabled"]),
        "backup": st.sampled_from([False, False, False, True]),
    }
)

operations = st.lists(
    st.one_of(
        st.tuples(st.just("connect"), st.integers(0, 7)),
        st.tuples(st.just("close"), st.integers(0, 50)),
        st.tuples(
            st.just("state"), st.integers(0, 7), st.sampled_from(["enabled", "drain", "disabled"])
        ),
        st.tuples(st.just("health"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("weight"), st.integers(0, 7), st.integers(0, 5)),
        st.tuples(st.just("snmp"), st.integers(0, 7), st.integers(0, 120)),
        st.tuples(st.just("tick"), st.integers(1, 30)),
    ),
    max_size=60,
)
