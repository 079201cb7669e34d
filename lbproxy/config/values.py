"""One value at a time: durations, addresses, and the converters that check a YAML value.

PURE. `parse_duration` and `parse_address` are public (the CLI and the simulator use them);
a converter takes a YAML node and the key as the user wrote it, and returns the value or
raises `Invalid` with a message that names what to fix.

A converter also says what it accepts, in words (`accepts`: the messages and the
configuration reference) and as a JSON Schema fragment (`schema`: `lbproxy schema`),
beside the code that checks it: the reference, the schema and `lbproxy check` are one
definition. The schema may be looser than the check where JSON Schema cannot say it (a
prime table size, a host name's labels), never stricter: what `check` accepts, the schema
accepts.
"""

from __future__ import annotations

import contextlib
import difflib
import ipaddress
import math
import os
import re
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any, TypeGuard, cast

import yaml

from lbproxy.config.accounts import AccountError, group_id, user_ids
from lbproxy.config.model import Address, IPNetwork

# --------------------------------------------------------------------------------------
# Scalars: durations and addresses (public, also used by the CLI and the simulator)
# --------------------------------------------------------------------------------------

# ASCII digits only: `\d` would take any script's digits, and float() reads them.
_DURATION = re.compile(r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))\s*(?P<unit>ms|s|m|h)?")
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
# Converters: (value node, label) -> Python value, or raise Invalid
# --------------------------------------------------------------------------------------
# A converter checks one YAML value. `label` is the key as the user wrote it, qualified by
# its section ("health_check.timeout"), so that messages name what to fix.

Reader = Callable[[yaml.Node, str], Any]
Schema = dict[str, Any]


class Converter:
    """Reads one YAML value (`converter(node, label)`) and says what it accepts.

    `accepts` is the requirement in words ("an integer from 0 to 65535"), `schema` the JSON
    Schema of the accepted values (a callable for one computed late, e.g. the registered
    schedulers). A table entry adds what only the key knows with `about()`: a description,
    the default as shown when the model's default is not the whole story, and the
    schedulers that read it (`read_by`) or that alone accept it (`only`: another
    scheduler makes it an error).
    """

    __slots__ = (
        "_schema",
        "accepts",
        "default",
        "description",
        "only",
        "read",
        "read_by",
        "secret",
    )

    def __init__(
        self,
        read: Reader,
        accepts: str,
        schema: Schema | Callable[[], Schema],
        *,
        description: str = "",
        default: str | None = None,
        only: tuple[str, ...] = (),
        read_by: tuple[str, ...] = (),
        secret: bool = False,
    ) -> None:
        self.read = read
        self.accepts = accepts
        self._schema = schema
        self.description = description
        self.default = default
        self.only = only
        self.read_by = read_by
        # The value names a file holding a secret: the reader applies the rule of
        # secret_files.py to it and lists it in Config.secret_files.
        self.secret = secret

    def __call__(self, node: yaml.Node, label: str) -> Any:
        return self.read(node, label)

    @property
    def schema(self) -> Schema:
        return self._schema() if callable(self._schema) else dict(self._schema)

    def about(
        self,
        description: str,
        *,
        default: str | None = None,
        only: tuple[str, ...] = (),
        read_by: tuple[str, ...] = (),
    ) -> Converter:
        """This converter, documented for one key."""
        return Converter(
            self.read,
            self.accepts,
            self._schema,
            description=description,
            default=default,
            only=only,
            read_by=only or read_by,
            secret=self.secret,
        )


def accepting(accepts: str, schema: Schema | Callable[[], Schema]) -> Callable[[Reader], Converter]:
    """Decorator: a reader function becomes a Converter that accepts `accepts`."""

    def wrap(read: Reader) -> Converter:
        return Converter(read, accepts, schema)

    return wrap


# JSON Schema fragments shared by several converters; loose where a pattern cannot say
# what the code checks (ports 1..65535, IP literals), so never stricter than the code.
_ADDRESS_SCHEMA: Schema = {
    "type": "string",
    "pattern": r"^\s*(?:\[[^\]]*\]|[^\s:\[\]]+):[0-9]+\s*$",
}
_NUMBER_FORMS = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_UNIT = r"\s*(?:ms|s|m|h)?\s*$"


def _one_or_list_schema(item: Schema) -> Schema:
    return {"anyOf": [item, {"type": "array", "items": item, "minItems": 1}]}


_NOT_SCALAR = object()  # what `scalar` gives for a list or a mapping: fails every check


class Invalid(Exception):
    """A value is wrong; reported at the line of `node` (or of the value being read)."""

    def __init__(self, message: str, node: yaml.Node | None = None):
        super().__init__(message)
        self.message = message
        self.node = node


def scalar(node: yaml.Node, label: str) -> Any:
    """The Python value of a scalar node as YAML resolves it (`yes` -> True, `5` -> 5)."""
    if not isinstance(node, yaml.ScalarNode):
        return _NOT_SCALAR
    try:
        return yaml.constructor.SafeConstructor().construct_object(node)
    except Exception:  # explicit tags (`!!int x`, `!foo`) fail in many different ways
        tag = node.tag.replace("tag:yaml.org,2002:", "!!")
        raise Invalid(f"{label}: cannot read {node.value!r} tagged {tag}") from None


def shown(node: yaml.Node) -> str:
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


def _expected(label: str, requirement: str, node: yaml.Node, detail: str = "") -> Invalid:
    message = f"{label} must be {requirement}, got {shown(node)}"
    return Invalid(f"{message} ({detail})" if detail else message, node)


def did_you_mean(word: object, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), list(options), n=1)
    return f"did you mean {close[0]!r}?" if close else ""


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def integer(minimum: int, maximum: int | None = None) -> Converter:
    if maximum is None:
        requirement = f"an integer >= {minimum}"
    else:
        requirement = f"an integer from {minimum} to {maximum}"

    def convert(node: yaml.Node, label: str) -> int:
        value = scalar(node, label)
        if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
            raise _expected(label, requirement, node)
        return value

    schema: Schema = {"type": "integer", "minimum": minimum}
    if maximum is not None:
        schema["maximum"] = maximum
    return Converter(convert, requirement, schema)


def number(above: float, at_most: float | None = None) -> Converter:
    """A finite number > `above` (and <= `at_most`), as a float."""
    requirement = f"a number > {above:g}" + (f" and <= {at_most:g}" if at_most is not None else "")

    def convert(node: yaml.Node, label: str) -> float:
        value = scalar(node, label)
        number = _finite_float(value) if _is_number(value) else None
        if number is None or number <= above or (at_most is not None and number > at_most):
            raise _expected(label, requirement, node)
        return number

    schema: Schema = {"type": "number", "exclusiveMinimum": above}
    if at_most is not None:
        schema["maximum"] = at_most
    return Converter(convert, requirement, schema)


def duration(*, positive: bool) -> Converter:
    requirement = "a duration (250ms, 5s, 2m, 1h or seconds) " + ("> 0" if positive else ">= 0")

    def convert(node: yaml.Node, label: str) -> float:
        try:
            seconds = parse_duration(scalar(node, label))
        except ValueError:
            raise _expected(label, requirement, node) from None
        if positive and seconds == 0:
            raise _expected(label, requirement, node)
        return seconds

    if positive:  # a non-zero digit somewhere, no sign but +
        text = r"^\s*\+?(?=[0-9.]*[1-9])" + _NUMBER_FORMS + _UNIT
        number: Schema = {"type": "number", "exclusiveMinimum": 0}
    else:  # -0 is 0, as parse_duration reads it
        text = r"^\s*(?:\+?" + _NUMBER_FORMS + r"|-(?:0+(?:\.0*)?|\.0+))" + _UNIT
        number = {"type": "number", "minimum": 0}
    return Converter(convert, requirement, {"anyOf": [number, {"type": "string", "pattern": text}]})


def choice(*options: str) -> Converter:
    requirement = "one of " + ", ".join(options)

    def convert(node: yaml.Node, label: str) -> str:
        value = scalar(node, label)
        if value not in options:
            raise _expected(label, requirement, node, did_you_mean(value, options))
        return cast(str, value)  # one of `options`

    return Converter(convert, requirement, {"enum": list(options)})


@accepting("true or false", {"type": "boolean"})
def boolean(node: yaml.Node, label: str) -> bool:
    value = scalar(node, label)
    if not isinstance(value, bool):
        raise _expected(label, "true or false", node)
    return value


@accepting("a non-empty string", {"type": "string", "minLength": 1})
def string(node: yaml.Node, label: str) -> str:
    value = scalar(node, label)
    if not isinstance(value, str) or not value:
        raise _expected(label, "a non-empty string", node)
    return value


# A path to a file holding a secret (a token, a password, a key): read as a string; the
# reader checks its owner and mode (secret_files.py), where it knows `global.user`.
secret_file = Converter(
    string.read,
    "a path to a file only root or lbproxy's user may read",
    {"type": "string", "minLength": 1},
    secret=True,
)


def _account(lookup: Callable[[str], object], what: str) -> Converter:
    """`global.user` / `global.group`: a name this system knows, or a numeric id."""
    requirement = f"a {what} name or a numeric id"

    def convert(node: yaml.Node, label: str) -> str:
        value = scalar(node, label)
        if _is_int(value) and value >= 0:
            value = str(value)
        if not isinstance(value, str) or not value:
            raise _expected(label, requirement, node)
        try:
            lookup(value)
        except AccountError as exc:
            raise Invalid(f"{label}: {exc}", node) from None
        return value

    schema: Schema = {
        "anyOf": [{"type": "string", "minLength": 1}, {"type": "integer", "minimum": 0}]
    }
    return Converter(convert, requirement, schema)


user = _account(user_ids, "user")
group = _account(group_id, "group")


_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@accepting(
    "a name of letters, digits, '.', '_' or '-'", {"type": "string", "pattern": "^[A-Za-z0-9_.-]+$"}
)
def plain_name(node: yaml.Node, label: str) -> str:
    # Names appear in API paths, CLI arguments and metric labels: keep them plain.
    value = scalar(node, label)
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise _expected(label, "a name of letters, digits, '.', '_' or '-'", node)
    return value


def address(*, listen: bool) -> Converter:
    def convert(node: yaml.Node, label: str) -> Address:
        value = scalar(node, label)
        try:
            return parse_address(value, listen=listen)
        except ValueError as exc:
            raise _expected(label, "HOST:PORT or [IPv6]:PORT", node, str(exc)) from None

    what = "IP:PORT, [IPv6]:PORT or localhost:PORT" if listen else "HOST:PORT or [IPv6]:PORT"
    return Converter(convert, what, _ADDRESS_SCHEMA)


listen_address = address(listen=True)


def _one_or_list(convert: Converter, what: str) -> Converter:
    """A converter for one value, or a non-empty list of them, into a tuple."""

    def read(node: yaml.Node, label: str) -> tuple[Any, ...]:
        if not isinstance(node, yaml.SequenceNode):
            return (convert(node, label),)
        if not node.value:
            raise Invalid(f"{label} must name at least one {what}", node)
        return tuple(convert(item, label) for item in node.value)

    return Converter(
        read, f"{convert.accepts}, or a list of them", _one_or_list_schema(convert.schema)
    )


_listen_addresses = _one_or_list(listen_address, "address")


@accepting(
    "a host name like api.example.com or a wildcard like *.example.com",
    {"type": "string", "pattern": r"^(?:\*\.)?[A-Za-z0-9_.-]+$"},
)
def _sni_name(node: yaml.Node, label: str) -> str:
    # An exact host name, or `*.` and a host name: the wildcard stands for exactly one
    # label (as nginx's and HAProxy's SNI maps, and certificates, RFC 6125 §6.4.3).
    value = scalar(node, label)
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


sni_names = _one_or_list(_sni_name, "name")


@accepting("a host name like lb.example.com", {"type": "string", "pattern": r"^[A-Za-z0-9_.-]+$"})
def _host_name(node: yaml.Node, label: str) -> str:
    value = scalar(node, label)
    requirement = "a host name like lb.example.com"
    if not isinstance(value, str):
        raise _expected(label, requirement, node)
    name = value.lower().removesuffix(".")
    if not _HOST_NAME.fullmatch(name) or ".." in name or _DOTTED_NUMBERS.fullmatch(name):
        raise _expected(label, requirement, node)
    return name


host_names = _one_or_list(_host_name, "host name")


@accepting(
    "IP:PORT, [IPv6]:PORT, localhost:PORT or none",
    {"anyOf": [{"type": "null"}, {"const": "none"}, _ADDRESS_SCHEMA]},
)
def admin_listen(node: yaml.Node, label: str) -> Address | None:
    # `listen: none` (or an empty value) turns the admin endpoint off.
    if scalar(node, label) in (None, "none"):
        return None
    address: Address = listen_address(node, label)
    return address


# A Unix socket's path must fit `sun_path` (108 bytes, with the terminating NUL).
MAX_SOCKET_PATH = 107


@accepting(
    "an absolute path or none",
    {"anyOf": [{"type": "null"}, {"const": "none"}, {"type": "string", "pattern": "^/"}]},
)
def admin_socket(node: yaml.Node, label: str) -> str | None:
    # `socket: none` (or an empty value): no admin socket, only the TCP endpoint.
    value = scalar(node, label)
    if value in (None, "none"):
        return None
    if not isinstance(value, str) or not value.startswith("/"):
        raise _expected(label, "an absolute path or none", node)
    if "\0" in value or len(value.encode()) > MAX_SOCKET_PATH:
        raise _expected(
            label, f"a path of at most {MAX_SOCKET_PATH} bytes (a Unix socket's limit)", node
        )
    return value


@accepting(
    "an address (IP:PORT, [IPv6]:PORT), a list of them, or none",
    {"anyOf": [{"const": "none"}, _one_or_list_schema(_ADDRESS_SCHEMA)]},
)
def vs_listen(node: yaml.Node, label: str) -> tuple[Address, ...]:
    # `listen: none`: a locator-only virtual server (SPEC §10) binds nothing.
    if scalar(node, label) == "none":
        return ()
    addresses: tuple[Address, ...] = _listen_addresses(node, label)
    return addresses


@accepting("a DNS zone like lb.internal.", {"type": "string", "pattern": "^[A-Za-z0-9_.-]+$"})
def dns_zone(node: yaml.Node, label: str) -> str:
    value = scalar(node, label)
    text = value.rstrip(".") if isinstance(value, str) else ""
    if not text or not _HOST_NAME.fullmatch(text):
        raise _expected(label, "a DNS zone like lb.internal.", node)
    return text.lower() + "."


_NETWORK_SCHEMA: Schema = {"type": "string", "pattern": r"^\s*[0-9A-Fa-f:.]+(?:/[0-9.]+)?\s*$"}


@accepting(
    "a list of CIDR networks like 10.0.0.0/8 (a bare IP is a /32 or /128)",
    {"anyOf": [_NETWORK_SCHEMA, {"type": "array", "items": _NETWORK_SCHEMA}]},
)
def networks(node: yaml.Node, label: str) -> tuple[IPNetwork, ...]:
    """A list of CIDR networks (a single one is accepted too); a bare IP is a /32 or /128."""
    items = node.value if isinstance(node, yaml.SequenceNode) else [node]
    networks = []
    for item in items:
        try:
            networks.append(_parse_network(scalar(item, label)))
        except ValueError as exc:
            raise _expected(
                label, "a list of CIDR networks like 10.0.0.0/8", item, str(exc)
            ) from None
    return tuple(networks)


@accepting("a regular expression", {"type": "string", "minLength": 1, "format": "regex"})
def regex(node: yaml.Node, label: str) -> str:
    pattern: str = string(node, label)
    try:
        re.compile(pattern)
    except re.error as exc:
        raise _expected(label, "a regular expression", node, str(exc)) from None
    return pattern


status_codes = _one_or_list(integer(100, 599), "status code")


_HEX = r"(?:\s*[0-9A-Fa-f]{2})+\s*"


@accepting(
    'bytes as hex digits, e.g. "0d0a" or "0d 0a" (quoted)',
    {"type": "string", "pattern": f"^{_HEX}$"},
)
def hex_bytes(node: yaml.Node, label: str) -> bytes:
    """Two hex digits a byte, spaces allowed between bytes; a string (YAML reads an
    unquoted `1234` as a number: it must be quoted)."""
    value = scalar(node, label)
    if not isinstance(value, str) or not re.fullmatch(_HEX, value):
        raise _expected(label, 'hex digits, two a byte (quoted, e.g. "0d0a")', node)
    return bytes.fromhex("".join(value.split()))


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


@accepting(
    f"a prime from 101 to {MAX_TABLE_SIZE}",
    {"type": "integer", "minimum": 101, "maximum": MAX_TABLE_SIZE},
)
def table_size(node: yaml.Node, label: str) -> int:
    # Maglev's permutations (offset + j * skip) mod M visit every slot only when M is prime.
    value = scalar(node, label)
    requirement = f"a prime from 101 to {MAX_TABLE_SIZE} (e.g. 65537, 131071 or 1000003)"
    if not _is_int(value) or not 101 <= value <= MAX_TABLE_SIZE:
        raise _expected(label, requirement, node)
    if not _is_prime(value):
        raise _expected(label, requirement, node, f"{value} is not prime")
    return value


@accepting(
    "a DNS name like _web._tcp.service.consul",
    {"type": "string", "pattern": r"^\s*[A-Za-z0-9_.-]+\s*$"},
)
def dns_name(node: yaml.Node, label: str) -> str:
    value = scalar(node, label)
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


@accepting(
    "SRV, A or AAAA (any case)",
    {"type": "string", "pattern": "^(?:[Ss][Rr][Vv]|[Aa]|[Aa][Aa][Aa][Aa])$"},
)
def record_type(node: yaml.Node, label: str) -> str:
    value = scalar(node, label)
    if isinstance(value, str) and value.upper() in _DISCOVERY_TYPES:
        return value.upper()  # `srv` or `a` is what a user means; DNS types are uppercase
    raise _expected(label, "one of SRV, A, AAAA", node)


@accepting("an IP address, IP:PORT or [IPv6]:PORT (port 53 by default)", {"type": "string"})
def _resolver(node: yaml.Node, label: str) -> Address:
    """A resolver: an IP address with an optional port (53), `IP:PORT` or `[v6]:PORT`."""
    value = scalar(node, label)
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


resolvers = _one_or_list(_resolver, "resolver")


@accepting(
    "an integer >= 1 or auto", {"anyOf": [{"const": "auto"}, {"type": "integer", "minimum": 1}]}
)
def workers(node: yaml.Node, label: str) -> int:
    if scalar(node, label) == "auto":
        return os.cpu_count() or 1
    try:
        return cast(int, integer(1)(node, label))
    except Invalid:
        raise _expected(label, "an integer >= 1 or auto", node) from None


@accepting(
    "an integer >= 1 or auto",
    {"anyOf": [{"const": "auto"}, {"type": "integer", "minimum": 1}]},
)
def max_clients(node: yaml.Node, label: str) -> int | None:
    # `auto` (None): derived from the open-file limit at start (lbproxy/net/descriptors.py).
    if scalar(node, label) == "auto":
        return None
    try:
        return cast(int, integer(1)(node, label))
    except Invalid:
        raise _expected(label, "an integer >= 1 or auto", node) from None


@accepting(
    "an integer >= 0 or none",
    {"anyOf": [{"type": "null"}, {"const": "none"}, {"type": "integer", "minimum": 0}]},
)
def responses(node: yaml.Node, label: str) -> int | None:
    # `responses: none` (or empty): replies are not counted, the session ends when idle.
    if scalar(node, label) in (None, "none"):
        return None
    try:
        return cast(int, integer(0)(node, label))
    except Invalid:
        raise _expected(label, "an integer >= 0 or none", node) from None


def duration_or_none() -> Converter:
    """A duration > 0, or `none` (or empty): None."""
    positive = duration(positive=True)
    requirement = "a duration (250ms, 5s, 2m, 1h or seconds) > 0, or none"

    def convert(node: yaml.Node, label: str) -> float | None:
        if scalar(node, label) in (None, "none"):
            return None
        try:
            return cast(float, positive(node, label))
        except Invalid:
            raise _expected(label, requirement, node) from None

    return Converter(
        convert,
        requirement,
        {"anyOf": [{"type": "null"}, {"const": "none"}, positive.schema]},
    )


def percentage(at_most: float) -> Converter:
    """A percentage from 0 to `at_most`: `20%` (or the number 20), as a float (20.0)."""
    requirement = f"a percentage from 0% to {at_most:g}% (like 20%)"

    def convert(node: yaml.Node, label: str) -> float:
        value = scalar(node, label)
        number: float | None = None
        if isinstance(value, str) and value.strip().endswith("%"):
            with contextlib.suppress(ValueError):
                number = float(value.strip()[:-1])
        elif _is_number(value):
            number = float(value)
        if number is None or not 0 <= number <= at_most:  # NaN fails both
            raise _expected(label, requirement, node)
        return number

    text = r"^\s*" + _NUMBER_FORMS + r"\s*%\s*$"
    return Converter(
        convert,
        requirement,
        {
            "anyOf": [
                {"type": "number", "minimum": 0, "maximum": at_most},
                {"type": "string", "pattern": text},
            ]
        },
    )


@accepting("2c or 3", {"enum": ["2c", "3", 3]})
def snmp_version(node: yaml.Node, label: str) -> str:
    # YAML reads `version: 3` as an int and `version: 2c` as a string; both are fine.
    value = scalar(node, label)
    if value in ("2c", "3") or (_is_int(value) and value == 3):
        return str(value)
    raise _expected(label, "2c or 3", node)


_OID = re.compile(r"\.?[0-9]+(?:\.[0-9]+)+")


@accepting(
    "a dotted numeric OID like 1.3.6.1.4.1.2021.10.1.5.1",
    {"type": "string", "pattern": r"^\.?[0-9]+(?:\.[0-9]+)+$"},
)
def oid(node: yaml.Node, label: str) -> str:
    value = scalar(node, label)
    if not isinstance(value, str) or not _OID.fullmatch(value):
        raise _expected(label, "a dotted numeric OID like 1.3.6.1.4.1.2021.10.1.5.1", node)
    return value.lstrip(".")


@accepting("a host name or IP address", {"type": "string", "minLength": 1})
def host(node: yaml.Node, label: str) -> str:
    value = scalar(node, label)
    try:
        if not isinstance(value, str):
            raise ValueError("a host must be a string")
        if ":" in value:  # a bare IPv6 literal needs no brackets here: there is no port
            return str(ipaddress.IPv6Address(value))
        return _parse_host(value, listen=False)
    except ValueError as exc:
        raise _expected(label, "a host name or IP address", node, str(exc)) from None


@accepting("a path starting with /", {"type": "string", "pattern": "^/"})
def http_path(node: yaml.Node, label: str) -> str:
    value = scalar(node, label)
    if not isinstance(value, str) or not value.startswith("/"):
        raise _expected(label, "a path starting with /", node)
    return value


# -- global.cluster.redis (SPEC §18) ---------------------------------------------------

_TLS_QUERY = ("ssl_ca_certs", "ssl_cert_reqs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
_REDIS_URL_EXAMPLE = "redis://HOST:6379/0, rediss://HOST:6379/0 or unix:///PATH"


@accepting(
    _REDIS_URL_EXAMPLE,
    {"type": "string", "pattern": "^(?:[Rr][Ee][Dd][Ii][Ss][Ss]?|[Uu][Nn][Ii][Xx])://"},
)
def redis_url(node: yaml.Node, label: str) -> str:
    """A Redis URL as coredis reads it, checked here so that a typo is a FILE:LINE error,
    not a failure at run time. No password in it: URLs are shown in logs and summaries
    (a user name may be given, for Redis 6 ACLs; the password goes in password_file)."""
    value = scalar(node, label)
    if not isinstance(value, str) or not value:
        raise _expected(label, _REDIS_URL_EXAMPLE, node)
    parts = urllib.parse.urlsplit(value)
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "unix"):
        raise _expected(label, _REDIS_URL_EXAMPLE, node, "the scheme is redis, rediss or unix")
    try:
        password, port = parts.password, parts.port
    except ValueError:
        raise _expected(label, _REDIS_URL_EXAMPLE, node, "the port is not a number") from None
    if password:
        raise Invalid(
            f"{label}: put the password in password_file, not in the URL "
            "(a URL is shown in logs and in `lbproxy check`)",
            node,
        )
    allowed = _TLS_QUERY if scheme == "rediss" else ("db",) if scheme == "unix" else ()
    for key in urllib.parse.parse_qs(parts.query, keep_blank_values=True):
        if key not in allowed:
            options = ", ".join(allowed) or "none"
            raise Invalid(f"{label}: unknown URL option {key!r} (options: {options})", node)
    if scheme == "unix":
        if parts.netloc.rpartition("@")[2] or not parts.path.startswith("/"):
            raise _expected(label, "unix:///ABSOLUTE/PATH", node)
        return value
    if not parts.hostname:
        raise _expected(label, _REDIS_URL_EXAMPLE, node, "no host")
    if port == 0:
        raise _expected(label, _REDIS_URL_EXAMPLE, node, "port 0")
    database = parts.path.strip("/")
    if database and not (database.isascii() and database.isdigit()):
        raise _expected(label, _REDIS_URL_EXAMPLE, node, "the path is a database number")
    return value


_KEY_PREFIX = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@accepting(
    "up to 64 letters, digits, '.', '_', ':' or '-'",
    {"type": "string", "pattern": "^[A-Za-z0-9_.:-]{1,64}$"},
)
def redis_key_prefix(node: yaml.Node, label: str) -> str:
    # Keys are matched with SCAN patterns: no glob characters (* ? [ ]) and no spaces.
    value = scalar(node, label)
    if not isinstance(value, str) or not _KEY_PREFIX.fullmatch(value):
        raise _expected(label, "up to 64 letters, digits, '.', '_', ':' or '-'", node)
    return value


_MEMBER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@accepting(
    "up to 64 letters, digits, '.', '_' or '-'",
    {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
)
def member_name(node: yaml.Node, label: str) -> str:
    value = scalar(node, label)
    if not isinstance(value, str) or not _MEMBER_NAME.fullmatch(value):
        raise _expected(label, "up to 64 letters, digits, '.', '_' or '-'", node)
    return value
