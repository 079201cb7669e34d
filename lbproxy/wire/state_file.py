"""The state file (`global.state_file`, SPEC §17): the runtime state as bytes and back.

PURE: no trio, no sockets, no clock (the caller passes the wall-clock time in). Encoding
and validation only; lbproxy/runtime/state.py decides what goes in, when the file is
written, and how a decoded `State` is applied to the running pools.

The file is versioned JSON, one object, as HAProxy's `server-state-file` is one line per
server: only what the files cannot say. Per virtual server, the real servers whose
runtime state, weight or last load report is not the file configuration's, each with the
address it had (a server whose address changed since is reset, not restored), and the
persistence entries in table order (least recently touched first), each with the
wall-clock time it expires at (a restart may take any time; an entry that expired
meanwhile is dropped on reading):

    {"lbproxy_state": 1, "written": 1764745200.5,
     "virtual_servers": [
       {"name": "web",
        "real_servers": [{"name": "b", "address": "10.0.0.2:80", "state": "drain"},
                         {"name": "a", "address": "10.0.0.1:80", "weight": 7,
                          "load": [0.5, 0.01]}],
        "persistence": [["192.0.2.7", "a", 1764745500.0]],
        "added": [{"name": "c", "address": "10.0.0.3:80", "weight": 2}],
        "removed": [["d", "10.0.0.4:80"]]}]}

`added` (the real servers added at run time, each as the entry it was given: read again
by the configuration reader when restored) and `removed` (those removed at run time
that a file names: name and the address it had) are left out when empty.

`lbproxy upgrade` hands the same document to the new process with every real server in
it and more keys: `"since"` (the wall-clock time of its last change of state or health)
and `"downtime"` (seconds it has spent down), and for a virtual server with active
checks `"up": true` or `false`, its health as the old process last saw it (HAProxy's
`server-state-file` carries the operational state too), and `"check": [result, reason,
at, duration]`, its last check, once there was one. The file never holds them: a
restart may take any time, and checks say again.

The file is input that anyone with write access to its folder, a full disk or a crash
may have spoilt. So `decode` accepts exactly what `encode` writes, bounded (MAX_BYTES,
names as the configuration allows them, states and weights as a PATCH allows them, finite
numbers in range), and for any other bytes raises one `StateFileError` with a short
reason; never another exception (tests/property/test_state_file.py feeds it anything).
A file is used whole or not at all.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from lbproxy.config.model import MAX_WEIGHT
from lbproxy.wire.cluster_messages import (
    MAX_ADDRESS,
    MAX_LOAD,
    NAME,
    STATES,
    MessageError,
    client_address,
    server_entry,
)

VERSION = 1  # "lbproxy_state"; a file of another version is refused (and replaced)
MAX_BYTES = 64 * 1024 * 1024  # a larger file is refused unread (~600 k entries fit)
MAX_TIME = 1e11  # seconds since 1970: any wall-clock time lbproxy will see
CHECK_RESULTS = ("ok", "fail", "timeout")  # an active check's (lbproxy_health_checks_total)
MAX_REASON = 4096  # characters of a check's reason: a reason quotes at most a few bytes


class StateFileError(ValueError):
    """Bytes that are not a state file `encode` wrote; the message says why."""


@dataclass(frozen=True, slots=True)
class ServerState:
    """One real server's runtime changes; a field is None when the file's value holds."""

    name: str
    address: str  # the address it had when written: restored only to the same address
    state: str | None = None  # enabled | drain | disabled
    weight: int | None = None  # 0..MAX_WEIGHT
    load: tuple[float, float] | None = None  # the last load report: (load, per_connection)
    up: bool | None = None  # its health, in an upgrade's hand-over only (never in the file)
    # ... and its last active check there: (result, reason, at: wall-clock, duration in s)
    check: tuple[str, str, float, float] | None = None
    since: float | None = None  # hand-over only: its last change of state or health (wall)
    downtime: float | None = None  # hand-over only: seconds it has spent down (health)


@dataclass(frozen=True, slots=True)
class StickyEntry:
    client: str  # the persistence key (lbproxy.core.persistence.client_key)
    real_server: str
    expires: float  # wall-clock seconds since 1970


@dataclass(frozen=True, slots=True)
class VirtualServerState:
    name: str
    real_servers: tuple[ServerState, ...] = ()
    persistence: tuple[StickyEntry, ...] = ()
    added: tuple[dict[str, Any], ...] = ()  # real servers added at run time: their entries
    removed: tuple[tuple[str, str], ...] = ()  # removed at run time: (name, address)


@dataclass(frozen=True, slots=True)
class State:
    written: float  # wall-clock seconds since 1970
    virtual_servers: tuple[VirtualServerState, ...] = ()


# -- encoding ---------------------------------------------------------------------------


def encode(state: State) -> bytes:
    return json.dumps(_document(state), separators=(",", ":"), allow_nan=False).encode()


def _document(state: State) -> dict[str, Any]:
    return {
        "lbproxy_state": VERSION,
        "written": state.written,
        "virtual_servers": [_virtual_server_document(vs) for vs in state.virtual_servers],
    }


def _virtual_server_document(vs: VirtualServerState) -> dict[str, Any]:
    document: dict[str, Any] = {
        "name": vs.name,
        "real_servers": [_server(rs) for rs in vs.real_servers],
        "persistence": [[e.client, e.real_server, e.expires] for e in vs.persistence],
    }
    if vs.added:
        document["added"] = list(vs.added)
    if vs.removed:
        document["removed"] = [list(pair) for pair in vs.removed]
    return document


def _server(rs: ServerState) -> dict[str, Any]:
    document: dict[str, Any] = {"name": rs.name, "address": rs.address}
    if rs.state is not None:
        document["state"] = rs.state
    if rs.weight is not None:
        document["weight"] = rs.weight
    if rs.load is not None:
        document["load"] = list(rs.load)
    if rs.up is not None:
        document["up"] = rs.up
    if rs.check is not None:
        document["check"] = list(rs.check)
    if rs.since is not None:
        document["since"] = rs.since
    if rs.downtime is not None:
        document["downtime"] = rs.downtime
    return document


# -- decoding -----------------------------------------------------------------------------


def decode(data: bytes) -> State:
    """The State `data` holds; raises StateFileError (only) for anything else."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise StateFileError(f"not bytes: {type(data).__name__}")
    if len(data) > MAX_BYTES:
        raise StateFileError(f"{len(data)} bytes (at most {MAX_BYTES})")
    if not data:
        raise StateFileError("empty")
    try:
        document = json.loads(bytes(data).decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        # A file cut short by a crash or a full disk ends here ("Expecting ..." at its end).
        raise StateFileError(f"not JSON ({type(exc).__name__}: {_short(str(exc), 80)})") from None
    document = _object(document, "the file", ("lbproxy_state", "written", "virtual_servers"))
    version = document["lbproxy_state"]
    if version != VERSION or isinstance(version, bool):
        raise StateFileError(f"version {_short(version)}, not {VERSION}")
    written = _real(document["written"], "written", MAX_TIME)
    return State(written, tuple(_virtual_server(vs) for vs in _list(document, "virtual_servers")))


def _virtual_server(value: object) -> VirtualServerState:
    document = _object(
        value, "a virtual server", ("name", "real_servers", "persistence"), ("added", "removed")
    )
    name = _name(document["name"], "virtual server name")
    return VirtualServerState(
        name,
        tuple(_real_server(rs) for rs in _list(document, "real_servers")),
        tuple(_entry(row) for row in _list(document, "persistence")),
        tuple(_added(entry) for entry in _list(document, "added", optional=True)),
        tuple(_removed(row) for row in _list(document, "removed", optional=True)),
    )


def _added(value: object) -> dict[str, Any]:
    """An added real server's entry (cluster_messages.server_entry: bounded, checked
    by the configuration reader when it is restored)."""
    try:
        return server_entry(value)
    except ValueError as exc:
        raise StateFileError(str(exc)) from None


def _removed(row: object) -> tuple[str, str]:
    if not isinstance(row, list) or len(row) != 2:
        raise StateFileError(f"a removed server is not [name, address]: {_short(row)}")
    name, address = row
    if not isinstance(address, str) or not 1 <= len(address) <= MAX_ADDRESS:
        raise StateFileError(f"address {_short(address)}")
    return _name(name, "removed real server name"), address


def _real_server(value: object) -> ServerState:
    document = _object(
        value,
        "a real server",
        ("name", "address"),
        ("state", "weight", "load", "up", "check", "since", "downtime"),
    )
    address = document["address"]
    if not isinstance(address, str) or not 1 <= len(address) <= MAX_ADDRESS:
        raise StateFileError(f"address {_short(address)}")
    state = document.get("state")
    if state is not None and (not isinstance(state, str) or state not in STATES):
        raise StateFileError(f"state {_short(state)}")
    weight = document.get("weight")
    if weight is not None:
        weight = _integer(weight, "weight", 0, MAX_WEIGHT)
    load = document.get("load")
    if load is not None:
        if not isinstance(load, list) or len(load) != 2:
            raise StateFileError(f"load is not [load, per_connection]: {_short(load)}")
        load = (_real(load[0], "load", MAX_LOAD), _real(load[1], "per_connection", MAX_LOAD))
    up = document.get("up")
    if up is not None and not isinstance(up, bool):
        raise StateFileError(f"up is not true or false: {_short(up)}")
    check = document.get("check")
    if check is not None:
        check = _check(check)
    since, downtime = document.get("since"), document.get("downtime")
    if since is not None:
        since = _real(since, "since", MAX_TIME)
    if downtime is not None:
        downtime = _real(downtime, "downtime", MAX_TIME)
    name = _name(document["name"], "real server name")
    return ServerState(name, address, state, weight, load, up, check, since, downtime)


def _check(value: object) -> tuple[str, str, float, float]:
    if not isinstance(value, list) or len(value) != 4:
        raise StateFileError(f"check is not [result, reason, at, duration]: {_short(value)}")
    result, reason, at, duration = value
    if result not in CHECK_RESULTS:
        raise StateFileError(f"check result {_short(result)}")
    if not isinstance(reason, str) or len(reason) > MAX_REASON:
        raise StateFileError(f"check reason {_short(reason)}")
    return (
        result,
        reason,
        _real(at, "check time", MAX_TIME),
        _real(duration, "check duration", MAX_TIME),
    )


def _entry(row: object) -> StickyEntry:
    if not isinstance(row, list) or len(row) != 3:
        raise StateFileError(f"an entry is not [client, server, expires]: {_short(row)}")
    client, server, expires = row
    try:
        client = client_address(client)
    except MessageError as exc:
        raise StateFileError(exc.detail) from None
    return StickyEntry(client, _name(server, "server"), _real(expires, "expires", MAX_TIME))


def _object(
    value: object, what: str, keys: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise StateFileError(f"{what} is not a JSON object")
    present = set(value)
    if not set(keys) <= present <= set(keys) | set(optional):
        raise StateFileError(f"{what} has keys {_short(sorted(present))}, expected {keys}")
    return value


def _list(document: dict[str, Any], key: str, optional: bool = False) -> list[Any]:
    value = document.get(key, []) if optional else document[key]
    if not isinstance(value, list):
        raise StateFileError(f"{key} is not a list")
    return value


def _no_constant(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _name(value: object, what: str) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise StateFileError(f"{what} is not a name: {_short(value)}")
    return value


def _integer(value: object, what: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise StateFileError(f"{what} is not an integer {low}..{high}: {_short(value)}")
    return value


def _real(value: object, what: str, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise StateFileError(f"{what} is not a number: {_short(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not (math.isfinite(number) and 0 <= number <= high):
        raise StateFileError(f"{what} is out of range: {_short(value)}")
    return number


def _short(value: object, limit: int = 40) -> str:
    text = value if isinstance(value, str) and limit > 40 else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
