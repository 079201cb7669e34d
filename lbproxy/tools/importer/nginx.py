"""nginx's `stream` configuration as lbproxy's (see translation.py for what a translator
fills, nginx_reader.py for the grammar).

Each `server { }` of `stream { }` becomes a virtual server (two when it listens on TCP
and UDP, one per route of an `ssl_preread` map), with the real servers of the upstream
its `proxy_pass` names; the servers proxying to one upstream with the same settings are
one virtual server on all their addresses, sharing its counts as nginx does. Settings
nginx inherits from `stream { }` into a server are inherited here too, and where
nginx's default differs from lbproxy's (timeouts, passive health, retries) nginx's is
written out, so the traffic behaves as it did."""

from __future__ import annotations

import ipaddress
import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lbproxy.tools.importer.nginx_reader import Directive, NginxSyntaxError, read
from lbproxy.tools.importer.translation import Mapping, Translation, Untranslated

# A port range is one listen address per port: a wide one is more likely a mistake (or
# a job for a firewall rule) than a set of ports to bind one by one. The HAProxy
# importer takes bind ranges up to the same size.
MAX_LISTEN_RANGE = 64


def _row(directive: str, lbproxy: str, note: str = "") -> Mapping:
    return Mapping("nginx", directive, lbproxy, note)


# The migration guide's rows for nginx, in the order the guide lists them: each names
# the key the translation writes (tests hold each row to what `translate` does).
DIRECTIVES: tuple[Mapping, ...] = (
    _row(
        "stream { }",
        "virtual_servers[]",
        "only `stream` is imported; `http { }`, `mail { }`, `events { }` and the "
        "other top-level directives are each named once",
    ),
    _row(
        "include",
        "",
        "nothing of its own: the files it names are read where it stands, globs in name "
        "order; a relative path is taken from the main file's directory, as `nginx -c FILE` "
        "does",
    ),
    _row("worker_processes", "global.workers", "`auto` stays `auto`"),
    _row(
        "server { } (in stream)",
        "virtual_servers[].name",
        "named after the upstream it proxies to. The servers proxying to one upstream "
        "with the same settings are one virtual server listening on all their addresses, "
        "so they share its counts (`max_conns`, `least_conn`) and round robin, as nginx "
        "does; where settings differ each is a virtual server of its own and the upstream "
        "is named. A server listening on TCP and UDP becomes two",
    ),
    _row(
        "listen ADDRESS:PORT",
        "virtual_servers[].listen",
        "`listen PORT` and `*:PORT` are `0.0.0.0:PORT`; a port range (`15001-15003`) "
        f"is one address per port, up to {MAX_LISTEN_RANGE}; "
        "host names and `unix:` sockets are not translated",
    ),
    _row("listen ... udp", "virtual_servers[].protocol", "`udp`"),
    _row(
        "listen ... proxy_protocol",
        "virtual_servers[].accept_proxy",
        "`true`; lbproxy believes the header "
        "only from `accept_proxy_from` and checks `allow`/`deny` against the address in it",
    ),
    _row(
        "listen ... ssl", "", "lbproxy does not terminate TLS (see the front door for passthrough)"
    ),
    _row(
        "listen ... backlog= / reuseport / so_keepalive= / fastopen= / bind / ipv6only=",
        "",
        "socket options lbproxy sets itself",
    ),
    _row(
        "set_real_ip_from",
        "virtual_servers[].accept_proxy_from",
        "with `listen ... proxy_protocol`; nginx still serves a peer it does not "
        "trust (with the peer's own address); lbproxy closes its connection",
    ),
    _row(
        "proxy_pass UPSTREAM",
        "virtual_servers[].real_servers[]",
        "the upstream's servers; a host name is resolved when first used, where nginx "
        "makes a server of every address it resolves to at start",
    ),
    _row("proxy_pass ADDRESS:PORT", "virtual_servers[].real_servers[].address", "one real server"),
    _row(
        "proxy_pass $variable (a map on $ssl_preread_server_name)",
        "virtual_servers[].sni",
        "one virtual server per route; the map's `default` is the virtual "
        "server without `sni`; exact names, `*.example.com` and `.example.com` "
        "(with `hostnames`) are translated, regular expressions are not; nginx's "
        "`*.example.com` matches deeper names too, lbproxy's one label: each such entry "
        "is named. Names routed to the default's upstream need no route of their own",
    ),
    _row(
        "proxy_pass $variable (a map on $ssl_preread_alpn_protocols)",
        "virtual_servers[].alpn",
        "one virtual server per route; the map's `default` is the virtual server without "
        "`alpn`. nginx matches a key against the whole comma-joined list a client offers, "
        "lbproxy's `alpn` each protocol in it: a key of one protocol (`acme-tls/1`) is "
        "translated, and the import says that a client offering it among others now takes "
        "its route where nginx gave it the default; keys with commas and regular "
        "expressions are not translated, nor a map within a map of both variables "
        "(give a virtual server both `sni` and `alpn`)",
    ),
    _row(
        "ssl_preread on",
        "virtual_servers[].sni",
        "with the map above; without it nginx's map always gives its default: only that "
        "route is imported",
    ),
    _row(
        "map",
        "virtual_servers[].sni",
        "read with the `proxy_pass` that names it: a map on `$ssl_preread_server_name` or "
        "`$ssl_preread_alpn_protocols`; any other is not translated",
    ),
    _row(
        "proxy_connect_timeout",
        "virtual_servers[].connect_timeout",
        "nginx's default 60s is written out when unset",
    ),
    _row(
        "proxy_timeout",
        "virtual_servers[].idle_timeout",
        "nginx's default 10m is written out when unset",
    ),
    _row(
        "proxy_timeout (in a udp server)",
        "virtual_servers[].udp.idle_timeout",
        "nginx's default 10m is written out when unset",
    ),
    _row("proxy_protocol on", "virtual_servers[].send_proxy", "`v1`: nginx sends version 1"),
    _row("proxy_responses", "virtual_servers[].udp.responses"),
    _row(
        "proxy_next_upstream / proxy_next_upstream_tries",
        "virtual_servers[].retries",
        "nginx tries every "
        "server once by default: `retries` is the number of servers less one; `off` is 0",
    ),
    _row(
        "allow / deny",
        "virtual_servers[].deny",
        "nginx's first matching rule wins, lbproxy's "
        "deny wins over allow: the rules are rewritten (a deny minus the allows before "
        "it) so that every address gets the same answer",
    ),
    _row(
        "allow ... + deny all",
        "virtual_servers[].allow",
        "the addresses allowed before a final `deny all`; without one there is no "
        "`allow` list: everyone not denied gets in, as in nginx",
    ),
    _row(
        "limit_conn (a zone on $binary_remote_addr or $remote_addr)",
        "virtual_servers[].per_source.max_connections",
        "one count per client address, as nginx keeps (see `limit_conn_zone`); a zone "
        "on another key is not translated",
    ),
    _row(
        "limit_conn (in a udp server)",
        "virtual_servers[].udp.max_sessions_per_source",
        "one count per client address, as nginx keeps",
    ),
    _row(
        "limit_conn_zone",
        "virtual_servers[].per_source.prefix_v6",
        "`128` (UDP: `udp.source_prefix.v6`: `128`), one count per IPv6 address too; "
        "read with the `limit_conn` that names it",
    ),
    _row(
        "upstream { }",
        "virtual_servers[].real_servers[]",
        "an upstream no server proxies to is named; so is one several virtual servers "
        "serve (settings that differ, or TCP and UDP with `max_conns`), whose counts "
        "are then not shared",
    ),
    _row(
        "(round robin)",
        "virtual_servers[].scheduler",
        "`rr`, or `wrr` with weights. Equal weights: the same sequence; with weights, "
        "the same count per server in "
        "every cycle of the total weight, interleaved, though the order within a cycle "
        "may differ with three servers or more (nginx: smooth weighted round robin, "
        "lbproxy's wrr: earliest deadline first)",
    ),
    _row(
        "least_conn",
        "virtual_servers[].scheduler",
        "`lc`, or `wlc` with weights; "
        "ties: nginx takes them in weighted round robin, lbproxy the one picked longest ago",
    ),
    _row(
        "hash $remote_addr [consistent]",
        "virtual_servers[].scheduler",
        "`maglev` with `hash_key: source`: "
        "each client stays on one server and clients spread alike; which server a "
        "client gets differs. `$remote_addr$remote_port` is `hash_key: source_port`; "
        "other keys are not translated",
    ),
    _row(
        "random",
        "",
        "no random scheduler: `random` keeps round robin; `random two [least_conn]` "
        "becomes `lc` (`wlc` with weights), named: lbproxy compares every server, nginx "
        "two picked at random",
    ),
    _row("server ... weight=", "virtual_servers[].real_servers[].weight"),
    _row("server ... max_conns=", "virtual_servers[].real_servers[].max_connections"),
    _row(
        "server ... max_fails= fail_timeout=",
        "virtual_servers[].health_check",
        "`type: none`, `fall`, `interval`: nginx's passive health: after `max_fails` "
        "failed connects a server "
        "gets nothing for `fail_timeout`, then one trial connection; nginx's defaults "
        "(1, 10s) are written out. lbproxy keeps one value per virtual server (the "
        "pair most of the upstream's servers have; a server with another is named); "
        "`max_fails=0` is not translated (lbproxy always counts)",
    ),
    _row("server ... backup", "virtual_servers[].real_servers[].backup", "`true`"),
    _row("server ... down", "virtual_servers[].real_servers[].state", "`disabled`"),
    _row(
        "server ... resolve / service= / slow_start= / route= / drain",
        "",
        "NGINX Plus parameters (see `discovery` and `slow_start`); Plus's `drain` keeps "
        "serving the clients bound to the server, lbproxy's `drain` sends them elsewhere",
    ),
    _row("zone", "", "shared memory: lbproxy's state is its own process's"),
    _row(
        "resolver / ssl_* / proxy_ssl* / proxy_bind / proxy_*_rate / access_log / "
        "error_log / log_format / js_* / return / set / preread_*",
        "",
        "named on stderr",
    ),
)

NGINX_CONNECT_TIMEOUT = "60s"
NGINX_PROXY_TIMEOUT = "10m"
NGINX_MAX_FAILS = 1
NGINX_FAIL_TIMEOUT = "10s"

_ADDRESS_KEYS = ("$remote_addr", "$binary_remote_addr")
_SERVER_INHERITED = (
    "proxy_connect_timeout",
    "proxy_timeout",
    "proxy_protocol",
    "proxy_responses",
    "proxy_next_upstream",
    "proxy_next_upstream_tries",
    "set_real_ip_from",
    "allow",
    "deny",
    "limit_conn",
    "ssl_preread",
)


class _Invalid(ValueError):
    """A value nginx would refuse: the directive is named, not translated."""


_UNITS = {
    "ms": 0.001,
    "s": 1,
    "m": 60,
    "h": 3600,
    "d": 86400,
    "w": 604800,
    "M": 2592000,
    "y": 31536000,
}
_TIME_PART = re.compile(r"([0-9]+)(ms|s|m|h|d|w|M|y)?")


def _seconds(text: str) -> float:
    """nginx's time: `500ms`, `10s`, `1m30s`, `2h` or seconds."""
    if not text:
        raise _Invalid("an empty time")
    total, position, units = 0.0, 0, ""
    while position < len(text):
        match = _TIME_PART.match(text, position)
        if match is None or (units and match.group(2) is None):
            raise _Invalid(f'"{text}" is not a time')
        total += int(match.group(1)) * _UNITS[match.group(2) or "s"]
        units += match.group(2) or "s"
        position = match.end()
    return total


def _duration(seconds: float) -> str:
    milliseconds = round(seconds * 1000)
    if milliseconds % 1000:
        return f"{milliseconds}ms"
    whole = milliseconds // 1000
    if whole and whole % 3600 == 0:
        return f"{whole // 3600}h"
    if whole and whole % 60 == 0:
        return f"{whole // 60}m"
    return f"{whole}s"


def _number(text: str, what: str) -> int:
    if not text.isdigit() or not text.isascii():
        raise _Invalid(f'{what} "{text}" is not a number')
    return int(text)


_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")


def _address(text: str) -> str:
    """HOST:PORT or [IPv6]:PORT as lbproxy writes it; _Invalid for anything else."""
    if text.startswith("unix:"):
        raise _Invalid("a Unix socket")
    if text.startswith("["):
        host, _, port = text[1:].partition("]:")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _Invalid(f'"{text}" is not an address') from None
        shown = f"[{host}]"
    else:
        host, colon, port = text.rpartition(":")
        if not colon:
            raise _Invalid(f'"{text}" has no port')
        if not _HOST.match(host):
            raise _Invalid(f'"{text}" is not an address')
        shown = host
    if not port.isdigit() or not port.isascii() or not 0 < int(port) < 65536:
        raise _Invalid(f'"{text}" has no port from 1 to 65535')
    return f"{shown}:{int(port)}"


_PORT_RANGE = re.compile(r"([0-9]+)-([0-9]+)", re.ASCII)


def _listen_addresses(text: str) -> list[str]:
    """The addresses `listen` binds: one, or one per port of a range (`15001-15003`,
    as nginx binds them)."""
    if re.fullmatch(r"[0-9]+(-[0-9]+)?", text, re.ASCII):
        text = f"*:{text}"
    if text.startswith("*:"):
        text = "0.0.0.0:" + text[2:]
    host, colon, port = text.rpartition(":")
    ports = _PORT_RANGE.fullmatch(port) if colon else None
    if ports is None:
        return [_listen_address(text)]
    first, last = int(ports.group(1)), int(ports.group(2))
    if not 0 < first <= last < 65536:
        raise _Invalid(f'"{text}" is not a port range from 1 to 65535')
    if last - first + 1 > MAX_LISTEN_RANGE:
        raise _Invalid(
            f'"{text}" is a range of {last - first + 1} ports (lbproxy binds each port of '
            f"a range as an address of its own: up to {MAX_LISTEN_RANGE}; list the ports "
            "in use instead)"
        )
    return [_listen_address(f"{host}:{number}") for number in range(first, last + 1)]


def _listen_address(text: str) -> str:
    address = _address(text)
    host = address.rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise _Invalid(f'listen "{text}": lbproxy listens on IP addresses') from None
    return address


def _wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "[::]")


def _network(text: str) -> list[str]:
    if text == "all":
        return ["0.0.0.0/0", "::/0"]
    if text.startswith("unix:"):
        raise _Invalid("a Unix socket")
    try:
        return [str(ipaddress.ip_network(text, strict=False))]
    except ValueError:
        raise _Invalid(f'"{text}" is not an address or network') from None


def _safe_name(text: str) -> str:
    """A name lbproxy accepts (letters, digits, . _ -) from an nginx name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "upstream"


def _server_name(address: str) -> str:
    """A real server's name from its address (names are letters, digits, . _ -):
    HOST-PORT, an IPv6 address's colons as underscores."""
    host, _, port = address.rpartition(":")
    host = re.sub(r"[^A-Za-z0-9.-]+", "_", host.strip("[]")).strip("_") or "host"
    return f"{host}-{port}"


def _subtract(
    networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network],
    taken: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network],
) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    for other in taken:
        remaining: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for net in networks:
            if net.version != other.version or not net.overlaps(other):
                remaining.append(net)
            elif not other.supernet_of(net):  # type: ignore[arg-type]  # same version
                remaining.extend(net.address_exclude(other))  # type: ignore[arg-type]  # same version
        networks = remaining
    return networks


def _access_lists(rules: list[tuple[bool, list[str]]]) -> tuple[list[str] | None, list[str]]:
    """nginx's ordered allow/deny (first match wins, no match: allowed) as lbproxy's
    allow and deny lists (an address is allowed when in allow and not in deny): each
    deny loses the addresses an earlier allow took; a final `deny all` makes the allows
    the allow list. None: lbproxy's default allow (everyone)."""
    parsed = [(allow, [ipaddress.ip_network(n) for n in nets]) for allow, nets in rules]
    everything = {ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0")}
    cut = len(parsed)
    for index, (_allow, nets) in enumerate(parsed):
        if everything <= set(nets):
            cut = index  # nothing after a rule on everyone is ever reached
            break
    allowed_before: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    deny: list[str] = []
    for allow, nets in parsed[:cut]:
        if allow:
            allowed_before.extend(nets)
        else:
            deny.extend(str(n) for n in _subtract(list(nets), allowed_before))
    if cut < len(parsed) and not parsed[cut][0]:
        # only the allowed need a deny: one outside every allowed network says nothing
        kept = [d for d in deny if any(ipaddress.ip_network(d).overlaps(a) for a in allowed_before)]
        return [str(n) for n in allowed_before], kept
    return None, deny


@dataclass
class _Upstream:
    directive: Directive
    used: bool = False


_SNI_VARIABLE = "$ssl_preread_server_name"
_ALPN_VARIABLE = "$ssl_preread_alpn_protocols"


@dataclass
class _Map:
    directive: Directive
    source: str
    hostnames: bool
    entries: list[tuple[Directive, str, str]] = field(default_factory=list)
    default: tuple[Directive, str] | None = None
    flags: list[Directive] = field(default_factory=list)  # hostnames, volatile


class _Translator:
    def __init__(self, translation: Translation) -> None:
        self.out = translation
        self.done: set[int] = set()
        self.left: dict[tuple[int, str], Untranslated] = {}
        self.upstreams: dict[str, _Upstream] = {}
        self.maps: dict[str, _Map] = {}
        self.nested: set[str] = set()  # maps named as another map's value
        self.zones: dict[str, Directive] = {}
        self.names: set[str] = set()
        self.pieces: list[_Piece] = []
        self.bound: dict[tuple[str, str], list[str]] = {}
        # the settings of stream { } and of the servers carried over: one that none of
        # them took is named
        self.settings_read: list[Directive] = []

    # what happened to each directive (each counted once, however often it is read)
    def took(self, directive: Directive) -> None:
        self.done.add(directive.order)

    def skip(self, directive: Directive, what: str) -> None:
        self.left.setdefault(
            (directive.order, what), Untranslated(directive.file, directive.line, what)
        )

    def note(self, directive: Directive, what: str) -> None:
        """What the import decided that a reader should know: said, not left behind."""
        self.left.setdefault(
            (directive.order, what), Untranslated(directive.file, directive.line, what, note=True)
        )

    def skip_block(self, directive: Directive, why: str = "") -> None:
        shown = f"{directive.name} {' '.join(directive.args)}".strip()
        self.skip(directive, f"{shown} {{ }}" + (f" ({why})" if why else ""))

    def unique(self, base: str, port: str) -> str:
        candidates = itertools.chain(
            (base, f"{base}-{port}"), (f"{base}-{port}-{i}" for i in itertools.count(2))
        )
        name = next(c for c in candidates if c not in self.names)
        self.names.add(name)
        return name

    def finish(self) -> None:
        # without a virtual server there is no configuration lbproxy could run
        self.out.translated = len(self.done) if self.out.virtual_servers else 0
        self.out.untranslated = [
            left for (_order, _what), left in sorted(self.left.items(), key=lambda i: i[0][0])
        ]

    # the main context
    def main(self, directives: tuple[Directive, ...]) -> None:
        streams = [d for d in directives if d.name == "stream" and d.block is not None]
        for directive in directives:
            if directive.name == "stream" and directive.block is not None:
                continue
            if directive.name == "worker_processes" and directive.block is None:
                self.workers(directive)
            elif directive.block is not None:
                self.skip_block(directive, "only stream { } is imported")
            else:
                self.skip(directive, " ".join((directive.name, *directive.args)))
        for stream in streams:
            self.stream(stream)

    def workers(self, directive: Directive) -> None:
        value = directive.args[0] if len(directive.args) == 1 else ""
        if value == "auto" or (value.isdigit() and value.isascii() and int(value) >= 1):
            workers: int | str = value if value == "auto" else int(value)
            self.out.settings.setdefault("global", {})["workers"] = workers
            self.took(directive)
        else:
            self.skip(directive, f"worker_processes {' '.join(directive.args)} (not 1 or more)")

    def stream(self, stream: Directive) -> None:
        assert stream.block is not None
        self.took(stream)
        inherited: dict[str, list[Directive]] = {}
        servers: list[Directive] = []
        for d in stream.block:
            if d.name == "upstream" and d.block is not None and len(d.args) == 1:
                self.upstreams[d.args[0]] = _Upstream(d)
            elif d.name == "map" and d.block is not None:
                self.read_map(d)
            elif d.name == "limit_conn_zone" and d.block is None:
                self.read_zone(d)
            elif d.name == "server" and d.block is not None and not d.args:
                servers.append(d)
            elif d.name in _SERVER_INHERITED and d.block is None:
                inherited.setdefault(d.name, []).append(d)
                self.settings_read.append(d)
            elif d.block is not None:
                self.skip_block(d)
            else:
                self.skip(d, " ".join((d.name, *d.args)))
        for server in servers:
            self.server(server, inherited)
        self.place()
        named = {order for order, _what in self.left}
        for d in self.settings_read:
            if d.order not in self.done and d.order not in named:
                self.skip(d, f"{' '.join((d.name, *d.args))} (nothing it applies to here)")
        for name, upstream in self.upstreams.items():
            if not upstream.used:
                self.skip_block(upstream.directive, f"no server proxies to {name}")
        for name, m in self.maps.items():
            if m.directive.order not in self.done:
                used = "used only within another map" if name in self.nested else ""
                self.skip_block(m.directive, used or "no proxy_pass uses it")
        for zone in self.zones.values():
            if zone.order not in self.done:
                self.skip(
                    zone,
                    f"limit_conn_zone {' '.join(zone.args)} (no translated limit_conn uses it)",
                )

    def place(self) -> None:
        """The virtual servers of the pieces: those of one upstream whose settings are
        the same become one, listening on all their addresses, so that the upstream's
        servers keep one connection count (max_conns) and one balancing state, as in
        nginx, where every server { } proxying to an upstream shares it."""
        placed: list[_Piece] = []
        for piece in self.pieces:
            same = next(
                (
                    p
                    for p in placed
                    if piece.upstream is not None
                    and p.upstream == piece.upstream
                    and p.settings() == piece.settings()
                ),
                None,
            )
            if same is None:
                placed.append(piece)
            else:
                listen = same.vs["listen"]
                listen.extend(a for a in piece.vs["listen"] if a not in listen)
        self.pieces = []
        for piece in placed:
            piece.vs["name"] = self.unique(piece.base, piece.port)
            listen = piece.vs["listen"]
            piece.vs["listen"] = listen[0] if len(listen) == 1 else listen
            self.out.virtual_servers.append(piece.vs)
        by_upstream: dict[str, list[_Piece]] = {}
        for piece in placed:
            if piece.upstream is not None:
                by_upstream.setdefault(piece.upstream, []).append(piece)
        for name, copies in by_upstream.items():
            self.shared_state(self.upstreams[name].directive, copies)

    def shared_state(self, upstream: Directive, copies: list[_Piece]) -> None:
        """One line when an upstream is served by several virtual servers: each counts
        its real servers' connections and balances on its own, where nginx shares."""
        if len(copies) < 2:
            return
        names = [p.vs["name"] for p in copies]
        shown = ", ".join(names[:-1]) + f" and {names[-1]}"
        limited = any("max_connections" in s for s in copies[0].vs["real_servers"])
        protocols = [p.vs.get("protocol", "tcp") for p in copies]
        if sorted(protocols) == ["tcp", "udp"]:
            # a TCP and a UDP virtual server are two in lbproxy, whatever their settings
            if limited:
                self.skip(
                    upstream,
                    f"upstream {upstream.args[0]}'s max_conns over TCP and UDP together "
                    f"(virtual servers {shown} each count their own connections, one "
                    "protocol each; nginx counts both against max_conns)",
                )
            return
        kept = ["max_conns counts"] if limited else []
        scheduler = copies[0].vs["scheduler"]
        if scheduler in ("lc", "wlc"):
            kept.append("least_conn counts")
        elif scheduler in ("rr", "wrr"):
            kept.append("round-robin position")
        kept.append("max_fails failures")
        what = " and ".join((", ".join(kept[:-1]), kept[-1])) if len(kept) > 1 else kept[0]
        routes = " and map routes" if any("sni" in p.vs or "alpn" in p.vs for p in copies) else ""
        self.skip(
            upstream,
            f"upstream {upstream.args[0]}'s shared state (the server {{ }} blocks{routes} "
            f"proxying to it differ in their settings: virtual servers {shown} each keep "
            f"their own {what}, where nginx keeps one for the upstream)",
        )

    def read_map(self, d: Directive) -> None:
        assert d.block is not None
        if len(d.args) != 2 or not d.args[1].startswith("$"):
            self.skip_block(d, "not a map from a variable to a variable")
            return
        m = _Map(d, d.args[0], hostnames=False)
        for entry in d.block:
            if entry.name == "hostnames" and not entry.args:
                m.hostnames = True
                m.flags.append(entry)
            elif entry.name == "volatile" and not entry.args:
                m.flags.append(entry)
            elif entry.name == "default" and len(entry.args) == 1:
                m.default = (entry, entry.args[0])
            elif len(entry.args) == 1 and entry.block is None:
                m.entries.append((entry, entry.name, entry.args[0]))
            else:
                self.skip(entry, f"map entry {entry.name} {' '.join(entry.args)}")
        self.maps[d.args[1]] = m

    def read_zone(self, d: Directive) -> None:
        zone = next((a[5:].split(":")[0] for a in d.args if a.startswith("zone=")), None)
        if zone is None:
            self.skip(d, f"limit_conn_zone {' '.join(d.args)} (no zone=)")
        else:
            self.zones[zone] = d

    # a server { } of stream { }
    def server(self, server: Directive, inherited: dict[str, list[Directive]]) -> None:
        """A whole server is one line when it cannot be carried over: what its
        directives said is forgotten then."""
        done, left, names = set(self.done), dict(self.left), set(self.names)
        used = {name for name, u in self.upstreams.items() if u.used}
        try:
            self.try_server(server, inherited)
        except _Invalid as why:
            self.done, self.left, self.names = done, left, names
            for name, upstream in self.upstreams.items():
                upstream.used = name in used
            self.skip_block(server, str(why))

    def try_server(self, server: Directive, inherited: dict[str, list[Directive]]) -> None:
        assert server.block is not None
        own: dict[str, list[Directive]] = {}
        listens: list[Directive] = []
        proxy_pass: Directive | None = None
        for d in server.block:
            if d.block is not None:
                self.skip_block(d)
            elif d.name == "listen":
                listens.append(d)
            elif d.name == "proxy_pass":
                proxy_pass = d
            elif d.name in _SERVER_INHERITED:
                own.setdefault(d.name, []).append(d)
            else:
                self.skip(d, " ".join((d.name, *d.args)))
        # nginx: a directive set in the server replaces the stream's; allow and deny
        # are one list of rules, inherited together
        settings = dict(inherited)
        for name, found in own.items():
            settings[name] = found
        if "allow" in own or "deny" in own:
            settings["allow"] = own.get("allow", [])
            settings["deny"] = own.get("deny", [])

        groups: dict[tuple[str, bool], list[str]] = {}
        errors: list[str] = []
        pending: dict[tuple[str, str], list[str]] = {}
        for listen in listens:
            try:
                addresses, protocol, accept_proxy = self.listen(listen, pending)
            except _Invalid as e:
                self.skip(listen, str(e))
                errors.append(str(e))
                continue
            groups.setdefault((protocol, accept_proxy), []).extend(addresses)
        if not groups:
            raise _Invalid(errors[0] if errors else "no listen")
        if proxy_pass is None or len(proxy_pass.args) != 1:
            raise _Invalid("no proxy_pass")
        routes = self.routes(proxy_pass, settings)
        self.took(server)
        self.took(proxy_pass)
        self.settings_read.extend(d for found in own.values() for d in found)
        self.pieces.extend(
            self.virtual_server(
                base, protocol, accept_proxy, addresses, sni, alpn, target, settings
            )
            for (protocol, accept_proxy), addresses in groups.items()
            for base, sni, alpn, target in routes
        )
        for key, hosts in pending.items():
            self.bound.setdefault(key, []).extend(hosts)

    def listen(
        self, d: Directive, pending: dict[tuple[str, str], list[str]]
    ) -> tuple[list[str], str, bool]:
        """(addresses, protocol, accept_proxy); _Invalid when it cannot be bound."""
        if not d.args:
            raise _Invalid("listen (no address)")
        try:
            addresses = _listen_addresses(d.args[0])
        except _Invalid as e:
            raise _Invalid(f"listen {' '.join(d.args)}: {e}") from None
        protocol, accept_proxy, ignored = "tcp", False, []
        for parameter in d.args[1:]:
            if parameter == "udp":
                protocol = "udp"
            elif parameter == "proxy_protocol":
                accept_proxy = True
            elif parameter == "ssl":
                raise _Invalid(f"listen {' '.join(d.args)} (lbproxy does not terminate TLS)")
            else:
                ignored.append(parameter)
        if protocol == "udp" and accept_proxy:
            accept_proxy = False
            ignored.append("proxy_protocol")
        for address in addresses:
            host, _, port = address.rpartition(":")
            taken = self.bound.get((protocol, port), []) + pending.get((protocol, port), [])
            for other in taken:
                if other == host or (
                    (_wildcard(host) or _wildcard(other)) and (":" in host) == (":" in other)
                ):
                    # nginx binds the wildcard alone and tells the servers apart by the
                    # address a client reached; lbproxy binds each address it is given
                    raise _Invalid(
                        f"listen {' '.join(d.args)} (port {port} is already bound on {other})"
                    )
        if ignored:
            self.skip(d, f"listen {d.args[0]} {' '.join(ignored)}")
        self.took(d)
        for address in addresses:
            host, _, port = address.rpartition(":")
            pending.setdefault((protocol, port), []).append(host)
        return addresses, protocol, accept_proxy

    def routes(
        self, proxy_pass: Directive, settings: dict[str, list[Directive]]
    ) -> list[tuple[str, list[str] | None, list[str] | None, str]]:
        """(name, sni, alpn, target) per virtual server (target: an upstream's name or
        an address; sni or alpn None for the route without one), or why there is none."""
        target = proxy_pass.args[0]
        if not target.startswith("$"):
            error = self.target_error(target)
            if error is not None:
                raise _Invalid(f"proxy_pass {target}: {error}")
            return [(target, None, None, target)]
        m = self.maps.get(target)
        if m is None or m.source not in (_SNI_VARIABLE, _ALPN_VARIABLE):
            raise _Invalid(
                f"proxy_pass {target}: only a map on {_SNI_VARIABLE} or {_ALPN_VARIABLE} "
                "is translated"
            )
        preread = settings.get("ssl_preread", [])
        preread_on = bool(preread) and preread[-1].args == ("on",)
        if preread:
            self.took(preread[-1])
        self.took(m.directive)
        for flag in m.flags:
            self.took(flag)
        by_target: dict[str, list[str]] = {}
        wildcards: list[tuple[Directive, str, str]] = []
        protocols: dict[str, Directive] = {}
        for entry, key, value in m.entries:
            if not preread_on:
                self.skip(
                    entry,
                    f"map entry {entry.name} (without ssl_preread on, nginx's "
                    f"{m.source} is empty: the default is used)",
                )
                continue
            if m.source == _ALPN_VARIABLE:
                names = self.alpn_protocols(entry, key, m.hostnames, protocols)
            else:
                names = self.sni_names(entry, key, m.hostnames)
            error = self.target_error(value)
            if error is not None:
                self.skip(entry, f"map entry {entry.name} {value}: {error}")
            elif names is not None:
                by_target.setdefault(value, []).extend(names)
                if m.source == _SNI_VARIABLE:
                    wildcards.extend((entry, n, value) for n in names if n.startswith("*."))
                self.took(entry)
        default: str | None = None
        if m.default is not None:
            entry, value = m.default
            error = self.target_error(value)
            if error is not None:
                self.skip(entry, f"map default {value}: {error}")
            else:
                self.took(entry)
                default = value
        if m.source == _ALPN_VARIABLE:
            if by_target:
                shown = next(iter(by_target.values()))[0]
                # nginx matches the key against the whole comma-joined list a client
                # offers; lbproxy's alpn against each protocol in it
                self.note(
                    m.directive,
                    f"map {m.source} {m.directive.args[1]}: lbproxy's alpn routes a client "
                    "offering the protocol among others, nginx's key only a client offering "
                    f"that one alone (a client offering {shown},h2 gets "
                    + (
                        "the map's default in nginx)"
                        if default is not None
                        else "no route in nginx)"
                    ),
                )
            # a protocol routed to the default's target gets there without a route of
            # its own (which would be a second virtual server, with counts of its own)
            if default is not None:
                by_target.pop(default, None)
        elif default in by_target:
            self.fold_into_default(by_target, default)
        for entry, name, value in wildcards:
            if value != default:
                # lbproxy's `*.` stands for one label and has no suffix form
                self.skip(
                    entry,
                    f"map entry {entry.name} {value} for names deeper than {name} (nginx's "
                    f"wildcard matches any depth, lbproxy's one label: a.b.{name[2:]} gets "
                    + ("the map's default)" if default is not None else "no route)"),
                )
        routes: list[tuple[str, list[str] | None, list[str] | None, str]] = []
        for value, names in by_target.items():
            unique = sorted(set(names), key=names.index)
            if m.source == _ALPN_VARIABLE:
                routes.append((value, None, unique, value))
            else:
                routes.append((value, unique, None, value))
        if default is not None:
            routes.append((default, None, None, default))
        if not routes:
            raise _Invalid(f"proxy_pass {target}: no route of the map can be carried over")
        return routes

    def alpn_protocols(
        self, entry: Directive, key: str, hostnames: bool, seen: dict[str, Directive]
    ) -> list[str] | None:
        """A key of a map on $ssl_preread_alpn_protocols as lbproxy's alpn: one protocol
        name, exact. nginx compares the map's keys lowercased; so does this."""
        if key.startswith("~"):
            self.skip(entry, f"map entry {key} (a regular expression)")
            return None
        if key == "":
            self.skip(entry, 'map entry "" (no protocol offered: route it with default)')
            return None
        if "," in key:
            self.skip(
                entry,
                f"map entry {key} (a list of protocols: nginx matches a client offering "
                "exactly these, lbproxy routes by one protocol)",
            )
            return None
        if hostnames and (key.startswith((".", "*.")) or key.endswith(".*")):
            self.skip(entry, f"map entry {key} (a hostnames wildcard)")
            return None
        protocol = key.lower()
        if len(protocol) > 255 or not all(" " < c <= "~" for c in protocol):
            self.skip(
                entry,
                f"map entry {entry.name} (not an ALPN protocol name: printable ASCII, "
                "1 to 255 characters)",
            )
            return None
        if protocol in seen:
            self.skip(
                entry,
                f"map entry {entry.name} (nginx compares keys lowercased: the same as "
                f"line {seen[protocol].line})",
            )
            return None
        seen[protocol] = entry
        return [protocol]

    @staticmethod
    def fold_into_default(by_target: dict[str, list[str]], default: str) -> None:
        """Names routed to the map's default target need no route of their own (which
        would be a second virtual server for that target, with counts of its own),
        unless another route's wildcard would catch them without it."""
        caught = {n[2:] for value, names in by_target.items() if value != default for n in names}
        kept = [
            n
            for n in by_target[default]
            if not n.startswith("*.") and "." in n and n.split(".", 1)[1] in caught
        ]
        if kept:
            by_target[default] = kept
        else:
            del by_target[default]

    def sni_names(self, entry: Directive, key: str, hostnames: bool) -> list[str] | None:
        if key.startswith("~"):
            self.skip(entry, f"map entry {key} (a regular expression)")
            return None
        if key == "":
            self.skip(entry, 'map entry "" (no server name: route it with default)')
            return None
        key = key.lower()
        if hostnames and key.startswith("."):
            key = key[1:]
            names = [key, f"*.{key}"]
        elif hostnames and key.startswith("*.") and "*" not in key[2:]:
            names = [key]
        else:
            names = [key]
        if not all(re.fullmatch(r"(\*\.)?[a-z0-9_]([a-z0-9_-]*\.?)*[a-z0-9_-]*", n) for n in names):
            self.skip(entry, f"map entry {entry.name} (not a server name lbproxy routes)")
            return None
        if hostnames is False and key.startswith("*."):
            self.skip(entry, f"map entry {entry.name} (a wildcard needs hostnames in nginx)")
            return None
        return names

    def target_error(self, target: str) -> str | None:
        if target in self.upstreams:
            return None
        inner = self.maps.get(target)
        if inner is not None and inner.source in (_SNI_VARIABLE, _ALPN_VARIABLE):
            self.nested.add(target)
            return (
                f"a map on {inner.source} within a map (routing by both is not "
                "translated: give virtual servers both sni and alpn)"
            )
        try:
            _address(target)
        except _Invalid as e:
            return str(e)
        return None

    def virtual_server(
        self,
        base: str,
        protocol: str,
        accept_proxy: bool,
        addresses: list[str],
        sni: list[str] | None,
        alpn: list[str] | None,
        target: str,
        settings: dict[str, list[Directive]],
    ) -> _Piece:
        upstream = self.upstreams.get(target)
        # a copy's name tells its own listen address apart
        port = addresses[0].rpartition(":")[2]
        base = _safe_name(base) if upstream is not None else f"stream-{port}"
        if protocol == "udp":
            base = f"{base}-udp"
        vs: dict[str, Any] = {"name": ""}  # named once the pieces are placed
        if protocol == "udp":
            vs["protocol"] = "udp"
        vs["listen"] = list(addresses)
        if sni is not None:
            vs["sni"] = sni
        if alpn is not None:
            vs["alpn"] = alpn
        pool = self.pool(upstream, target)
        vs.update(pool.scheduler)
        if protocol == "tcp":
            vs["connect_timeout"] = self.time(
                settings, "proxy_connect_timeout", NGINX_CONNECT_TIMEOUT
            )
            vs["idle_timeout"] = self.time(settings, "proxy_timeout", NGINX_PROXY_TIMEOUT)
        if protocol == "tcp":
            vs["retries"] = self.retries(settings, len(pool.servers))
        self.access(vs, settings)
        proxy_protocol = settings.get("proxy_protocol", [])
        limit = self.limit(settings)
        if protocol == "tcp":
            if accept_proxy:
                vs["accept_proxy"] = True
                trusted = self.trusted(settings)
                if trusted:
                    vs["accept_proxy_from"] = trusted
            if proxy_protocol:
                self.took(proxy_protocol[-1])
                if proxy_protocol[-1].args == ("on",):
                    vs["send_proxy"] = "v1"
            if limit is not None:
                vs["per_source"] = {"max_connections": limit, "prefix_v6": 128}
        else:
            if proxy_protocol and proxy_protocol[-1].args == ("on",):
                self.skip(
                    proxy_protocol[-1], "proxy_protocol on (lbproxy sends no PROXY header over UDP)"
                )
            udp: dict[str, Any] = {
                "idle_timeout": self.time(settings, "proxy_timeout", NGINX_PROXY_TIMEOUT)
            }
            responses = settings.get("proxy_responses", [])
            if responses:
                try:
                    udp["responses"] = _number(responses[-1].args[0], "proxy_responses")
                    self.took(responses[-1])
                except (_Invalid, IndexError):
                    self.skip(responses[-1], f"proxy_responses {' '.join(responses[-1].args)}")
            if limit is not None:
                udp["max_sessions_per_source"] = limit
                udp["source_prefix"] = {"v6": 128}
            vs["udp"] = udp
        vs["health_check"] = pool.health
        vs["real_servers"] = pool.servers
        return _Piece(target if upstream is not None else None, base, port, vs)

    def time(self, settings: dict[str, list[Directive]], name: str, default: str) -> str:
        found = settings.get(name, [])
        if not found:
            return default
        d = found[-1]
        try:
            if len(d.args) != 1:
                raise _Invalid("one time expected")
            seconds = _seconds(d.args[0])
            if seconds <= 0:
                raise _Invalid("0 (lbproxy needs more than 0)")
        except _Invalid as e:
            self.skip(d, f"{name} {' '.join(d.args)}: {e}")
            return default
        self.took(d)
        return _duration(seconds)

    def retries(self, settings: dict[str, list[Directive]], servers: int) -> int:
        retries = max(servers - 1, 0)
        switch = settings.get("proxy_next_upstream", [])
        if switch:
            self.took(switch[-1])
            if switch[-1].args == ("off",):
                return 0
        tries = settings.get("proxy_next_upstream_tries", [])
        if tries:
            try:
                count = _number(tries[-1].args[0] if tries[-1].args else "", "tries")
                self.took(tries[-1])
                if count:
                    retries = min(retries, count - 1)
            except _Invalid as e:
                self.skip(tries[-1], f"proxy_next_upstream_tries: {e}")
        return retries

    def access(self, vs: dict[str, Any], settings: dict[str, list[Directive]]) -> None:
        rules = sorted(settings.get("allow", []) + settings.get("deny", []), key=lambda d: d.order)
        parsed: list[tuple[bool, list[str]]] = []
        for rule in rules:
            try:
                if len(rule.args) != 1:
                    raise _Invalid("one address expected")
                parsed.append((rule.name == "allow", _network(rule.args[0])))
                self.took(rule)
            except _Invalid as e:
                self.skip(rule, f"{rule.name} {' '.join(rule.args)}: {e}")
        allow, deny = _access_lists(parsed)
        if allow is not None:
            vs["allow"] = allow
        if deny:
            vs["deny"] = deny

    def trusted(self, settings: dict[str, list[Directive]]) -> list[str]:
        trusted: list[str] = []
        for d in settings.get("set_real_ip_from", []):
            try:
                if len(d.args) != 1:
                    raise _Invalid("one address expected")
                trusted.extend(n for n in _network(d.args[0]) if n not in trusted)
                self.took(d)
            except _Invalid as e:
                self.skip(d, f"set_real_ip_from {' '.join(d.args)}: {e}")
        return trusted

    def limit(self, settings: dict[str, list[Directive]]) -> int | None:
        limit: int | None = None
        for d in settings.get("limit_conn", []):
            zone = self.zones.get(d.args[0]) if len(d.args) == 2 else None
            if zone is None:
                self.skip(d, f"limit_conn {' '.join(d.args)} (no such limit_conn_zone)")
                continue
            if not zone.args or zone.args[0] not in _ADDRESS_KEYS:
                self.skip(
                    d,
                    f"limit_conn {' '.join(d.args)} (a zone keyed by "
                    f"{zone.args[0] if zone.args else 'nothing'}, not the client address)",
                )
                continue
            try:
                count = _number(d.args[1], "limit_conn")
                if count < 1:
                    raise _Invalid("0")
            except _Invalid as e:
                self.skip(d, f"limit_conn {' '.join(d.args)}: {e}")
                continue
            self.took(d)
            self.took(zone)
            limit = count if limit is None else min(limit, count)
        return limit

    def pool(self, upstream: _Upstream | None, target: str) -> _Pool:
        if upstream is None:
            address = _address(target)
            return _Pool(
                {"scheduler": "rr"},
                {"type": "none", "fall": NGINX_MAX_FAILS, "interval": NGINX_FAIL_TIMEOUT},
                [{"name": _server_name(address), "address": address}],
            )
        upstream.used = True
        u = upstream.directive
        assert u.block is not None
        self.took(u)
        method: Directive | None = None
        servers: list[dict[str, Any]] = []
        passive: list[tuple[Directive, int, str]] = []
        for d in u.block:
            if d.name == "server" and d.block is None:
                server = self.upstream_server(d, passive)
                if server is not None:
                    if any(s["name"] == server["name"] for s in servers):
                        server["name"] = f"{server['name']}-{len(servers) + 1}"
                    servers.append(server)
            elif d.name in ("least_conn", "hash", "random") and d.block is None:
                method = d
            elif d.block is not None:
                self.skip_block(d)
            else:
                self.skip(d, " ".join((d.name, *d.args)))
        if not servers:
            raise _Invalid(f"upstream {u.args[0]} has no server lbproxy can carry over")
        weighted = len({s.get("weight", 1) for s in servers}) > 1
        scheduler: dict[str, Any] = {"scheduler": "wrr" if weighted else "rr"}
        if method is not None and method.name == "least_conn" and not method.args:
            scheduler = {"scheduler": "wlc" if weighted else "lc"}
            self.took(method)
        elif (
            method is not None
            and method.name == "hash"
            and method.args[1:] in ((), ("consistent",))
            and method.args
        ):
            key = method.args[0]
            if key in _ADDRESS_KEYS:
                scheduler = {"scheduler": "maglev", "hash_key": "source"}
                self.took(method)
            elif key in ("$remote_addr$remote_port", "$binary_remote_addr$remote_port"):
                scheduler = {"scheduler": "maglev", "hash_key": "source_port"}
                self.took(method)
            else:
                self.skip(
                    method,
                    f"hash {' '.join(method.args)} (lbproxy hashes the client "
                    "address, or address and port)",
                )
        elif (
            method is not None
            and method.name == "random"
            and method.args
            in (
                ("two",),
                ("two", "least_conn"),
            )
        ):
            # nginx's default method for two is least_conn: the closer of lbproxy's
            # schedulers, though it compares every server, not two picked at random
            scheduler = {"scheduler": "wlc" if weighted else "lc"}
            self.skip(
                method,
                f"{' '.join((method.name, *method.args))} (lbproxy's "
                f"{scheduler['scheduler']} takes the least loaded of all the servers, "
                "nginx of two picked at random)",
            )
        elif method is not None:
            self.skip(method, f"{' '.join((method.name, *method.args))} (kept round robin)")
        fall, interval = NGINX_MAX_FAILS, NGINX_FAIL_TIMEOUT
        if passive:
            # lbproxy's passive health is one per virtual server: the most servers' own
            pairs = [(f, i) for _d, f, i in passive]
            fall, interval = max(pairs, key=lambda p: (pairs.count(p), -pairs.index(p)))
            for d, other_fall, other_interval in passive:
                if (other_fall, other_interval) != (fall, interval):
                    self.skip(
                        d,
                        f"server {d.args[0]} max_fails={other_fall} fail_timeout="
                        f"{other_interval} (lbproxy's passive health is one per "
                        f"virtual server: max_fails={fall} fail_timeout={interval}, "
                        "as most of the upstream's servers)",
                    )
        return _Pool(scheduler, {"type": "none", "fall": fall, "interval": interval}, servers)

    def upstream_server(
        self, d: Directive, passive: list[tuple[Directive, int, str]]
    ) -> dict[str, Any] | None:
        if not d.args:
            self.skip(d, "server (no address)")
            return None
        try:
            address = _address(d.args[0])
        except _Invalid as e:
            self.skip(d, f"server {' '.join(d.args)}: {e}")
            return None
        server: dict[str, Any] = {"name": _server_name(address), "address": address}
        fall, interval = NGINX_MAX_FAILS, NGINX_FAIL_TIMEOUT
        ignored: list[str] = []
        for parameter in d.args[1:]:
            key, equals, value = parameter.partition("=")
            try:
                if key == "weight" and equals:
                    weight = _number(value, "weight")
                    if not 1 <= weight <= 65535:
                        raise _Invalid(f"weight {weight}")
                    server["weight"] = weight
                elif key == "max_conns" and equals:
                    server["max_connections"] = _number(value, "max_conns")
                elif key == "max_fails" and equals:
                    fall = _number(value, "max_fails")
                    if fall == 0:
                        raise _Invalid(
                            "max_fails=0: lbproxy counts failed connects always (health_check.fall)"
                        )
                elif key == "fail_timeout" and equals:
                    seconds = _seconds(value)
                    if seconds <= 0:
                        raise _Invalid("fail_timeout=0")
                    interval = _duration(seconds)
                elif parameter == "backup":
                    server["backup"] = True
                elif parameter == "down":
                    server["state"] = "disabled"
                else:
                    ignored.append(parameter)
            except _Invalid as e:
                self.skip(d, f"server {d.args[0]} {parameter}: {e}")
        if ignored:
            self.skip(d, f"server {d.args[0]} {' '.join(ignored)}")
        if server.get("state") != "disabled":  # a server nginx never uses has no health
            passive.append((d, max(fall, 1), interval))
        self.took(d)
        return server


@dataclass
class _Piece:
    """A virtual server as one server { } (one protocol, one route) makes it, before
    those proxying to the same upstream alike are merged; named once placed."""

    upstream: str | None  # None: proxy_pass to an address, an upstream of its own
    base: str
    port: str
    vs: dict[str, Any]

    def settings(self) -> dict[str, Any]:
        return {k: v for k, v in self.vs.items() if k not in ("name", "listen")}


@dataclass
class _Pool:
    scheduler: dict[str, Any]
    health: dict[str, Any]
    servers: list[dict[str, Any]]


def translate(path: Path) -> Translation:
    """The lbproxy configuration for the nginx configuration at `path` (its includes
    read too). A file nginx would refuse, or one that cannot be read, translates to
    nothing, with the reason as its one line."""
    translation = Translation(source="nginx", path=str(path))
    try:
        directives = read(path)
    except NginxSyntaxError as e:
        translation.untranslated.append(
            Untranslated(
                e.file, e.line, f"the configuration: {e.message} (nginx would not start with it)"
            )
        )
        return translation
    except OSError as e:
        translation.untranslated.append(
            Untranslated(str(path), 0, f"the configuration: {e.strerror or e}")
        )
        return translation
    translator = _Translator(translation)
    translator.main(directives)
    translator.finish()
    return translation
