"""The command line (click only): parse flags, load the configuration, call the runner.

Exit codes (SPEC §1): 0 success, 1 runtime failure, 2 bad usage or invalid
configuration. An invalid configuration prints `FILE:LINE: message` for every problem
and never a traceback.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import click

from lbproxy import __version__
from lbproxy.config.model import MAX_WEIGHT, Config, ConfigError
from lbproxy.config.reader import load
from lbproxy.config.summary import summary, warnings
from lbproxy.net.compiled import describe as describe_implementation

EXIT_RUNTIME = 1
EXIT_USAGE = 2


def _examples(*lines: str) -> str:
    """An epilog of example command lines, kept as written (click's \\b: no rewrap)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


def _load_or_exit(paths: tuple[str, ...]) -> Config:
    try:
        return load(list(paths))
    except ConfigError as exc:
        for problem in exc.problems:
            click.echo(str(problem), err=True)
        click.echo(
            f"lbproxy: configuration invalid ({len(exc.problems)} problem"
            f"{'s' if len(exc.problems) != 1 else ''})",
            err=True,
        )
        sys.exit(EXIT_USAGE)


@click.group(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=_examples(
        "lbproxy demo                    # demo servers, the proxy and its dashboard",
        "lbproxy check /etc/lbproxy      # validate a configuration folder",
        "lbproxy run /etc/lbproxy        # serve it (SIGHUP reloads)",
        "lbproxy status                  # the live table from the admin endpoint",
        "lbproxy COMMAND --help          # each command's options and examples",
    )
    + '\n\nShell completion: eval "$(_LBPROXY_COMPLETE=bash_source lbproxy)" (zsh_source,'
    " fish_source); see docs/reference/cli.md.",
)
@click.version_option(
    __version__,
    prog_name="lbproxy",
    # the second line: compiled or pure-Python connection path (lbproxy/net/compiled.py)
    message=f"%(prog)s, version %(version)s\n{describe_implementation()}",
)
def main() -> None:
    """lbproxy: a Layer-4 TCP reverse proxy and load balancer."""


@main.command(
    epilog=_examples(
        "lbproxy run configs/",
        "lbproxy run global.yaml web.yaml --log-level debug",
        "kill -HUP $(pidof -s lbproxy)    # reload the files",
    )
)
@click.argument("config", nargs=-1, required=True)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
@click.option("--worker-fd", type=int, hidden=True)  # a worker of `workers: N` (runtime/workers/)
@click.option("--upgrade-fd", type=int, hidden=True)  # started by an upgrade (upgrade.py)
def run(
    config: tuple[str, ...], log_level: str, worker_fd: int | None, upgrade_fd: int | None
) -> None:
    """Run the proxy. CONFIG: YAML files or folders of *.yaml files.

    SIGHUP reloads the configuration; SIGTERM or SIGINT drain, then exit. Under
    systemd socket activation (LISTEN_FDS) the passed sockets are served, not bound.
    """
    from lbproxy.runtime import server  # trio is imported only by the commands that need it

    server.raise_descriptor_limit()
    if worker_fd is not None:  # started by the supervisor, which sends the configuration
        from lbproxy.runtime import workers

        sys.exit(workers.run_worker(worker_fd, list(config), log_level))
    if upgrade_fd is not None:  # started by `lbproxy upgrade`: takes over the sockets
        from lbproxy.runtime import takeover

        sys.exit(takeover.run_new(upgrade_fd, list(config), log_level))
    cfg = _load_or_exit(config)
    if cfg.global_.workers > 1:
        from lbproxy.runtime import workers

        sys.exit(workers.run(cfg, config_paths=list(config), log_level=log_level))
    sys.exit(server.run(cfg, config_paths=list(config), log_level=log_level))


@main.command(
    epilog=_examples("lbproxy check configs/", "lbproxy check --resolve /etc/lbproxy/web.yaml")
)
@click.argument("config", nargs=-1, required=True)
@click.option(
    "--resolve",
    is_flag=True,
    help="Also resolve each discovery.dns name once and print the real servers it adds.",
)
def check(config: tuple[str, ...], resolve: bool) -> None:
    """Validate CONFIG and print a summary of its virtual servers."""
    cfg = _load_or_exit(config)
    click.echo(summary(cfg))
    for warning in warnings(cfg):  # valid (exit 0), but probably not what was meant
        click.echo(f"warning: {warning}", err=True)
    click.echo("configuration ok")
    if resolve and not _print_discovered(cfg):
        sys.exit(EXIT_RUNTIME)


@main.command(
    epilog=_examples(
        "lbproxy schema > /etc/lbproxy/lbproxy.schema.json",
        "# then, as the first line of a configuration file:",
        "# yaml-language-server: $schema=lbproxy.schema.json",
    )
)
def schema() -> None:
    """Print the configuration's JSON Schema (draft 2020-12), for editors.

    It is built from the definition `check` uses: every key, type, range and default.
    """
    from lbproxy.config.schema import dumps

    click.echo(dumps(), nl=False)


def _print_discovered(cfg: Config) -> bool:
    """`check --resolve`: each discovery name's servers now; False if one did not answer."""
    import trio

    from lbproxy.config.summary import discovery_summary
    from lbproxy.control.discovery import resolve_all

    found = trio.run(resolve_all, cfg)
    if not found:
        click.echo("no virtual server has discovery.dns")
    answered = True
    for vs, outcome in found:
        assert vs.discovery is not None
        click.echo(f"virtual server {vs.name}: {discovery_summary(vs.discovery)}")
        if outcome.result != "ok":
            answered = False
            why = {"nxdomain": "NXDOMAIN", "empty": "no records"}.get(outcome.result, "error")
            detail = f": {outcome.detail}" if outcome.detail else ""
            click.echo(f"  {why}{detail}; would add no real server")
            continue
        if outcome.detail:
            click.echo(f"  {outcome.detail}")
        for name, reason in outcome.refused:
            click.echo(f"  refused {name} ({reason}): see discovery.dns.allow_addresses")
        static = {rs.name for rs in vs.real_servers}
        click.echo(f"  would add {len(outcome.servers)} real server(s)")
        for rs in outcome.servers:
            notes = [f"weight {rs.weight}"] + (["backup"] if rs.backup else [])
            if rs.name in static:
                notes.append("a static real server has this name: not added")
            click.echo(f"    {rs.name}  {rs.address}  {', '.join(notes)}")
    return answered


@main.command(
    "import",
    epilog=_examples(
        "lbproxy import /etc/haproxy/haproxy.cfg > lbproxy.yaml",
        "lbproxy import --from nginx /etc/nginx/nginx.conf > lbproxy.yaml",
        "lbproxy check lbproxy.yaml",
    ),
)
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--from",
    "source",
    type=click.Choice(["haproxy", "nginx"]),
    help="The balancer FILE is for (guessed from its content when omitted).",
)
def import_configuration(file: str, source: str | None) -> None:
    """Print FILE (an HAProxy `mode tcp` or nginx `stream` configuration) as lbproxy's
    configuration on stdout; every directive not carried over is named on stderr as
    FILE:LINE. Exits 2 when nothing could be translated. HAProxy's environment
    variables and `.if` blocks are read with the environment this command runs in."""
    import os
    from pathlib import Path

    from lbproxy.tools.importer.translation import guess_source, to_yaml

    path = Path(file)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        click.echo(f"{file}: {e.strerror or e}", err=True)
        sys.exit(EXIT_USAGE)
    chosen = source or guess_source(text)
    if chosen is None:
        click.echo(
            f"{file}: neither HAProxy nor nginx configuration: say which with --from", err=True
        )
        sys.exit(EXIT_USAGE)
    if chosen == "haproxy":
        from lbproxy.tools.importer import haproxy

        # HAProxy expands environment variables and decides `.if` blocks when it reads
        # its file: the import does so with the environment it runs in.
        translation = haproxy.translate(path, os.environ)
    else:
        from lbproxy.tools.importer import nginx

        translation = nginx.translate(path)
    for left in translation.untranslated:
        click.echo(str(left), err=True)
    if translation.translated == 0:
        click.echo(f"{file}: nothing could be translated", err=True)
        sys.exit(EXIT_USAGE)
    click.echo(to_yaml(translation), nl=False)


@main.command(
    epilog=_examples(
        "lbproxy simulate configs/sap.yaml -n 8",
        "lbproxy simulate configs/wrr.yaml -n 12 --explain",
        "lbproxy simulate maglev.yaml -n 3000 --clients 1000 --events moves.yaml",
        "lbproxy simulate --replay access.log.gz now.yaml next.yaml --max-moved 10",
        "lbproxy simulate --replay haproxy.log --log-format haproxy lbproxy.yaml",
    )
)
@click.argument("config", nargs=-1, required=True)
@click.option(
    "--connections",
    "-n",
    type=click.IntRange(min=0),
    help="How many connections arrive (required, except with --replay).",
)
@click.option("--hold", is_flag=True, help="Every connection stays open.")
@click.option("--events", type=click.Path(dir_okay=False), help="YAML list of events.")
@click.option("--virtual-server", "vs_name", help="Needed when CONFIG has several.")
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Connections per second of simulated time.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
@click.option("--explain", is_flag=True, help="Print every pick with each server's score.")
@click.option(
    "--clients",
    type=click.IntRange(min=1),
    help="Connections come from K client addresses in turn (10.0.0.1, 10.0.0.2, ...).",
)
@click.option("--locate", is_flag=True, help="Every arrival is a locator answer (nothing is held).")
@click.option(
    "--replay",
    "replay_log",
    metavar="LOG",
    help="Replay a traffic log (.gz too; - for stdin) through each CONFIG, one configuration each.",
)
@click.option(
    "--log-format",
    type=click.Choice(["lbproxy", "haproxy"]),
    help="With --replay: lbproxy's JSON access log (default) or HAProxy's `option tcplog`.",
)
@click.option(
    "--max-moved",
    type=click.FloatRange(min=0, max=100),
    metavar="PCT",
    help="With --replay: exit 1 when more than PCT percent of a virtual server's clients "
    "go first to another server than in the first CONFIG.",
)
@click.option(
    "--max-peak-ratio",
    type=click.FloatRange(min=1),
    metavar="R",
    help="With --replay: exit 1 when a virtual server's busiest real server peaks at more "
    "than R times the mean of its servers' peaks.",
)
@click.pass_context
def simulate(
    ctx: click.Context,
    config: tuple[str, ...],
    connections: int | None,
    hold: bool,
    events: str | None,
    vs_name: str | None,
    rate: float,
    as_json: bool,
    explain: bool,
    clients: int | None,
    locate: bool,
    replay_log: str | None,
    log_format: str | None,
    max_moved: float | None,
    max_peak_ratio: float | None,
) -> None:
    """Run the real scheduler offline and print each real server's share: on a
    synthetic arrival sequence (--connections), or on a traffic log (--replay LOG),
    each CONFIG then being one configuration (a file or a folder) to compare."""
    replay_only = {
        "--log-format": log_format,
        "--max-moved": max_moved,
        "--max-peak-ratio": max_peak_ratio,
    }
    if replay_log is not None:
        synthetic_only = {
            "--connections": connections,
            "--hold": hold or None,
            "--events": events,
            "--virtual-server": vs_name,
            "--explain": explain or None,
            "--clients": clients,
            "--locate": locate or None,
            "--rate": None
            if ctx.get_parameter_source("rate") is click.core.ParameterSource.DEFAULT
            else rate,
        }
        given = [name for name, value in synthetic_only.items() if value is not None]
        if given:
            raise click.UsageError(
                f"{', '.join(given)} not allowed with --replay: the log says what arrives, "
                "when, from whom and for how long"
            )
        _replay(replay_log, config, log_format or "lbproxy", max_moved, max_peak_ratio, as_json)
        return
    given = [name for name, value in replay_only.items() if value is not None]
    if given:
        raise click.UsageError(f"{', '.join(given)} only with --replay LOG")
    if connections is None:
        raise click.UsageError("Missing option '--connections' / '-n' (or --replay LOG).")
    if locate and hold:
        click.echo("--locate and --hold exclude each other: a locator holds nothing", err=True)
        sys.exit(EXIT_USAGE)
    from lbproxy.tools.simulate import SimulationError, choose_virtual_server, parse_events
    from lbproxy.tools.simulate import simulate as run_simulation

    cfg = _load_or_exit(config)
    try:
        vs = choose_virtual_server(cfg, vs_name)
        event_list = []
        if events:
            try:
                text = Path(events).read_text()
            except OSError as exc:
                raise SimulationError(f"{events}: {exc.strerror}") from None
            event_list = parse_events(text, events, [rs.name for rs in vs.real_servers])
    except SimulationError as exc:
        click.echo(str(exc), err=True)
        sys.exit(EXIT_USAGE)
    result = run_simulation(
        vs,
        connections,
        hold=hold,
        events=event_list,
        rate=rate,
        explain=explain,
        clients=clients,
        locate=locate,
    )
    if as_json:
        click.echo(json.dumps(result.as_json()))
        return
    from lbproxy.tools.render import print_explain, print_simulation

    if explain:
        print_explain(result)
    print_simulation(result, hold=hold)
    if result.throttle is not None:  # the admission-control timeline (SPEC section 5)
        click.echo("\n".join(result.throttle.lines()))
    if result.clients is not None:  # SPEC section 12: who moved when servers came and went
        click.echo(f"clients: {len(result.clients)}")
        for moves in result.moves:
            click.echo(f"  {moves.line()}")
    if result.protection is not None:  # SPEC section 23: ejections and panic
        click.echo("\n".join(result.protection_lines()))


def _replay(
    log: str,
    configs: tuple[str, ...],
    log_format: str,
    max_moved: float | None,
    max_peak_ratio: float | None,
    as_json: bool,
) -> None:
    """`simulate --replay`: read the log, replay it through each configuration, print,
    and exit 1 when a gate is exceeded."""
    from lbproxy.tools import replay

    loaded = [(path, _load_or_exit((path,))) for path in configs]
    try:
        if log == "-":
            traffic = replay.read_log(sys.stdin, log_format, log)
        else:
            with replay.open_log(log) as lines:
                traffic = replay.read_log(lines, log_format, log)
    except (OSError, EOFError, zlib.error) as exc:  # EOFError, zlib.error: a bad .gz
        click.echo(f"{log}: {getattr(exc, 'strerror', None) or exc}", err=True)
        sys.exit(EXIT_USAGE)
    for number, reason in traffic.first_malformed:
        click.echo(f"{log}:{number}: malformed: {reason}", err=True)
    if traffic.malformed:
        click.echo(
            f"{log}: {traffic.malformed} malformed line{'s' if traffic.malformed != 1 else ''}"
            + (
                f" (the first {len(traffic.first_malformed)} above)"
                if traffic.malformed > len(traffic.first_malformed)
                else ""
            )
            + ", not replayed",
            err=True,
        )
    if not len(traffic):
        click.echo(f"{log}: no connection to replay ({log_format} format)", err=True)
        sys.exit(EXIT_USAGE)
    results = replay.replay_all(traffic, loaded)
    for result in results:
        for name, n in result.missing.items():
            click.echo(
                f"{result.label}: no virtual server {name!r}: its {n} connection"
                f"{'s' if n != 1 else ''} not replayed",
                err=True,
            )
    failures = replay.gates(results, max_moved, max_peak_ratio)
    if as_json:
        click.echo(json.dumps(replay.as_json(traffic, results, failures)))
    else:
        for line in replay.summary_lines(traffic, results):
            click.echo(line)
    for failure in failures:
        click.echo(failure.line(), err=True)
    if failures:
        sys.exit(EXIT_RUNTIME)


@main.command(
    epilog=_examples(
        "lbproxy demo                 # 8080, 8081 and the dashboard on 9100",
        "lbproxy demo --port 0        # free ports everywhere",
        "(it prints how to connect from another terminal: python3 or bash, no nc)",
    )
)
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option(
    "--admin-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Port of the admin endpoint and dashboard (default 9100, or a free one if taken).",
)
@click.option("--duration", type=float, default=None, hidden=True)  # tests: stop by itself
def demo(port: int, admin_port: int | None, duration: float | None) -> None:
    """Start three demo real servers, an SNMP agent each, and lbproxy in front of them
    on loopback: wlc on PORT, dwd (weights from SNMP) on PORT+1."""
    from lbproxy.tools import demo as demo_module

    sys.exit(demo_module.run(port=port, duration=duration, admin_port=admin_port))


# -- runtime commands through the admin API -------------------------------------------

_ADMIN_OPTIONS = (
    click.option(
        "--admin",
        "admin",
        metavar="URL",
        help="Admin endpoint (default: $LBPROXY_ADMIN, else http://127.0.0.1:9100); on "
        "this host its admin socket is used when one answers for its port.",
    ),
    click.option(
        "--token-file",
        type=click.Path(dir_okay=False),
        help="File holding the admin token, for TCP (default: $LBPROXY_TOKEN holds the token).",
    ),
    click.option(
        "--socket",
        "socket_path",
        metavar="PATH",
        type=click.Path(dir_okay=False),
        help="The admin socket to use (global.admin.socket), instead of looking for it.",
    ),
    click.option(
        "--insecure",
        is_flag=True,
        help="Send the token over plain http:// to an address that is not loopback.",
    ),
)


def admin_options(command):
    """--admin, --token-file, --socket and --insecure, for every runtime command."""
    for option in reversed(_ADMIN_OPTIONS):
        command = option(command)
    return command


def _client(
    admin: str | None,
    token_file: str | None,
    socket_path: str | None = None,
    insecure: bool = False,
):
    """The admin client (lbproxy/admin/client.py `connect`: the admin socket on this
    host, else TCP with the token); exit 2 when it cannot be used as given."""
    from lbproxy.admin.client import AdminError, connect

    try:
        return connect(admin, token_file, socket_path=socket_path, insecure=insecure)
    except AdminError as exc:
        click.echo(f"lbproxy: {exc}", err=True)
        sys.exit(EXIT_USAGE)


def _call(function, *args):
    from lbproxy.admin.client import AdminError

    try:
        return function(*args)
    except AdminError as exc:
        click.echo(f"lbproxy: {exc}", err=True)
        sys.exit(EXIT_RUNTIME)


@main.command(
    epilog=_examples(
        "lbproxy status",
        "lbproxy status --admin https://lb1.example.com:9443 --token-file admin.token",
        'lbproxy status | awk \'NR > 1 && $7 == "down" {print $1 "/" $4}\'',
        "lbproxy status --json | jq '.virtual_servers[].name'",
        "lbproxy status --wide        # also the last check's result and reason",
        "lbproxy status --verbose     # also says which endpoint it used (stderr)",
    )
)
@admin_options
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON document.")
@click.option(
    "--verbose", "-v", is_flag=True, help="Say on stderr which endpoint was used and how."
)
@click.option("--wide", is_flag=True, help="Also show each server's last check and its reason.")
def status(
    admin: str | None,
    token_file: str | None,
    socket_path: str | None,
    insecure: bool,
    as_json: bool,
    verbose: bool,
    wide: bool,
) -> None:
    """Virtual servers and real servers: state, health, weights, connections, bytes."""
    client = _client(admin, token_file, socket_path, insecure)
    if verbose:
        click.echo(f"lbproxy: using the {client.describe()}", err=True)
    document = _call(client.status)
    if as_json:
        click.echo(json.dumps(document, indent=2))
        return
    from lbproxy.tools.render import print_status

    print_status(document, wide=wide)


@main.command(
    epilog=_examples(
        "lbproxy explain web 203.0.113.7",
        "lbproxy explain web 2001:db8::7 --json | jq .pick",
    )
)
@click.argument("vs")
@click.argument("client")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=0,
    help="The client's port (maglev hash_key source_port).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON document.")
@admin_options
def explain(
    vs: str, client: str, port: int, as_json: bool, admin, token_file, socket_path, insecure
) -> None:
    """Where a new connection from CLIENT (an IPv4 or IPv6 address) to virtual server VS
    would go now, by which rule, and why each real server is or is not eligible, with
    the scheduler's score. Nothing is taken: the answer is computed on the live state."""
    api = _client(admin, token_file, socket_path, insecure)
    document = _call(api.explain, vs, client, port)
    if as_json:
        click.echo(json.dumps(document, indent=2))
        return
    from lbproxy.tools.render import live_explain_lines

    click.echo("\n".join(live_explain_lines(document)))


def _patch(admin, token_file, socket_path, insecure, vs, rs, change) -> None:
    client = _client(admin, token_file, socket_path, insecure)
    result = _call(client.patch, vs, rs, change)
    weight = result["weight"]
    click.echo(
        f"{vs}/{rs}: state {result['state']}, health {result['health']}, "
        f"weight {weight['static']} (effective {weight['effective']}), "
        f"{result['active_connections']} active"
    )


class WeightType(click.ParamType):
    """A static weight as the configuration file writes it: digits, 0 to MAX_WEIGHT.

    Checked here, before the admin API is asked: `1.5`, `3.0`, `abc`, `-1` or `1e3`
    exit 2 with the rule (the API applies the same one, lbproxy/core/pool.py weight_error).
    """

    name = "weight"

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        text = str(value)
        if text.isascii() and text.isdigit() and int(text) <= MAX_WEIGHT:
            return int(text)
        self.fail(f"weight must be an integer from 0 to {MAX_WEIGHT}, got {text!r}", param, ctx)


class _SetWeightCommand(click.Command):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # `set-weight web a -1` is a negative weight, not an unknown option "-1".
        for arg in args:
            if arg == "--":
                break
            if arg[:1] == "-" and arg[1:2].isdigit():
                weight = next(p for p in self.params if p.name == "weight")
                weight.type.fail(
                    f"weight must be an integer from 0 to {MAX_WEIGHT}, got {arg!r}",
                    weight,
                    ctx,
                )
        return super().parse_args(ctx, args)


@main.command(
    "set-weight",
    cls=_SetWeightCommand,
    epilog=_examples("lbproxy set-weight web s1 3", "lbproxy set-weight web s1 0   # no new"),
)
@click.argument("vs")
@click.argument("rs")
@click.argument("weight", type=WeightType())
@admin_options
def set_weight(vs: str, rs: str, weight: int, admin, token_file, socket_path, insecure) -> None:
    """Set real server RS's static weight in virtual server VS (until the next reload).

    WEIGHT is an integer from 0 to 65535, as `weight:` in the configuration file.
    """
    _patch(admin, token_file, socket_path, insecure, vs, rs, {"weight": weight})


def _state_command(name: str, state: str, help_text: str):
    @main.command(name, help=help_text, epilog=_examples(f"lbproxy {name} web s1"))
    @click.argument("vs")
    @click.argument("rs")
    @admin_options
    def command(vs: str, rs: str, admin, token_file, socket_path, insecure) -> None:
        _patch(admin, token_file, socket_path, insecure, vs, rs, {"state": state})

    return command


_state_command(
    "enable", "enabled", "RS takes new connections again (and cancels a drain's closes)."
)
_state_command("disable", "disabled", "No new connections to RS, and its existing ones close.")


class DurationType(click.ParamType):
    """A duration as the configuration file writes it (250ms, 30s, 2m, 1h or seconds)."""

    name = "duration"

    def convert(self, value, param, ctx) -> float:
        from lbproxy.config.values import parse_duration

        try:
            return parse_duration(value)
        except ValueError:
            self.fail(f"{value!r} is not a duration like 250ms, 30s, 2m, 1h or seconds", param, ctx)


@main.command(
    epilog=_examples(
        "lbproxy drain web s1",
        "lbproxy drain web s1 --close-after 30s --close-rate 50",
        "lbproxy drain web s1 --close-after 0   # and close them all now",
    )
)
@click.argument("vs")
@click.argument("rs")
@click.option(
    "--close-after",
    type=DurationType(),
    help="Then close RS's connections still open (counted reason=drain).",
)
@click.option(
    "--close-rate",
    type=click.FloatRange(min=0, min_open=True),
    help="Close at most this many a second, oldest first (default: all at once).",
)
@admin_options
def drain(
    vs: str,
    rs: str,
    close_after: float | None,
    close_rate: float | None,
    admin,
    token_file,
    socket_path,
    insecure,
) -> None:
    """No new connections to RS in virtual server VS; its existing ones finish, or
    (--close-after) are closed after that long. `lbproxy enable` cancels pending closes."""
    change: dict[str, object] = {"state": "drain"}
    if close_after is not None:
        change["close_after"] = close_after
    if close_rate is not None:
        change["close_rate"] = close_rate
    _patch(admin, token_file, socket_path, insecure, vs, rs, change)


@main.command(
    "shutdown-sessions",
    epilog=_examples("lbproxy shutdown-sessions web s1"),
)
@click.argument("vs")
@click.argument("rs")
@admin_options
def shutdown_sessions(vs: str, rs: str, admin, token_file, socket_path, insecure) -> None:
    """Close real server RS's established connections in virtual server VS now (its
    state does not change; counted reason=shutdown)."""
    client = _client(admin, token_file, socket_path, insecure)
    result = _call(client.shutdown_sessions, vs, rs)
    click.echo(f"{vs}/{rs}: closed {result['closed']} connection(s)")


@main.command(
    "per-source",
    epilog=_examples(
        "lbproxy per-source web",
        "lbproxy per-source web --json | jq '.networks[] | select(.at_limit)'",
        "lbproxy per-source web --limit 1000 | awk 'NR > 1 && $2 >= 5'",
        "lbproxy per-source web --clear 203.0.113.7",
        "lbproxy per-source web --clear 203.0.113.0/24",
        "lbproxy per-source web --clear          # every network",
    ),
)
@click.argument("vs")
@click.option(
    "--limit",
    type=click.IntRange(1, 10_000),
    default=100,
    show_default=True,
    help="Networks to show, busiest first.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON document.")
@click.option(
    "--clear",
    "network",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[NETWORK]",
    help="Forget NETWORK's arrivals (an address or ADDRESS/PREFIX; alone: every network's).",
)
@admin_options
def per_source(
    vs: str,
    limit: int,
    as_json: bool,
    network: str | None,
    admin,
    token_file,
    socket_path,
    insecure,
) -> None:
    """The client networks virtual server VS's per_source block tracks (HAProxy's show
    table): open connections, arrivals within the window, and whether the next arrival
    would be refused; --clear forgets arrivals (HAProxy's clear table), never open
    connections."""
    client = _client(admin, token_file, socket_path, insecure)
    if network is not None:
        result = _call(client.clear_per_source, vs, network or None)
        if as_json:
            click.echo(json.dumps(result, indent=2))
            return
        kept = result["kept"]
        click.echo(
            f"{vs}: cleared the arrivals of {result['cleared']} network(s)"
            + (f"; {kept} kept: their open connections stay counted" if kept else "")
        )
        return
    document = _call(client.per_source, vs, limit)
    if as_json:
        click.echo(json.dumps(document, indent=2))
        return
    from lbproxy.tools.render import print_per_source

    print_per_source(document)


@main.command(
    "add-server",
    epilog=_examples(
        "lbproxy add-server web s3 10.0.0.13:80",
        "lbproxy add-server web s4 10.0.0.14:80 --weight 2 --max-connections 500",
        "lbproxy add-server web spare 10.0.0.15:80 --backup",
    ),
)
@click.argument("vs")
@click.argument("name")
@click.argument("address")
@click.option("--weight", type=WeightType(), help="Static weight (default 1).")
@click.option(
    "--max-connections", type=click.IntRange(min=0), help="Concurrent connections (0: no limit)."
)
@click.option("--backup", is_flag=True, help="A backup server: it serves while no primary can.")
@admin_options
def add_server(
    vs: str,
    name: str,
    address: str,
    weight: int | None,
    max_connections: int | None,
    backup: bool,
    admin,
    token_file,
    socket_path,
    insecure,
) -> None:
    """Add real server NAME at ADDRESS (HOST:PORT) to virtual server VS, without a
    file; with health checks it takes connections once its first check passes. It
    stays across reloads (unless a file names it) and restarts (global.state_file)."""
    entry: dict[str, object] = {"name": name, "address": address}
    if weight is not None:
        entry["weight"] = weight
    if max_connections is not None:
        entry["max_connections"] = max_connections
    if backup:
        entry["backup"] = True
    client = _client(admin, token_file, socket_path, insecure)
    result = _call(client.add_server, vs, entry)
    click.echo(f"{vs}/{name}: added at {result['address']} ({result['health']})")


@main.command("remove-server", epilog=_examples("lbproxy remove-server web s3"))
@click.argument("vs")
@click.argument("name")
@admin_options
def remove_server(vs: str, name: str, admin, token_file, socket_path, insecure) -> None:
    """Remove real server NAME from virtual server VS: it takes no new connection and
    is gone when its last one ends."""
    client = _client(admin, token_file, socket_path, insecure)
    result = _call(client.remove_server, vs, name)
    if result.get("removing"):
        click.echo(f"{vs}/{name}: removing; it drains and goes with its last connection")
    else:
        click.echo(f"{vs}/{name}: removed")


@main.command(epilog=_examples("lbproxy reload", "lbproxy reload --admin http://127.0.0.1:9100"))
@admin_options
def reload(
    admin: str | None, token_file: str | None, socket_path: str | None, insecure: bool
) -> None:
    """Reload the configuration files of the running proxy (like SIGHUP)."""
    client = _client(admin, token_file, socket_path, insecure)
    result = _call(client.reload)
    changes = result.get("changes") or ["no changes"]
    click.echo("reloaded: " + "; ".join(changes))


if __name__ == "__main__":  # pragma: no cover
    main()


@main.command(
    epilog=_examples(
        "lbproxy upgrade /etc/lbproxy      # with these files, not the running ones",
        "/opt/lbproxy/bin/pip install -U lbproxy && lbproxy upgrade",
        "kill -USR2 $(pidof -s lbproxy)    # the same, without the admin endpoint",
    )
)
@click.argument("config", nargs=-1)
@admin_options
def upgrade(
    config: tuple[str, ...],
    admin: str | None,
    token_file: str | None,
    socket_path: str | None,
    insecure: bool,
) -> None:
    """Replace the running lbproxy by the one installed now, refusing no client.

    A new process starts, takes over the listening sockets and the runtime changes,
    and once it is ready the old one stops accepting and drains its connections for
    global.drain_timeout. If the new one fails (exit 2: invalid CONFIG, with every
    FILE:LINE; 1: any other failure), the old one keeps serving. Other CONFIG files than
    the running ones only through the admin socket (over TCP: 403).
    """
    from lbproxy.admin.client import AdminError

    client = _client(admin, token_file, socket_path, insecure)
    client.timeout = 90.0  # the new process's start (the server gives it 60 s)
    paths = [str(Path(path).resolve()) for path in config]
    try:
        result = client.upgrade(paths)
    except AdminError as exc:
        document = exc.document
        if "exit" not in document:  # not the upgrade's own answer: unreachable, 401, ...
            click.echo(f"lbproxy: {exc}", err=True)
            sys.exit(EXIT_RUNTIME)
        for line in document.get("errors") or []:
            click.echo(line, err=True)
        click.echo(f"lbproxy: upgrade failed: {document.get('error')}; still serving", err=True)
        sys.exit(EXIT_USAGE if document["exit"] == EXIT_USAGE else EXIT_RUNTIME)
    click.echo(
        f"upgraded: pid {result['pid']} serves now; pid {result['old_pid']} drains its"
        " connections and exits"
    )
