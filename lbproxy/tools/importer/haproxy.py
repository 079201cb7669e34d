"""haproxy's configuration as lbproxy's (see translation.py for what a translator fills).

The grammar is read by haproxy_grammar.py (by hand: no maintained Python library parses
haproxy.cfg). Here each `mode tcp` proxy becomes virtual servers:

- a `listen` section is one virtual server, named after it;
- a `frontend` gives one virtual server per backend it routes to (its
  `default_backend`, and every backend `use_backend ... if { req.ssl_sni ... }` names,
  on the frontend's addresses with the names as `sni`), named after the backend (as
  HAProxy's logs name it);
- frontends that send clients to one backend alike share its virtual server (on all
  their addresses: the servers' limits and the scheduler are shared, as in HAProxy);
  a frontend that takes them otherwise (its own maxconn, ACLs, accept-proxy ...) gets a
  copy, `BACKEND-FRONTEND` (`BACKEND-PORT` for binds of one frontend that differ in
  accept-proxy), and one line says the copies share nothing;
- a proxy takes every setting of the last `defaults` section above it (or the one its
  `from NAME` names) that it does not set itself.

`DIRECTIVES` is the migration guide's table; tests hold each row to what `translate`
does. Everything else is named on stderr by FILE:LINE."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from collections.abc import Mapping as Environment
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lbproxy.core import schedulers
from lbproxy.tools.importer.haproxy_grammar import (
    PROXY_SECTIONS,
    Parsed,
    Section,
    Statement,
    parse,
)
from lbproxy.tools.importer.translation import Mapping, Translation, Untranslated

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
ReadFile = Callable[[str], "str | None"]


def _row(directive: str, lbproxy: str, note: str = "") -> Mapping:
    return Mapping("haproxy", directive, lbproxy, note)


# The migration guide's rows for haproxy, in the order the guide lists them.
DIRECTIVES: tuple[Mapping, ...] = (
    _row("listen NAME", "virtual_servers[].name", "one virtual server"),
    _row(
        "frontend NAME + default_backend B",
        "virtual_servers[].name",
        "one virtual server per backend the frontend routes to, named after the backend; "
        "frontends that take clients alike (same ACLs, maxconn, accept-proxy) share it, on "
        "all their addresses; another gets a copy `BACKEND-FRONTEND`, named on stderr (its "
        "servers' limits and balancing are its own)",
    ),
    _row(
        "defaults [NAME], from NAME",
        "virtual_servers[]",
        "applied to each proxy below it (or naming it with `from`), then translated there",
    ),
    _row("mode tcp", "virtual_servers[].protocol", "`tcp` (a `mode http` proxy is skipped)"),
    _row("bind ADDR:PORT[,...] (several binds)", "virtual_servers[].listen", "a list"),
    _row(
        "bind ... accept-proxy",
        "virtual_servers[].accept_proxy",
        "the binds with it and those without become virtual servers of their own "
        "(`BACKEND-PORT` for the first port of the second)",
    ),
    _row(
        "tcp-request connection expect-proxy layer4 if { src ... }",
        "virtual_servers[].accept_proxy_from",
    ),
    _row(
        "balance roundrobin",
        "virtual_servers[].scheduler",
        "`wrr`: equal weights give HAProxy's very sequence, others the same share of each "
        "cycle, interleaved in another order",
    ),
    _row("balance static-rr", "virtual_servers[].scheduler", "`wrr`, as roundrobin"),
    _row("balance leastconn", "virtual_servers[].scheduler", "`wlc` (weighted, as HAProxy's)"),
    _row("balance first", "virtual_servers[].scheduler", "`first` (fills by `maxconn`)"),
    _row(
        "balance source",
        "virtual_servers[].scheduler",
        "`maglev` with `hash_key: source`: a client keeps its server (another mapping)",
    ),
    _row("hash-type consistent", "virtual_servers[].scheduler", "`maglev` is consistent"),
    _row("server NAME ADDR:PORT", "virtual_servers[].real_servers[]", "`:` in names is `-`"),
    _row("server ... weight N", "virtual_servers[].real_servers[].weight"),
    _row(
        "server ... maxconn N",
        "virtual_servers[].real_servers[].max_connections",
        "with `queue` (HAProxy queues clients of a full server; timeout: `timeout queue`, "
        "else `timeout connect`)",
    ),
    _row(
        "server ... backup",
        "virtual_servers[].real_servers[].backup",
        "several backups share the load, as with `option allbackups`",
    ),
    _row("option allbackups", "virtual_servers[].real_servers[].backup", "lbproxy's way"),
    _row("server ... disabled", "virtual_servers[].real_servers[].state", "`disabled`"),
    _row(
        "server ... check",
        "virtual_servers[].health_check",
        "lbproxy checks every server of a virtual server; no server with `check`: `type: none`",
    ),
    _row("server ... inter T", "virtual_servers[].health_check.interval"),
    _row("server ... rise N", "virtual_servers[].health_check.rise"),
    _row("server ... fall N", "virtual_servers[].health_check.fall"),
    _row("server ... port N", "virtual_servers[].real_servers[].health_check.port"),
    _row("server ... addr A", "virtual_servers[].real_servers[].health_check.address"),
    _row(
        "server ... on-marked-down shutdown-sessions",
        "virtual_servers[].health_check.on_down",
        "`close`",
    ),
    _row(
        "server ... on-marked-up shutdown-backup-sessions",
        "virtual_servers[].health_check.on_up",
        "`close_backups`",
    ),
    _row(
        "server ... send-proxy, send-proxy-v2",
        "virtual_servers[].send_proxy",
        "`v1`, `v2`: one value for the virtual server",
    ),
    _row(
        "server ... check-send-proxy",
        "virtual_servers[].real_servers[].health_check.send_proxy",
        "`true`: that server's checks start with a PROXY header (v1 unless the virtual "
        "server's `send_proxy` is v2)",
    ),
    _row(
        "server ... slowstart T",
        "virtual_servers[].slow_start",
        "one value for the virtual server; lbproxy ramps at start-up too, HAProxy only a "
        "server coming back up",
    ),
    _row(
        "server ... agent-check agent-port agent-inter agent-addr agent-send",
        "virtual_servers[].agent_check",
        "when every server has one; else each one's `real_servers[].agent_check` (port, "
        "address: lbproxy asks those only, every 2 s); agent-inter and agent-send are one "
        "value per virtual server (others named)",
    ),
    _row("default-server ...", "virtual_servers[].real_servers[]", "applied to each server"),
    _row("option tcp-check", "virtual_servers[].health_check.type", "`tcp`, or the sequence's"),
    _row("option pgsql-check user U", "virtual_servers[].health_check.type", "`pgsql`, `user`"),
    _row("option mysql-check user U", "virtual_servers[].health_check.type", "`mysql`, `user`"),
    _row("option redis-check", "virtual_servers[].health_check.type", "`redis`"),
    _row(
        "option smtpchk [EHLO name]",
        "virtual_servers[].health_check.type",
        "`smtp`, `helo` (lbproxy says EHLO: HELO is named)",
    ),
    _row("option ssl-hello-chk", "virtual_servers[].health_check.type", "`tls` (a handshake)"),
    _row(
        "option httpchk [METHOD] [URI] [VERSION\\r\\nHost:\\ NAME]",
        "virtual_servers[].health_check.type",
        "`http`, `method` (HAProxy's default `OPTIONS`), `path`, a Host header as `host`; "
        "lbproxy speaks HTTP/1.1 with its own headers (another version or header is named)",
    ),
    _row(
        "http-check send meth M uri U hdr Host NAME",
        "virtual_servers[].health_check.method",
        "with `path` and `host`",
    ),
    _row("http-check expect string|rstring S", "virtual_servers[].health_check.expect_body"),
    _row("http-check expect status N", "virtual_servers[].health_check.expect_status"),
    _row(
        "tcp-check send/expect sequence",
        "virtual_servers[].health_check.type",
        "sends in a row are one message; Redis `role:`: `redis` with `role`; a PostgreSQL "
        "StartupMessage: `pgsql`; a MySQL handshake response: `mysql` with its user; `220` "
        "then EHLO: `smtp`; else `send_expect` with the first message and expect (the rest "
        "named on stderr)",
    ),
    _row("tcp-check connect port N", "virtual_servers[].health_check.port"),
    _row("timeout connect", "virtual_servers[].connect_timeout"),
    _row(
        "timeout client, timeout server",
        "virtual_servers[].idle_timeout",
        "the longer of the two (lbproxy's idle is both sides silent)",
    ),
    _row("timeout tunnel", "virtual_servers[].idle_timeout", "wins over client/server"),
    _row(
        "timeout check",
        "virtual_servers[].health_check.timeout",
        "without it, the shorter of `inter` and `timeout connect`, as HAProxy waits",
    ),
    _row("timeout queue", "virtual_servers[].queue.timeout"),
    _row(
        "option abortonclose",
        "virtual_servers[].queue.abort_on_close",
        "a queued client that closed its side is dropped at its turn, as in HAProxy; without "
        "it lbproxy serves it, a FIN being possibly a half-close",
    ),
    _row("maxconn (frontend, listen, defaults)", "virtual_servers[].max_connections"),
    _row("maxconn (global)", "global.max_clients"),
    _row("user, group (global)", "global.user"),
    _row(
        "retries N, option redispatch",
        "virtual_servers[].retries",
        "lbproxy always retries on another server (HAProxy: the same one without "
        "`redispatch`); HAProxy's default is 3",
    ),
    _row("option tcplog", "global.access_log", "JSON with `log_format: json`"),
    _row(
        "use_backend B if { req.ssl_sni -i NAME }",
        "virtual_servers[].sni",
        "exact names (`-m str`, the default); named ACLs, `||` and `-f` lists too; "
        "lbproxy matches any case, as `-i` (without it HAProxy matches the case written)",
    ),
    _row(
        "use_backend B if { req.ssl_alpn PROTOCOL }",
        "virtual_servers[].alpn",
        "on the backend's virtual server, without `sni`; exact protocols (`-m str`, the "
        "default), `||` and named ACLs; not `-i` (lbproxy compares case and all); a "
        "`req.ssl_sni` rule after a `req.ssl_alpn` one is not translated (lbproxy tries "
        "a name's own routes first)",
    ),
    _row(
        "use_backend %[req.ssl_sni,lower,map(FILE,DEFAULT)]",
        "virtual_servers[].sni",
        "each `NAME BACKEND` line of the map (read from the configuration's folder) a route, "
        "DEFAULT the default; map_beg, map_end, map_reg are not translated",
    ),
    _row(
        "tcp-request inspect-delay, tcp-request content accept if { req.ssl_hello_type 1 }",
        "virtual_servers[].sni",
        "lbproxy pre-reads the ClientHello on an SNI address within `connect_timeout`",
    ),
    _row(
        "tcp-request connection reject if { src ... }",
        "virtual_servers[].deny",
        "src ACLs, named or inline, and `-f` lists (read from the configuration's folder)",
    ),
    _row(
        "tcp-request connection accept if { src ... } + reject",
        "virtual_servers[].allow",
        "also `reject if !{ src ... }`",
    ),
    _row(
        "stick-table type ip size N expire T + stick on src",
        "virtual_servers[].persistence",
        "`max_entries`, `timeout` (also `stick match` + `stick store-request`); a server "
        "that is drained, weight 0 or full loses its sticky clients' new connections at "
        "once (HAProxy's `drain` and weight 0 keep serving them; a full one queues them)",
    ),
    _row("balance uri, hdr, url_param, rdp-cookie, random", "", "not translated"),
    _row("mode http, option http*, http-request", "", "lbproxy is Layer 4"),
    _row("bind ... ssl crt", "", "TLS termination: lbproxy passes TLS through"),
    _row("global: daemon, log, stats, chroot, nbthread, tune.*", "", "not translated"),
)


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# server and default-server keywords that take a value (the others are flags).
_VALUED = _words(
    """weight maxconn minconn maxqueue inter fastinter downinter rise fall port addr slowstart
    agent-port agent-inter agent-addr agent-send id cookie on-error on-marked-down
    on-marked-up error-limit observe track resolvers resolve-prefer resolve-net init-addr
    check-sni sni crt ca-file crl-file verify verifyhost ciphers ciphersuites source usesrc
    redir pool-max-conn pool-low-conn pool-purge-delay proto alpn npn check-alpn check-proto
    namespace max-reuse proxy-v2-options socks4 tcp-ut log-proto set-proxy-v2-tlv-fmt
    ssl-min-ver ssl-max-ver curves sigalgs client-sigalgs shard guid hash-key interface ws"""
)
_SERVER_FLAGS_IGNORED = frozenset(("enabled", "no-backup", "no-send-proxy", "no-send-proxy-v2"))

_NAME = re.compile(r"[^A-Za-z0-9._-]")
_TIME = re.compile(r"^(\d+)(us|ms|s|m|h|d)?$")
_UNIT_MS = {"us": 0.001, "ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, None: 1}
_SNI_FETCHES = ("req.ssl_sni", "req_ssl_sni")
_ALPN_FETCH = "req.ssl_alpn"
_HELLO_FETCHES = ("req.ssl_hello_type", "req_ssl_hello_type")
_BALANCE = {
    "roundrobin": "wrr",
    "static-rr": "wrr",
    "leastconn": "wlc",
    "first": "first",
    "source": "maglev",
}
_CHECK_OPTIONS = (
    "tcp-check",
    "pgsql-check",
    "mysql-check",
    "redis-check",
    "smtpchk",
    "ssl-hello-chk",
    "httpchk",
    "ldap-check",
    "spop-check",
    "external-check",
)
_MAX_BIND_RANGE = 64
# `%[req.ssl_sni,lower,map(FILE,DEFAULT)]`: the fetch, the map converter, file, default
_SNI_MAP = re.compile(
    r"^%\[(req\.ssl_sni|req_ssl_sni)(?:,lower)?,(map\w*)\(([^,()]+)(?:,([^,()]+))?\)\]$"
)


def translate(path: Path, env: Environment[str, str] | None = None) -> Translation:
    """Read `path` (one haproxy.cfg) and translate it as HAProxy reads it with the
    environment variables `env` (none by default); never raises on its content. The
    address lists its ACLs name (`src -f FILE`) are read too, a relative name from the
    configuration's folder."""
    text = path.read_text(encoding="utf-8", errors="replace")

    def read(name: str) -> str | None:
        try:
            return (path.parent / name).read_text(encoding="utf-8", errors="replace")
        except (OSError, ValueError):
            return None

    return translate_text(text, str(path), read, env)


def translate_text(
    text: str,
    file: str,
    read: ReadFile | None = None,
    env: Environment[str, str] | None = None,
) -> Translation:
    """The translation of `text`, the content of `file`, with the environment variables
    `env`; `read(NAME)` gives the content of a file an ACL names, None when there is
    none (pure: no file is read here)."""
    return _Translator(parse(text, file, env), file, read or _no_files).run()


def _no_files(name: str) -> str | None:
    return None


# --- values -----------------------------------------------------------------------


def _time_ms(text: str) -> float | None:
    match = _TIME.match(text)
    if match is None:
        return None
    return int(match.group(1)) * _UNIT_MS[match.group(2)]


def _duration(ms: float) -> str:
    """lbproxy's way to write `ms` milliseconds (a whole unit when there is one)."""
    whole = max(1, round(ms))
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if whole % size == 0:
            return f"{whole // size}{unit}"
    return f"{whole}ms"


def _size(text: str) -> int | None:
    match = re.match(r"^(\d+)([kmg]?)$", text.lower())
    if match is None:
        return None
    return int(match.group(1)) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[match.group(2)]


def _name(text: str) -> str:
    return _NAME.sub("-", text) or "unnamed"


def _network(text: str) -> str | None:
    try:
        network = ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None
    if network.prefixlen == network.max_prefixlen:
        return str(network.network_address)
    return str(network)


def _host_port(text: str) -> tuple[str, str] | None:
    """HOST and PORT text of an address as HAProxy writes one (`[v6]:p`, `v6:p`,
    `host:p`, `ipv4@`/`ipv6@` prefixes); None for sockets lbproxy has no use for."""
    for prefix in ("ipv4@", "ipv6@", "tcp@", "tcp4@", "tcp6@"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    if "@" in text or text.startswith("/"):
        return None
    if text.startswith("["):
        host, sep, port = text[1:].partition("]")
        if not sep or (port and not port.startswith(":")):
            return None
        return host, port[1:]
    if ":" not in text:
        return text, ""
    host, _, port = text.rpartition(":")
    return host, port


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- conditions (ACLs) ----------------------------------------------------------------


@dataclass(frozen=True)
class _Pattern:
    """One `acl` line or `{ ... }` term: a fetch, its match method and values."""

    fetch: str
    method: str  # "" (the fetch's own), str, end, beg, reg, ...
    values: tuple[str, ...]
    files: tuple[str, ...] = ()  # `-f FILE`: more values, one a line
    from_map: bool = False  # `-M`
    ignore_case: bool = False  # `-i`


def _pattern(words: list[str]) -> _Pattern | None:
    if not words:
        return None
    fetch, rest = words[0], words[1:]
    method, values, files, from_map, ignore_case = "", [], [], False, False
    i = 0
    while i < len(rest):
        word = rest[i]
        if word == "--":
            values.extend(rest[i + 1 :])
            break
        if word in ("-i", "-n", "-u"):
            ignore_case = ignore_case or word == "-i"
            i += 1
        elif word in ("-m", "-f", "-M"):
            if i + 1 >= len(rest):
                return None
            if word == "-m":
                method = rest[i + 1]
            elif word == "-f":
                files.append(rest[i + 1])
            else:
                from_map = True
            i += 2
        else:
            values.append(word)
            i += 1
    return _Pattern(fetch, method, tuple(values), tuple(files), from_map, ignore_case)


@dataclass(frozen=True)
class _Term:
    negated: bool
    patterns: tuple[_Pattern, ...]  # an ACL of several lines: any of them


def _condition(words: list[str], acls: dict[str, list[_Pattern]]) -> list[list[_Term]] | str:
    """`if|unless COND` as OR-groups of AND-ed terms, or why it cannot be read."""
    if not words or words[0] not in ("if", "unless"):
        return "a condition other than if/unless"
    unless = words[0] == "unless"
    groups: list[list[_Term]] = [[]]
    i = 1
    while i < len(words):
        word = words[i]
        if word in ("||", "or"):
            groups.append([])
            i += 1
            continue
        negated = False
        while word.startswith("!"):
            negated = not negated
            word = word[1:]
            if not word:
                i += 1
                if i >= len(words):
                    return "a `!` with nothing after it"
                word = words[i]
        if word == "{":
            try:
                end = words.index("}", i + 1)
            except ValueError:
                return "an unclosed `{`"
            pattern = _pattern(list(words[i + 1 : end]))
            if pattern is None:
                return "an empty or malformed `{ ... }`"
            groups[-1].append(_Term(negated, (pattern,)))
            i = end + 1
            continue
        if word in ("TRUE", "FALSE"):
            return f"the predefined ACL {word}"
        if word not in acls:
            return f"the ACL {word!r} (not defined in this section)"
        groups[-1].append(_Term(negated, tuple(acls[word])))
        i += 1
    if any(not group for group in groups):
        return "an empty condition"
    if unless:
        if len(groups) != 1 or len(groups[0]) != 1:
            return "`unless` with several terms"
        term = groups[0][0]
        groups = [[_Term(not term.negated, term.patterns)]]
    return groups


def _src_networks(term: _Term, read: ReadFile) -> list[str] | str:
    """The networks of a `src` term (its values and the lines of its `-f` files), or
    why it is not one."""
    networks: list[str] = []
    for pattern in term.patterns:
        if pattern.fetch != "src":
            return f"a condition on {pattern.fetch}"
        if pattern.from_map:
            return "src matched against a map (-M)"
        if pattern.method not in ("", "ip"):
            return f"src matched with -m {pattern.method}"
        values = [(value, "") for value in pattern.values]
        for name in pattern.files:
            listed = _listed(name, read)
            if isinstance(listed, str):
                return listed
            values.extend(listed)
        for value, where in values:
            network = _network(value)
            if network is None:
                return f"{where}{value!r} is not an address or a network"
            if network not in networks:
                networks.append(network)
    return networks


def _listed(name: str, read: ReadFile) -> list[tuple[str, str]] | str:
    """The values of an ACL's `-f` list, as HAProxy reads one (a value a line, `#`
    lines are comments), each with where it is; or why there are none."""
    content = read(name)
    if content is None:
        return f"the list {name} cannot be read"
    values = []
    for number, line in enumerate(content.splitlines(), start=1):
        value = line.strip()
        if value and not value.startswith("#"):
            values.append((value, f"{name}:{number}: "))
    return values


def _alpn_condition(groups: list[list[_Term]]) -> bool:
    """Whether a use_backend condition is on req.ssl_alpn alone (then `_alpn_names`)."""
    return all(p.fetch == _ALPN_FETCH for group in groups for t in group for p in t.patterns)


def _alpn_names(groups: list[list[_Term]]) -> list[str] | str:
    """The protocols of `{ req.ssl_alpn X }` terms (OR-ed), exact as lbproxy's `alpn`
    matches them; or why they do not translate."""
    names: list[str] = []
    for group in groups:
        if len(group) != 1 or group[0].negated:
            return "an ALPN condition other than a protocol list (negated, or AND-ed)"
        for pattern in group[0].patterns:
            if pattern.from_map or pattern.files:
                return "ALPN protocols from a file or a map"
            if pattern.method not in ("", "str"):
                return f"req.ssl_alpn -m {pattern.method} (lbproxy matches exact protocol names)"
            if pattern.ignore_case:
                return "req.ssl_alpn -i (lbproxy matches protocol names exactly, case and all)"
            names.extend(value for value in pattern.values if value not in names)
    return names


def _sni_names(groups: list[list[_Term]], read: ReadFile) -> list[str] | str:
    names: list[str] = []
    for group in groups:
        if len(group) != 1 or group[0].negated:
            return "a server-name condition other than a name list (negated, or AND-ed)"
        for pattern in group[0].patterns:
            if pattern.fetch not in _SNI_FETCHES:
                return (
                    f"use_backend on {pattern.fetch} (lbproxy routes on req.ssl_sni, "
                    "and on req.ssl_alpn alone)"
                )
            if pattern.from_map:
                return "server names matched against a map (-M)"
            if pattern.method not in ("", "str"):
                return (
                    f"req.ssl_sni -m {pattern.method} (lbproxy matches exact names and "
                    "`*.example.com`, one label)"
                )
            values = list(pattern.values)
            for name in pattern.files:
                listed = _listed(name, read)
                if isinstance(listed, str):
                    return listed
                values.extend(value for value, _ in listed)
            names.extend(value.lower() for value in values if value.lower() not in names)
    return names


# --- a proxy's settings, its defaults' first ----------------------------------------


@dataclass
class _Server:
    statement: Statement
    name: str
    address: str
    options: dict[str, tuple[str | None, Statement]]


@dataclass
class _Proxy:
    """What a section (with its defaults) says; each value with the statement it came from."""

    section: Section | None
    mode: tuple[str, Statement] | None = None
    balance: Statement | None = None
    hash_type: Statement | None = None
    timeouts: dict[str, tuple[float, Statement]] = field(default_factory=dict)
    check_option: Statement | None = None
    tcplog: Statement | None = None
    redispatch: Statement | None = None
    abortonclose: Statement | None = None
    allbackups: Statement | None = None
    tcp_checks: list[Statement] = field(default_factory=list)
    tcp_checks_inherited: bool = False  # the first own `tcp-check` replaces them
    http_checks: list[Statement] = field(default_factory=list)
    http_checks_inherited: bool = False
    default_server: dict[str, tuple[str | None, Statement]] = field(default_factory=dict)
    maxconn: tuple[int, Statement] | None = None
    retries: tuple[int, Statement] | None = None
    binds: list[Statement] = field(default_factory=list)
    servers: list[_Server] = field(default_factory=list)
    acls: dict[str, list[_Pattern]] = field(default_factory=dict)
    acl_statements: dict[str, list[Statement]] = field(default_factory=dict)
    connection_rules: list[Statement] = field(default_factory=list)
    content_rules: list[Statement] = field(default_factory=list)
    inspect_delay: Statement | None = None
    use_backends: list[Statement] = field(default_factory=list)
    default_backend: Statement | None = None
    stick_table: Statement | None = None
    stick_rules: list[Statement] = field(default_factory=list)
    disabled: Statement | None = None
    accept_proxy_binds: list[Statement] = field(default_factory=list)

    def inherit(self, section: Section) -> _Proxy:
        """A copy for `section`, keeping what defaults may pass on."""
        return _Proxy(
            section=section,
            mode=self.mode,
            balance=self.balance,
            hash_type=self.hash_type,
            timeouts=dict(self.timeouts),
            check_option=self.check_option,
            tcplog=self.tcplog,
            redispatch=self.redispatch,
            abortonclose=self.abortonclose,
            allbackups=self.allbackups,
            tcp_checks=list(self.tcp_checks),
            tcp_checks_inherited=bool(self.tcp_checks),
            http_checks=list(self.http_checks),
            http_checks_inherited=bool(self.http_checks),
            default_server=dict(self.default_server),
            maxconn=self.maxconn,
            retries=self.retries,
            default_backend=self.default_backend,
        )


@dataclass
class _Route:
    backend: str
    names: list[str]
    statements: list[Statement]
    alpn: list[str] = field(default_factory=list)


@dataclass
class _Planned:
    """A frontend's addresses that send clients to `backend` alike (`front`: the keys
    the frontend gives a virtual server; `split`: the frontend's binds differ)."""

    backend: str
    frontend: _Proxy
    listen: list[str]
    names: list[str]
    front: dict[str, Any]
    split: bool
    alpn: list[str] = field(default_factory=list)


class _Translator:
    def __init__(self, parsed: Parsed, file: str, read: ReadFile):
        self.parsed = parsed
        self.file = file
        self.read = read
        self.translation = Translation(source="haproxy", path=file)
        self.used: set[tuple[str, int]] = set()
        self.left: dict[tuple[str, int, str], None] = {}
        self.notes: set[tuple[str, int, str]] = set()  # of `left`: said, not left behind
        self.defaults: dict[str, _Proxy] = {}
        self.proxies: list[_Proxy] = []
        self.backends: dict[str, _Proxy] = {}
        self.vs_names: set[str] = set()
        self.routed: set[str] = set()  # backends some frontend sends clients to
        self.bound: list[tuple[IPAddress, int, _Proxy]] = []  # listen addresses taken
        self.planned: list[_Planned] = []

    # bookkeeping

    def use(self, *statements: Statement | None) -> None:
        for statement in statements:
            if statement is not None:
                self.used.add((statement.file, statement.line))

    def skip(self, statement: Statement, what: str) -> None:
        self.left[(statement.file, statement.line, what)] = None

    def skip_section(self, section: Section | None, what: str) -> None:
        """A whole section left behind: one line at its start, none for its statements."""
        if section is None:
            return
        lines = {(st.file, st.line) for st in section.statements}
        for key in [key for key in self.left if key[:2] in lines]:
            del self.left[key]
        self.used -= lines | {(section.header.file, section.header.line)}
        self.skip(section.header, what)

    # the whole file

    def run(self) -> Translation:
        for problem in self.parsed.problems:
            self.left[(problem.file, problem.line, problem.message)] = None
        for note in self.parsed.notes:
            self.left[(note.file, note.line, note.message)] = None
            self.notes.add((note.file, note.line, note.message))
        for statement in self.parsed.before_sections:
            self.skip(statement, f"{statement.text} (outside any section)")
        current = _Proxy(section=None)
        for section in self.parsed.sections:
            if section.kind == "global":
                self.read_global(section)
            elif section.kind not in PROXY_SECTIONS:
                self.skip(section.header, f"the {section.kind} section {section.name}".rstrip())
            else:
                # a defaults section starts afresh: it resets the one before it
                base = _Proxy(section=None) if section.kind == "defaults" else current
                if section.source is not None:
                    if section.source in self.defaults:
                        base = self.defaults[section.source]
                    else:
                        self.skip(section.header, f"from {section.source}: no such defaults")
                proxy = self.read_proxy(base.inherit(section), section)
                if section.kind == "defaults":
                    current = proxy
                    if section.name:
                        self.defaults[section.name] = proxy
                else:
                    self.proxies.append(proxy)
                    if section.kind in ("backend", "listen"):
                        self.backends[section.name] = proxy
        for proxy in self.proxies:
            if proxy.section is not None and proxy.section.kind in ("frontend", "listen"):
                self.build_frontend(proxy)
        self.build_virtual_servers()
        self.report_unused_backends()
        self.admin_elsewhere()
        # without a virtual server the rest (global settings) is no configuration
        self.translation.translated = len(self.used) if self.translation.virtual_servers else 0
        self.translation.untranslated.extend(
            Untranslated(file, line, what, note=(file, line, what) in self.notes)
            for file, line, what in sorted(self.left, key=_order)
        )
        return self.translation

    def read_global(self, section: Section) -> None:
        settings = self.translation.settings.setdefault("global", {})
        for st in section.statements:
            words = st.words
            if words[0] == "maxconn" and len(words) == 2 and words[1].isdigit() and int(words[1]):
                settings["max_clients"] = int(words[1])
                self.use(st)
            elif words[0] in ("user", "uid", "group", "gid") and len(words) == 2:
                key = "user" if words[0] in ("user", "uid") else "group"
                settings[key] = int(words[1]) if words[1].isdigit() else words[1]
                self.use(st)
            elif words[0] in ("setenv", "presetenv", "unsetenv", "resetenv"):
                self.use(st)  # the grammar applied it to the lines below, as HAProxy does
            else:
                self.skip(st, st.text)
        if not settings:
            del self.translation.settings["global"]

    # one section's statements

    def read_proxy(self, proxy: _Proxy, section: Section) -> _Proxy:
        kind = section.kind
        if kind == "listen" and len(section.header.words) > 2:
            # `listen NAME ADDR:PORT`: the old way to write its bind
            address = [w for w in section.header.words[2:] if w != "from"]
            if address and address[0] != (section.source or ""):
                proxy.binds.append(
                    Statement(section.header.file, section.header.line, ("bind", address[0]))
                )
        for st in section.statements:
            self.read_statement(proxy, kind, st)
        return proxy

    def read_statement(self, proxy: _Proxy, kind: str, st: Statement) -> None:
        words = list(st.words)
        keyword = words[0]
        front = kind in ("frontend", "listen", "defaults")
        back = kind in ("backend", "listen", "defaults")
        if keyword == "mode" and len(words) == 2:
            proxy.mode = (words[1], st)
        elif keyword == "disabled" and len(words) == 1:
            proxy.disabled = st
        elif keyword == "enabled" and len(words) == 1:
            proxy.disabled = None
            self.use(st)
        elif keyword == "balance" and back and len(words) >= 2:
            proxy.balance = st
        elif keyword == "hash-type" and back:
            proxy.hash_type = st
        elif keyword == "timeout" and len(words) == 3:
            ms = _time_ms(words[2])
            if ms is None:
                self.skip(st, f"{st.text} (not a time)")
            else:
                proxy.timeouts[words[1]] = (ms, st)
        elif keyword in ("contimeout", "clitimeout", "srvtimeout") and len(words) == 2:
            ms = _time_ms(words[1])
            name = {"contimeout": "connect", "clitimeout": "client", "srvtimeout": "server"}
            if ms is not None:
                proxy.timeouts[name[keyword]] = (ms, st)
            else:
                self.skip(st, f"{st.text} (not a time)")
        elif keyword == "option" and len(words) >= 2 and words[1] in _CHECK_OPTIONS and back:
            proxy.check_option = st
        elif keyword == "no" and words[1:3] and words[1] == "option" and len(words) >= 3:
            if words[2] in _CHECK_OPTIONS and proxy.check_option is not None:
                proxy.check_option = None
                self.use(st)
            elif words[2] == "tcplog":
                proxy.tcplog = None
                self.use(st)
            elif words[2] == "redispatch":
                proxy.redispatch = None
                self.use(st)
            elif words[2] == "abortonclose":
                proxy.abortonclose = None
                self.use(st)
            elif words[2] == "allbackups":
                proxy.allbackups = None
                self.use(st)
            else:
                self.skip(st, st.text)
        elif keyword == "option" and words[1:] == ["tcplog"] and front:
            proxy.tcplog = st
        elif keyword == "option" and words[1:] == ["redispatch"]:
            proxy.redispatch = st
        elif keyword == "option" and words[1:] == ["abortonclose"] and back:
            proxy.abortonclose = st
        elif keyword == "option" and words[1:] == ["allbackups"] and back:
            proxy.allbackups = st
        elif keyword == "tcp-check" and back:
            if proxy.tcp_checks_inherited:
                proxy.tcp_checks, proxy.tcp_checks_inherited = [], False
            proxy.tcp_checks.append(st)
        elif keyword == "http-check" and back:
            if proxy.http_checks_inherited:
                proxy.http_checks, proxy.http_checks_inherited = [], False
            proxy.http_checks.append(st)
        elif keyword == "default-server" and back:
            proxy.default_server.update(self.server_options(words[1:], st))
        elif keyword == "server" and kind in ("backend", "listen"):
            self.read_server(proxy, st)
        elif keyword == "maxconn" and front and len(words) == 2 and words[1].isdigit():
            proxy.maxconn = (int(words[1]), st)
        elif keyword == "retries" and back and len(words) == 2 and words[1].isdigit():
            proxy.retries = (int(words[1]), st)
        elif keyword == "bind" and kind in ("frontend", "listen"):
            proxy.binds.append(st)
        elif keyword == "acl" and kind != "defaults" and len(words) >= 3:
            pattern = _pattern(words[2:])
            if pattern is None:
                self.skip(st, f"{st.text} (malformed)")
            else:
                proxy.acls.setdefault(words[1], []).append(pattern)
                proxy.acl_statements.setdefault(words[1], []).append(st)
        elif keyword == "tcp-request" and words[1:2] == ["connection"] and kind != "defaults":
            proxy.connection_rules.append(st)
        elif keyword == "tcp-request" and words[1:2] == ["content"] and kind != "defaults":
            proxy.content_rules.append(st)
        elif keyword == "tcp-request" and words[1:2] == ["inspect-delay"] and front:
            proxy.inspect_delay = st
        elif keyword == "use_backend" and kind in ("frontend", "listen"):
            proxy.use_backends.append(st)
        elif keyword == "default_backend" and kind in ("frontend", "listen", "defaults"):
            proxy.default_backend = st if len(words) == 2 else None
            if len(words) != 2:
                self.skip(st, st.text)
        elif keyword == "stick-table" and kind in ("backend", "listen"):
            proxy.stick_table = st
        elif keyword == "stick" and kind in ("backend", "listen"):
            proxy.stick_rules.append(st)
        else:
            self.skip(st, st.text)

    def server_options(
        self, words: list[str], st: Statement
    ) -> dict[str, tuple[str | None, Statement]]:
        options: dict[str, tuple[str | None, Statement]] = {}
        i = 0
        while i < len(words):
            word = words[i]
            if word in _VALUED:
                if i + 1 >= len(words):
                    self.skip(st, f"{word} without a value")
                    break
                options[word] = (words[i + 1], st)
                i += 2
                continue
            if word.startswith("no-") and word[3:] in ("check", "agent-check", "backup"):
                options.pop(word[3:], None)
                options[word] = (None, st)
            elif word in ("no-send-proxy", "no-send-proxy-v2"):
                options.pop(word[3:], None)
            else:
                options[word] = (None, st)
            i += 1
        return options

    def read_server(self, proxy: _Proxy, st: Statement) -> None:
        if len(st.words) < 3:
            self.skip(st, f"{st.text} (no address)")
            return
        options = dict(proxy.default_server)
        for key, value in self.server_options(list(st.words[3:]), st).items():
            if key.startswith("no-"):
                options.pop(key[3:], None)
            else:
                options[key] = value
        proxy.servers.append(_Server(st, st.words[1], st.words[2], options))

    # frontends and listens

    def build_frontend(self, proxy: _Proxy) -> None:
        """Plan the frontend's virtual servers (one per backend it routes to and group of
        its binds that agree on accept-proxy); `build_virtual_servers` makes them."""
        section = proxy.section
        assert section is not None
        header = section.header
        if proxy.disabled is not None:
            self.skip_section(section, f"{section.kind} {section.name}: disabled")
            return
        mode = proxy.mode[0] if proxy.mode else "tcp"
        if mode != "tcp":
            self.skip_section(
                section, f"{section.kind} {section.name}: mode {mode} (lbproxy is Layer 4)"
            )
            return
        bound = self.listen_addresses(proxy)
        if not bound:
            self.skip(header, f"{section.kind} {section.name}: no address lbproxy can listen on")
            return
        self.use(header, proxy.mode[1] if proxy.mode else None)
        front: dict[str, Any] = {}
        self.front_settings(proxy, front)
        if proxy.tcplog is not None:  # HAProxy logs a connection in its frontend
            self.translation.settings.setdefault("global", {})["access_log"] = True
            self.use(proxy.tcplog)
        routes = self.routes(proxy)
        if not routes:
            self.skip(header, f"{section.kind} {section.name}: no backend to send clients to")
            return
        sni = any(route.names or route.alpn for route in routes)
        if sni:
            self.sni_idiom(proxy)
        else:
            for st in proxy.content_rules:
                self.skip(st, st.text)
            if proxy.inspect_delay is not None:
                self.skip(proxy.inspect_delay, proxy.inspect_delay.text)
        # `accept-proxy` is a bind's: lbproxy's accept_proxy a virtual server's, so the
        # binds with it and those without become virtual servers of their own
        groups: list[tuple[list[str], dict[str, Any]]] = []
        for wants_proxy in (False, True):
            listen = [address for address, on in bound if on == wants_proxy]
            if not listen:
                continue
            settings = dict(front)
            if wants_proxy:
                settings["accept_proxy"] = True
                self.use(*proxy.accept_proxy_binds)
            groups.append((listen, settings))
        for route in routes:
            backend = self.backends[route.backend]
            self.routed.add(route.backend)
            if backend.disabled is not None:
                self.skip_section(backend.section, f"backend {route.backend}: disabled")
                continue
            backend_mode = backend.mode[0] if backend.mode else "tcp"
            if backend_mode != "tcp":
                if backend.section is not None:
                    self.skip_section(
                        backend.section,
                        f"backend {route.backend}: mode {backend_mode} (lbproxy is Layer 4)",
                    )
                continue
            self.use(*route.statements)
            for listen, settings in groups:
                self.planned.append(
                    _Planned(
                        route.backend,
                        proxy,
                        listen,
                        route.names,
                        settings,
                        len(groups) > 1,
                        route.alpn,
                    )
                )

    def build_virtual_servers(self) -> None:
        """One virtual server per backend and set of front settings: frontends that send
        their clients alike to a backend share one (its server limits and scheduler, as
        in HAProxy), on all their addresses."""
        merged: dict[tuple[str, str], list[_Planned]] = {}
        for plan in self.planned:
            backend = self.backends[plan.backend]
            client = plan.frontend.timeouts.get("client")
            key = [plan.front, plan.names, plan.alpn, client[0] if client else None]
            if any(not (_host_port(s.address) or ("", ""))[1] for s in backend.servers):
                key.append(_ports(plan.listen))  # a server without port takes the client's
            merged.setdefault((plan.backend, repr(key)), []).append(plan)
        copies: dict[str, list[list[_Planned]]] = {}
        for (backend_name, _), plans in merged.items():
            copies.setdefault(backend_name, []).append(plans)
        for backend_name, variants in copies.items():
            backend = self.backends[backend_name]
            assert backend.section is not None
            if len(variants) > 1:
                self.skip(
                    backend.section.header,
                    f"backend {backend_name}: {len(variants)} virtual servers, one for each "
                    "way its frontends' addresses take clients ("
                    + "; ".join(_variant(plans) for plans in variants)
                    + "): each has its own server limits (maxconn) and balancing state, "
                    "which HAProxy shares",
                )
            for index, plans in enumerate(variants):
                self.build_virtual_server(backend_name, plans, index)

    def build_virtual_server(self, backend_name: str, plans: list[_Planned], index: int) -> None:
        backend = self.backends[backend_name]
        first = plans[0]
        section = first.frontend.section
        assert section is not None and backend.section is not None
        listen: list[str] = []
        for plan in plans:
            listen.extend(a for a in plan.listen if a not in listen)
        if index == 0:
            name = self.vs_name(backend_name)
        elif first.split:
            name = self.vs_name(f"{backend_name}-{_ports(first.listen)[0]}")
        else:
            name = self.vs_name(f"{backend_name}-{section.name}")
        vs: dict[str, Any] = {"name": name, "listen": listen if len(listen) > 1 else listen[0]}
        if first.names:
            vs["sni"] = list(first.names)
        if first.alpn:
            vs["alpn"] = list(first.alpn)
        ports = _ports(listen)
        port = ports[0] if len(ports) == 1 else None
        self.back_settings(backend, vs, first.front, port, first.frontend.timeouts.get("client"))
        if vs["real_servers"]:
            self.translation.virtual_servers.append(vs)
        else:
            self.vs_names.discard(vs["name"])
            self.skip(backend.section.header, f"{backend_name}: no server lbproxy can use")

    def listen_addresses(self, proxy: _Proxy) -> list[tuple[str, bool]]:
        """The addresses of the binds, each with whether it takes a PROXY header."""
        addresses: list[tuple[str, bool]] = []
        for st in proxy.binds:
            if len(st.words) < 2:
                self.skip(st, f"{st.text} (no address)")
                continue
            found: list[str] = []
            for part in st.words[1].split(","):
                parsed = _host_port(part)
                if parsed is None or not parsed[1]:
                    self.skip(st, f"bind {part} (not an IP:PORT lbproxy can listen on)")
                    continue
                host, port = parsed
                host = "0.0.0.0" if host in ("", "*") else host
                ports = _port_range(port)
                if ports is None:
                    self.skip(st, f"bind {part} (port {port})")
                    continue
                try:
                    ip = ipaddress.ip_address(host)
                except ValueError:
                    self.skip(st, f"bind {part} (lbproxy listens on an IP address)")
                    continue
                for number in ports:
                    owner = self.bound_by(ip, number, proxy)
                    if owner is not None:
                        self.skip(st, f"bind {_address(host, number)} (also bound by {owner})")
                    else:
                        found.append(_address(host, number))
                        self.bound.append((ip, number, proxy))
            options = list(st.words[2:])
            accept_proxy = "accept-proxy" in options
            if found:
                taken = {a for a, _ in addresses}
                addresses.extend((a, accept_proxy) for a in found if a not in taken)
                self.use(st)
            i = 0
            while i < len(options):
                word = options[i]
                if word == "accept-proxy":
                    proxy.accept_proxy_binds.append(st)
                    i += 1
                    continue
                takes_value = word in _BIND_VALUED
                what = f"bind option {word}" + (
                    f" {options[i + 1]}" if takes_value and i + 1 < len(options) else ""
                )
                if word == "ssl":
                    what = "bind ... ssl (TLS termination: lbproxy passes TLS through)"
                elif found:
                    what += f" (the address {st.words[1]} is translated without it)"
                self.skip(st, what)
                i += 2 if takes_value else 1
        return addresses

    def bound_by(self, ip: IPAddress, port: int, proxy: _Proxy) -> str | None:
        """The proxy that already listens where binding `ip:port` would fail."""
        for other_ip, other_port, other in self.bound:
            if other_port != port or other_ip.version != ip.version:
                continue
            if other_ip == ip or other_ip.is_unspecified or ip.is_unspecified:
                section = other.section
                return f"{section.kind} {section.name}" if section else "another proxy"
        return None

    def admin_elsewhere(self) -> None:
        """lbproxy's admin endpoint (127.0.0.1:9100 by default) on a port no virtual
        server took."""
        port = 9100
        loopback = ipaddress.ip_address("127.0.0.1")
        while any(
            p == port and ip.version == 4 and (ip == loopback or ip.is_unspecified)
            for ip, p, _ in self.bound
        ):
            port += 1
        if port != 9100:
            settings = self.translation.settings.setdefault("global", {})
            settings["admin"] = {"listen": f"127.0.0.1:{port}"}

    def front_settings(self, proxy: _Proxy, front: dict[str, Any]) -> None:
        self.connection_rules(proxy, front)
        if proxy.maxconn is not None:
            front["max_connections"] = proxy.maxconn[0]
            self.use(proxy.maxconn[1])

    def connection_rules(self, proxy: _Proxy, front: dict[str, Any]) -> None:
        allow: list[str] = []  # accepted so far
        deny: list[str] = []
        final_allow: list[str] | None = None
        accepted_any = False
        done: Statement | None = None
        for st in proxy.connection_rules:
            words = list(st.words[2:])
            if done is not None:
                self.skip(st, f"{st.text} (never reached after line {done.line})")
                continue
            if words[:2] == ["expect-proxy", "layer4"]:
                if self.expect_proxy(proxy, front, st, words[2:]):
                    continue
                self.skip(st, st.text)
                continue
            if not words or words[0] not in ("accept", "reject"):
                self.skip(st, st.text)
                continue
            action = words[0]
            if len(words) == 1:
                final_allow = list(allow) if action == "reject" else None
                self.use(st)
                done = st
                continue
            groups = _condition(words[1:], proxy.acls)
            if isinstance(groups, str):
                self.skip(st, f"{st.text} ({groups})")
                continue
            terms = [group[0] for group in groups if len(group) == 1]
            if len(terms) != len(groups) or len({t.negated for t in terms}) != 1:
                self.skip(st, f"{st.text} (only a list of src ACLs, all negated or none)")
                continue
            networks: list[str] = []
            why = ""
            for term in terms:
                found = _src_networks(term, self.read)
                if isinstance(found, str):
                    why = found
                    break
                networks.extend(found)
            if why:
                self.skip(st, f"{st.text} ({why})")
                continue
            negated = terms[0].negated
            if action == "reject" and not negated:
                if accepted_any:
                    self.skip(
                        st, f"{st.text} (a reject after an accept: lbproxy's deny wins over allow)"
                    )
                    continue
                deny.extend(n for n in networks if n not in deny)
            elif action == "reject":
                final_allow = allow + [n for n in networks if n not in allow]
                done = st
            elif not negated:
                allow.extend(n for n in networks if n not in allow)
                accepted_any = True
            else:
                self.skip(st, f"{st.text} (accept if !...: write it as reject if ...)")
                continue
            self.use(st, *self.acl_lines(proxy, terms))
        if final_allow is not None:
            front["allow"] = final_allow
        if deny:
            front["deny"] = deny

    def acl_lines(self, proxy: _Proxy, terms: list[_Term]) -> list[Statement]:
        lines: list[Statement] = []
        for name, patterns in proxy.acls.items():
            if any(term.patterns == tuple(patterns) for term in terms):
                lines.extend(proxy.acl_statements.get(name, []))
        return lines

    def expect_proxy(
        self, proxy: _Proxy, front: dict[str, Any], st: Statement, rest: list[str]
    ) -> bool:
        if not rest:
            front["accept_proxy"] = True
            self.use(st)
            return True
        groups = _condition(rest, proxy.acls)
        if isinstance(groups, str) or any(len(g) != 1 or g[0].negated for g in groups):
            return False
        networks: list[str] = []
        for group in groups:
            found = _src_networks(group[0], self.read)
            if isinstance(found, str):
                return False
            networks.extend(found)
        front["accept_proxy"] = True
        front["accept_proxy_from"] = networks
        self.use(st, *self.acl_lines(proxy, [g[0] for g in groups]))
        return True

    def sni_idiom(self, proxy: _Proxy) -> None:
        """`tcp-request inspect-delay` and `content accept if { req.ssl_hello_type 1 }`:
        what lbproxy's SNI pre-read does by itself."""
        if proxy.inspect_delay is not None:
            self.use(proxy.inspect_delay)
        for st in proxy.content_rules:
            words = list(st.words[2:])
            groups = _condition(words[1:], proxy.acls) if words[:1] == ["accept"] else "other"
            if (
                not isinstance(groups, str)
                and len(groups) == 1
                and len(groups[0]) == 1
                and not groups[0][0].negated
                and all(p.fetch in _HELLO_FETCHES for p in groups[0][0].patterns)
            ):
                self.use(st, *self.acl_lines(proxy, groups[0]))
            else:
                self.skip(st, st.text)

    def routes(self, proxy: _Proxy) -> list[_Route]:
        section = proxy.section
        assert section is not None
        routes: dict[str, _Route] = {}
        map_default: _Route | None = None
        for st in proxy.use_backends:
            words = list(st.words)
            if len(words) < 2:
                self.skip(st, st.text)
                continue
            if words[1].startswith("%[") and len(words) == 2:
                found = self.sni_map(st, words[1], routes)
                if found is not None and map_default is None:
                    map_default = found
                continue
            backend = words[1]
            if backend not in self.backends:
                self.skip(st, f"{st.text} (no backend {backend})")
                continue
            if len(words) == 2:
                self.skip(st, f"{st.text} (unconditional: write it as default_backend)")
                continue
            groups = _condition(words[2:], proxy.acls)
            if not isinstance(groups, str) and _alpn_condition(groups):
                self.alpn_route(st, backend, groups, routes, proxy)
                continue
            names = _sni_names(groups, self.read) if not isinstance(groups, str) else groups
            if isinstance(names, str):
                self.skip(st, f"{st.text} ({names})")
                continue
            if any(route.alpn for route in routes.values()):
                # HAProxy tries its rules in order; lbproxy tries a name's own routes
                # before the protocols of no name: only req.ssl_alpn rules after every
                # req.ssl_sni rule keep their meaning.
                self.skip(
                    st,
                    f"{st.text} (after a req.ssl_alpn rule, which HAProxy tries first and "
                    "lbproxy after a name's own routes)",
                )
                continue
            taken = {name for route in routes.values() for name in route.names}
            route = routes.setdefault(backend, _Route(backend, [], []))
            # the first rule naming a server name wins, as in HAProxy
            route.names.extend(n for n in names if n not in taken and n not in route.names)
            route.statements.append(st)
            assert not isinstance(groups, str)
            route.statements.extend(self.acl_lines(proxy, [t for g in groups for t in g]))
        default = proxy.default_backend
        if map_default is not None and map_default.backend:
            if default is not None:
                self.skip(default, f"{default.text} (the map's default comes first)")
            if map_default.backend not in routes:
                routes[map_default.backend] = map_default
            default = None
        result = list(routes.values())
        if section.kind == "listen" and proxy.servers:
            if section.name not in routes:
                result.append(_Route(section.name, [], []))
            if default is not None:
                self.skip(default, f"{default.text} (the listen section has servers)")
        elif default is not None:
            name = default.words[1]
            if name not in self.backends:
                self.skip(default, f"{default.text} (no backend {name})")
            elif name in routes:
                self.skip(default, f"{default.text} (also an SNI route: lbproxy gives it one)")
            else:
                result.append(_Route(name, [], [default]))
        return result

    def alpn_route(
        self,
        st: Statement,
        backend: str,
        groups: list[list[_Term]],
        routes: dict[str, _Route],
        proxy: _Proxy,
    ) -> None:
        """`use_backend B if { req.ssl_alpn X }`: B's virtual server gets `alpn: [X]`
        (without `sni`: any name, after the names' own routes)."""
        protocols = _alpn_names(groups)
        if isinstance(protocols, str):
            self.skip(st, f"{st.text} ({protocols})")
            return
        long = next((p for p in protocols if len(p.encode()) > 255), None)
        if long is not None:
            self.skip(st, f"{st.text} (an ALPN protocol name is at most 255 bytes)")
            return
        route = routes.get(backend)
        if route is not None and route.names:
            self.skip(
                st,
                f"{st.text} (backend {backend} has req.ssl_sni routes too: lbproxy's alpn "
                "would apply only with its sni names)",
            )
            return
        taken = {p for other in routes.values() for p in other.alpn}
        route = routes.setdefault(backend, _Route(backend, [], []))
        # the first rule naming a protocol wins, as in HAProxy
        route.alpn.extend(p for p in protocols if p not in taken and p not in route.alpn)
        route.statements.append(st)
        route.statements.extend(self.acl_lines(proxy, [t for g in groups for t in g]))

    def sni_map(self, st: Statement, expression: str, routes: dict[str, _Route]) -> _Route | None:
        """`use_backend %[req.ssl_sni,lower,map(FILE[,DEFAULT])]`: each `NAME BACKEND` line
        of the map an SNI route (lbproxy matches any case, as `lower` makes HAProxy do);
        the route of the map's default (no backend: none given), or None when it cannot
        be read."""
        match = _SNI_MAP.match(expression)
        if match is None:
            self.skip(st, f"{st.text} (lbproxy routes on req.ssl_sni through a map(FILE,DEFAULT))")
            return None
        converter, name, fallback = match.group(2), match.group(3), match.group(4)
        if converter not in ("map", "map_str"):
            self.skip(st, f"{st.text} ({converter}: lbproxy matches whole names)")
            return None
        content = self.read(name)
        if content is None:
            self.skip(st, f"{st.text} (the map {name} cannot be read)")
            return None
        self.use(st)
        taken = {n for route in routes.values() for n in route.names}
        for number, line in enumerate(content.splitlines(), start=1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            key, backend = fields[0].lower(), " ".join(fields[1:])
            if backend not in self.backends:
                why = "no backend" if not backend else f"no backend {backend}"
                self.skip(st, f"{name}:{number}: {line.strip()} ({why})")
                continue
            if key in taken:
                continue  # the first line naming a server name wins, as in HAProxy
            taken.add(key)
            route = routes.setdefault(backend, _Route(backend, [], []))
            route.names.append(key)
            if st not in route.statements:
                route.statements.append(st)
        if fallback is None:
            return _Route("", [], [])
        if fallback not in self.backends:
            self.skip(st, f"{st.text} (no backend {fallback})")
            return None
        return _Route(fallback, [], [st])

    def vs_name(self, wanted: str) -> str:
        name = _name(wanted)
        while name in self.vs_names:
            name += "-2"
        self.vs_names.add(name)
        return name

    # backends

    def back_settings(
        self,
        backend: _Proxy,
        vs: dict[str, Any],
        front: dict[str, Any],
        port: str | None,
        client_timeout: tuple[float, Statement] | None,
    ) -> None:
        """The backend's part of a virtual server (`front`: the frontend's keys, `port`
        its one listen port if it has one, `client_timeout` its `timeout client`)."""
        section = backend.section
        assert section is not None
        self.use(section.header, backend.mode[1] if backend.mode else None)
        scheduler = "wrr"
        if backend.balance is not None:
            words = backend.balance.words
            if words[1] in _BALANCE:
                scheduler = _BALANCE[words[1]]
                self.use(backend.balance)
                if len(words) > 2:
                    self.skip(backend.balance, f"{backend.balance.text} (its arguments)")
            else:
                self.skip(backend.balance, f"{backend.balance.text} (another algorithm)")
        vs["scheduler"] = scheduler
        if scheduler == "maglev":
            vs["hash_key"] = "source"
            self.use(backend.hash_type)
        elif backend.hash_type is not None:
            self.skip(backend.hash_type, f"{backend.hash_type.text} (only with balance source)")
        for key in ("accept_proxy", "accept_proxy_from", "allow", "deny"):
            if key in front:
                vs[key] = _copy(front[key])
        servers = self.real_servers(backend, port)
        self.server_wide(backend, vs, servers)
        if "max_connections" in front:
            vs["max_connections"] = front["max_connections"]
        timeouts = backend.timeouts
        if "connect" in timeouts:
            vs["connect_timeout"] = _duration(timeouts["connect"][0])
            self.use(timeouts["connect"][1])
        idle = timeouts.get("tunnel")
        if idle is None:
            # `timeout client` is the frontend's, `timeout server` the backend's
            sides = [t for t in (client_timeout, timeouts.get("server")) if t is not None]
            if sides:
                idle = max(sides, key=lambda t: t[0])
                self.use(*(t[1] for t in sides))
        if idle is not None:
            if idle[0] > 0:
                vs["idle_timeout"] = _duration(idle[0])
                self.use(idle[1])
            else:
                self.skip(idle[1], f"{idle[1].text} (0: no timeout)")
        retries = backend.retries[0] if backend.retries else 3
        vs["retries"] = retries
        self.use(backend.retries[1] if backend.retries else None, backend.redispatch)
        for name in ("client-fin", "server-fin", "http-request", "http-keep-alive", "tarpit"):
            if name in timeouts:
                self.skip(timeouts[name][1], timeouts[name][1].text)
        self.backups(backend, servers)
        self.health(backend, vs, servers)
        kept = {rs["name"] for rs in servers}
        self.agent(vs, [s for s in backend.servers if _name(s.name) in kept], servers)
        self.persistence(backend, vs)
        if any("max_connections" in s for s in servers):
            queue_timeout = timeouts.get("queue") or timeouts.get("connect")
            vs["queue"] = {"timeout": _duration(queue_timeout[0])} if queue_timeout else {}
            if queue_timeout is not None:
                self.use(queue_timeout[1])
            if backend.abortonclose is not None:
                vs["queue"]["abort_on_close"] = True
        # without a full server nothing queues: the option has nothing to drop
        self.use(backend.abortonclose)
        vs["real_servers"] = servers

    def real_servers(self, backend: _Proxy, port: str | None) -> list[dict[str, Any]]:
        servers: list[dict[str, Any]] = []
        names: set[str] = set()
        for server in backend.servers:
            st = server.statement
            parsed = _host_port(server.address)
            if parsed is None:
                self.skip(st, f"server {server.name} {server.address} (not a TCP address)")
                continue
            host, server_port = parsed
            if not server_port:
                if port is None:
                    self.skip(st, f"server {server.name} without a port (the frontend has several)")
                    continue
                server_port = port
            if not server_port.isdigit() or not 0 < int(server_port) < 65536:
                self.skip(st, f"server {server.name} port {server_port}")
                continue
            name = _name(server.name)
            while name in names:
                name += "-2"
            names.add(name)
            rs: dict[str, Any] = {"name": name, "address": _address(host, int(server_port))}
            self.use(st)
            self.server_options_to(server, rs)
            servers.append(rs)
        return servers

    def server_options_to(self, server: _Server, rs: dict[str, Any]) -> None:
        handled = {
            "check", "inter", "rise", "fall", "send-proxy", "send-proxy-v2", "slowstart",
            "agent-check", "agent-port", "agent-inter", "agent-addr", "agent-send",
            "on-marked-down", "on-marked-up",
        }  # fmt: skip
        for key, (value, st) in server.options.items():
            if key == "weight" and value is not None and value.isdigit():
                rs["weight"] = int(value)
                self.use(st)
            elif key == "maxconn" and value is not None and value.isdigit():
                if int(value) > 0:
                    rs["max_connections"] = int(value)
                self.use(st)
            elif key == "backup":
                rs["backup"] = True
                self.use(st)
            elif key == "disabled":
                rs["state"] = "disabled"
                self.use(st)
            elif key == "port" and value is not None:
                if value.isdigit() and 0 < int(value) < 65536:
                    rs.setdefault("health_check", {})["port"] = int(value)
                    self.use(st)
                else:
                    self.skip(st, f"server {server.name} port {value}")
            elif key == "addr" and value is not None:
                rs.setdefault("health_check", {})["address"] = value
                self.use(st)
            elif key == "check-send-proxy":
                rs.setdefault("health_check", {})["send_proxy"] = True
                self.use(st)
            elif key in handled or key in _SERVER_FLAGS_IGNORED or key.startswith("no-"):
                continue
            else:
                shown = f"{key} {value}" if value is not None else key
                self.skip(st, f"server {server.name} ... {shown}")

    def backups(self, backend: _Proxy, servers: list[dict[str, Any]]) -> None:
        """HAProxy sends to its first backup only, unless `option allbackups`; lbproxy
        schedules over every backup."""
        backups = [rs["name"] for rs in servers if rs.get("backup")]
        if backend.allbackups is not None:
            if backups:
                self.use(backend.allbackups)
            return
        for server in backend.servers:
            if _name(server.name) in backups[1:]:
                self.skip(
                    server.options["backup"][1],
                    f"server {server.name} backup (HAProxy uses only the first backup "
                    "without option allbackups; lbproxy uses them all)",
                )

    def server_wide(
        self, backend: _Proxy, vs: dict[str, Any], servers: list[dict[str, Any]]
    ) -> None:
        """Per-server options lbproxy holds once per virtual server: the first server's
        value, and a line for each server that says otherwise."""
        kept = {rs["name"] for rs in servers}
        chosen = [s for s in backend.servers if _name(s.name) in kept]
        proxy_of: dict[str, str] = {}
        for server in chosen:
            if "send-proxy-v2" in server.options:
                proxy_of[server.name] = "v2"
            elif "send-proxy" in server.options:
                proxy_of[server.name] = "v1"
            else:
                proxy_of[server.name] = "none"
        self.one_value(vs, "send_proxy", chosen, proxy_of, ("send-proxy-v2", "send-proxy"), "none")
        if vs["scheduler"] not in schedulers.reading("slow_start"):
            # `first` reads no weight: lbproxy would refuse a slow_start it cannot ramp.
            for server in chosen:
                if "slowstart" in server.options:
                    self.skip(
                        server.options["slowstart"][1],
                        f"server {server.name}: slowstart (scheduler {vs['scheduler']} "
                        "reads no weight to ramp)",
                    )
            return
        slow: dict[str, str] = {}
        for server in chosen:
            value = server.options.get("slowstart", (None, None))[0]
            ms = _time_ms(value) if value is not None else 0
            slow[server.name] = _duration(ms) if ms else "0s"
        self.one_value(vs, "slow_start", chosen, slow, ("slowstart",), "0s")

    def one_value(
        self,
        vs: dict[str, Any],
        key: str,
        servers: list[_Server],
        values: dict[str, str],
        options: tuple[str, ...],
        default: str,
    ) -> None:
        if not servers:
            return
        first = values[servers[0].name]
        if first != default:
            vs[key] = first
        for server in servers:
            where = next(
                (server.options[o][1] for o in options if o in server.options), server.statement
            )
            if values[server.name] == first:
                if values[server.name] != default:
                    self.use(where)
            else:
                self.skip(
                    where,
                    f"server {server.name}: {key} {values[server.name]} (lbproxy has one "
                    f"per virtual server: {first})",
                )

    def health(self, backend: _Proxy, vs: dict[str, Any], servers: list[dict[str, Any]]) -> None:
        kept = {rs["name"] for rs in servers}
        chosen = [s for s in backend.servers if _name(s.name) in kept]
        checked = [s for s in chosen if "check" in s.options]
        if not checked:
            vs["health_check"] = {"type": "none"}
            for st in backend.tcp_checks + backend.http_checks:
                self.skip(st, f"{st.text} (no server has `check`)")
            if backend.check_option is not None:
                self.skip(
                    backend.check_option, f"{backend.check_option.text} (no server has `check`)"
                )
            return
        check: dict[str, Any] = {"type": "tcp"}
        self.check_type(backend, check)
        first = checked[0]
        for key, option, read in (
            ("interval", "inter", _time_ms),
            ("rise", "rise", _count),
            ("fall", "fall", _count),
        ):
            values: dict[str, tuple[str | None, Statement | None]] = {
                s.name: s.options.get(option, (None, None)) for s in checked
            }
            value, source = values[first.name]
            parsed = read(value) if value is not None else None
            if parsed:
                check[key] = _duration(parsed) if key == "interval" else int(parsed)
                self.use(source)
            for server in checked[1:]:
                other, where = values[server.name]
                if other != value and where is not None:
                    self.skip(where, f"server {server.name} {option} {other} (lbproxy: {value})")
        for key, option, value, lbproxy in (
            ("on_down", "on-marked-down", "shutdown-sessions", "close"),
            ("on_up", "on-marked-up", "shutdown-backup-sessions", "close_backups"),
        ):
            said = {s.name: s.options.get(option, (None, None)) for s in checked}
            wanted = said[first.name][0] == value
            if wanted:
                check[key] = lbproxy
            for server in checked:
                given, where = said[server.name]
                if where is None:
                    continue
                if given == value and wanted:
                    self.use(where)
                else:
                    self.skip(where, f"server {server.name} ... {option} {given}")
        if "check" in backend.timeouts:
            check["timeout"] = _duration(backend.timeouts["check"][0])
            self.use(backend.timeouts["check"][1])
        else:
            # HAProxy's check waits `inter` in all, its connect at most `timeout connect`
            inter = _time_ms(first.options.get("inter", ("2s", None))[0] or "2s") or 2000
            connect = backend.timeouts.get("connect", (inter, None))[0]
            if min(inter, connect) != 1000:
                check["timeout"] = _duration(min(inter, connect))
        for server in checked:
            self.use(server.options["check"][1])
        for server in chosen:
            if server not in checked:
                self.skip(
                    server.statement,
                    f"server {server.name} without check (lbproxy checks every server of "
                    "the virtual server)",
                )
        vs["health_check"] = check

    def check_type(self, backend: _Proxy, check: dict[str, Any]) -> None:
        option = backend.check_option
        if option is None:
            for st in backend.tcp_checks + backend.http_checks:
                self.skip(st, f"{st.text} (without option tcp-check / httpchk)")
            return
        kind, args = option.words[1], list(option.words[2:])
        self.use(option)
        if kind == "tcp-check":
            self.tcp_check(backend.tcp_checks, check)
        elif kind == "pgsql-check":
            check["type"] = "pgsql"
            if args[:1] == ["user"] and len(args) >= 2:
                check["user"] = args[1]
        elif kind == "mysql-check":
            check["type"] = "mysql"
            if args[:1] == ["user"] and len(args) >= 2:
                check["user"] = args[1]
        elif kind == "redis-check":
            check["type"] = "redis"
        elif kind == "smtpchk":
            check["type"] = "smtp"
            if len(args) >= 2 and args[0].upper() in ("EHLO", "HELO"):
                check["helo"] = args[1]
                if args[0].upper() == "HELO":
                    self.skip(option, f"{option.text} (lbproxy's smtp check says EHLO)")
        elif kind == "ssl-hello-chk":
            check["type"] = "tls"
        elif kind == "httpchk":
            self.http_check(backend, args, check)
        else:
            self.used.discard((option.file, option.line))
            self.skip(option, f"{option.text} (checked by connect instead)")
        if kind != "tcp-check":
            for st in backend.tcp_checks:
                self.skip(st, f"{st.text} (option {kind} is the check)")
        if kind != "httpchk":
            for st in backend.http_checks:
                self.skip(st, f"{st.text} (option {kind} is the check)")

    def http_check(self, backend: _Proxy, args: list[str], check: dict[str, Any]) -> None:
        """`option httpchk [[METHOD] URI [VERSION]]` (HAProxy sends `OPTIONS / HTTP/1.0`
        by default; headers ride on the version, after `\\r\\n`) and `http-check`."""
        option = backend.check_option
        assert option is not None
        check["type"] = "http"
        if len(args) <= 1:
            args = ["OPTIONS", args[0] if args else "/"]
        check["method"] = args[0].upper()
        if args[1].startswith("/"):
            if args[1] != "/":
                check["path"] = args[1]
        else:
            self.skip(option, f"{option.text} (the URI {args[1]}: lbproxy asks for a path)")
        if len(args) >= 3:
            version, *headers = args[2].split("\r\n")
            self.request_extras(option, check, version, [h.partition(":") for h in headers])
        for st in backend.http_checks:
            words = list(st.words[1:])
            if words[:2] == ["expect", "status"] and len(words) == 3 and words[2].isdigit():
                check["expect_status"] = int(words[2])
                self.use(st)
            elif words[:1] == ["expect"] and len(words) == 3 and words[1] in ("string", "rstring"):
                pattern = words[2]
                check["expect_body"] = re.escape(pattern) if words[1] == "string" else pattern
                self.use(st)
            elif words[:1] == ["send"]:
                self.http_send(st, words[1:], check)
            else:
                self.skip(st, st.text)

    def http_send(self, st: Statement, words: list[str], check: dict[str, Any]) -> None:
        """`http-check send [meth M] [uri U] [ver V] [hdr NAME VALUE]...`."""
        headers: list[tuple[str, str, str]] = []
        version = ""
        i = 0
        while i + 1 < len(words):
            key, value = words[i], words[i + 1]
            if key == "meth":
                check["method"] = value.upper()
            elif key == "uri" and value.startswith("/"):
                check["path"] = value
            elif key == "ver":
                version = value
            elif key == "hdr" and i + 2 < len(words):
                headers.append((value, ":", words[i + 2]))
                i += 1
            else:
                self.skip(st, f"http-check send ... {key} {value}")
            i += 2
        if i < len(words):
            self.skip(st, f"http-check send ... {words[i]}")
        if check.get("path") == "/":
            del check["path"]
        self.use(st)
        self.request_extras(st, check, version, headers)

    def request_extras(
        self,
        st: Statement,
        check: dict[str, Any],
        version: str,
        headers: list[tuple[str, str, str]],
    ) -> None:
        """An HTTP check's version and headers: a Host header is lbproxy's `host`; the
        rest is named (lbproxy's check speaks HTTP/1.1 with its own headers)."""
        if version and version.upper() != "HTTP/1.1":
            self.skip(st, f"the check's HTTP version {version} (lbproxy's: HTTP/1.1)")
        for name, sep, value in headers:
            if sep and name.strip().lower() == "host" and value.strip():
                check["host"] = value.strip()
            elif name.strip():
                self.skip(st, f"the check's header {name.strip()}{sep} {value.strip()}".rstrip())

    def tcp_check(self, rules: list[Statement], check: dict[str, Any]) -> None:
        """A `tcp-check` sequence as one of lbproxy's check types."""
        if not rules:
            return
        # a message is often written over several sends in a row: one message each run
        runs = _send_runs(rules)
        sends = [(run[0], data) for kind, data, run in runs if kind == "send"]
        binaries = [(run[0], data) for kind, data, run in runs if kind == "send-binary"]
        expects = [st for st in rules if _second(st) == "expect"]
        connects = [st for st in rules if _second(st) == "connect"]
        comments = [st for st in rules if _second(st) == "comment"]
        self.use(*comments)
        text = " ".join(value for _, value in sends).lower()
        patterns = [(parsed[2] if (parsed := _tcp_expect(st)) else "") for st in expects]
        expected = " ".join(patterns)
        role = re.search(r"role:(master|slave|replica)", expected)
        matched: list[Statement] = []
        if "ping" in text and "info replication" in text and role is not None:
            check["type"] = "redis"
            check["role"] = "master" if role.group(1) == "master" else "replica"
            matched = [*rules]
            if "auth " in text:
                auth = next(st for st, value in sends if value.lower().startswith("auth "))
                self.skip(auth, "tcp-check send AUTH ... (use health_check.password_file)")
                matched.remove(auth)
        elif binaries and _pgsql_user(binaries[0][1]) is not None:
            check["type"] = "pgsql"
            check["user"] = _pgsql_user(binaries[0][1])
            matched = [*rules]
        elif binaries and _mysql_user(binaries[0][1]) is not None:
            check["type"] = "mysql"
            check["user"] = _mysql_user(binaries[0][1])
            matched = [*rules]
            packet = bytes.fromhex(binaries[0][1])
            declared = int.from_bytes(packet[:3], "little")
            if declared != len(packet) - 4:
                self.skip(
                    binaries[0][0],
                    f"tcp-check send-binary ... (its MySQL packet says {declared} bytes and "
                    f"holds {len(packet) - 4}: HAProxy's check waits for the rest; lbproxy's "
                    "mysql check sends a whole one)",
                )
        elif any("220" in pattern for pattern in patterns[:1]) and any(
            value.upper().startswith(("EHLO", "HELO")) for _, value in sends
        ):
            check["type"] = "smtp"
            helo = next(v for _, v in sends if v.upper().startswith(("EHLO", "HELO"))).split()
            if len(helo) > 1:
                check["helo"] = helo[1].strip()
            matched = [*rules]
        else:
            matched = self.send_expect(rules, check)
        for st in connects:
            words = list(st.words[2:])
            if words[:1] == ["port"] and len(words) == 2 and words[1].isdigit():
                check["port"] = int(words[1])
                if st not in matched:
                    matched.append(st)
            elif words:
                self.skip(st, f"{st.text} (lbproxy checks connect plainly)")
                if st in matched:
                    matched.remove(st)
            elif st not in matched:
                matched.append(st)
        self.use(*matched)
        for st in rules:
            named = any(key[:2] == (st.file, st.line) for key in self.left)
            if st not in matched and st not in comments and not named:
                self.skip(st, f"{st.text} (lbproxy's check: the first send and expect)")

    def send_expect(self, rules: list[Statement], check: dict[str, Any]) -> list[Statement]:
        matched: list[Statement] = []
        runs = _send_runs(rules)
        expect = next((st for st in rules if _second(st) == "expect"), None)
        if not runs and expect is None:
            return [st for st in rules if _second(st) == "connect"]
        if runs:
            kind, data, sent = runs[0]
            if kind == "send":
                check["send"] = data.replace("\\", "\\\\")
            else:
                check["send_hex"] = data
            matched.extend(sent)
        parsed = _tcp_expect(expect) if expect is not None else None
        if expect is not None and parsed is not None:
            negated, kind, pattern = parsed
            if not negated and kind in ("string", "rstring", "binary"):
                key = {"string": "expect", "rstring": "expect", "binary": "expect_hex"}[kind]
                check[key] = re.escape(pattern) if kind == "string" else pattern
                matched.append(expect)
        if "expect" not in check and "expect_hex" not in check:
            check["expect"] = "."  # send_expect needs something to find: any answer
        check["type"] = "send_expect"
        return matched

    def agent(
        self, vs: dict[str, Any], servers: list[_Server], rs_list: list[dict[str, Any]]
    ) -> None:
        """`agent-check`: the virtual server's `agent_check` when every server has one,
        else each server's own `{port, address}` (lbproxy then asks only those, every
        2 s and sending nothing: other agent-inter and agent-send are named)."""
        agents = [s for s in servers if "agent-check" in s.options]
        if not agents:
            return
        ports = {s.name: _port(s.options.get("agent-port", (None, None))[0]) for s in agents}
        for server in [s for s in agents if ports[s.name] is None]:
            self.skip(
                server.options["agent-check"][1],
                f"server {server.name} agent-check without a valid agent-port",
            )
            agents.remove(server)
        if not agents:
            return
        everyone = len(agents) == len(servers)
        by_name = {rs["name"]: rs for rs in rs_list}
        block: dict[str, Any] = {}
        first = agents[0].options
        distinct = {ports[s.name] for s in agents}
        if everyone and len(distinct) == 1:
            block["port"] = distinct.pop()
        inter = first.get("agent-inter", (None, None))[0] if everyone else None
        inter_ms = _time_ms(inter) if inter is not None else None
        if inter_ms:
            block["interval"] = _duration(inter_ms)
        send = first.get("agent-send", (None, None))[0] if everyone else None
        if send:
            block["send"] = send.replace("\\", "\\\\")
        if everyone:
            vs["agent_check"] = block
        for server in agents:
            own: dict[str, Any] = {}
            if "port" not in block:
                own["port"] = ports[server.name]
            if "agent-addr" in server.options:
                own["address"] = server.options["agent-addr"][0]
            if own:
                by_name[_name(server.name)]["agent_check"] = own
            for key in ("agent-check", "agent-port", "agent-addr"):
                if key in server.options:
                    self.use(server.options[key][1])
            for key, lbproxy, default in (
                ("agent-inter", inter, "2s"),
                ("agent-send", send, None),
            ):
                value, where = server.options.get(key, (None, None))
                if where is None:
                    continue
                same = value == lbproxy or (
                    key == "agent-inter" and lbproxy is None and _time_ms(value or "") == 2000
                )
                if same:
                    self.use(where)
                else:
                    kept = lbproxy if lbproxy is not None else default or "nothing"
                    self.skip(
                        where,
                        f"server {server.name} {key} {value} (lbproxy's agents share one "
                        f"value per virtual server: {kept})",
                    )

    def persistence(self, backend: _Proxy, vs: dict[str, Any]) -> None:
        rules = backend.stick_rules
        table = backend.stick_table
        on_src = [
            st for st in rules
            if list(st.words[1:3]) in (["on", "src"], ["match", "src"], ["store-request", "src"])
            and len(st.words) == 3
        ]  # fmt: skip
        for st in rules:
            if st not in on_src:
                self.skip(st, f"{st.text} (lbproxy persists on the client address only)")
        kinds = {st.words[1] for st in on_src}
        # persistence is a lookup and a store: `stick on`, or `stick match` with
        # `stick store-request` (a store alone serves another backend's `table` lookups)
        sticks = "on" in kinds or {"match", "store-request"} <= kinds
        if table is None or not sticks:
            why = "no stick-table in this backend" if table is None else "no lookup and store"
            for st in on_src:
                self.skip(st, f"{st.text} ({why})")
            if table is not None:
                self.skip(table, f"{table.text} ({why})")
            return
        words = list(table.words[1:])
        options = dict(zip(words[::2], words[1::2], strict=False))
        if options.get("type") not in ("ip", "ipv6"):
            self.skip(table, f"{table.text} (lbproxy: a table of client addresses, stick on src)")
            return
        persistence: dict[str, Any] = {}
        expire = _time_ms(options["expire"]) if "expire" in options else None
        if expire:
            persistence["timeout"] = _duration(expire)
        size = _size(options["size"]) if "size" in options else None
        if size:
            persistence["max_entries"] = size
        for key in options:
            if key not in ("type", "size", "expire"):
                self.skip(table, f"stick-table {key} {options[key]}")
        vs["persistence"] = persistence
        self.use(table, *on_src)

    def report_unused_backends(self) -> None:
        for proxy in self.proxies:
            section = proxy.section
            if section and section.kind == "backend" and section.name not in self.routed:
                self.skip_section(section, f"backend {section.name}: no frontend uses it")


_BIND_VALUED = _words(
    """name id maxconn backlog interface mss nice process thread tcp-ut uid gid user group
    mode level severity-output namespace crt crt-list ca-file crl-file ciphers ciphersuites
    alpn npn curves ecdhe sigalgs ssl-min-ver ssl-max-ver verify tls-ticket-keys
    ca-sign-file ca-sign-pass shards label quic-cc-algo"""
)


def _port_range(text: str) -> list[int] | None:
    if text.isdigit():
        port = int(text)
        return [port] if 0 < port < 65536 else None
    low, sep, high = text.partition("-")
    if sep and low.isdigit() and high.isdigit():
        first, last = int(low), int(high)
        if 0 < first <= last < 65536 and last - first < _MAX_BIND_RANGE:
            return list(range(first, last + 1))
    return None


def _ports(listen: list[str]) -> list[str]:
    """The ports of listen addresses, each once, in order."""
    return list(dict.fromkeys(address.rsplit(":", 1)[1] for address in listen))


def _variant(plans: list[_Planned]) -> str:
    """A virtual server of a shared backend, for the line that names the copies."""
    frontends = ", ".join(
        dict.fromkeys(p.frontend.section.name for p in plans if p.frontend.section)
    )
    listen = ", ".join(dict.fromkeys(a for p in plans for a in p.listen))
    proxy = " with accept-proxy" if plans[0].front.get("accept_proxy") else ""
    return f"{frontends} on {listen}{proxy}"


def _copy(value: Any) -> Any:
    """A list of its own for each virtual server (YAML would write one shared list as
    an anchor and aliases)."""
    return list(value) if isinstance(value, list) else value


_EXPECT_OPTIONS = _words(
    "min-recv comment ok-status error-status tout-status on-success on-error status-code"
)


def _tcp_send(statement: Statement) -> tuple[str, str] | None:
    """`tcp-check send DATA [comment MSG]` (or send-binary): the kind and the data."""
    if _second(statement) in ("send", "send-binary") and len(statement.words) >= 3:
        return statement.words[1], statement.words[2]
    return None


def _tcp_expect(statement: Statement) -> tuple[bool, str, str] | None:
    """`tcp-check expect [options] [!] MATCH PATTERN [options]`: negated, match, pattern."""
    words = statement.words[2:]
    negated = False
    i = 0
    while i < len(words):
        word = words[i]
        if word in _EXPECT_OPTIONS:
            i += 2
        elif word == "!":
            negated = True
            i += 1
        elif i + 1 < len(words):
            return negated, word, words[i + 1]
        else:
            return None
    return None


def _second(statement: Statement) -> str:
    return statement.words[1] if len(statement.words) > 1 else ""


def _port(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() and 0 < int(text) < 65536 else None


def _count(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() and int(text) > 0 else None


def _send_runs(rules: list[Statement]) -> list[tuple[str, str, list[Statement]]]:
    """The sends of a sequence, those in a row of one kind joined (`send-binary 0000`
    then `send-binary 0025` is one message): kind, data, statements."""
    runs: list[tuple[str, str, list[Statement]]] = []
    previous = ""
    for st in rules:
        sent = _tcp_send(st)
        if sent is None:
            if _second(st) != "comment":
                previous = ""
            continue
        kind, data = sent
        if kind == previous:
            _, joined, statements = runs[-1]
            runs[-1] = (kind, joined + data, [*statements, st])
        else:
            runs.append((kind, data, [st]))
        previous = kind
    return runs


def _mysql_user(hex_text: str) -> str | None:
    """The user of a MySQL handshake response (the client's first packet, sequence 1)
    written as `tcp-check send-binary` hex, as `option mysql-check user U` sends it."""
    try:
        data = bytes.fromhex(hex_text)
    except ValueError:
        return None
    if len(data) < 10 or data[3] != 1:
        return None
    payload = data[4:]
    protocol_41 = int.from_bytes(payload[:2], "little") & 0x200
    # 4.1: flags (4), max packet (4), charset (1), 23 zeros; before: flags (2), max (3)
    user, nul, _ = payload[32 if protocol_41 else 5 :].partition(b"\x00")
    if not nul or not user:
        return None
    try:
        text = user.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text if text.isprintable() else None


def _pgsql_user(hex_text: str) -> str | None:
    """The user of a PostgreSQL StartupMessage written as `tcp-check send-binary` hex."""
    try:
        data = bytes.fromhex(hex_text)
    except ValueError:
        return None
    if len(data) < 9 or data[4:8] != b"\x00\x03\x00\x00":
        return None
    fields = data[8:].split(b"\x00")
    for key, value in zip(fields[::2], fields[1::2], strict=False):
        if key == b"user" and value:
            return value.decode("utf-8", "replace")
    return None


def _order(key: tuple[str, int, str]) -> tuple[str, int]:
    return key[0], key[1]
