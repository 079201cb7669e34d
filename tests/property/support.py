"""What the scheduler property tests share: the random states they explore (server
options and a sequence of operations on a pool) and the pool they start from."""

from __future__ import annotations

from hypothesis import strategies as st

from lbproxy.config.model import PersistenceConfig
from lbproxy.core.pool import Pool
from tests.factories import SNMP, virtual_server

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


def build(scheduler: str, options: list[dict], persistence: bool = False) -> Pool:
    servers = {f"s{i}": dict(opts, snmp=SNMP) for i, opts in enumerate(options)}
    extra: dict = {"snmp": SNMP} if scheduler in ("dwd", "dwr") else {}
    if scheduler == "maglev":
        extra["table_size"] = 101  # small: the rules do not depend on the size
    if persistence:
        extra["persistence"] = PersistenceConfig(timeout=1.0, max_entries=4)
    if scheduler == "least-load":
        for opts in servers.values():
            opts["max_connections"] = opts["max_connections"] or 3
    return Pool(virtual_server(scheduler, servers, slow_start=5.0, quiesce=True, **extra), 0)
