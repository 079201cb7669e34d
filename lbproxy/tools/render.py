"""Terminal tables (rich) for `simulate`, `status` and `demo`; plain lines when piped."""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Mapping, Sequence

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from lbproxy.core.pool import PoolStats
from lbproxy.tools.simulate import SimulationResult

SEQUENCE_SHOWN = 200  # picks printed in table mode
SEQUENCE_ROW = 20


def simulation_table(result: SimulationResult, *, hold: bool) -> Table:
    total = sum(result.picks.values())
    refused = result.sequence.count(None)
    title = (
        f"{result.virtual_server} ({result.scheduler}): {len(result.sequence)} connections"
        f"{', held' if hold else ''}{f', {refused} not served' if refused else ''}"
    )
    table = Table(title=title)
    table.add_column("real server")
    table.add_column("picks", justify="right")
    table.add_column("share", justify="right")
    for name, picks in result.picks.items():
        share = picks / total if total else 0.0
        table.add_row(name, str(picks), f"{share:.1%}")
    return table


def print_simulation(result: SimulationResult, *, hold: bool) -> None:
    console = Console(highlight=False)
    console.print(simulation_table(result, hold=hold))
    # The sequence in numbered rows, so a change after connection N is easy to find.
    shown = result.sequence[:SEQUENCE_SHOWN]
    console.print("sequence (- = not served):")
    for start in range(0, len(shown), SEQUENCE_ROW):
        row = " ".join(
            name if name is not None else "-" for name in shown[start : start + SEQUENCE_ROW]
        )
        console.print(f"  {start + 1:>5}: {row}")
    if len(result.sequence) > len(shown):
        console.print(f"  ... {len(result.sequence) - len(shown)} more (--json prints all)")
    if result.rejected:
        refused = ", ".join(f"{reason} {n}" for reason, n in result.rejected.items())
        console.print(f"refused before a pick: {refused}")


def print_explain(result: SimulationResult) -> None:
    console = Console(highlight=False)
    if result.score_legend:  # what the numbers in brackets are
        console.print(
            f"scores ({result.scheduler}): {result.score_legend}", markup=False, soft_wrap=True
        )
    for pick in result.explain:
        scores = ", ".join(f"{name}={score}" for name, score in pick.scores.items())
        # markup=False: "[a=(1, 0), ...]" is data, not a rich style tag
        console.print(
            f"#{pick.number} t={pick.time:.2f}s -> {pick.server or '-'}  [{scores}]",
            markup=False,
        )


# -- `lbproxy status` ----------------------------------------------------------------
#
# No name, address or number is ever cut, whatever the width. Piped (`| grep`, `watch`,
# cron, ssh without a tty): plain aligned columns, one real server per line with its
# virtual server repeated, as `kubectl get` and `docker ps` print. On a terminal: a table
# when it fits, else each real server as a short block of `key value` items, wrapped
# between items (a value wider than the whole terminal folds onto the next line).

PLAIN_COLUMNS = (
    "VIRTUAL_SERVER",
    "SCHEDULER",
    "THROTTLE",
    "REAL_SERVER",
    "ADDRESS",
    "STATE",
    "HEALTH",
    "WEIGHT",
    "DYNAMIC",
    "EFFECTIVE",
    "ACTIVE",
    "TOTAL",
    "BYTES_IN",
    "BYTES_OUT",
    "DISCOVERED",  # yes: from DNS (discovery.dns); no: from the configuration file
    # Appended, not inserted, so that the columns above keep their places for awk.
    "BACKUP",  # yes: `backup: true`, takes connections only while no primary is online
    "QUEUED",  # the virtual server's clients waiting in its queue (repeated, as SCHEDULER)
    "SINCE",  # how long STATE and HEALTH have been as they are, e.g. 3m12s
    # What the agent check last said: its state, weight percent and max_connections
    # (drain:50%:maxconn=30), and its reason with blanks as `_`; - without an agent.
    # DESC, not REASON: `--wide`'s REASON is found by its header's place in the line.
    "AGENT",
    "AGENT_DESC",
)
# `--wide`: the last check's result and reason, last: the reason is the rest of the line.
WIDE_COLUMNS = ("CHECK", "REASON")
UNBOUNDED = 1 << 20  # cells: wider than any terminal
PLAIN_GAP = "   "  # as docker ps: three spaces between columns


def aligned(rows: list[list[str]], gap: str = PLAIN_GAP) -> list[str]:
    """Rows of words as plain columns: each padded to its column's widest, `gap` between,
    no trailing spaces (what `status` prints when piped, and the other plain tables)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        gap.join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def status_plain(document: dict, *, wide: bool = False, now: float | None = None) -> list[str]:
    """The lines of `lbproxy status` when stdout is not a terminal: header, then rows.

    Every value is one word (`-` for none, exact byte counts), so `awk '{print $4}'`
    and `grep NAME` work on it; a virtual server without real servers still has a row.
    With `wide`, the last check's result and its reason (several words) end each row.
    """
    now = time.time() if now is None else now
    loads = _has_load(document)
    columns = [*PLAIN_COLUMNS, "LOAD"] if loads else list(PLAIN_COLUMNS)
    if wide:
        columns += WIDE_COLUMNS
    rows = [columns]
    for vs in document["virtual_servers"]:
        head = [vs["name"], vs["scheduler"], _mode(vs)]
        for rs in vs["real_servers"]:
            weight = rs["weight"]
            rows.append(
                [
                    *head,
                    rs["name"],
                    rs["address"],
                    rs["state"],
                    rs["health"],
                    str(weight["static"]),
                    "-" if weight.get("dynamic") is None else str(weight["dynamic"]),
                    str(weight["effective"]),
                    str(rs["active_connections"]),
                    str(rs["connections_total"]),
                    str(rs["bytes_in"]),
                    str(rs["bytes_out"]),
                    "yes" if rs.get("discovered") else "no",
                    "yes" if rs.get("backup") else "no",
                    str(vs.get("queued", 0)),
                    _for_how_long(rs.get("since"), now),
                    *_agent_cells(rs),
                    *([_load(rs)] if loads else []),
                    *(_check_cells(rs) if wide else []),
                ]
            )
        if not vs["real_servers"]:
            rows.append([*head] + ["-"] * (len(columns) - len(head)))
    return aligned(rows)


def _for_how_long(since: object, now: float) -> str:
    """How long ago ISO 8601 `since` was, in one word: 45s, 12m5s, 3h2m, 2d4h; - for none."""
    if not isinstance(since, str):
        return "-"
    try:
        seconds = int(max(0.0, now - datetime.datetime.fromisoformat(since).timestamp()))
    except ValueError:
        return "-"
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if days:
        return f"{days}d{hours % 24}h"
    if hours:
        return f"{hours}h{minutes % 60}m"
    if minutes:
        return f"{minutes}m{seconds % 60}s"
    return f"{seconds}s"


def _agent_cells(rs: dict) -> list[str]:
    """What the agent last said, as two words: `drain:50%:maxconn=30` and its reason
    (`deploy_window`: blanks as `_`); `-` for none."""
    agent = rs.get("agent")
    if not agent:
        return ["-", "-"]
    said = [str(agent.get("state") or "-")]
    if agent.get("weight_percent") not in (None, 100):
        said.append(f"{agent['weight_percent']}%")
    if agent.get("max_connections") is not None:
        said.append(f"maxconn={agent['max_connections']}")
    reason = "_".join(str(agent.get("reason") or "").split())
    return [":".join(said), reason or "-"]


def _check_cells(rs: dict) -> list[str]:
    """The last check's result and reason (`-`: none yet, or no reason: it passed)."""
    check = rs.get("check")
    if not check:
        return ["-", "-"]
    reason = " ".join(str(check.get("reason") or "").split())  # one line, whatever it says
    return [str(check.get("result") or "-"), reason or "-"]


def _state_for(rs: dict, now: float) -> str:
    """`enabled, up 3m12s`: the state and health, and for how long."""
    return f"{rs['state']}, {rs['health']} {_for_how_long(rs.get('since'), now)}"


def status_table(document: dict, *, wide: bool = False, now: float | None = None) -> Table:
    now = time.time() if now is None else now
    table = Table(title="lbproxy status")
    for column, justify in (
        ("virtual server", "left"),
        ("real server", "left"),
        ("address", "left"),
        ("state", "left"),
        ("health", "left"),
        ("since", "right"),
        ("weight", "right"),
        ("effective", "right"),
        ("active", "right"),
        ("total", "right"),
        ("bytes in", "right"),
        ("bytes out", "right"),
    ):
        # fold, never an ellipsis: print_status only prints the table when it fits.
        table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]  # rich wants a Literal
    loads = _has_load(document)
    if loads:
        table.add_column("load", justify="right", overflow="fold")
    if wide:
        table.add_column("last check", overflow="fold")
    for vs in document["virtual_servers"]:
        first = True
        label = f"{vs['name']} ({vs['scheduler']}, {_mode(vs, ' ')}{_queued(vs)})"
        for rs in vs["real_servers"]:
            weight = rs["weight"]
            static = str(weight["static"])
            if weight.get("dynamic") is not None:
                static += f" / snmp {weight['dynamic']}"
            table.add_row(
                Text(label if first else ""),  # Text: names and addresses are not markup
                Text(
                    rs["name"]
                    + (" (dns)" if rs.get("discovered") else "")
                    + (" (backup)" if rs.get("backup") else "")
                ),
                Text(rs["address"]),
                Text(rs["state"] + _agent(rs)),  # the agent's reason is not markup either
                _health(rs["health"]),
                _for_how_long(rs.get("since"), now),
                static,
                str(weight["effective"]),
                str(rs["active_connections"]),
                str(rs["connections_total"]),
                _bytes(rs["bytes_in"]),
                _bytes(rs["bytes_out"]),
                *([_load(rs)] if loads else []),
                *([Text(": ".join(_check_cells(rs)))] if wide else []),
            )
            first = False
        if first:  # no real servers: the virtual server still has its row
            table.add_row(Text(label), *["-"] * (len(table.columns) - 1))
        table.add_section()
    return table


def _agent(rs: dict) -> str:
    """` (agent drain: deploy)`, ` (agent 50%)`: what a server's agent says, beside the
    operator's state, when it says anything but ready at 100%."""
    agent = rs.get("agent")
    if not agent:
        return ""
    said = [] if agent["state"] == "ready" else [agent["state"]]
    if agent["weight_percent"] != 100:
        said.append(f"{agent['weight_percent']}%")
    if agent.get("max_connections") is not None:
        said.append(f"maxconn {agent['max_connections']}")
    if not said:
        return ""
    reason = f": {agent['reason']}" if agent.get("reason") and agent["state"] != "ready" else ""
    return f" (agent {' '.join(said)}{reason})"


def _queued(vs: dict) -> str:
    """`, 3 queued` while clients wait in the virtual server's queue (SPEC §13)."""
    return f", {vs['queued']} queued" if vs.get("queued") else ""


def status_blocks(
    document: dict, width: int, *, wide: bool = False, now: float | None = None
) -> list[Text]:
    """The terminal lines for a table too wide: per real server, items wrapped to `width`."""
    now = time.time() if now is None else now
    lines = [Text("lbproxy status", style="italic")]
    for vs in document["virtual_servers"]:
        label = [
            Text(vs["name"], style="bold"),
            Text(f"({vs['scheduler']}, {_mode(vs, ' ')}{_queued(vs)})"),
        ]
        lines += _pack(label, width, indent=0)
        if not vs["real_servers"]:
            lines.append(Text("  no real servers"))
        for rs in vs["real_servers"]:
            weight = rs["weight"]
            items = [
                Text(rs["name"], style="bold"),
                *([Text("(dns)")] if rs.get("discovered") else []),
                *([Text("(backup)")] if rs.get("backup") else []),
                Text(rs["address"]),
                Text(rs["state"] + _agent(rs)),
                _health(rs["health"]),
                Text(f"since {_for_how_long(rs.get('since'), now)}"),
                Text(f"weight {weight['static']}"),
            ]
            if weight.get("dynamic") is not None:
                items.append(Text(f"snmp {weight['dynamic']}"))
            items += [
                Text(f"effective {weight['effective']}"),
                Text(f"active {rs['active_connections']}"),
                Text(f"total {rs['connections_total']}"),
                Text(f"bytes in {_bytes(rs['bytes_in'])}"),
                Text(f"bytes out {_bytes(rs['bytes_out'])}"),
            ]
            if rs.get("load") is not None:
                items.append(Text(f"load {_load(rs)}"))
            if wide:
                items.append(Text("check " + ": ".join(_check_cells(rs))))
            lines += _pack(items, width, indent=2)
    return lines


def _pack(items: list[Text], width: int, indent: int) -> list[Text]:
    """Items on lines of at most `width` cells, two spaces apart, never split (the first
    line at `indent`, the next ones 2 deeper); an item wider than a line gets one alone."""
    lines: list[Text] = []
    line = Text(" " * indent)
    empty = True
    for item in items:
        if not empty and line.cell_len + 2 + item.cell_len > width:
            lines.append(line)
            line, empty = Text(" " * (indent + 2)), True
        if not empty:
            line.append("  ")
        line.append_text(item)
        empty = False
    lines.append(line)
    return lines


def print_status(document: dict, console: Console | None = None, *, wide: bool = False) -> None:
    """`lbproxy status`: plain columns unless stdout is a terminal, then a table or blocks.

    The layout follows whether stdout *is* a terminal: FORCE_COLOR or TTY_COMPATIBLE in
    the environment (rich honours both) do not turn a pipe into one.
    """
    if console is None:
        console = Console(highlight=False, force_terminal=_isatty(sys.stdout))
    if not console.is_terminal:
        lines = status_plain(document, wide=wide) + udp_plain(document) + per_source_plain(document)
        lines += cluster_plain(document, time.time())
        lines += protection_plain(document, time.time())
        console.file.write("".join(line + "\n" for line in lines))
        console.file.flush()
        return
    table = status_table(document, wide=wide)
    unbounded = console.options.update(max_width=UNBOUNDED)  # the table's natural width
    if Measurement.get(console, unbounded, table).maximum <= console.width:
        console.print(table)
    else:
        for line in status_blocks(document, console.width, wide=wide):
            console.print(line, overflow="fold")
    for line in udp_lines(document) + per_source_lines(document):
        console.print(line, overflow="fold")
    for line in cluster_lines(document, time.time()):
        console.print(line, overflow="fold")
    for line in protection_lines(document, time.time()):
        console.print(line, overflow="fold")


def _ago(last_seen: object, now: float) -> str:
    if not isinstance(last_seen, int | float):
        return "-"
    return f"{max(0.0, now - last_seen):.1f}s"


def cluster_plain(document: dict, now: float) -> list[str]:
    """The cluster's members (SPEC §18) after the rows, when clustered: a blank line,
    a header, one row per member, one word per column as above."""
    cluster = document.get("cluster")
    if not cluster:
        return []
    state = "connected" if cluster.get("connected") else "disconnected"
    rows = [["CLUSTER", "MEMBER", "LAST_SEEN", "ALIVE"]]
    for member in cluster.get("members") or [{"name": "-", "last_seen": None}]:
        alive = member.get("alive")
        rows.append(
            [
                state,
                str(member.get("name", "-")),
                _ago(member.get("last_seen"), now),
                "-" if alive is None else "yes" if alive else "no",
            ]
        )
    return ["", *aligned(rows)]


PROTECTION_COLUMNS = ("PROTECTION", "VIRTUAL_SERVER", "REAL_SERVER", "LEFT")


def _protection_rows(document: dict, now: float) -> list[list[str]]:
    """SPEC §23: a virtual server in panic (every enabled server picked as if up), and
    each ejected real server with the time its ejection has left."""
    rows = []
    for vs in document["virtual_servers"]:
        if vs.get("panic"):
            rows.append(["panic", vs["name"], "-", "-"])
        for rs in vs["real_servers"]:
            until = rs.get("ejected_until")
            if until:
                rows.append(["ejected", vs["name"], rs["name"], _left(until, now)])
    return rows


def _left(until: str, now: float) -> str:
    """The time from `now` (seconds since the epoch) to ISO 8601 `until`, like 12.5s."""
    try:
        end = datetime.datetime.fromisoformat(until).timestamp()
    except ValueError:
        return "-"
    return f"{max(0.0, end - now):.1f}s"


def protection_plain(document: dict, now: float) -> list[str]:
    """Panic and ejected servers after the rows: a blank line, a header, one row each,
    one word per column (none: nothing)."""
    rows = _protection_rows(document, now)
    if not rows:
        return []
    rows.insert(0, list(PROTECTION_COLUMNS))
    return ["", *aligned(rows)]


def protection_lines(document: dict, now: float) -> list[Text]:
    """The terminal's view of panic and ejected servers, one line each."""
    lines = []
    for kind, vs, rs, left in _protection_rows(document, now):
        if kind == "panic":
            line = Text(f"panic {vs}: ", style="bold red")
            line.append("too few servers available; every enabled one is picked as if up")
        else:
            line = Text(f"ejected {vs}/{rs}: ", style="bold yellow")
            line.append(f"connects failed in a row; back in {left}")
        lines.append(line)
    return lines


UDP_COLUMNS: tuple[str, ...] = ("UDP_VIRTUAL_SERVER", "SESSIONS", "SESSIONS_TOTAL", "DATAGRAMS_IN")
UDP_COLUMNS += ("DATAGRAMS_OUT", "DROPPED")


def _udp_rows(document: dict) -> list[list[str]]:
    """Per UDP virtual server (SPEC §19): open sessions (the real servers' active
    counts), sessions opened, datagrams each way, datagrams dropped (all reasons)."""
    rows = []
    for vs in document["virtual_servers"]:
        udp = vs.get("udp")
        if not udp:
            continue
        dropped = udp.get("dropped") or {}
        rows.append(
            [
                vs["name"],
                str(sum(rs["active_connections"] for rs in vs["real_servers"])),
                str(udp.get("sessions_total", 0)),
                str(udp.get("datagrams_in", 0)),
                str(udp.get("datagrams_out", 0)),
                str(sum(dropped.values())),
            ]
        )
    return rows


def udp_plain(document: dict) -> list[str]:
    """The UDP virtual servers' session tables after the rows: a blank line, a header,
    one row per UDP virtual server, one word per column as above (none: nothing)."""
    rows = _udp_rows(document)
    if not rows:
        return []
    rows.insert(0, list(UDP_COLUMNS))
    return ["", *aligned(rows)]


def udp_lines(document: dict) -> list[Text]:
    """The terminal's view of the UDP session tables, one line per UDP virtual server;
    the dropped datagrams by reason when there are any."""
    lines = []
    for vs in document["virtual_servers"]:
        udp = vs.get("udp")
        if not udp:
            continue
        active = sum(rs["active_connections"] for rs in vs["real_servers"])
        line = Text(f"udp {vs['name']}: ", style="bold")
        line.append(
            f"{active} sessions open, {udp.get('sessions_total', 0)} opened, datagrams "
            f"in {udp.get('datagrams_in', 0)} out {udp.get('datagrams_out', 0)}"
        )
        dropped = {r: n for r, n in (udp.get("dropped") or {}).items() if n}
        if dropped:
            line.append(
                ", dropped " + ", ".join(f"{r} {n}" for r, n in dropped.items()), style="yellow"
            )
        lines.append(line)
    return lines


PER_SOURCE_COLUMNS = ("PER_SOURCE_VIRTUAL_SERVER", "REJECTED", "TRACKED", "MAX_TRACKED")


def _per_source_rows(document: dict) -> list[list[str]]:
    """Per virtual server with `per_source:` (SPEC §23): the connections it closed at
    accept, the client networks it tracks and its bound."""
    rows = []
    for vs in document["virtual_servers"]:
        table = vs.get("per_source")
        if table:
            rows.append(
                [
                    vs["name"],
                    str(table.get("rejected", 0)),
                    str(table.get("tracked", 0)),
                    str(table.get("max_tracked", 0)),
                ]
            )
    return rows


def per_source_plain(document: dict) -> list[str]:
    """The per-source tables after the rows: a blank line, a header, one row per virtual
    server that has one (none: nothing)."""
    rows = _per_source_rows(document)
    if not rows:
        return []
    rows.insert(0, list(PER_SOURCE_COLUMNS))
    return ["", *aligned(rows)]


def per_source_lines(document: dict) -> list[Text]:
    """The terminal's view of the per-source tables, one line per virtual server."""
    lines = []
    for name, rejected, tracked, max_tracked in _per_source_rows(document):
        line = Text(f"per_source {name}: ", style="bold")
        line.append(f"{rejected} rejected", style="yellow" if rejected != "0" else "")
        line.append(f", {tracked} client networks tracked (at most {max_tracked})")
        lines.append(line)
    return lines


def cluster_lines(document: dict, now: float) -> list[Text]:
    """The terminal's view of the cluster: its state, then each member and when it was
    last seen (this instance's own heartbeat included)."""
    cluster = document.get("cluster")
    if not cluster:
        return []
    members = cluster.get("members") or []
    if cluster.get("connected"):
        head = Text("cluster: connected", style="green")
    else:
        head = Text("cluster: Redis unreachable, serving on local state", style="red")
    head.append(f" ({len(members)} member{'' if len(members) == 1 else 's'} last seen)")
    lines = [head]
    for member in members:
        line = Text(
            f"  {member.get('name', '-')}  last seen {_ago(member.get('last_seen'), now)} ago"
        )
        if member.get("alive") is False:
            line.append("  (no heartbeat)", style="red")
        lines.append(line)
    return lines


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no stream, or a closed one
        return False


def _mode(vs: dict, space: str = "-") -> str:
    """The throttle mode, or `locator only` for a virtual server with `listen: none`
    (it has no connections to throttle; SPEC §10)."""
    return f"locator{space}only" if vs.get("listen") == [] else vs["throttle_mode"]


def _has_load(document: dict) -> bool:
    """Whether any real server has a `least-load` load to show (a LOAD column)."""
    return any(
        rs.get("load") is not None
        for vs in document["virtual_servers"]
        for rs in vs["real_servers"]
    )


def _load(rs: dict) -> str:
    return "-" if rs.get("load") is None else f"{rs['load']:.4g}"


def _health(health: str) -> Text:
    return Text("up", style="green") if health == "up" else Text("down", style="red")


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


# -- `lbproxy demo` ------------------------------------------------------------------

TABLE_WIDTH = 78  # the live view fits an 80-column terminal


def stats_table(stats: PoolStats) -> Table:
    """The `demo` (wlc) table: weight is static/effective."""
    table = _table(stats, "weight: static/effective; total: connections sent so far")
    table.add_column("real server")
    table.add_column("weight", justify="right")
    table.add_column("state")
    table.add_column("health")
    table.add_column("active", justify="right")
    table.add_column("total", justify="right")
    table.add_column("bytes in", justify="right")
    table.add_column("bytes out", justify="right")
    for rs in stats.real_servers:
        table.add_row(
            rs.name,
            f"{_number(rs.weight_static)}/{_number(rs.weight_effective)}",
            rs.state,
            _health(rs.health),
            str(rs.active_connections),
            str(rs.connections_total),
            str(rs.bytes_in),
            str(rs.bytes_out),
        )
    return table


def dwd_table(stats: PoolStats, reported: Mapping[str, str]) -> Table:
    """The `demo-dwd` table: what each agent reports now, and the weights polled from it."""
    table = _table(
        stats,
        "snmp value: the agent's answer now; weight: dynamic (last poll)/effective",
    )
    table.add_column("real server")
    table.add_column("snmp value", justify="right")
    table.add_column("weight", justify="right")
    table.add_column("share", justify="right")
    table.add_column("state")
    table.add_column("health")
    table.add_column("active", justify="right")
    table.add_column("total", justify="right")
    total = sum(rs.weight_effective for rs in stats.real_servers if rs.available)
    for rs in stats.real_servers:
        dynamic = "-" if rs.weight_dynamic is None else _number(rs.weight_dynamic)
        share = rs.weight_effective / total if total and rs.available else 0.0
        table.add_row(
            rs.name,
            reported.get(rs.name, "-"),
            f"{dynamic}/{_number(rs.weight_effective)}",
            f"{share:.0%}",
            rs.state,
            _health(rs.health),
            str(rs.active_connections),
            str(rs.connections_total),
        )
    return table


def _table(stats: PoolStats, caption: str) -> Table:
    title = (
        f"[bold]{stats.name}[/] ({stats.scheduler}): "
        f"{stats.active_connections} active connection(s)"
    )
    if stats.dynamic_weight_fallback:
        title += "; [yellow]static fallback: all dynamic weights 0[/]"
    return Table(
        title=title,
        title_justify="left",
        caption=caption,
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        min_width=TABLE_WIDTH,  # room for the title and the caption on one line each
    )


def plain_lines(
    stats: PoolStats,
    label: str,
    reported: Mapping[str, str] | None = None,
    *,
    virtual_servers: Sequence[str],
) -> list[str]:
    """One line per real server, for output that is not a terminal.

    `demo` lines show `weight static/effective`; lines of a virtual server whose
    weights come from SNMP show `snmp VALUE  dynamic W  effective W` (VALUE: what the
    agent answers now; dynamic: the weight from the last poll), and `static fallback`
    while every dynamic weight is 0. `virtual_servers`: the names of the virtual servers
    printed together, whose longest sets the width of their column."""
    width = max((len(rs.name) for rs in stats.real_servers), default=0)
    vs_width = max(len(name) for name in virtual_servers)
    lines = []
    for rs in stats.real_servers:
        if rs.weight_dynamic is None or reported is None:
            weights = f"weight {_number(rs.weight_static)}/{_number(rs.weight_effective)}"
        else:
            weights = (
                f"snmp {reported.get(rs.name, '-')}  dynamic {_number(rs.weight_dynamic)}"
                f"  effective {_number(rs.weight_effective)}"
            )
            if stats.dynamic_weight_fallback:
                weights += "  static fallback"
        lines.append(
            f"[{label:>5}] {stats.name:<{vs_width}}  {rs.name:<{width}}  {rs.address}  {weights}"
            f"  {rs.state}  {rs.health}  active {rs.active_connections}"
            f"  total {rs.connections_total}  in {rs.bytes_in}  out {rs.bytes_out}"
        )
    return lines


def _number(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:.2f}"


# Why explain says a new connection would be refused, by lbproxy_rejected_total's reason.
REFUSALS = {
    "max_clients": "the process holds global.max_clients clients",
    "throttle": "the throttle is in digg",
    "acl": "the address is outside allow or in deny",
    "max_connections": "the virtual server holds its max_connections clients",
    "per_source": "the client's network is at its per_source limit",
    "no_server": "no server can take it",
}


def live_explain_lines(document: dict) -> list[str]:
    """`lbproxy explain VS IP`: the answer in one sentence, then one aligned row per real
    server (ELIGIBLE yes/no, WHY not, the scheduler's SCORE; "-" for none)."""
    pick = document.get("pick")
    by = document.get("by", "")
    head = f"{document.get('virtual_server')}: a new connection from {document.get('client')} "
    if pick is not None:
        head += f"would go to {pick} (by {by})"
    elif by == "queue":
        head += "would wait in the queue (every eligible server is full)"
    else:
        reason = document.get("reason") or "no_server"
        why = REFUSALS.get(reason, reason)
        head += f"would be refused ({reason}: {why})"
    lines = [head]
    if document.get("panic"):
        lines.append("panic: too few servers up; every enabled server is offered as if up")
    if document.get("worker") is not None:
        lines.append(f"answered by worker {document['worker']} (each worker picks on its own)")
    rows = [["SERVER", "ELIGIBLE", "WHY", "SCORE", ""]]
    for rs in document.get("servers", []):
        rows.append(
            [
                str(rs["name"]),
                "yes" if rs["eligible"] else "no",
                rs["why"] or "-",
                rs["score"] if rs["score"] is not None else "-",
                "<- pick" if rs["name"] == pick else "",
            ]
        )
    lines.extend(aligned(rows, gap="  "))
    return lines


# -- `lbproxy per-source` ----------------------------------------------------------------

PER_SOURCE_NETWORK_COLUMNS = ("NETWORK", "OPEN", "ARRIVALS", "AT_LIMIT")
PER_SOURCE_REMOTE_COLUMNS = ("REMOTE_OPEN", "REMOTE_ARRIVALS")


def _count(value: object) -> str:
    return "-" if value is None else str(value)


def per_source_rows(document: dict) -> list[list[str]]:
    """`lbproxy per-source VS`: a header, then one row per network listed, one word per
    column ("-" for a count the table does not keep: ARRIVALS without `rate`); AT_LIMIT
    is the limit its next arrival would meet, `-` for none; with `shared` the other
    instances' counts end each row."""
    shared = bool((document.get("limits") or {}).get("shared"))
    header = [*PER_SOURCE_NETWORK_COLUMNS, *(PER_SOURCE_REMOTE_COLUMNS if shared else ())]
    rows = [header]
    for network in document.get("networks", []):
        row = [
            str(network["network"]),
            _count(network["open"]),
            _count(network["arrivals"]),
            network.get("limited_by") or "-",
        ]
        if shared:
            row += [_count(network.get("remote_open")), _count(network.get("remote_arrivals"))]
        rows.append(row)
    return rows


def per_source_summary(document: dict) -> str:
    """One line: the virtual server, how many networks are tracked and shown, the limits."""
    limits = document.get("limits") or {}
    rules = []
    if limits.get("max_connections"):
        rules.append(f"max_connections {limits['max_connections']}")
    if limits.get("rate"):
        rules.append(f"rate {limits['rate']} per {limits.get('interval')}s")
    rules.append(f"by /{limits.get('prefix_v4')} (IPv4) and /{limits.get('prefix_v6')} (IPv6)")
    if limits.get("shared"):
        rules.append("shared")
    tracked = document.get("tracked", 0)
    shown = len(document.get("networks", []))
    more = f", the {shown} busiest shown" if shown < tracked else ""
    return (
        f"{document.get('virtual_server')}: {tracked} client network(s) tracked "
        f"(at most {document.get('max_tracked')}){more}; {', '.join(rules)}"
    )


def print_per_source(document: dict, console: Console | None = None) -> None:
    """`lbproxy per-source VS`: plain columns when piped (the summary on stderr, so the
    rows stay columns for awk), a table under its summary on a terminal."""
    if console is None:
        console = Console(highlight=False, force_terminal=_isatty(sys.stdout))
    rows = per_source_rows(document)
    if not console.is_terminal:
        sys.stderr.write(per_source_summary(document) + "\n")
        console.file.write("".join(line + "\n" for line in aligned(rows)))
        console.file.flush()
        return
    console.print(Text(per_source_summary(document), style="bold"), overflow="fold")
    table = Table(box=box.SIMPLE_HEAD)
    for column in rows[0]:
        words = column in ("NETWORK", "AT_LIMIT")
        table.add_column(column.lower().replace("_", " "), justify="left" if words else "right")
    for row in rows[1:]:
        style = "yellow" if row[3] != "-" else None
        table.add_row(*row, style=style)
    console.print(table)
