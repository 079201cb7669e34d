"""Configuration: YAML virtual-server files -> frozen, typed objects.

PURE: no trio, no sockets, no clock. `load(paths)` reads every file, keeps the line of
every node (PyYAML's composed nodes carry `start_mark`), and reports *every* problem
at once as a `ConfigError` whose `problems` are `Problem(file, line, message)`.

The dataclasses below are the contract the rest of lbproxy reads; defaults are the ones
of SPEC §2 and §9 and the README's configuration reference. Below them: `parse_duration`
and `parse_address` (also for the CLI), the converters that check one value each, the
reading of each section into its dataclass, the checks across files (duplicate names,
port clashes, a single `global:`), `load`, and `summary` for `lbproxy check`.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    line: int  # 1-based
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


class ConfigError(Exception):
    """Raised by `load` with every problem found, in file and line order."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


@dataclass(frozen=True, slots=True)
class Address:
    host: str  # "127.0.0.1", "::1", "0.0.0.0", "::" or a host name (real servers only)
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class AdminConfig:
    listen: Address | None = Address("127.0.0.1", 9100)  # None: `listen: none`
    token_file: str | None = None


@dataclass(frozen=True, slots=True)
class DnsLocatorConfig:
    """`global.locator.dns`: the DNS face of the locator (SPEC §10)."""

    listen: Address = Address("127.0.0.1", 5353)  # UDP and TCP
    zone: str = "lb.internal."  # absolute, lower case, ending in a dot
    ttl: int = 0  # of every answer; 0 = ask again each time


@dataclass(frozen=True, slots=True)
class LocatorConfig:
    dns: DnsLocatorConfig | None = None  # None: no DNS locator


@dataclass(frozen=True, slots=True)
class GlobalConfig:
    admin: AdminConfig = AdminConfig()
    locator: LocatorConfig = LocatorConfig()
    log_format: str = "text"  # text | json
    drain_timeout: float = 30.0
    access_log: bool = False  # one INFO line per connection on logger lbproxy.access
    workers: int = 1  # `auto` is resolved to os.cpu_count() by the loader


@dataclass(frozen=True, slots=True)
class HealthCheckConfig:
    type: str = "tcp"  # tcp | send_expect | http | none
    interval: float = 2.0
    timeout: float = 1.0
    rise: int = 2
    fall: int = 3
    send: str | None = None  # send_expect
    expect: str | None = None  # send_expect: regular expression
    path: str = "/"  # http
    expect_status: tuple[int, ...] = (200,)  # http
    on_down: str = "keep"  # keep | close: what happens to established connections


@dataclass(frozen=True, slots=True)
class SnmpConfig:
    oid: str = "1.3.6.1.4.1.2021.10.1.5.1"
    version: str = "2c"  # "2c" | "3"
    community: str = "public"
    user: str | None = None
    auth_protocol: str = "SHA"  # SHA | SHA256 | MD5
    auth_key_file: str | None = None
    priv_protocol: str = "AES"  # AES | AES256 | DES
    priv_key_file: str | None = None
    host: str | None = None  # None: the real server's own address host
    port: int = 161
    interval: float = 5.0
    timeout: float = 1.0
    retries: int = 1
    on_no_answer: str = "zero"  # zero | hold | static
    stale_after: float | None = None  # None: 3 x interval
    smoothing: float = 1.0  # 0 < a <= 1
    max_value: int = 100


@dataclass(frozen=True, slots=True)
class ThrottleConfig:
    max_connections: int | None = None
    max_rate: float | None = None
    digg_factor: float = 2.0
    high_idle_timeout: float = 49.0
    min_idle_timeout: float = 1.0
    interval: float = 1.0


# The largest static weight, in the file and at run time (PATCH, `set-weight`): ipvsadm's
# bound ("the valid values of weight are 0 through to 65535"), and a DNS SRV weight's.
MAX_WEIGHT = 65535


@dataclass(frozen=True, slots=True)
class PersistenceConfig:
    timeout: float = 300.0  # an entry expires this long after its last connection ended
    max_entries: int = 100000  # least recently used entries beyond this are evicted


@dataclass(frozen=True, slots=True)
class QueueConfig:
    max: int = 1000  # waiting clients; one more is refused (queue_full)
    timeout: float = 5.0  # seconds a client may wait for a free slot (queue_timeout)


@dataclass(frozen=True, slots=True)
class ConditioningConfig:
    """`conditioning:` of a virtual server: Geode's load conditioning (SPEC §11)."""

    interval: float = 300.0  # Geode's load-conditioning-interval default, 5 minutes
    idle_for: float = 30.0  # only connections idle this long are candidates
    max_per_interval: int = 10  # at most this many closed per interval
    threshold: float = 10.0  # Geode's locator-load-imbalance-threshold


# Geode's default imbalance threshold, for `?current=` on a virtual server that has no
# `conditioning:` block (LocatorLoadSnapshot.DEFAULT_LOAD_IMBALANCE_THRESHOLD).
DEFAULT_IMBALANCE_THRESHOLD = 10.0


@dataclass(frozen=True, slots=True)
class RealServerConfig:
    name: str
    address: Address
    weight: int = 1
    max_connections: int = 0  # 0 = unlimited
    load_factor: float = 1.0
    state: str = "enabled"  # enabled | drain | disabled
    backup: bool = False  # takes connections only while no primary is online (SPEC §13)
    snmp: SnmpConfig | None = None  # the VS block merged with this server's overrides
    line: int = field(default=0, compare=False)  # where, not what: moving lines is no change
    discovered: bool = False  # made from a DNS answer (discovery.dns), not read from a file


@dataclass(frozen=True, slots=True)
class DnsDiscoveryConfig:
    """`discovery.dns` of a virtual server (SPEC §14): real servers from SRV/A/AAAA."""

    name: str  # resolved as an absolute name: no search domains
    type: str = "SRV"  # SRV | A | AAAA
    port: int | None = None  # A/AAAA only (required there); SRV records carry their port
    resolvers: tuple[Address, ...] = ()  # empty: the system's (/etc/resolv.conf)
    interval: float = 10.0  # re-resolve period; the answers' TTL is not used
    hold: float = 30.0  # empty answers or NXDOMAIN this long before servers go
    timeout: float = 2.0  # bound of one round, so a silent resolver stalls nothing
    line: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class VirtualServerConfig:
    name: str
    listen: tuple[Address, ...]
    real_servers: tuple[RealServerConfig, ...]
    scheduler: str = "wlc"
    quiesce: bool = False
    load_source: str = "connections"  # connections | snmp | report
    load_poll_interval: float = 5.0
    slow_start: float = 0.0
    connect_timeout: float = 3.0
    idle_timeout: float = 300.0
    retries: int = 2
    max_connections: int = 0  # 0 = unlimited
    allow: tuple[IPNetwork, ...] = (
        ipaddress.ip_network("0.0.0.0/0"),
        ipaddress.ip_network("::/0"),
    )
    deny: tuple[IPNetwork, ...] = ()
    send_proxy: str = "none"  # none | v1 | v2
    accept_proxy: bool = False
    health_check: HealthCheckConfig = HealthCheckConfig()
    snmp: SnmpConfig | None = None  # None: no `snmp:` block
    throttle: ThrottleConfig | None = None  # None: no admission control
    table_size: int = 65537  # maglev: lookup table slots, a prime >= 101
    hash_key: str = "source"  # maglev: source | source_port
    persistence: PersistenceConfig | None = None  # None: no client persistence
    discovery: DnsDiscoveryConfig | None = None  # None: only the static real_servers
    queue: QueueConfig | None = None  # None: a full pool refuses (max_connections)
    # TLS server names routed here from a shared listen address (lower case); (): the
    # default of its addresses, or a virtual server alone on them
    sni: tuple[str, ...] = ()
    conditioning: ConditioningConfig | None = None  # None: connections are never moved
    file: str = field(default="", compare=False)
    line: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class Config:
    global_: GlobalConfig = GlobalConfig()
    virtual_servers: tuple[VirtualServerConfig, ...] = ()
    files: tuple[str, ...] = field(default=())


# --------------------------------------------------------------------------------------
# Scalars: durations and addresses (public, also used by the CLI and the simulator)
# --------------------------------------------------------------------------------------

_DURATION = re.compile(r"(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*(?P<unit>ms|s|m|h)?")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

# RFC 1123 host names; an all-numeric dotted name is a mistyped IPv4 address instead.
_HOST_NAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62})(?:\.[A-Za-z0-9_-]{1,63})*\.?"
)
_DOTTED_NUMBERS = re.compile(r"[0-9.]+")


def parse_duration(value: object) -> float:
    """`250ms`, `5s`, `2m`, `1h` or a number of seconds -> seconds; ValueError if bad."""
    if isinstance(value, bool):  # bool is an int to Python, never a duration to a user
        raise ValueError("a boolean is not a duration")
    if isinstance(value, int | float):
        seconds = _finite_float(value)
    elif isinstance(value, str) and (match := _DURATION.fullmatch(value.strip())):
        seconds = _finite_float(float(match["number"]) * _DURATION_UNITS[match["unit"] or "s"])
    else:
        raise ValueError(f"{value!r} is not a duration like 250ms, 5s, 2m, 1h or seconds")
    if seconds is None:
        raise ValueError("a duration must be finite")
    if seconds < 0:
        raise ValueError("a duration cannot be negative")
    return seconds


def parse_address(text: str, *, listen: bool = False) -> Address:
    """`HOST:PORT` or `[IPv6]:PORT` -> Address; ValueError with the reason if bad.

    A listen host must be an IP literal or `localhost` (we bind it, so it must be ours
    and must not depend on DNS); a real-server host may also be a DNS name. IP literals
    are normalised (`[::0001]` -> `::1`) so that equal addresses compare equal.
    """
    if not isinstance(text, str):
        raise ValueError("an address must be a string")
    text = text.strip()
    if text.startswith("["):
        inside, bracket, port = text[1:].partition("]:")
        if not bracket:
            raise ValueError("expected [IPv6]:PORT")
        try:
            host = str(ipaddress.IPv6Address(inside))
        except ValueError:
            raise ValueError(f"{inside!r} is not an IPv6 address") from None
    else:
        host, colon, port = text.rpartition(":")
        if not colon or not host:
            raise ValueError("expected HOST:PORT")
        host = _parse_host(host, listen=listen)
    return Address(host, _parse_port(port))


def _parse_host(host: str, *, listen: bool) -> str:
    if ":" in host:
        raise ValueError("an IPv6 address needs brackets, as in [::1]:80")
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    if listen and host != "localhost":
        raise ValueError("a listen host must be an IP address or localhost")
    if _DOTTED_NUMBERS.fullmatch(host) or not _HOST_NAME.fullmatch(host):
        raise ValueError(f"{host!r} is not an IP address or host name")
    return host


def _parse_port(port: str) -> int:
    if not (port.isascii() and port.isdigit()):
        raise ValueError(f"port {port!r} is not a number")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"port {int(port)} is not in 1..65535")
    return int(port)


def _parse_network(text: object) -> IPNetwork:
    if not isinstance(text, str):
        raise ValueError("a network must be a string")
    try:
        return ipaddress.ip_network(text.strip(), strict=True)
    except ValueError:
        pass
    try:
        loose = ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise ValueError("not an IPv4 or IPv6 network") from None
    # Rejected rather than masked: `10.0.0.1/8` is more likely a typo than 10.0.0.0/8.
    raise ValueError(f"host bits set; did you mean {loose}?")


def _finite_float(value: float) -> float | None:
    try:
        result = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return result if math.isfinite(result) else None


# --------------------------------------------------------------------------------------
# Converters: (value node, label) -> Python value, or raise _Invalid
# --------------------------------------------------------------------------------------
# A converter checks one YAML value. `label` is the key as the user wrote it, qualified by
# its section ("health_check.timeout"), so that messages name what to fix.

Converter = Callable[[yaml.Node, str], Any]

_NOT_SCALAR = object()  # what `_scalar` gives for a list or a mapping: fails every check


class _Invalid(Exception):
    """A value is wrong; reported at the line of `node` (or of the value being read)."""

    def __init__(self, message: str, node: yaml.Node | None = None):
        super().__init__(message)
        self.message = message
        self.node = node


def _scalar(node: yaml.Node, label: str) -> Any:
    """The Python value of a scalar node as YAML resolves it (`yes` -> True, `5` -> 5)."""
    if not isinstance(node, yaml.ScalarNode):
        return _NOT_SCALAR
    try:
        return yaml.constructor.SafeConstructor().construct_object(node)
    except Exception:  # explicit tags (`!!int x`, `!foo`) fail in many different ways
        tag = node.tag.replace("tag:yaml.org,2002:", "!!")
        raise _Invalid(f"{label}: cannot read {node.value!r} tagged {tag}") from None


def _shown(node: yaml.Node) -> str:
    """The value of `node` as the user wrote it, for a message."""
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    try:
        value = yaml.constructor.SafeConstructor().construct_object(node)
    except Exception:  # unreadable: the text as written is good enough here
        return repr(node.value)
    if value is None:
        return "nothing"
    return repr(value) if isinstance(value, str) else node.value


def _expected(label: str, requirement: str, node: yaml.Node, detail: str = "") -> _Invalid:
    message = f"{label} must be {requirement}, got {_shown(node)}"
    return _Invalid(f"{message} ({detail})" if detail else message, node)


def _did_you_mean(word: object, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), list(options), n=1)
    return f"did you mean {close[0]!r}?" if close else ""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(minimum: int, maximum: int | None = None) -> Converter:
    if maximum is None:
        requirement = f"an integer >= {minimum}"
    else:
        requirement = f"an integer from {minimum} to {maximum}"

    def convert(node: yaml.Node, label: str) -> int:
        value = _scalar(node, label)
        if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
            raise _expected(label, requirement, node)
        return value

    return convert


def _number(above: float, at_most: float | None = None) -> Converter:
    """A finite number > `above` (and <= `at_most`), as a float."""
    requirement = f"a number > {above:g}" + (f" and <= {at_most:g}" if at_most is not None else "")

    def convert(node: yaml.Node, label: str) -> float:
        value = _scalar(node, label)
        number = _finite_float(value) if _is_number(value) else None
        if number is None or number <= above or (at_most is not None and number > at_most):
            raise _expected(label, requirement, node)
        return number

    return convert


def _duration(*, positive: bool) -> Converter:
    requirement = "a duration (250ms, 5s, 2m, 1h or seconds) " + ("> 0" if positive else ">= 0")

    def convert(node: yaml.Node, label: str) -> float:
        try:
            seconds = parse_duration(_scalar(node, label))
        except ValueError:
            raise _expected(label, requirement, node) from None
        if positive and seconds == 0:
            raise _expected(label, requirement, node)
        return seconds

    return convert


def _choice(*options: str) -> Converter:
    requirement = "one of " + ", ".join(options)

    def convert(node: yaml.Node, label: str) -> str:
        value = _scalar(node, label)
        if value not in options:
            raise _expected(label, requirement, node, _did_you_mean(value, options))
        return value

    return convert


def _boolean(node: yaml.Node, label: str) -> bool:
    value = _scalar(node, label)
    if not isinstance(value, bool):
        raise _expected(label, "true or false", node)
    return value


def _string(node: yaml.Node, label: str) -> str:
    value = _scalar(node, label)
    if not isinstance(value, str) or not value:
        raise _expected(label, "a non-empty string", node)
    return value


_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _name(node: yaml.Node, label: str) -> str:
    # Names appear in API paths, CLI arguments and metric labels: keep them plain.
    value = _scalar(node, label)
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise _expected(label, "a name of letters, digits, '.', '_' or '-'", node)
    return value


def _address(*, listen: bool) -> Converter:
    def convert(node: yaml.Node, label: str) -> Address:
        value = _scalar(node, label)
        try:
            return parse_address(value, listen=listen)
        except ValueError as exc:
            raise _expected(label, "HOST:PORT or [IPv6]:PORT", node, str(exc)) from None

    return convert


_listen_address = _address(listen=True)


def _one_or_list(convert: Converter, what: str) -> Converter:
    """A converter for one value, or a non-empty list of them, into a tuple."""

    def read(node: yaml.Node, label: str) -> tuple:
        if not isinstance(node, yaml.SequenceNode):
            return (convert(node, label),)
        if not node.value:
            raise _Invalid(f"{label} must name at least one {what}", node)
        return tuple(convert(item, label) for item in node.value)

    return read


_listen_addresses = _one_or_list(_listen_address, "address")


def _sni_name(node: yaml.Node, label: str) -> str:
    # An exact host name, or `*.` and a host name: the wildcard stands for exactly one
    # label (as nginx's and HAProxy's SNI maps, and certificates, RFC 6125 §6.4.3).
    value = _scalar(node, label)
    requirement = "a host name like api.example.com or a wildcard like *.example.com"
    if not isinstance(value, str):
        raise _expected(label, requirement, node)
    name = value.lower().removesuffix(".")
    host = name[2:] if name.startswith("*.") else name
    if "*" in host:
        raise _expected(label, requirement, node, "'*' may only be the whole first label")
    if not _HOST_NAME.fullmatch(host) or ".." in host:
        raise _expected(label, requirement, node)
    return name


_sni_names = _one_or_list(_sni_name, "name")


def _admin_listen(node: yaml.Node, label: str) -> Address | None:
    # `listen: none` (or an empty value) turns the admin endpoint off.
    if _scalar(node, label) in (None, "none"):
        return None
    return _listen_address(node, label)


def _vs_listen(node: yaml.Node, label: str) -> tuple[Address, ...]:
    # `listen: none`: a locator-only virtual server (SPEC §10) binds nothing.
    if _scalar(node, label) == "none":
        return ()
    return _listen_addresses(node, label)


def _dns_zone(node: yaml.Node, label: str) -> str:
    value = _scalar(node, label)
    text = value.rstrip(".") if isinstance(value, str) else ""
    if not text or not _HOST_NAME.fullmatch(text):
        raise _expected(label, "a DNS zone like lb.internal.", node)
    return text.lower() + "."


def _networks(node: yaml.Node, label: str) -> tuple[IPNetwork, ...]:
    """A list of CIDR networks (a single one is accepted too); a bare IP is a /32 or /128."""
    items = node.value if isinstance(node, yaml.SequenceNode) else [node]
    networks = []
    for item in items:
        try:
            networks.append(_parse_network(_scalar(item, label)))
        except ValueError as exc:
            raise _expected(
                label, "a list of CIDR networks like 10.0.0.0/8", item, str(exc)
            ) from None
    return tuple(networks)


def _regex(node: yaml.Node, label: str) -> str:
    pattern = _string(node, label)
    try:
        re.compile(pattern)
    except re.error as exc:
        raise _expected(label, "a regular expression", node, str(exc)) from None
    return pattern


_status_codes = _one_or_list(_integer(100, 599), "status code")

MAX_TABLE_SIZE = 1000003  # a rebuild costs ~M log M probes in Python: ~2 s at this size


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    divisor = 3
    while divisor * divisor <= n:
        if n % divisor == 0:
            return False
        divisor += 2
    return True


def _table_size(node: yaml.Node, label: str) -> int:
    # Maglev's permutations (offset + j * skip) mod M visit every slot only when M is prime.
    value = _scalar(node, label)
    requirement = f"a prime from 101 to {MAX_TABLE_SIZE} (e.g. 65537, 131071 or 1000003)"
    if not _is_int(value) or not 101 <= value <= MAX_TABLE_SIZE:
        raise _expected(label, requirement, node)
    if not _is_prime(value):
        raise _expected(label, requirement, node, f"{value} is not prime")
    return value


def _dns_name(node: yaml.Node, label: str) -> str:
    value = _scalar(node, label)
    if not isinstance(value, str) or not value.strip():
        raise _expected(label, "a DNS name like _web._tcp.service.consul", node)
    value = value.strip()
    try:
        ipaddress.ip_address(value)
    except ValueError:
        pass
    else:
        raise _expected(label, "a DNS name, not an address", node, "list it in real_servers")
    if _DOTTED_NUMBERS.fullmatch(value) or not _HOST_NAME.fullmatch(value):
        raise _expected(label, "a DNS name like _web._tcp.service.consul", node)
    return value


_DISCOVERY_TYPES = ("SRV", "A", "AAAA")


def _record_type(node: yaml.Node, label: str) -> str:
    value = _scalar(node, label)
    if isinstance(value, str) and value.upper() in _DISCOVERY_TYPES:
        return value.upper()  # `srv` or `a` is what a user means; DNS types are uppercase
    raise _expected(label, "one of SRV, A, AAAA", node)


def _resolver(node: yaml.Node, label: str) -> Address:
    """A resolver: an IP address with an optional port (53), `IP:PORT` or `[v6]:PORT`."""
    value = _scalar(node, label)
    requirement = "an IP address or IP:PORT, [IPv6]:PORT"
    if not isinstance(value, str):
        raise _expected(label, requirement, node)
    try:
        return Address(str(ipaddress.ip_address(value.strip())), 53)
    except ValueError:
        pass
    try:
        address = parse_address(value)
    except ValueError as exc:
        raise _expected(label, requirement, node, str(exc)) from None
    try:
        ipaddress.ip_address(address.host)
    except ValueError:
        # Finding the resolver by name would need a resolver.
        raise _expected(label, requirement, node, "a resolver must be an IP address") from None
    return address


_resolvers = _one_or_list(_resolver, "resolver")


def _workers(node: yaml.Node, label: str) -> int:
    if _scalar(node, label) == "auto":
        return os.cpu_count() or 1
    try:
        return _integer(1)(node, label)
    except _Invalid:
        raise _expected(label, "an integer >= 1 or auto", node) from None


def _snmp_version(node: yaml.Node, label: str) -> str:
    # YAML reads `version: 3` as an int and `version: 2c` as a string; both are fine.
    value = _scalar(node, label)
    if value in ("2c", "3") or (_is_int(value) and value == 3):
        return str(value)
    raise _expected(label, "2c or 3", node)


_OID = re.compile(r"\.?\d+(?:\.\d+)+")


def _oid(node: yaml.Node, label: str) -> str:
    value = _scalar(node, label)
    if not isinstance(value, str) or not _OID.fullmatch(value):
        raise _expected(label, "a dotted numeric OID like 1.3.6.1.4.1.2021.10.1.5.1", node)
    return value.lstrip(".")


def _host(node: yaml.Node, label: str) -> str:
    value = _scalar(node, label)
    try:
        if not isinstance(value, str):
            raise ValueError("a host must be a string")
        if ":" in value:  # a bare IPv6 literal needs no brackets here: there is no port
            return str(ipaddress.IPv6Address(value))
        return _parse_host(value, listen=False)
    except ValueError as exc:
        raise _expected(label, "a host name or IP address", node, str(exc)) from None


def _http_path(node: yaml.Node, label: str) -> str:
    value = _scalar(node, label)
    if not isinstance(value, str) or not value.startswith("/"):
        raise _expected(label, "a path starting with /", node)
    return value


def _scheduler(node: yaml.Node, label: str) -> str:
    value = _scalar(node, label)
    known = _known_schedulers()
    if value not in known:
        hint = _did_you_mean(value, known)
        hint = f" ({hint})" if hint else ""
        raise _Invalid(f"unknown scheduler {_shown(node)}{hint}; known: {', '.join(known)}", node)
    return value


_FALLBACK_SCHEDULERS = (
    "rr",
    "wrr",
    "lc",
    "wlc",
    "dwd",
    "dwr",
    "least-load",
    "sap",
    "first",
    "maglev",
)


def _known_schedulers() -> list[str]:
    # Imported late: the scheduler package may import this module.
    try:
        from lbproxy.schedulers import available
    except ImportError:
        return sorted(_FALLBACK_SCHEDULERS)
    return sorted(available())


# --------------------------------------------------------------------------------------
# The keys of each section and how to read them
# --------------------------------------------------------------------------------------
# Keys map to the dataclass field of the same name; nested sections are read separately.

_TOP_LEVEL_SECTIONS = ("global", "virtual_servers")

_GLOBAL_FIELDS: dict[str, Converter] = {
    "log_format": _choice("text", "json"),
    "drain_timeout": _duration(positive=False),
    "workers": _workers,
    "access_log": _boolean,
}
_GLOBAL_SECTIONS = ("admin", "locator")

_ADMIN_FIELDS: dict[str, Converter] = {
    "listen": _admin_listen,
    "token_file": _string,
}

_VIRTUAL_SERVER_FIELDS: dict[str, Converter] = {
    "name": _name,
    "listen": _vs_listen,
    "scheduler": _scheduler,
    "quiesce": _boolean,
    "load_source": _choice("connections", "snmp", "report"),
    "load_poll_interval": _duration(positive=True),
    "slow_start": _duration(positive=False),
    "connect_timeout": _duration(positive=True),
    "idle_timeout": _duration(positive=True),
    "retries": _integer(0),
    "max_connections": _integer(0),
    "allow": _networks,
    "deny": _networks,
    "send_proxy": _choice("none", "v1", "v2"),
    "accept_proxy": _boolean,
    "table_size": _table_size,
    "hash_key": _choice("source", "source_port"),
    "sni": _sni_names,
}
_VIRTUAL_SERVER_SECTIONS = (
    "health_check",
    "snmp",
    "throttle",
    "persistence",
    "queue",
    "conditioning",
    "real_servers",
    "discovery",
)

_REAL_SERVER_FIELDS: dict[str, Converter] = {
    "name": _name,
    "address": _address(listen=False),
    "weight": _integer(0, MAX_WEIGHT),
    "max_connections": _integer(0),
    "load_factor": _number(above=0),
    "state": _choice("enabled", "drain", "disabled"),
    "backup": _boolean,
}
_REAL_SERVER_SECTIONS = ("snmp",)

_HEALTH_CHECK_FIELDS: dict[str, Converter] = {
    "type": _choice("tcp", "send_expect", "http", "none"),
    "interval": _duration(positive=True),
    "timeout": _duration(positive=True),
    "rise": _integer(1),
    "fall": _integer(1),
    "send": _string,
    "expect": _regex,
    "path": _http_path,
    "expect_status": _status_codes,
    "on_down": _choice("keep", "close"),
}

_SNMP_FIELDS: dict[str, Converter] = {
    "oid": _oid,
    "version": _snmp_version,
    "community": _string,
    "user": _string,
    "auth_protocol": _choice("SHA", "SHA256", "MD5"),
    "auth_key_file": _string,
    "priv_protocol": _choice("AES", "AES256", "DES"),
    "priv_key_file": _string,
    "host": _host,
    "port": _integer(1, 65535),
    "interval": _duration(positive=True),
    "timeout": _duration(positive=True),
    "retries": _integer(0),
    "on_no_answer": _choice("zero", "hold", "static"),
    "stale_after": _duration(positive=True),
    "smoothing": _number(above=0, at_most=1),
    "max_value": _integer(1),
}

_THROTTLE_FIELDS: dict[str, Converter] = {
    "max_connections": _integer(1),
    "max_rate": _number(above=0),
    "digg_factor": _number(above=1),
    "high_idle_timeout": _duration(positive=True),
    "min_idle_timeout": _duration(positive=True),
    "interval": _duration(positive=True),
}

_PERSISTENCE_FIELDS: dict[str, Converter] = {
    "timeout": _duration(positive=True),
    "max_entries": _integer(1),
}

# Keys that only the maglev scheduler reads: an error with any other (not silently unused).
_MAGLEV_KEYS = ("table_size", "hash_key")
_LOCATOR_SECTIONS = ("dns",)

_DNS_LOCATOR_FIELDS: dict[str, Converter] = {
    "listen": _listen_address,
    "zone": _dns_zone,
    "ttl": _integer(0, 2**31 - 1),
}

_CONDITIONING_FIELDS: dict[str, Converter] = {
    "interval": _duration(positive=True),
    "idle_for": _duration(positive=False),
    "max_per_interval": _integer(1),
    "threshold": _number(above=0),
}

# Schedulers without a load to balance (SPEC §11): they reject a `conditioning:` block.
_UNCONDITIONED_SCHEDULERS = ("rr", "wrr", "first", "maglev")

_DISCOVERY_SECTIONS = ("dns",)

_DNS_DISCOVERY_FIELDS: dict[str, Converter] = {
    "name": _dns_name,
    "type": _record_type,
    "port": _integer(1, 65535),
    "resolvers": _resolvers,
    "interval": _duration(positive=True),
    "hold": _duration(positive=False),
    "timeout": _duration(positive=True),
}

_QUEUE_FIELDS: dict[str, Converter] = {
    "max": _integer(1),
    "timeout": _duration(positive=True),
}

# Schedulers whose weights come from the SNMP poller.
_SNMP_SCHEDULERS = ("dwd", "dwr")


# --------------------------------------------------------------------------------------
# Reading one file: mappings with lines, unknown and duplicate keys
# --------------------------------------------------------------------------------------


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


_STRING_TAG = "tag:yaml.org,2002:str"
_NULL_TAG = "tag:yaml.org,2002:null"


def _is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == _NULL_TAG


@dataclass
class _Section:
    """One YAML mapping, read: the valid values and where every key was."""

    line: int  # of the key that introduced the mapping, else of the mapping itself
    values: dict[str, Any] = field(default_factory=dict)  # converted, valid values only
    nodes: dict[str, yaml.Node] = field(default_factory=dict)  # every known key's value
    key_lines: dict[str, int] = field(default_factory=dict)  # every key present

    def line_of(self, key: str) -> int:
        return self.key_lines.get(key, self.line)


class _Document:
    """One configuration file: composes it and reports problems against it."""

    def __init__(self, file: str, problems: list[Problem]):
        self.file = file
        self.problems = problems

    def error(self, line: int, message: str) -> None:
        self.problems.append(Problem(self.file, line, message))

    def compose(self) -> yaml.Node | None:
        """The root node, or None for an empty or unreadable file (reported)."""
        try:
            with open(self.file, encoding="utf-8") as stream:
                return yaml.compose(stream, Loader=yaml.SafeLoader)
        except OSError as exc:
            self.error(1, f"cannot read: {exc.strerror or exc}")
        except UnicodeDecodeError as exc:
            self.error(1, f"cannot read: not UTF-8 text ({exc.reason})")
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            context = f" ({exc.context})" if exc.context else ""
            self.error(mark.line + 1 if mark else 1, f"YAML syntax error: {exc.problem}{context}")
        except yaml.YAMLError as exc:  # e.g. a control character: no mark, only a position
            self.error(1, f"YAML error: {exc}")
        return None

    def section(
        self,
        node: yaml.Node,
        where: str,
        fields: Mapping[str, Converter],
        nested: Collection[str] = (),
        *,
        prefix: str = "",
        line: int | None = None,
    ) -> _Section | None:
        """Read a mapping: convert `fields`, keep `nested` sections' nodes for the caller.

        `where` names the mapping in messages ("virtual server web"); `prefix` qualifies
        its keys in messages ("health_check."). An empty value counts as an empty mapping,
        so `health_check:` with nothing under it means "all defaults". Returns None (and
        reports) when the node is not a mapping.
        """
        section = _Section(line if line is not None else _line(node))
        if _is_null(node):
            return section
        if not isinstance(node, yaml.MappingNode):
            self.error(_line(node), f"{where} must be a mapping, got {_shown(node)}")
            return None
        known = [*fields, *nested]
        for key_node, value_node in node.value:
            key = self._key(key_node, section, where, known)
            if key is None:
                continue
            section.nodes[key] = value_node
            if key in fields:
                try:
                    section.values[key] = fields[key](value_node, prefix + key)
                except _Invalid as exc:
                    self.error(_line(exc.node or value_node), exc.message)
        return section

    def _key(
        self, key_node: yaml.Node, section: _Section, where: str, known: Collection[str]
    ) -> str | None:
        """The key as a known, first-seen string; anything else is reported, giving None."""
        line = _line(key_node)
        # Only plain strings: YAML would read `yes:` as True and `1:` as an int.
        is_string = isinstance(key_node, yaml.ScalarNode) and key_node.tag == _STRING_TAG
        key = key_node.value if is_string else None
        if key is None:
            self.error(line, f"keys must be strings, got {_shown(key_node)} in {where}")
            return None
        if key in section.key_lines:
            first = section.key_lines[key]
            self.error(line, f"duplicate key {key!r} in {where} (first at line {first})")
            return None
        section.key_lines[key] = line
        if key not in known:
            hint = _did_you_mean(key, known)
            self.error(line, f"unknown key {key!r} in {where}" + (f" ({hint})" if hint else ""))
            return None
        return key

    def require(self, section: _Section, where: str, *keys: str) -> None:
        for key in keys:
            if key not in section.key_lines:
                self.error(section.line, f"{where} needs {key!r}")


def _peek_name(node: yaml.Node) -> str | None:
    """The `name:` of a mapping before it is read, to say where its problems are."""
    if not isinstance(node, yaml.MappingNode):
        return None
    for key_node, value_node in node.value:
        if key_node.value == "name" and isinstance(value_node, yaml.ScalarNode):
            return value_node.value or None
    return None


# --------------------------------------------------------------------------------------
# Sections -> dataclasses
# --------------------------------------------------------------------------------------


@dataclass
class _GlobalRead:
    config: GlobalConfig
    file: str
    line: int  # of the `global:` key
    admin_line: int | None  # of `admin.listen`; None when it is the default
    dns_line: int = 0  # of `locator.dns.listen` (or of `dns:`)


@dataclass
class _VirtualServerRead:
    """What the checks across files need, known even when the virtual server is invalid."""

    file: str
    line: int
    name: str | None
    name_line: int
    listen: list[tuple[Address, int]]  # each address with its own line
    config: VirtualServerConfig | None  # None when a problem prevented building it
    sni: list[tuple[str, int]] = field(default_factory=list)  # each name with its line
    accept_proxy: tuple[bool, int] = (False, 0)  # and the line of the key, 0: default


def _nested(
    doc: _Document,
    parent: _Section,
    key: str,
    where: str,
    fields: Mapping[str, Converter],
    nested: Collection[str] = (),
    *,
    prefix: str = "",
) -> _Section | None:
    """The section under `parent[key]`; None when it is absent or not a mapping."""
    node = parent.nodes.get(key)
    if node is None:
        return None
    return doc.section(node, where, fields, nested, prefix=prefix, line=parent.line_of(key))


def _read_file(
    doc: _Document, root: yaml.Node
) -> tuple[_GlobalRead | None, list[_VirtualServerRead]]:
    top = doc.section(root, "the top level", {}, _TOP_LEVEL_SECTIONS)
    if top is None:
        return None, []
    global_read = _read_global(doc, top) if "global" in top.nodes else None
    return global_read, _read_virtual_servers(doc, top)


def _read_global(doc: _Document, top: _Section) -> _GlobalRead:
    line = top.line_of("global")
    section = _nested(doc, top, "global", "global", _GLOBAL_FIELDS, _GLOBAL_SECTIONS)
    section = section or _Section(line)
    admin = _nested(doc, section, "admin", "global.admin", _ADMIN_FIELDS, prefix="admin.")
    admin = admin or _Section(line)
    locator, dns_line = _read_locator(doc, section)
    config = GlobalConfig(admin=AdminConfig(**admin.values), locator=locator, **section.values)
    read = _GlobalRead(config, doc.file, line, admin.key_lines.get("listen"))
    read.dns_line = dns_line
    return read


def _read_locator(doc: _Document, section: _Section) -> tuple[LocatorConfig, int]:
    """`global.locator`, and the line of its DNS listen address (for port clashes)."""
    locator = _nested(
        doc, section, "locator", "global.locator", {}, _LOCATOR_SECTIONS, prefix="locator."
    )
    if locator is None:
        return LocatorConfig(), 0
    dns = _nested(
        doc, locator, "dns", "global.locator.dns", _DNS_LOCATOR_FIELDS, prefix="locator.dns."
    )
    if dns is None:
        return LocatorConfig(), 0
    return LocatorConfig(DnsLocatorConfig(**dns.values)), dns.line_of("listen")


def _read_virtual_servers(doc: _Document, top: _Section) -> list[_VirtualServerRead]:
    node = top.nodes.get("virtual_servers")
    if node is None or _is_null(node):
        return []
    if not isinstance(node, yaml.SequenceNode):
        doc.error(_line(node), f"virtual_servers must be a list, got {_shown(node)}")
        return []
    reads = (_read_virtual_server(doc, item) for item in node.value)
    return [read for read in reads if read is not None]


def _read_virtual_server(doc: _Document, node: yaml.Node) -> _VirtualServerRead | None:
    name = _peek_name(node)
    where = f"virtual server {name}" if name else "virtual server"
    vs = doc.section(node, where, _VIRTUAL_SERVER_FIELDS, _VIRTUAL_SERVER_SECTIONS)
    if vs is None:
        return None
    # With discovery, the static real servers may be empty or left out (SPEC §14).
    discovers = "discovery" in vs.nodes
    doc.require(vs, where, "name", "listen", *(() if discovers else ("real_servers",)))
    health_check = _read_health_check(doc, vs, where)
    snmp = _nested(doc, vs, "snmp", f"snmp of {where}", _SNMP_FIELDS, prefix="snmp.")
    throttle = _read_throttle(doc, vs, where)
    persistence = _read_persistence(doc, vs, where)
    discovery = _read_discovery(doc, vs, where)
    queue = _nested(doc, vs, "queue", f"queue of {where}", _QUEUE_FIELDS, prefix="queue.")
    conditioning = _read_conditioning(doc, vs, where)
    real_servers = _read_real_servers(doc, vs, snmp, allow_empty=discovers)

    config = None
    if "name" in vs.values and "listen" in vs.values and (real_servers or discovery):
        config = VirtualServerConfig(
            **vs.values,
            real_servers=tuple(real_servers),
            health_check=health_check,
            snmp=_snmp_config(snmp.values, default_host=None) if snmp else None,
            throttle=throttle,
            persistence=persistence,
            discovery=discovery,
            queue=QueueConfig(**queue.values) if queue is not None else None,
            conditioning=conditioning,
            file=doc.file,
            line=vs.line,
        )
        _check_scheduler_needs(doc, vs, config)
        _check_conditioning(doc, vs, config)
    listen = list(
        zip(vs.values.get("listen", ()), _item_lines(vs.nodes.get("listen")), strict=False)
    )
    sni = list(zip(vs.values.get("sni", ()), _item_lines(vs.nodes.get("sni")), strict=False))
    seen: dict[str, int] = {}
    for name, line in sni:
        if name in seen:
            doc.error(line, f"duplicate sni name {name!r} (first at line {seen[name]})")
        seen.setdefault(name, line)
    accept_proxy = (vs.values.get("accept_proxy", False), vs.key_lines.get("accept_proxy", 0))
    return _VirtualServerRead(
        doc.file,
        vs.line,
        vs.values.get("name"),
        vs.line_of("name"),
        listen,
        config,
        sni=sni,
        accept_proxy=accept_proxy,
    )


def _item_lines(node: yaml.Node | None) -> list[int]:
    """The line of each item of a list, or of a lone value."""
    if node is None:
        return []
    if isinstance(node, yaml.SequenceNode):
        return [_line(item) for item in node.value]
    return [_line(node)]


def _read_health_check(doc: _Document, vs: _Section, where: str) -> HealthCheckConfig:
    section = _nested(
        doc,
        vs,
        "health_check",
        f"health_check of {where}",
        _HEALTH_CHECK_FIELDS,
        prefix="health_check.",
    )
    if section is None:
        return HealthCheckConfig()
    check = HealthCheckConfig(**section.values)
    if check.type == "send_expect" and "expect" not in section.nodes:
        doc.error(section.line_of("type"), "health_check type send_expect needs 'expect'")
    return check


def _read_throttle(doc: _Document, vs: _Section, where: str) -> ThrottleConfig | None:
    section = _nested(
        doc, vs, "throttle", f"throttle of {where}", _THROTTLE_FIELDS, prefix="throttle."
    )
    if section is None:
        return None
    if not section.nodes.keys() & {"max_connections", "max_rate"}:
        doc.error(section.line, "throttle needs max_connections or max_rate (or both)")
    throttle = ThrottleConfig(**section.values)
    if throttle.min_idle_timeout > throttle.high_idle_timeout:
        key = "min_idle_timeout" if "min_idle_timeout" in section.nodes else "high_idle_timeout"
        doc.error(
            section.line_of(key),
            f"throttle.min_idle_timeout ({throttle.min_idle_timeout:g}s) must not exceed "
            f"throttle.high_idle_timeout ({throttle.high_idle_timeout:g}s)",
        )
    return throttle


def _read_persistence(doc: _Document, vs: _Section, where: str) -> PersistenceConfig | None:
    section = _nested(
        doc,
        vs,
        "persistence",
        f"persistence of {where}",
        _PERSISTENCE_FIELDS,
        prefix="persistence.",
    )
    return None if section is None else PersistenceConfig(**section.values)


def _read_conditioning(doc: _Document, vs: _Section, where: str) -> ConditioningConfig | None:
    section = _nested(
        doc,
        vs,
        "conditioning",
        f"conditioning of {where}",
        _CONDITIONING_FIELDS,
        prefix="conditioning.",
    )
    return None if section is None else ConditioningConfig(**section.values)


def _check_conditioning(doc: _Document, vs: _Section, config: VirtualServerConfig) -> None:
    """Conditioning moves connections by load: a scheduler without one cannot have it."""
    if config.conditioning is not None and config.scheduler in _UNCONDITIONED_SCHEDULERS:
        doc.error(
            vs.line_of("conditioning"),
            f"conditioning needs a scheduler with a load (lc, wlc, dwd, dwr, least-load, "
            f"sap); scheduler {config.scheduler} has none",
        )


def _read_real_servers(
    doc: _Document, vs: _Section, vs_snmp: _Section | None, *, allow_empty: bool = False
) -> list[RealServerConfig]:
    node = vs.nodes.get("real_servers")
    if node is None or (allow_empty and _is_null(node)):
        return []  # reported by `require`
    if not isinstance(node, yaml.SequenceNode):
        doc.error(vs.line_of("real_servers"), f"real_servers must be a list, got {_shown(node)}")
        return []
    if not node.value and not allow_empty:
        doc.error(vs.line_of("real_servers"), "real_servers is empty: a virtual server needs one")
        return []
    servers: list[RealServerConfig] = []
    first_lines: dict[str, int] = {}
    for item in node.value:
        read = _read_real_server(doc, item, vs_snmp)
        if read is None:
            continue
        section, config = read
        name = section.values.get("name")
        if name in first_lines:
            doc.error(
                section.line_of("name"),
                f"duplicate real server name {name!r} (first at line {first_lines[name]})",
            )
        elif name is not None:
            first_lines[name] = section.line_of("name")
        if config is not None:
            servers.append(config)
    return servers


def _read_discovery(doc: _Document, vs: _Section, where: str) -> DnsDiscoveryConfig | None:
    section = _nested(doc, vs, "discovery", f"discovery of {where}", {}, _DISCOVERY_SECTIONS)
    if section is None:
        return None
    if "dns" not in section.key_lines:
        doc.error(section.line, "discovery needs 'dns'")
        return None
    dns = _nested(
        doc,
        section,
        "dns",
        f"discovery.dns of {where}",
        _DNS_DISCOVERY_FIELDS,
        prefix="discovery.dns.",
    )
    if dns is None:
        return None
    doc.require(dns, "discovery.dns", "name")
    record_type = dns.values.get("type", "SRV")
    if "type" in dns.nodes and "type" not in dns.values:
        return None  # an unknown type: reported; whether a port belongs is unknown too
    if record_type == "SRV" and "port" in dns.nodes:
        doc.error(
            dns.line_of("port"),
            "discovery.dns.port is only for type A or AAAA: SRV records carry their own port",
        )
        return None
    if record_type != "SRV" and "port" not in dns.nodes:
        doc.error(
            dns.line_of("type"),
            f"discovery.dns type {record_type} needs 'port' ({record_type} records carry none)",
        )
        return None
    if "name" not in dns.values or ("port" in dns.nodes and "port" not in dns.values):
        return None  # reported
    return DnsDiscoveryConfig(**dns.values, line=dns.line)


def _read_real_server(
    doc: _Document, node: yaml.Node, vs_snmp: _Section | None
) -> tuple[_Section, RealServerConfig | None] | None:
    name = _peek_name(node)
    where = f"real server {name}" if name else "real server"
    rs = doc.section(node, where, _REAL_SERVER_FIELDS, _REAL_SERVER_SECTIONS)
    if rs is None:
        return None
    doc.require(rs, where, "name", "address")
    rs_snmp = _nested(doc, rs, "snmp", f"snmp of {where}", _SNMP_FIELDS, prefix="snmp.")
    if "name" not in rs.values or "address" not in rs.values:
        return rs, None
    snmp = _real_server_snmp(doc, vs_snmp, rs_snmp, rs.values["address"].host)
    return rs, RealServerConfig(**rs.values, snmp=snmp, line=rs.line)


def _real_server_snmp(
    doc: _Document, vs_snmp: _Section | None, rs_snmp: _Section | None, host: str
) -> SnmpConfig | None:
    """The virtual server's snmp block with the real server's overrides on top."""
    blocks = [block for block in (vs_snmp, rs_snmp) if block is not None]
    if not blocks:
        return None
    values: dict[str, Any] = {}
    for block in blocks:
        values.update(block.values)
    snmp = _snmp_config(values, default_host=host)
    if snmp.version == "3" and snmp.user is None:
        # Report where version 3 was asked for; one virtual-server block shared by many
        # real servers gives the same problem each time, which `load` reports once.
        setter = next(block for block in reversed(blocks) if "version" in block.values)
        doc.error(setter.line_of("version"), "snmp version 3 needs 'user'")
    return snmp


def _snmp_config(values: Mapping[str, Any], *, default_host: str | None) -> SnmpConfig:
    snmp = SnmpConfig(**values)
    stale_after = snmp.stale_after if snmp.stale_after is not None else 3 * snmp.interval
    return replace(snmp, host=snmp.host or default_host, stale_after=stale_after)


def _check_scheduler_needs(doc: _Document, vs: _Section, config: VirtualServerConfig) -> None:
    """Dynamic schedulers need their load source configured."""
    scheduler, line = config.scheduler, vs.line_of("scheduler")
    if scheduler in _SNMP_SCHEDULERS or (
        scheduler == "least-load" and config.load_source == "snmp"
    ):
        missing = [rs.name for rs in config.real_servers if rs.snmp is None]
        if config.snmp is None and missing:
            what = "least-load with load_source snmp" if scheduler == "least-load" else scheduler
            doc.error(
                line,
                f"scheduler {what} needs an snmp block on the virtual server or on every "
                f"real server (missing on {', '.join(missing)})",
            )
    if scheduler != "maglev":
        for key in _MAGLEV_KEYS:
            if key in vs.key_lines:
                doc.error(vs.line_of(key), f"{key} applies to scheduler maglev only")
    if config.discovery is not None:
        _check_discovery_needs(doc, vs, config)
    if scheduler == "least-load" and config.load_source == "connections":
        # Load is connections / max_connections: unlimited servers have no load to compare.
        for rs in config.real_servers:
            if rs.max_connections == 0:
                doc.error(
                    rs.line,
                    f"real server {rs.name} needs max_connections > 0 "
                    "(scheduler least-load with load_source connections)",
                )


def _check_discovery_needs(doc: _Document, vs: _Section, config: VirtualServerConfig) -> None:
    """Discovered servers have only a name, an address and a weight: what a scheduler
    needs beyond that must come from the virtual server."""
    scheduler, line = config.scheduler, vs.line_of("discovery")
    if config.snmp is None and (
        scheduler in _SNMP_SCHEDULERS
        or (scheduler == "least-load" and config.load_source == "snmp")
    ):
        doc.error(
            line,
            f"scheduler {scheduler} with discovery needs an snmp block on the virtual "
            "server (discovered real servers are polled with it)",
        )
    if scheduler == "least-load" and config.load_source == "connections":
        doc.error(
            line,
            "scheduler least-load with load_source connections cannot use discovery "
            "(discovered real servers have no max_connections)",
        )


# --------------------------------------------------------------------------------------
# Checks across files
# --------------------------------------------------------------------------------------


def _at(file: str, first_file: str, first_line: int) -> str:
    """Where the first of two things is, seen from a problem in `file`."""
    return f"line {first_line}" if file == first_file else f"{first_file}:{first_line}"


def _single_global(reads: list[_GlobalRead], problems: list[Problem]) -> GlobalConfig:
    if not reads:
        return GlobalConfig()
    first = reads[0]
    for extra in reads[1:]:
        where = _at(extra.file, first.file, first.line)
        problems.append(
            Problem(extra.file, extra.line, f"only one file may hold global: (first at {where})")
        )
    return first.config


def _check_unique_names(servers: list[_VirtualServerRead], problems: list[Problem]) -> None:
    first: dict[str, _VirtualServerRead] = {}
    for vs in servers:
        if vs.name is None:
            continue
        if vs.name not in first:
            first[vs.name] = vs
            continue
        where = _at(vs.file, first[vs.name].file, first[vs.name].name_line)
        problems.append(
            Problem(
                vs.file,
                vs.name_line,
                f"duplicate virtual server name {vs.name!r} (first at {where})",
            )
        )


@dataclass(frozen=True)
class _Claim:
    """A listen address taken, and by what."""

    address: Address
    what: str  # "0.0.0.0:80 of virtual server web", "the admin endpoint 127.0.0.1:9100"
    file: str | None  # None: a default, not written anywhere
    line: int
    vs: _VirtualServerRead | None = None  # the virtual server that listens there

    def describe(self, seen_from: str) -> str:
        if self.file is None:
            return f"{self.what} (the default; set global.admin.listen to move it)"
        return f"{self.what} at {_at(seen_from, self.file, self.line)}"


def _check_port_clashes(
    servers: list[_VirtualServerRead], global_read: _GlobalRead | None, problems: list[Problem]
) -> None:
    """Report every listen address that another listener (or the admin endpoint) has."""
    claims = _admin_claims(global_read) + _locator_claims(global_read, problems)
    for vs in servers:
        owner = f"virtual server {vs.name}" if vs.name else "a virtual server"
        for address, line in vs.listen:
            clash = next(
                (
                    claim
                    for claim in claims
                    if _clashes(address, claim.address)
                    # Two virtual servers on the very same address share it when one
                    # of them routes by SNI (SPEC §13; two without are two defaults:
                    # a clash). The rest is `_check_shared_addresses`' job.
                    and not (
                        claim.vs not in (None, vs)
                        and (vs.sni or claim.vs.sni)  # type: ignore[union-attr]
                        and _same(address, claim.address)
                    )
                ),
                None,
            )
            if clash is not None:
                problems.append(
                    Problem(
                        vs.file,
                        line,
                        f"listen address {address} clashes with {clash.describe(vs.file)}",
                    )
                )
            claims.append(_Claim(address, f"{address} of {owner}", vs.file, line, vs))


def _admin_claims(global_read: _GlobalRead | None) -> list[_Claim]:
    admin = global_read.config.admin if global_read else GlobalConfig().admin
    if admin.listen is None:
        return []
    what = f"the admin endpoint {admin.listen}"
    if global_read is None or global_read.admin_line is None:
        return [_Claim(admin.listen, what, None, 0)]
    return [_Claim(admin.listen, what, global_read.file, global_read.admin_line)]


def _locator_claims(global_read: _GlobalRead | None, problems: list[Problem]) -> list[_Claim]:
    """The DNS locator's TCP port (its UDP port clashes with no TCP listener)."""
    dns = global_read.config.locator.dns if global_read else None
    if dns is None or global_read is None:
        return []
    line = global_read.dns_line or global_read.line
    claim = _Claim(dns.listen, f"the DNS locator {dns.listen}", global_read.file, line)
    for admin in _admin_claims(global_read):
        if _clashes(dns.listen, admin.address):
            problems.append(
                Problem(
                    global_read.file,
                    line,
                    f"{claim.what} clashes with {admin.describe(global_read.file)}",
                )
            )
    return [claim]


def _clashes(a: Address, b: Address) -> bool:
    """Would binding both fail? A wildcard host takes the port for its whole family."""
    if a.port != b.port:
        return False
    ip_a, ip_b = _listen_ip(a.host), _listen_ip(b.host)
    if ip_a.version != ip_b.version:
        return False
    return ip_a == ip_b or ip_a.is_unspecified or ip_b.is_unspecified


def _same(a: Address, b: Address) -> bool:
    return a.port == b.port and _listen_ip(a.host) == _listen_ip(b.host)


def _check_shared_addresses(servers: list[_VirtualServerRead], problems: list[Problem]) -> None:
    """Virtual servers on one address (SPEC §13): no name routed to two of them, and
    one way of reading the PROXY header (it is read before the ClientHello, so before
    the virtual server is known). Two defaults are a clash (`_check_port_clashes`)."""
    groups: dict[tuple, list[tuple[_VirtualServerRead, Address, int]]] = {}
    for vs in servers:
        for address, line in vs.listen:
            key = (_listen_ip(address.host), address.port)
            group = groups.setdefault(key, [])
            if not any(other is vs for other, _, _ in group):
                group.append((vs, address, line))
    for group in groups.values():
        if len(group) < 2:
            continue
        names: dict[str, tuple[_VirtualServerRead, int]] = {}
        first_vs, _, first_line = group[0]
        for vs, address, line in group:
            for name, name_line in vs.sni:
                if name in names:
                    other, other_line = names[name]
                    problems.append(
                        Problem(
                            vs.file,
                            name_line,
                            f"sni name {name!r} on {address} is routed to virtual server "
                            f"{other.name} already (at {_at(vs.file, other.file, other_line)})",
                        )
                    )
                else:
                    names[name] = (vs, name_line)
            if vs.accept_proxy[0] != first_vs.accept_proxy[0]:
                problems.append(
                    Problem(
                        vs.file,
                        vs.accept_proxy[1] or line,
                        f"virtual servers sharing {address} must agree on accept_proxy "
                        f"({first_vs.name} at {_at(vs.file, first_vs.file, first_line)} has "
                        f"{str(first_vs.accept_proxy[0]).lower()})",
                    )
                )


def _listen_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address("127.0.0.1" if host == "localhost" else host)


# --------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------


def load(paths: Sequence[str | os.PathLike[str]]) -> Config:
    """Read and validate configuration files and folders; ConfigError lists every problem."""
    problems: list[Problem] = []
    files = _expand(paths, problems)
    global_reads: list[_GlobalRead] = []
    servers: list[_VirtualServerRead] = []
    for file in files:
        doc = _Document(file, problems)
        root = doc.compose()
        if root is None:
            continue
        global_read, file_servers = _read_file(doc, root)
        if global_read is not None:
            global_reads.append(global_read)
        servers.extend(file_servers)

    global_ = _single_global(global_reads, problems)
    _check_unique_names(servers, problems)
    _check_port_clashes(servers, global_reads[0] if global_reads else None, problems)
    _check_shared_addresses(servers, problems)
    if not servers and (files or paths):
        first = files[0] if files else os.fsdecode(paths[0])
        problems.append(Problem(first, 1, "no virtual servers configured"))
    if problems:
        raise ConfigError(_in_order(problems))
    return Config(
        global_=global_,
        virtual_servers=tuple(vs.config for vs in servers if vs.config is not None),
        files=tuple(files),
    )


def _expand(paths: Sequence[str | os.PathLike[str]], problems: list[Problem]) -> list[str]:
    """Files to read: each path itself, or a folder's *.yaml and *.yml in name order."""
    if not paths:
        problems.append(Problem("<command line>", 0, "no configuration file or folder given"))
    files: list[str] = []
    for path in map(os.fsdecode, paths):
        if not os.path.isdir(path):
            files.append(path)  # a missing file is reported when it is read
            continue
        try:
            names = sorted(os.listdir(path))
        except OSError as exc:
            problems.append(Problem(path, 1, f"cannot read folder: {exc.strerror or exc}"))
            continue
        for name in names:
            joined = os.path.join(path, name)
            if name.endswith((".yaml", ".yml")) and os.path.isfile(joined):
                files.append(joined)
    return files


def _in_order(problems: list[Problem]) -> list[Problem]:
    """Sorted by file and line; a problem found several times is reported once."""
    return sorted(dict.fromkeys(problems), key=lambda p: (p.file, p.line))


# --------------------------------------------------------------------------------------
# summary (for `lbproxy check`)
# --------------------------------------------------------------------------------------


def summary(config: Config) -> str:
    lines = [_global_summary(config.global_)]
    for vs in config.virtual_servers:
        lines.extend(_virtual_server_summary(vs))
    servers = sum(len(vs.real_servers) for vs in config.virtual_servers)
    lines.append(
        f"{_count(len(config.virtual_servers), 'virtual server')}, {_count(servers, 'real server')}"
    )
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _global_summary(global_: GlobalConfig) -> str:
    admin = str(global_.admin.listen) if global_.admin.listen else "off"
    text = (
        f"admin {admin}, log {global_.log_format}, workers {global_.workers}, "
        f"drain timeout {global_.drain_timeout:g}s"
    )
    dns = global_.locator.dns
    if dns is not None:
        text += f"\nDNS locator {dns.listen} (UDP and TCP), zone {dns.zone}, ttl {dns.ttl}"
    return text


def _virtual_server_summary(vs: VirtualServerConfig) -> list[str]:
    scheduler = vs.scheduler
    if vs.quiesce:
        scheduler += ", quiesce"
    if vs.scheduler == "least-load":
        scheduler += f", load from {vs.load_source}"
    if vs.slow_start:
        scheduler += f", slow start {vs.slow_start:g}s"
    if vs.scheduler == "maglev":
        scheduler += f", table {vs.table_size}, hash {vs.hash_key}"
    lines = [
        f"virtual server {vs.name} ({vs.file}:{vs.line})",
        f"  listen      {_listen_summary(vs)}",
    ]
    if vs.sni:
        lines.append(f"  sni         {', '.join(vs.sni)}")
    lines += [
        f"  scheduler   {scheduler}",
        f"  health      {_health_summary(vs.health_check)}",
    ]
    if vs.throttle is not None:
        lines.append(f"  throttle    {_throttle_summary(vs.throttle)}")
    if vs.persistence is not None:
        lines.append(
            f"  persistence {vs.persistence.timeout:g}s, "
            f"at most {vs.persistence.max_entries} clients"
        )
    if vs.discovery is not None:
        lines.append(f"  discovery   {discovery_summary(vs.discovery)}")
    if vs.queue is not None:
        lines.append(f"  queue       up to {vs.queue.max} clients for {vs.queue.timeout:g}s")
    if vs.conditioning is not None:
        lines.append(f"  conditioning {_conditioning_summary(vs.conditioning)}")
    lines.append("  real servers")
    lines.extend(_table([_real_server_row(vs, rs) for rs in vs.real_servers], indent="    "))
    if vs.discovery is not None:
        lines.append("    + discovered (lbproxy check --resolve shows them)")
    return lines


def discovery_summary(dns: DnsDiscoveryConfig) -> str:
    """`SRV _web._tcp.service.consul via 127.0.0.1:8600, every 10s, hold 30s`."""
    what = f"{dns.type} {dns.name}" + (f" port {dns.port}" if dns.port is not None else "")
    via = ", ".join(str(a) for a in dns.resolvers) if dns.resolvers else "the system's resolvers"
    return f"{what} via {via}, every {dns.interval:g}s, hold {dns.hold:g}s"


def _listen_summary(vs: VirtualServerConfig) -> str:
    if not vs.listen:
        return "none (locator only)"
    return ", ".join(str(address) for address in vs.listen)


def _conditioning_summary(c: ConditioningConfig) -> str:
    return (
        f"every {c.interval:g}s, idle for {c.idle_for:g}s, at most {c.max_per_interval} "
        f"per interval, threshold {c.threshold:g}"
    )


def _health_summary(check: HealthCheckConfig) -> str:
    if check.type == "none":
        return "none"
    return f"{check.type} every {check.interval:g}s, rise {check.rise}, fall {check.fall}"


def _throttle_summary(throttle: ThrottleConfig) -> str:
    limits = []
    if throttle.max_connections is not None:
        limits.append(f"max {throttle.max_connections} connections")
    if throttle.max_rate is not None:
        limits.append(f"max {throttle.max_rate:g} connections/s")
    return ", ".join(limits)


def _real_server_row(vs: VirtualServerConfig, rs: RealServerConfig) -> list[str]:
    row = [rs.name, str(rs.address), f"weight {rs.weight}", rs.state]
    if rs.backup:
        row.append("backup")
    if vs.scheduler == "sap":
        row.append(f"load factor {rs.load_factor:g}")
    if rs.max_connections:
        row.append(f"max {rs.max_connections} connections")
    if rs.snmp is not None and vs.scheduler in (*_SNMP_SCHEDULERS, "least-load"):
        row.append(f"snmp {rs.snmp.host}:{rs.snmp.port}")
    return row


def _table(rows: list[list[str]], indent: str) -> list[str]:
    """Left-aligned columns."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(max(map(len, rows)))]
    return [
        indent + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
        for row in rows
    ]
