"""The scheduler registry is the one place that knows the algorithms.

Outside lbproxy/core/schedulers no code names a scheduler: config, the pool, the API and
the metrics ask the registry what an algorithm reads instead. The first test fails when a
string constant equal to a registered name appears anywhere else in lbproxy/.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from lbproxy.config.model import VirtualServerConfig
from lbproxy.core import schedulers
from tests.factories import virtual_server

PACKAGE = Path(__file__).resolve().parents[4] / "lbproxy"
SCHEDULERS = PACKAGE / "core" / "schedulers"
# The demo's configuration, written in code, is a user's configuration: it chooses its
# schedulers (wlc, and dwd to show dynamic weights) as a YAML file would. So do the
# importers: each writes the scheduler that behaves as HAProxy's or nginx's balance
# method (their output goes through `lbproxy check` in their tests).
USER_CONFIGURATIONS = {
    PACKAGE / "tools" / "demo.py",
    PACKAGE / "tools" / "importer" / "haproxy.py",
    PACKAGE / "tools" / "importer" / "nginx.py",
}


def _named_schedulers(source: str, where: str, names: set[str]) -> list[str]:
    """Every string constant of `source` that is a scheduler's name, as `where:LINE: 'name'`."""
    return [
        f"{where}:{node.lineno}: {node.value!r}"
        for node in ast.walk(ast.parse(source, where))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]


def test_no_scheduler_is_named_outside_the_schedulers_package():
    names = set(schedulers.available())
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if SCHEDULERS not in path.parents and path not in USER_CONFIGURATIONS
        for hit in _named_schedulers(path.read_text(), str(path.relative_to(PACKAGE)), names)
    ]
    assert found == []


def test_the_name_check_sees_a_comparison_and_a_tuple_but_not_prose():
    source = """
        if config.scheduler == "least-load":
            only = ("lc", "maglev")
        text = "scheduler maglev needs ..."
    """
    hits = _named_schedulers(textwrap.dedent(source), "x.py", set(schedulers.available()))
    assert hits == ["x.py:2: 'least-load'", "x.py:3: 'lc'", "x.py:3: 'maglev'"]


def test_the_catalogue_is_in_rank_order_and_every_name_is_unique():
    catalogue = [cls.name for cls in schedulers.catalogue()]
    assert catalogue == [
        "rr", "wrr", "lc", "wlc", "dwd", "dwr", "least-load", "sap", "first", "maglev"
    ]  # fmt: skip
    assert sorted(catalogue) == schedulers.available()


def test_a_duplicate_name_is_refused():
    class Again(schedulers.Scheduler):
        name = "rr"

    with pytest.raises(ValueError, match="already registered"):
        schedulers.register(Again)


def test_what_each_scheduler_reads():
    assert schedulers.reading(schedulers.SNMP) == ("dwd", "dwr", "least-load")
    assert schedulers.reading(schedulers.REPORTS) == ("least-load",)
    assert schedulers.reading(schedulers.CLIENT) == ("maglev",)
    assert schedulers.reading("quiesce") == ("wlc", "dwd", "dwr")
    assert schedulers.reading("load_factor") == ("sap",)
    assert schedulers.with_load() == ("lc", "wlc", "dwd", "dwr", "least-load", "sap")
    assert schedulers.without_load() == ("rr", "wrr", "first", "maglev")
    keyed = [cls.name for cls in schedulers.catalogue() if cls.keyed]
    assert keyed == ["maglev"]


@pytest.mark.parametrize(
    ("load_source", "snmp", "reports"),
    [("connections", False, False), ("snmp", True, False), ("report", False, True)],
)
def test_least_load_reads_snmp_or_reports_by_its_load_source(load_source, snmp, reports):
    config = virtual_server("least-load", {"a": {"max_connections": 1}}, load_source=load_source)
    least_load = schedulers.get("least-load")
    assert (least_load.reads_snmp(config), least_load.reads_reports(config)) == (snmp, reports)
    dwd = schedulers.get("dwd")
    assert (dwd.reads_snmp(config), dwd.reads_reports(config)) == (True, False)


def test_maglev_declares_its_options_and_their_defaults():
    maglev = schedulers.get("maglev")
    assert list(schedulers.option_fields()) == ["table_size", "hash_key"]
    assert schedulers.option_owner("table_size") == "maglev"
    assert schedulers.option_owner("quiesce") is None
    defaults = maglev.options_of(virtual_server("maglev", {"a": {}}))
    assert (defaults.table_size, defaults.hash_key) == (65537, "source")
    given = maglev.options_of(virtual_server("maglev", {"a": {}}, table_size=101))
    assert given.table_size == 101
    assert schedulers.get("rr").options_of(VirtualServerConfig("v", (), ())) is None
