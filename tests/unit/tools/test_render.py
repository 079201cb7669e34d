"""`lbproxy status` rendering of the API document: plain columns, table, wrapped blocks."""

from __future__ import annotations

import copy
import datetime
import io

import pytest
from rich.console import Console

from lbproxy.tools.render import per_source_plain, print_status, protection_plain, status_plain

LONG_HOST = "backend-" + "x" * 52 + ".example:8080"  # 73 characters: wider than a terminal


def real_server(name: str, address: str, dynamic=None, total=7, discovered=False) -> dict:
    return {
        "name": name,
        "address": address,
        "state": "enabled",
        "health": "up",
        "weight": {"static": 3, "dynamic": dynamic, "effective": 2.5},
        "active_connections": 1,
        "connections_total": total,
        "bytes_in": 1234567,
        "bytes_out": 89,
        "discovered": discovered,
    }


DOCUMENT = {
    "virtual_servers": [
        {
            "name": "snmp-weighted",
            "scheduler": "dwd",
            "throttle_mode": "high",
            "real_servers": [
                real_server("alpha", "127.0.0.1:9001", dynamic=40, total=123456789),
                real_server("far", LONG_HOST, discovered=True),
            ],
        },
        {"name": "empty", "scheduler": "rr", "throttle_mode": "low", "real_servers": []},
    ]
}


def render(width: int, terminal: bool) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=terminal, color_system=None)
    print_status(DOCUMENT, console)
    return out.getvalue()


def test_plain_columns_keep_every_value_and_a_row_for_an_empty_virtual_server():
    lines = status_plain(DOCUMENT)
    assert [line.split() for line in lines[1:]] == [
        ["snmp-weighted", "dwd", "high", "alpha", "127.0.0.1:9001", "enabled", "up", "3", "40",
         "2.5", "1", "123456789", "1234567", "89", "no", "no", "0", "-", "-", "-"],
        ["snmp-weighted", "dwd", "high", "far", LONG_HOST, "enabled", "up", "3", "-", "2.5",
         "1", "7", "1234567", "89", "yes", "no", "0", "-", "-", "-"],
        ["empty", "rr", "low"] + ["-"] * 17,
    ]  # fmt: skip
    assert render(30, terminal=False) == "".join(line + "\n" for line in lines)


NOW = datetime.datetime(2026, 12, 5, 15, 3, 12, tzinfo=datetime.UTC).timestamp()


@pytest.mark.parametrize(
    "since, shown",
    [
        ("2026-12-05T15:03:12.000Z", "0s"),
        ("2026-12-05T15:02:30.500Z", "41s"),
        ("2026-12-05T15:00:00.000Z", "3m12s"),
        ("2026-12-05T11:00:00.000Z", "4h3m"),
        ("2026-12-01T15:00:00.000Z", "4d0h"),
        (None, "-"),
        ("not a time", "-"),
    ],
)
def test_since_is_one_word_saying_how_long(since, shown):
    rs = {**real_server("alpha", "127.0.0.1:9001"), "since": since}
    document = {"virtual_servers": [{**DOCUMENT["virtual_servers"][1], "real_servers": [rs]}]}
    header, row = status_plain(document, now=NOW)
    assert header.split()[17] == "SINCE" and row.split()[17] == shown


def test_wide_ends_each_row_with_the_last_check_and_its_whole_reason():
    reason = "send_expect check: '^PONG' not found in 6 bytes \"NOPE\\r\\n\" within 0.3s"
    failed = {
        **real_server("alpha", "127.0.0.1:9001"),
        "check": {"result": "fail", "reason": reason},
    }
    unchecked = {**real_server("beta", "127.0.0.1:9002"), "check": None}
    vs = {**DOCUMENT["virtual_servers"][1], "real_servers": [failed, unchecked]}
    header, alpha, beta = status_plain({"virtual_servers": [vs]}, wide=True, now=NOW)
    assert header.split()[-5:] == ["SINCE", "AGENT", "AGENT_DESC", "CHECK", "REASON"]
    assert alpha[header.index("REASON") :] == reason
    assert alpha.split()[-len(reason.split()) - 1] == "fail"
    assert beta.split()[-2:] == ["-", "-"]
    table = io.StringIO()
    print_status(
        {"virtual_servers": [vs]},
        Console(file=table, width=300, force_terminal=True, color_system=None),
        wide=True,
    )
    assert "last check" in table.getvalue() and reason in table.getvalue()


def test_a_narrow_terminal_folds_a_value_wider_than_itself_and_cuts_nothing():
    screen = render(40, terminal=True)
    lines = screen.splitlines()
    assert "…" not in screen and max(len(line) for line in lines) <= 40
    assert LONG_HOST in "".join(line.strip() for line in lines)  # folded, not cut
    for item in ("weight 3", "snmp 40", "effective 2.5", "active 1", "total 123456789"):
        assert any(item in line for line in lines), item
    assert any("bytes in 1.2 MB" in line for line in lines)
    assert lines[-2:] == ["empty  (rr, low)", "  no real servers"]


def test_a_terminal_wide_enough_gets_the_table():
    screen = render(250, terminal=True)
    assert "┃ virtual server" in screen and "…" not in screen
    assert max(len(line) for line in screen.splitlines()) <= 250
    assert "│ empty (rr, low)" in screen
    assert "3 / snmp 40" in screen and LONG_HOST in screen and "123456789" in screen


def test_discovered_servers_are_marked_in_every_layout():
    assert status_plain(DOCUMENT)[0].split()[14] == "DISCOVERED"
    table = render(250, terminal=True)
    assert "far (dns)" in table and "alpha (dns)" not in table
    blocks = render(40, terminal=True).splitlines()
    far = next(i for i, line in enumerate(blocks) if line.strip().startswith("far"))
    assert blocks[far].split()[:2] == ["far", "(dns)"]


def test_backups_and_queued_clients_are_shown_in_the_table_and_the_blocks():
    document = {
        "virtual_servers": [
            {
                "name": "web",
                "scheduler": "rr",
                "throttle_mode": "low",
                "queued": 3,
                "real_servers": [
                    real_server("main", "127.0.0.1:9001"),
                    {**real_server("sorry", "127.0.0.1:9002"), "backup": True},
                ],
            }
        ]
    }
    for width in (200, 40):  # the table, then the wrapped blocks
        out = io.StringIO()
        console = Console(file=out, width=width, force_terminal=True, color_system=None)
        print_status(document, console)
        text = out.getvalue()
        assert "3 queued" in text and "(backup)" in text
        assert text.count("(backup)") == 1  # only the backup server
    # Piped: a BACKUP column per real server, the virtual server's QUEUED on each line.
    header, *lines = (line.split() for line in status_plain(document))
    assert header[15:17] == ["BACKUP", "QUEUED"]
    assert {line[3]: line[15:17] for line in lines} == {"main": ["no", "3"], "sorry": ["yes", "3"]}


def test_panic_and_ejected_servers_follow_the_rows_with_the_time_left():
    document = copy.deepcopy(DOCUMENT)
    web = document["virtual_servers"][0]
    web["panic"] = True
    web["real_servers"][0]["ejected_until"] = "2026-12-05T15:00:30.000Z"
    web["real_servers"][1]["ejected_until"] = None
    now = datetime.datetime(2026, 12, 5, 15, 0, 2, 500000, tzinfo=datetime.UTC).timestamp()
    assert [line.split() for line in protection_plain(document, now)] == [
        [],
        ["PROTECTION", "VIRTUAL_SERVER", "REAL_SERVER", "LEFT"],
        ["panic", "snmp-weighted", "-", "-"],
        ["ejected", "snmp-weighted", "alpha", "27.5s"],
    ]
    assert protection_plain(DOCUMENT, now) == []  # nothing to say: nothing printed
    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=True, color_system=None)
    print_status(document, console)
    text = out.getvalue()
    assert "panic snmp-weighted: too few servers available" in text
    assert "ejected snmp-weighted/alpha: connects failed in a row; back in " in text


def test_per_source_tables_follow_the_rows_plain_and_on_a_terminal():
    document = {
        "virtual_servers": [
            dict(
                DOCUMENT["virtual_servers"][1],
                per_source={"tracked": 2, "max_tracked": 100000, "rejected": 40},
            )
        ]
    }
    plain = status_plain(document) + per_source_plain(document)
    out = io.StringIO()
    print_status(document, Console(file=out, width=100, force_terminal=False))
    assert out.getvalue() == "".join(line + "\n" for line in plain)
    assert [line.split() for line in plain[-2:]] == [
        ["PER_SOURCE_VIRTUAL_SERVER", "REJECTED", "TRACKED", "MAX_TRACKED"],
        ["empty", "40", "2", "100000"],
    ]
    screen = io.StringIO()
    terminal = Console(file=screen, width=100, force_terminal=True, color_system=None)
    print_status(document, terminal)
    assert (
        "per_source empty: 40 rejected, 2 client networks tracked (at most 100000)"
        in screen.getvalue()
    )
    assert per_source_plain(DOCUMENT) == []  # no table: nothing


def test_plain_status_shows_what_the_agent_last_said_in_two_words():
    said = {
        **real_server("alpha", "127.0.0.1:9001"),
        "agent": {"state": "drain", "weight_percent": 50, "max_connections": 30,
                  "reason": " deploy  window\n2 ", "at": "2026-12-05T15:00:00.000Z"},
    }  # fmt: skip
    ready = {
        **real_server("beta", "127.0.0.1:9002"),
        "agent": {"state": "ready", "weight_percent": 100, "max_connections": None,
                  "reason": "", "at": None},
    }  # fmt: skip
    none = real_server("gamma", "127.0.0.1:9003")
    vs = {**DOCUMENT["virtual_servers"][1], "real_servers": [said, ready, none]}
    for wide in (False, True):
        header, *rows = (
            line.split() for line in status_plain({"virtual_servers": [vs]}, wide=wide)
        )
        at = header.index("AGENT")
        assert header[at : at + 2] == ["AGENT", "AGENT_DESC"] and at == 18
        assert {row[3]: row[at : at + 2] for row in rows} == {
            "alpha": ["drain:50%:maxconn=30", "deploy_window_2"],
            "beta": ["ready", "-"],
            "gamma": ["-", "-"],
        }
