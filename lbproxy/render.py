"""Terminal tables (rich) for `simulate`, `status` and the demo."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from lbproxy.simulate import SimulationResult

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


def print_explain(result: SimulationResult) -> None:
    console = Console(highlight=False)
    for pick in result.explain:
        scores = ", ".join(f"{name}={score}" for name, score in pick.scores.items())
        # markup=False: "[a=(1, 0), ...]" is data, not a rich style tag
        console.print(
            f"#{pick.number} t={pick.time:.2f}s -> {pick.server or '-'}  [{scores}]",
            markup=False,
        )


def status_table(document: dict) -> Table:
    table = Table(title="lbproxy status")
    for column, justify in (
        ("virtual server", "left"),
        ("real server", "left"),
        ("address", "left"),
        ("state", "left"),
        ("health", "left"),
        ("weight", "right"),
        ("effective", "right"),
        ("active", "right"),
        ("total", "right"),
        ("bytes in", "right"),
        ("bytes out", "right"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for vs in document["virtual_servers"]:
        first = True
        label = f"{vs['name']} ({vs['scheduler']}, {vs['throttle_mode']})"
        for rs in vs["real_servers"]:
            weight = rs["weight"]
            static = str(weight["static"])
            if weight.get("dynamic") is not None:
                static += f" / snmp {weight['dynamic']}"
            table.add_row(
                label if first else "",
                rs["name"],
                rs["address"],
                rs["state"],
                "[green]up[/]" if rs["health"] == "up" else "[red]down[/]",
                static,
                str(weight["effective"]),
                str(rs["active_connections"]),
                str(rs["connections_total"]),
                _bytes(rs["bytes_in"]),
                _bytes(rs["bytes_out"]),
            )
            first = False
        table.add_section()
    return table


def print_status(document: dict) -> None:
    Console().print(status_table(document))


def _bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)
