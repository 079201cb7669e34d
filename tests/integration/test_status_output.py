"""`lbproxy status` never cuts a name, address or number: piped, and on terminals of 40,
80 and 200 columns (a real pseudo-terminal, as a user's shell gives it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.integration.harness import (
    ROOT,
    ask_name,
    free_port,
    front_door_proxy,
    run_cli,
    run_in_terminal,
    with_admin,
)

VS_NAME = "web-frontend-production-eu-w01"  # 30 characters
NAMES = (
    "alpha-backend-server-000000001",  # 30 characters each
    "bravo-backend-server-000000002",
    "charlie-backend-server-0000003",
)
CONNECTIONS = 5
BOX_DRAWING = re.compile("[\u2500-\u257f]")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture
def status_setup(name_servers, lbproxy):
    """Two virtual servers; long real-server names, one on ::1; some traffic."""
    alpha, charlie = name_servers(NAMES[0], NAMES[2])
    (bravo,) = name_servers(NAMES[1], host="::1")
    (delta,) = name_servers("delta")
    port, db_port, admin_port = free_port(), free_port(), free_port()
    config = with_admin(
        "global:\n"
        "  admin: {listen: none}\n"
        "virtual_servers:\n"
        f"  - name: {VS_NAME}\n"
        f"    listen: 127.0.0.1:{port}\n"
        "    scheduler: rr\n"
        "    health_check: {type: none}\n"
        "    real_servers:\n"
        f"      - {{name: {NAMES[0]}, address: 127.0.0.1:{alpha.port}}}\n"
        f'      - {{name: {NAMES[1]}, address: "[::1]:{bravo.port}", weight: 12}}\n'
        f"      - {{name: {NAMES[2]}, address: 127.0.0.1:{charlie.port}, state: drain}}\n"
        "  - name: db\n"
        f"    listen: 127.0.0.1:{db_port}\n"
        "    scheduler: wlc\n"
        "    health_check: {type: none}\n"
        "    real_servers:\n"
        f"      - {{name: delta, address: 127.0.0.1:{delta.port}}}\n",
        admin_port,
    )
    lbproxy(config)
    served = [ask_name(port) for _ in range(CONNECTIONS)]
    assert sorted(set(served)) == [NAMES[0], NAMES[1]]
    admin = f"http://127.0.0.1:{admin_port}"
    out = run_cli("status", "--json", "--admin", admin)
    assert out.returncode == 0, out.stderr
    return admin, json.loads(out.stdout)


def rows(document) -> list[tuple[dict, dict]]:
    return [(vs, rs) for vs in document["virtual_servers"] for rs in vs["real_servers"]]


def plain_fields(vs: dict, rs: dict) -> list[str]:
    weight = rs["weight"]
    return [
        vs["name"], vs["scheduler"], vs["throttle_mode"], rs["name"], rs["address"],
        rs["state"], rs["health"], str(weight["static"]),
        "-" if weight["dynamic"] is None else str(weight["dynamic"]), str(weight["effective"]),
        str(rs["active_connections"]), str(rs["connections_total"]), str(rs["bytes_in"]),
        str(rs["bytes_out"]), "yes" if rs["discovered"] else "no",
        "yes" if rs["backup"] else "no", str(vs["queued"]),
    ]  # fmt: skip


SINCE = re.compile(r"\d+s|\d+m\d+s|\d+h\d+m|\d+d\d+h")  # how long, one word


def test_piped_status_is_plain_aligned_columns_one_real_server_a_line(status_setup):
    admin, document = status_setup
    # COLUMNS=40 changes nothing when stdout is a pipe, nor do FORCE_COLOR and
    # TTY_COMPATIBLE (which make rich colour a pipe): it is still not a terminal
    out = subprocess.run(
        [sys.executable, "-m", "lbproxy", "status", "--admin", admin],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=dict(os.environ, COLUMNS="40", FORCE_COLOR="1", TTY_COMPATIBLE="1"),
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert not BOX_DRAWING.search(out.stdout) and "…" not in out.stdout
    assert "\x1b" not in out.stdout  # no colour codes in a pipe
    assert lines[0].split() == [
        "VIRTUAL_SERVER", "SCHEDULER", "THROTTLE", "REAL_SERVER", "ADDRESS", "STATE",
        "HEALTH", "WEIGHT", "DYNAMIC", "EFFECTIVE", "ACTIVE", "TOTAL", "BYTES_IN", "BYTES_OUT",
        "DISCOVERED", "BACKUP", "QUEUED", "SINCE", "AGENT", "AGENT_DESC",
    ]  # fmt: skip
    expected = [plain_fields(vs, rs) for vs, rs in rows(document)]
    assert [line.split()[:-3] for line in lines[1:]] == expected
    assert all(SINCE.fullmatch(line.split()[-3]) for line in lines[1:]), lines
    assert all(line.split()[-2:] == ["-", "-"] for line in lines[1:])  # no agent check
    # the exact values: the traffic went to alpha and bravo, 3 and 2 rr picks
    by_name = {fields[3]: fields for fields in expected}
    assert by_name[NAMES[0]][11] == "3" and by_name[NAMES[1]][11] == "2"
    assert by_name[NAMES[0]][13] == str(3 * len(NAMES[0] + "\n"))  # the greetings
    assert by_name[NAMES[1]][4].startswith("[::1]:") and by_name[NAMES[1]][7] == "12"
    # aligned: every value starts where its header does
    starts = [m.start() for m in re.finditer(r"\S+", lines[0])]
    for line in lines[1:]:
        assert [m.start() for m in re.finditer(r"\S+", line)] == starts, line


def test_status_through_grep_finds_the_whole_line(status_setup):
    admin, document = status_setup
    out = subprocess.run(
        f"{sys.executable} -m lbproxy status --admin {admin} | grep {NAMES[1]}",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    ((vs, rs),) = [(vs, rs) for vs, rs in rows(document) if rs["name"] == NAMES[1]]
    assert out.stdout.split()[:-3] == plain_fields(vs, rs)  # then SINCE, AGENT, AGENT_DESC


@pytest.mark.parametrize("columns", [40, 80])
def test_a_narrow_terminal_wraps_between_values_and_cuts_none(status_setup, columns):
    admin, document = status_setup
    screen = run_in_terminal(columns, "status", "--admin", admin)
    lines = screen.splitlines()
    assert "…" not in screen and not BOX_DRAWING.search(screen)
    assert max(len(line) for line in lines) <= columns
    for vs in document["virtual_servers"]:
        assert any(vs["name"] in line for line in lines)
    for _, rs in rows(document):
        start = next(i for i, line in enumerate(lines) if rs["name"] in line)
        block = [lines[start]]
        for line in lines[start + 1 :]:
            if not line.startswith("    "):
                break
            block.append(line)
        weight = rs["weight"]
        for value in (
            rs["address"],
            rs["state"],
            rs["health"],
            f"weight {weight['static']}",
            f"effective {weight['effective']}",
            f"active {rs['active_connections']}",
            f"total {rs['connections_total']}",
            "bytes in ",
            "bytes out ",
        ):
            assert any(value in line for line in block), (value, block)


def test_a_wide_terminal_shows_the_table_with_every_value_whole(status_setup):
    admin, document = status_setup
    screen = run_in_terminal(200, "status", "--admin", admin)
    assert "…" not in screen and "┃ virtual server" in screen
    assert max(len(line) for line in screen.splitlines()) <= 200
    for _, rs in rows(document):
        (line,) = [line for line in screen.splitlines() if rs["name"] in line]
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        weight = rs["weight"]
        assert cells[1:5] + cells[6:10] == [
            rs["name"], rs["address"], rs["state"], rs["health"], str(weight["static"]),
            str(weight["effective"]), str(rs["active_connections"]),
            str(rs["connections_total"]),
        ]  # fmt: skip
        assert SINCE.fullmatch(cells[5]), cells
    assert f"{VS_NAME} (rr, low)" in screen


# -- backup servers and the queue (SPEC §13) ---------------------------------------------


def test_status_shows_the_backup_mark_and_the_queued_clients(name_servers, lbproxy):
    _, admin_port, opened = front_door_proxy(name_servers, lbproxy, queued=2)
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        (vs,) = json.loads(run_cli("status", "--json", "--admin", admin).stdout)["virtual_servers"]
        assert vs["queued"] == 2
        assert {rs["name"]: rs["backup"] for rs in vs["real_servers"]} == {
            "primary": False,
            "standby": True,
        }
        # Piped: BACKUP per real server, the virtual server's QUEUED on each of its lines.
        out = run_cli("status", "--admin", admin)
        assert out.returncode == 0, out.stderr
        header, *lines = (line.split() for line in out.stdout.splitlines())
        assert header[15:18] == ["BACKUP", "QUEUED", "SINCE"]
        assert {line[3]: line[15:17] for line in lines} == {
            "primary": ["no", "2"],
            "standby": ["yes", "2"],
        }
        # On a terminal: the table, and the wrapped blocks of a narrow one.
        wide = run_in_terminal(200, "status", "--admin", admin)
        assert "web (rr, low, 2 queued)" in wide
        (standby,) = [line for line in wide.splitlines() if "standby" in line]
        assert "standby (backup)" in standby
        assert "primary (backup)" not in wide
        narrow = run_in_terminal(40, "status", "--admin", admin).splitlines()
        assert any("2 queued" in line for line in narrow), narrow
        (standby,) = [line for line in narrow if "standby" in line]
        assert standby.split()[:2] == ["standby", "(backup)"]
    finally:
        for sock in opened:
            sock.close()
