"""The cluster's messages (SPEC §18): what lbproxy instances write to Redis and read back.

PURE: no trio, no sockets, no clock. Encoding and validation only; the sync itself
(lbproxy/control/cluster.py) owns the Redis keys and channels.

Everything read from Redis is input from the network: another lbproxy wrote it, or
anyone who can reach the Redis server did. So `decode_*` accepts exactly what
`encode_*` writes and nothing else — UTF-8 JSON, one object, the exact set of keys, the
protocol version, names as the configuration allows them, weights and states as a PATCH
allows them, finite numbers in range, a bounded size — and raises `MessageError`
(with a short `reason` for the metrics: oversized, garbage, invalid) for anything
else. A message is applied whole or not at all: its caller gets a validated object or
an exception, never a half-read one.

Every message and every value is signed (`Signer`): HMAC-SHA256 under the cluster's
key (`global.cluster.key_file`) over a fixed label, the key prefix, the kind of the
message (or, for a persistence entry, the Redis key it is stored under) and the body,
written in front of the body as 64 hex digits and a dot:

    MAC "." BODY      MAC = hex(HMAC-SHA256(key, "lbproxy-cluster/2" LF PREFIX LF KIND LF BODY))

KIND is `change`, `entries`, `member`, or `p:VS:CLIENT` for a persistence entry: a
value signed for one place is refused in another (another prefix, another kind,
another client's key). A message whose MAC is missing or wrong is refused
("signature") before its body is read.

Three kinds of message:

- `Change`: one runtime change of a real server (state, weight or load report),
  versioned. The version is a hybrid logical clock (Kulkarni et al., 2014): the
  wall clock in milliseconds shifted left by VERSION_SHIFT bits, plus a counter, and
  never lower than one above any version this instance has seen; ties are broken by
  the origin's name. Two changes to one server therefore settle on the later one
  everywhere: every instance keeps the highest (version, origin).
- `EntryBatch`: persistence entries one instance created or moved (client -> real
  server, with the time they have left when the batch was made, and when that was),
  for one virtual server. Each entry is also stored under its own key
  (`encode_entry_value`: `EXPIRES_MS SERVER`, signed for that key).
- `Member`: the value of an instance's heartbeat key.

`EntryBatch`, `SourceCounts` and `Member` carry the sender's instance id (`INSTANCE`,
optional: an older lbproxy writes none): two instances given the same name apply each
other's messages and notice each other (control/cluster.py).
"""

from __future__ import annotations

import hmac
import json
import math
import re
from dataclasses import dataclass
from ipaddress import ip_address, ip_network
from typing import Any

from lbproxy.config.model import MAX_WEIGHT, MIN_CLUSTER_KEY

PROTOCOL = 2  # "v" of every message; a message of another version is refused
MAX_MESSAGE = 64 * 1024  # bytes of a body; a larger message is refused unread ("oversized")
MAC_LABEL = b"lbproxy-cluster/2"  # the first line of what is MACed
MAC_SIZE = 64  # hex digits of an HMAC-SHA256
MIN_KEY = MIN_CLUSTER_KEY  # bytes of a cluster key, at least
MAX_ENTRIES = 200  # persistence entries per EntryBatch (see `batches`)
MAX_VERSION = 2**53 - 1  # exact in a double (Redis' Lua compares versions as numbers)
VERSION_SHIFT = 10  # 1024 versions per millisecond before the clock part moves on
MAX_LOAD = 1e9  # a load report above this is refused (no real load is)
MAX_TTL_MS = 366 * 24 * 3600 * 1000  # a persistence entry's time left, at most a year
# topology: a real server added at run time (its entry) or removed (null), SPEC §24
KINDS = ("state", "weight", "load", "topology")
MAX_ENTRY_KEYS = 32  # keys of an added real server's entry, at each level
MAX_ENTRY_TEXT = 1000  # characters of a key or string in an added real server's entry
MAX_ADDRESS = 300  # characters of a real server's address as written (`HOST:PORT`)
STATES = ("enabled", "drain", "disabled")  # lbproxy.core.pool.STATES (a test checks)
REASONS = ("oversized", "garbage", "invalid", "signature")
# A message made this far ahead of the receiver's clock is refused ("future"): one forged
# (or made by a host whose clock is wrong) with a version far ahead would otherwise win
# its field for ever and pull every instance's clock (next_version) with it.
MAX_AHEAD = 60.0
KIND_CHANGE, KIND_ENTRIES, KIND_MEMBER = "change", "entries", "member"
KIND_SOURCES = "sources"
MAX_NETWORKS = 400  # client networks per SourceCounts message (see `source_batches`)
MAX_SOURCE_COUNT = 10**7  # an open count or arrival count above this is refused

# Names as the configuration allows them (config/values.py `plain_name`, `member_name`).
NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
MEMBER = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# An instance id: random per lbproxy (kept across an upgrade, shared by the workers of
# one supervisor), so that two instances given one name can tell each other apart.
INSTANCE = re.compile(r"[0-9a-f]{16}")


class MessageError(ValueError):
    """A message that is not one of ours; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Change:
    kind: str  # state | weight | load
    virtual_server: str
    real_server: str
    value: Any  # state: a STATES name; weight: an int 0..MAX_WEIGHT; load: a float >= 0
    per_connection: float | None  # load only: the per-connection estimate, None: default
    version: int
    origin: str  # the member name of the instance that made the change

    @property
    def field(self) -> str:
        """Its field in the cluster's state hash: one per kind and real server."""
        return f"{self.kind}/{self.virtual_server}/{self.real_server}"

    @property
    def order(self) -> tuple[int, str]:
        """What decides between two changes of one field: the higher wins."""
        return (self.version, self.origin)


@dataclass(frozen=True, slots=True)
class RemoteEntry:
    client: str  # the persistence key: the client's address (persistence.client_key)
    real_server: str
    ttl_ms: int  # how long the entry has left


@dataclass(frozen=True, slots=True)
class EntryBatch:
    origin: str
    virtual_server: str
    entries: tuple[RemoteEntry, ...]
    time: float = 0.0  # Unix time the batch was made at (its entries' TTLs count from then)
    instance: str | None = None  # the sender's instance id (None: an older lbproxy's)


@dataclass(frozen=True, slots=True)
class SourceCounts:
    """One instance's per-source counts of one virtual server (`per_source.shared`):
    per client network (an address, or a network `ADDRESS/PREFIX`), its open connections
    and its arrivals within the last `interval`, as of `time`. A publication too large
    for one message is cut into several with the same `time`."""

    origin: str
    virtual_server: str
    time: float  # Unix time the counts were taken at
    networks: tuple[tuple[str, int, int], ...]  # (network, open, recent)
    instance: str | None = None  # the sender's instance id (None: an older lbproxy's)


@dataclass(frozen=True, slots=True)
class Member:
    name: str
    last_seen: float  # Unix time of its last heartbeat, seconds
    instance: str | None = None  # its instance id (None: an older lbproxy's)


def next_version(wall_seconds: float, last: int) -> int:
    """The version of a change made now: the clock's, or one above the last seen."""
    return min(max(int(wall_seconds * 1000) << VERSION_SHIFT, last + 1), MAX_VERSION)


def version_time(version: int) -> float:
    """The wall-clock time (seconds) a version was made at (within its counter)."""
    return (version >> VERSION_SHIFT) / 1000


# -- signing ----------------------------------------------------------------------------


class Signer:
    """Signs and checks what one cluster (one key, one key prefix) writes to Redis."""

    def __init__(self, key: bytes, prefix: str) -> None:
        if len(key) < MIN_KEY:
            raise ValueError(f"a cluster key has at least {MIN_KEY} bytes, not {len(key)}")
        self._key = key
        self._head = MAC_LABEL + b"\n" + prefix.encode("ascii") + b"\n"

    def mac(self, kind: str, body: bytes) -> bytes:
        """The hex MAC of `body` as a message of `kind`."""
        message = self._head + kind.encode("utf-8", "surrogateescape") + b"\n" + body
        return hmac.new(self._key, message, "sha256").hexdigest().encode("ascii")

    def sign(self, kind: str, body: bytes) -> bytes:
        return self.mac(kind, body) + b"." + body

    def open(self, kind: str, data: object) -> bytes:
        """The body of a signed message of `kind`; MessageError when it is not one."""
        if isinstance(data, str):
            data = data.encode("utf-8", "surrogateescape")
        if not isinstance(data, bytes | bytearray | memoryview):
            raise MessageError("garbage", f"not bytes: {type(data).__name__}")
        data = bytes(data)
        if len(data) > MAC_SIZE + 1 + MAX_MESSAGE:
            raise MessageError("oversized", f"{len(data)} bytes (at most {MAX_MESSAGE})")
        if data[MAC_SIZE : MAC_SIZE + 1] != b".":
            raise MessageError("signature", "no MAC")
        body = data[MAC_SIZE + 1 :]
        if not hmac.compare_digest(data[:MAC_SIZE], self.mac(kind, body)):
            raise MessageError("signature", f"a wrong MAC on a message of kind {kind}")
        return body


# -- encoding ---------------------------------------------------------------------------


def _dump(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":"), allow_nan=False).encode()


def encode_change(change: Change) -> bytes:
    document: dict[str, Any] = {
        "v": PROTOCOL,
        "kind": change.kind,
        "vs": change.virtual_server,
        "rs": change.real_server,
        "value": change.value,
        "version": change.version,
        "origin": change.origin,
    }
    if change.kind == "load":
        document["per_connection"] = change.per_connection
    return _dump(document)


def encode_entries(batch: EntryBatch) -> bytes:
    rows = [[e.client, e.real_server, e.ttl_ms] for e in batch.entries]
    return encode_rows(batch.origin, batch.virtual_server, rows, batch.time, batch.instance)


def _head(origin: str, instance: str | None) -> dict[str, Any]:
    head: dict[str, Any] = {"v": PROTOCOL, "origin": origin}
    if instance is not None:
        head["instance"] = instance
    return head


def encode_rows(
    origin: str, vs: str, rows: list[list[Any]], time: float, instance: str | None = None
) -> bytes:
    """An EntryBatch from its rows `[client, real server, ttl_ms]` as they are (the
    sender's fast path: no RemoteEntry per entry); at most MAX_ENTRIES of them."""
    return _dump({**_head(origin, instance), "vs": vs, "time": time, "entries": rows})


def entries_prefix(origin: str, instance: str | None = None) -> bytes:
    """How every batch body that `encode_entries` writes for `origin` and `instance`
    begins, so that an instance can pass over its own batches without decoding them
    (and not over those of another instance with the same name)."""
    return _dump(_head(origin, instance))[:-1] + b","


def entry_kind(vs: str, client: str) -> str:
    """The kind a persistence entry's value is signed as: its key after `PREFIX:`."""
    return f"p:{vs}:{client}"


def encode_entry_value(server: str, expires_ms: int) -> bytes:
    """The value stored under a persistence entry's key: when it expires (Unix time in
    milliseconds) and its real server."""
    return b"%d %s" % (expires_ms, server.encode("ascii"))


def decode_entry_value(data: bytes) -> tuple[str, int]:
    """(server, expires_ms) of a value `encode_entry_value` wrote; MessageError else."""
    expires, _, server = data.partition(b" ")
    if not expires.isdigit() or len(expires) > 15:
        raise MessageError("invalid", f"entry value {_short(data)}")
    try:
        name = server.decode("ascii")
    except UnicodeDecodeError:
        raise MessageError("invalid", f"entry value {_short(data)}") from None
    return _name(name, "server"), int(expires)


def encode_sources(counts: SourceCounts) -> bytes:
    rows = [list(row) for row in counts.networks]
    return _dump(
        {
            **_head(counts.origin, counts.instance),
            "vs": counts.virtual_server,
            "time": counts.time,
            "networks": rows,
        }
    )


def source_batches(
    origin: str,
    vs: str,
    time: float,
    networks: list[tuple[str, int, int]],
    instance: str | None = None,
) -> list[SourceCounts]:
    """`networks` cut into messages that each encode within MAX_MESSAGE (none: one empty
    message, which tells the others this instance counts nothing now) (a row is at
    most 43 characters of network, two counts of 8 digits and punctuation: < 70 bytes)."""
    return [
        SourceCounts(origin, vs, time, tuple(networks[i : i + MAX_NETWORKS]), instance)
        for i in range(0, max(1, len(networks)), MAX_NETWORKS)
    ]


def encode_member(member: Member) -> bytes:
    document: dict[str, Any] = {"v": PROTOCOL, "name": member.name}
    if member.instance is not None:
        document["instance"] = member.instance
    document["last_seen"] = member.last_seen
    return _dump(document)


def batches(origin: str, vs: str, entries: list[RemoteEntry]) -> list[EntryBatch]:
    """`entries` cut into batches that each encode within MAX_MESSAGE."""
    # An entry encodes within 290 bytes (a client of at most 64 characters, a name of at
    # most 200, a TTL of at most 11 digits, 10 of punctuation): MAX_ENTRIES of them and
    # the rest of the message stay below MAX_MESSAGE with any names the reader allows.
    return [
        EntryBatch(origin, vs, tuple(entries[i : i + MAX_ENTRIES]))
        for i in range(0, len(entries), MAX_ENTRIES)
    ]


# -- decoding -----------------------------------------------------------------------------


def _load(data: object, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(data, bytes | bytearray | memoryview | str):
        raise MessageError("garbage", f"not bytes: {type(data).__name__}")
    if len(data) > MAX_MESSAGE:
        raise MessageError("oversized", f"{len(data)} bytes (at most {MAX_MESSAGE})")
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
        document = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise MessageError("garbage", f"not JSON ({type(exc).__name__})") from None
    if not isinstance(document, dict):
        raise MessageError("garbage", "not a JSON object")
    present = set(document)
    if not set(keys) <= present <= set(keys) | set(optional):
        raise MessageError("invalid", f"keys {sorted(present)}, expected {sorted(keys)}")
    if document["v"] != PROTOCOL or isinstance(document["v"], bool):
        raise MessageError("invalid", f"protocol version {document['v']!r}, not {PROTOCOL}")
    return document


def _no_constant(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) != len(pairs):
        raise ValueError("a key twice")
    return document


def _name(value: object, what: str, pattern: re.Pattern[str] = NAME) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise MessageError("invalid", f"{what} is not a name: {_short(value)}")
    return value


def _integer(value: object, what: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise MessageError("invalid", f"{what} is not an integer {low}..{high}: {_short(value)}")
    return value


def _real(value: object, what: str, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MessageError("invalid", f"{what} is not a number: {_short(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float (JSON allows 4300 digits)
        number = math.inf
    if not (math.isfinite(number) and 0 <= number <= high):
        raise MessageError("invalid", f"{what} is out of range: {_short(value)}")
    return number


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def server_entry(value: object) -> dict[str, Any]:
    """A real server's entry as added at run time: an object with a name and an
    address, of plain values and objects of them (one level), bounded; ValueError with
    the reason otherwise. Its keys and values are the configuration reader's to check."""
    entry = _entry_object(value, "an added real server")
    name = entry.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"added real server name is not a name: {_short(name)}")
    address = entry.get("address")
    if not isinstance(address, str) or not 1 <= len(address) <= MAX_ADDRESS:
        raise ValueError(f"address {_short(address)}")
    for nested in entry.values():
        if isinstance(nested, dict):
            _entry_object(nested, "a block of an added real server", scalars_only=True)
    return entry


def _entry_object(value: object, what: str, scalars_only: bool = False) -> dict[str, Any]:
    if not isinstance(value, dict) or len(value) > MAX_ENTRY_KEYS:
        raise ValueError(f"{what} is not a JSON object of at most {MAX_ENTRY_KEYS} keys")
    for key, item in value.items():
        if not isinstance(key, str) or len(key) > MAX_ENTRY_TEXT:
            raise ValueError(f"{what} has a key that is not a short string")
        if isinstance(item, str) and len(item) > MAX_ENTRY_TEXT:
            raise ValueError(f"{what}: {_short(key)} is {len(item)} characters long")
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{what}: {_short(key)} is not a finite number")
        if isinstance(item, list) or (isinstance(item, dict) and scalars_only):
            raise ValueError(f"{what}: {_short(key)} is not a plain value")
    return value


def decode_change(data: object) -> Change:
    document = _load(
        data, ("v", "kind", "vs", "rs", "value", "version", "origin"), ("per_connection",)
    )
    kind = document["kind"]
    if kind not in KINDS:
        raise MessageError("invalid", f"unknown kind {_short(kind)}")
    value = document["value"]
    per_connection = None
    if kind == "state":
        if value not in STATES or not isinstance(value, str):
            raise MessageError("invalid", f"state {_short(value)}")
    elif kind == "weight":
        value = _integer(value, "weight", 0, MAX_WEIGHT)
    elif kind == "topology":
        if value is not None:
            try:
                value = server_entry(value)
            except ValueError as exc:
                raise MessageError("invalid", str(exc)) from None
    else:
        value = _real(value, "load", MAX_LOAD)
        if document.get("per_connection") is not None:
            per_connection = _real(document["per_connection"], "per_connection", MAX_LOAD)
    if kind != "load" and "per_connection" in document:
        raise MessageError("invalid", "per_connection on a change that is not a load report")
    return Change(
        kind,
        _name(document["vs"], "vs"),
        _name(document["rs"], "rs"),
        value,
        per_connection,
        _integer(document["version"], "version", 0, MAX_VERSION),
        _name(document["origin"], "origin", MEMBER),
    )


def _instance(document: dict[str, Any]) -> str | None:
    """The optional instance id of a message (an older lbproxy writes none)."""
    if "instance" not in document:
        return None
    return _name(document["instance"], "instance", INSTANCE)


def decode_entries(data: object) -> EntryBatch:
    document = _load(data, ("v", "origin", "vs", "time", "entries"), ("instance",))
    rows = document["entries"]
    if not isinstance(rows, list) or not 1 <= len(rows) <= MAX_ENTRIES:
        raise MessageError("invalid", f"entries is not a list of 1..{MAX_ENTRIES}")
    return EntryBatch(
        _name(document["origin"], "origin", MEMBER),
        _name(document["vs"], "vs"),
        tuple(decode_entry(row) for row in rows),
        _real(document["time"], "time", 1e11),
        _instance(document),
    )


def decode_entry(row: object) -> RemoteEntry:
    if not isinstance(row, list) or len(row) != 3:
        raise MessageError("invalid", f"an entry is not [client, server, ttl]: {_short(row)}")
    client, server, ttl = row
    return RemoteEntry(
        client_address(client), _name(server, "server"), _integer(ttl, "ttl", 1, MAX_TTL_MS)
    )


def client_address(value: object) -> str:
    """A persistence key from the network: an IP address as `client_key` writes it."""
    if not isinstance(value, str) or not 2 <= len(value) <= 64:
        raise MessageError("invalid", f"client {_short(value)}")
    try:
        parsed = ip_address(value)
    except ValueError:
        raise MessageError("invalid", f"client {_short(value)} is not an address") from None
    if value != str(parsed):  # one spelling per address, so one key per client
        raise MessageError("invalid", f"client {_short(value)} is not written as {parsed}")
    return value


def decode_sources(data: object) -> SourceCounts:
    document = _load(data, ("v", "origin", "vs", "time", "networks"), ("instance",))
    rows = document["networks"]
    if not isinstance(rows, list) or len(rows) > MAX_NETWORKS:
        raise MessageError("invalid", f"networks is not a list of at most {MAX_NETWORKS}")
    networks = []
    for row in rows:
        if not isinstance(row, list) or len(row) != 3:
            raise MessageError(
                "invalid", f"a network is not [network, open, recent]: {_short(row)}"
            )
        networks.append(
            (
                client_network(row[0]),
                _integer(row[1], "open", 0, MAX_SOURCE_COUNT),
                _integer(row[2], "recent", 0, MAX_SOURCE_COUNT),
            )
        )
    return SourceCounts(
        _name(document["origin"], "origin", MEMBER),
        _name(document["vs"], "vs"),
        _real(document["time"], "time", 1e11),
        tuple(networks),
        _instance(document),
    )


def client_network(value: object) -> str:
    """A client network from the network: an address, or `ADDRESS/PREFIX` with no host
    bits, written as ipaddress writes it (one spelling per network)."""
    if not isinstance(value, str) or not 2 <= len(value) <= 43:
        raise MessageError("invalid", f"network {_short(value)}")
    if "/" not in value:
        return client_address(value)
    try:
        parsed = ip_network(value, strict=True)
    except ValueError:
        raise MessageError("invalid", f"network {_short(value)} is not a network") from None
    if value != str(parsed):
        raise MessageError("invalid", f"network {_short(value)} is not written as {parsed}")
    return value


def decode_member(data: object) -> Member:
    document = _load(data, ("v", "name", "last_seen"), ("instance",))
    return Member(
        _name(document["name"], "name", MEMBER),
        _real(document["last_seen"], "last_seen", 1e11),
        _instance(document),
    )
