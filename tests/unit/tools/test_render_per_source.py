"""`lbproxy per-source VS` (tools/render.py): plain columns when piped, a table under
its summary on a terminal."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from lbproxy.tools.render import per_source_rows, per_source_summary, print_per_source


def document(shared: bool = False, tracked: int = 2) -> dict:
    return {
        "virtual_server": "web",
        "tracked": tracked,
        "max_tracked": 100000,
        "limits": {
            "max_connections": 10,
            "rate": None,
            "interval": 1,
            "prefix_v4": 24,
            "prefix_v6": 64,
            "shared": shared,
        },
        "limit": 100,
        "networks": [
            {
                "network": "203.0.113.0/24",
                "open": 10,
                "arrivals": None,
                "at_limit": True,
                "limited_by": "max_connections",
                "remote_open": 2 if shared else None,
                "remote_arrivals": None,
            },
            {
                "network": "2001:db8::/64",
                "open": 1,
                "arrivals": None,
                "at_limit": False,
                "limited_by": None,
                "remote_open": 0 if shared else None,
                "remote_arrivals": None,
            },
        ],
    }


def test_piped_it_is_one_word_per_column_and_the_summary_goes_to_stderr(capsys) -> None:
    out = io.StringIO()
    print_per_source(document(), Console(file=out, width=100, force_terminal=False))
    assert [line.split() for line in out.getvalue().splitlines()] == [
        ["NETWORK", "OPEN", "ARRIVALS", "AT_LIMIT"],
        ["203.0.113.0/24", "10", "-", "max_connections"],
        ["2001:db8::/64", "1", "-", "-"],
    ]
    assert capsys.readouterr().err.startswith("web: 2 client network(s) tracked")


def test_shared_adds_the_other_instances_columns() -> None:
    rows = per_source_rows(document(shared=True))
    assert rows[0][-2:] == ["REMOTE_OPEN", "REMOTE_ARRIVALS"]
    assert rows[1][-2:] == ["2", "-"]


@pytest.mark.parametrize(("tracked", "shown"), [(2, ""), (5000, "the 2 busiest shown")])
def test_the_summary_names_the_limits_and_what_is_left_out(tracked: int, shown: str) -> None:
    summary = per_source_summary(document(tracked=tracked))
    assert summary.startswith(f"web: {tracked} client network(s) tracked (at most 100000)")
    assert "max_connections 10" in summary and "by /24 (IPv4) and /64 (IPv6)" in summary
    assert "rate" not in summary.replace("max_connections", "")
    assert (shown in summary) if shown else ("busiest" not in summary)


def test_on_a_terminal_it_is_a_table_under_its_summary() -> None:
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=True, color_system=None)
    print_per_source(document(), console)
    text = out.getvalue()
    assert text.splitlines()[0].startswith("web: 2 client network(s) tracked")
    assert "network" in text and "at limit" in text
    assert "203.0.113.0/24" in text and "max_connections" in text
