"""Runtime state that survives a restart: `global.state_file` (SPEC §17).

What is kept is what the configuration files cannot say (HAProxy's `server-state-file`
is the model): a real server's state and static weight where they differ from its
configuration (set with PATCH, `lbproxy drain`/`set-weight`, or by the cluster), the real
servers added and removed at run time (SPEC §24), the last
load report of each real server, and the persistence entries with the wall-clock time
they expire at. Health, counters, SNMP values and throttle modes are not: they are
measured again within seconds. An upgrade's hand-over (`snapshot(..., handover=True)`)
carries the health and last check of each actively checked server as well: the new
process starts from the old one's verdicts, seconds old, rather than from the files'
(every server up, one added at run time down until its first check); and each server's
timeline (`since`, `downtime_s`), so the operator's view goes on across the upgrade.

The API (lbproxy/runtime/server.py calls it; `lbproxy upgrade` passes the same bytes over
its Unix socket instead of through the file):

    snapshot(server) -> bytes      the state of a running Server, encoded
                                   (lbproxy/wire/state_file.py owns the format)
    restore(server, data, source) -> bool
                                   apply those bytes to a Server whose pools are built
                                   and that accepts nothing yet; never raises: a file
                                   that cannot be read is one warning, False, and the
                                   server runs on its file configuration
    Server.initial_state = data    set before `serve()`: restored instead of the file

Restoring, per virtual server of the snapshot: a virtual or real server that is no longer
configured is skipped and logged; a real server whose address changed is reset (its
state, weight, load report and persistence entries are dropped: it is another server
now); an entry that expired while lbproxy was down is dropped. States and weights are
applied through the Server's own paths (logged as `(state file)`), entries through the
persistence table's `learn`, in their table order, so its LRU order survives too.

Writing (`StateWriter.run`, a service task): once a second a cheap fingerprint of the
state (the runtime changes, and per persistence table its size and its most recently
touched entry — every acquire, release and learn moves an entry to the end) is compared
with the one last written; only when it differs is a snapshot taken (in the event loop,
where the tables are consistent) and written from a thread: temp file in the same folder,
fsync, os.replace, fsync of the folder, so a crash leaves the old file or the new one,
never half of one. A write error is logged once (and its end once). The final write is
made after the drain, when SIGTERM has stopped the process. One writer per file: before
each write the file is compared (inode and mtime: os.replace makes a new inode) with the
one this process wrote last, and a file someone else wrote since — the new process of
`lbproxy upgrade`, which writes at once — ends this process's writing (logged), so an
old process draining after a hand-over never puts its stale state back.

Trusting the file: its folder is writable by lbproxy's user, so what lies at the path
is input, not lbproxy's own. It is opened without following a symbolic link
(O_NOFOLLOW), and a link, anything but a regular file, a file writable by group or
others (anyone else could have written it) or one larger than the format's 64 MiB
(wire/state_file.py MAX_BYTES) is one warning and ignored: the start goes on from the
configuration files. lbproxy never writes through a link: the temp file is created
with O_EXCL|O_NOFOLLOW (mkstemp) in the same folder, mode 0600, and renamed over the
path, which replaces a link there instead of following it.

With `workers: N` each worker has a persistence table of its own: worker 1 writes the
file, worker k (k > 1) writes its part, the same format, to `STATE_FILE.wK` beside it
(`StateWriter.suffix`). At start every process reads the file, then the persistence
entries of every part (`part_paths`: their states and weights are worker 1's already,
PATCHes reach every worker alike), so each worker restores every worker's entries. A
process without workers merges the parts into its own file and removes them after its
first write, so a later `workers: 1` leaves no part behind. An upgrade of a supervisor
hands over one worker's snapshot (its health, timelines and state: the workers check the
same servers and take the same changes); each new worker restores it instead of the
file, then the parts' persistence entries (`initial_state_is_one_workers`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import tempfile
from typing import TYPE_CHECKING, Any, Protocol

import trio

from lbproxy.core.real_server import CheckRecord
from lbproxy.net import wall_clock
from lbproxy.wire.state_file import (
    MAX_BYTES,
    ServerState,
    State,
    StateFileError,
    StickyEntry,
    VirtualServerState,
    decode,
    encode,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from lbproxy.config.model import Config
    from lbproxy.core.pool import Pool, RealServer
    from lbproxy.core.topology import RuntimeTopology

log = logging.getLogger("lbproxy.state")

INTERVAL = 1.0  # seconds between two looks at the state: at most one write per second
VIA = " (state file)"


class Server(Protocol):
    """What the state file reads and restores: lbproxy/runtime/server.py's Server."""

    @property
    def config(self) -> Config: ...

    @property
    def initial_state(self) -> bytes | None: ...

    @property
    def initial_state_is_one_workers(self) -> bool: ...

    @property
    def topology(self) -> Mapping[str, RuntimeTopology]: ...

    def pools(self) -> list[Pool]: ...

    def add_server(self, vs_name: str, entry: object, via: str = "") -> tuple[int, list[str]]: ...

    def remove_server(self, vs_name: str, rs_name: str, via: str = "") -> tuple[int, str]: ...

    def apply_state(self, pool: Pool, rs: RealServer, state: str, via: str = "") -> None: ...

    def apply_weight(
        self, pool: Pool, rs: RealServer, weight: object, via: str = ""
    ) -> str | None: ...


# -- snapshot ---------------------------------------------------------------------------


def snapshot(
    server: Server, wall: float | None = None, now: float | None = None, handover: bool = False
) -> bytes:
    """The runtime state of `server`, encoded (see the module header for what is kept);
    with `handover` (an upgrade's, never the file), every real server's timeline and the
    health and last check of those that active checks watch as well."""
    now = trio.current_time() if now is None else now
    wall = now + wall_clock.offset() if wall is None else wall
    return encode(_state(server, wall, now, handover))


def _state(server: Server, wall: float, now: float, handover: bool = False) -> State:
    return State(
        wall,
        tuple(
            _virtual_server(pool, wall, now, server.topology.get(pool.name), handover)
            for pool in server.pools()
        ),
    )


def _virtual_server(
    pool: Pool,
    wall: float,
    now: float,
    topology: RuntimeTopology | None = None,
    handover: bool = False,
) -> VirtualServerState:
    servers = []
    added: tuple[dict[str, Any], ...] = ()
    removed: tuple[tuple[str, str], ...] = ()
    if topology is not None:
        added = tuple(topology.entries.values())
        removed = topology.removed_from_files()
    # Without active checks health is passive: a new process starts every server up and
    # the first failed connects say otherwise, as at any start.
    checked = handover and pool.config.health_check.type != "none"
    for rs in pool.servers:
        config = rs.config
        state = rs.state if rs.state != config.state else None
        weight = int(rs.static_weight) if rs.static_weight != float(config.weight) else None
        load = pool.locator.reports.get(rs)
        if handover:  # every server, with its timeline
            up = rs.health.up if checked else None
            last = rs.counters.check_last if checked else None
            check = None if last is None else (last.result, last.reason, last.at, last.duration)
            since = wall - max(now - rs.changed_at, 0.0)
            downtime = pool.downtime(rs, now)
            servers.append(
                ServerState(
                    rs.name,
                    str(rs.address),
                    state,
                    weight,
                    load,
                    up=up,
                    check=check,
                    since=since,
                    downtime=downtime,
                )
            )
        elif state is not None or weight is not None or load is not None:
            servers.append(ServerState(rs.name, str(rs.address), state, weight, load))
    entries: list[StickyEntry] = []
    persistence = pool.persistence
    if persistence is not None:
        timeout = persistence.timeout
        for key, entry in persistence.entries.items():
            if entry.active:  # in use: it has its whole timeout once the last one ends
                expires = wall + timeout
            elif entry.expires > now:
                expires = wall + (entry.expires - now)
            else:
                continue  # expired, not swept yet
            entries.append(StickyEntry(key, entry.server.name, expires))
    return VirtualServerState(pool.name, tuple(servers), tuple(entries), added, removed)


def fingerprint(server: Server) -> tuple[Any, ...]:
    """Changes whenever the snapshot would (but for time passing): O(servers), no entry scan."""
    parts: list[Any] = [
        (name, topology.fingerprint()) for name, topology in server.topology.items()
    ]
    for pool in server.pools():
        for rs in pool.servers:
            if rs.state != rs.config.state or rs.static_weight != float(rs.config.weight):
                parts.append((pool.name, rs.name, rs.state, rs.static_weight))
        parts.extend((pool.name, rs.name, load) for rs, load in pool.locator.reports.items())
        persistence = pool.persistence
        if persistence is not None and persistence.entries:
            last = next(reversed(persistence.entries.values()))
            parts.append((pool.name, len(persistence.entries), last.key, id(last.server)))
            parts.append((last.active, last.expires))
    return tuple(parts)


# -- restore ----------------------------------------------------------------------------


def restore(
    server: Server, data: bytes, source: str = "the state file", entries_only: bool = False
) -> bool:
    """Apply a snapshot to `server` before it accepts; False (one warning) when unusable.
    `entries_only`: a worker's part (module header): its persistence entries, no more."""
    try:
        state = decode(data)
    except StateFileError as exc:
        log.warning("%s is unusable (%s); starting from the configuration files", source, exc)
        return False
    now = trio.current_time()
    wall = now + wall_clock.offset()  # as the API shows times: the same moment, the same time
    counts = {"changes": 0, "loads": 0, "entries": 0, "expired": 0, "health": 0}
    pools = {pool.name: pool for pool in server.pools()}
    for vs_state in state.virtual_servers:
        pool = pools.get(vs_state.name)
        if pool is None:
            log.info(
                "%s: virtual server %s is no longer configured; skipped", source, vs_state.name
            )
            continue
        _restore_pool(server, pool, vs_state, wall, now, counts, source, entries_only)
    log.info(
        "restored from %s (written %.0fs ago): %d state/weight change(s), %d load report(s), "
        "%d persistence entries%s%s",
        source,
        max(0.0, wall - state.written),
        counts["changes"],
        counts["loads"],
        counts["entries"],
        f" ({counts['expired']} expired meanwhile)" if counts["expired"] else "",
        f", {counts['health']} health state(s) kept" if counts["health"] else "",
    )
    return True


def _restore_topology(
    server: Server, pool: Pool, vs_state: VirtualServerState, source: str
) -> None:
    """The real servers added and removed at run time: an added one read again as the
    API reads it (one that is no longer valid, or whose name a file now uses, is
    skipped), a removed one removed again while a file names it at the same address."""
    for entry in vs_state.added:
        status, errors = server.add_server(pool.name, entry, VIA)
        if status != 201:
            log.info(
                "%s: added real server %s/%s skipped: %s",
                *(source, pool.name, entry.get("name"), "; ".join(errors)),
            )
    for name, address in vs_state.removed:
        rs = pool.by_name.get(name)
        if rs is not None and str(rs.config.address) == address:
            server.remove_server(pool.name, name, VIA)


def _restore_pool(
    server: Server,
    pool: Pool,
    vs_state: VirtualServerState,
    wall: float,
    now: float,
    counts: dict[str, int],
    source: str,
    entries_only: bool = False,
) -> None:
    if not entries_only:
        _restore_topology(server, pool, vs_state, source)
    reset: set[str] = set()
    for saved in vs_state.real_servers:
        rs = pool.by_name.get(saved.name)
        if rs is None:
            log.info("%s: %s/%s is no longer configured; skipped", source, pool.name, saved.name)
            continue
        if str(rs.address) != saved.address:
            log.info(
                "%s: %s/%s is now %s (was %s); its runtime state is reset",
                *(source, pool.name, rs.name, rs.address, saved.address),
            )
            reset.add(rs.name)
            continue
        if entries_only:
            continue
        if saved.state is not None:
            server.apply_state(pool, rs, saved.state, VIA)
            counts["changes"] += 1
        if saved.weight is not None and server.apply_weight(pool, rs, saved.weight, VIA) is None:
            counts["changes"] += 1
        if saved.load is not None and pool.locator.report_load(rs, *saved.load) is None:
            pool.locator.report_counts[rs.name] -= 1  # restored, not received
            counts["loads"] += 1
        if saved.up is not None and pool.restore_health(rs, saved.up, now):
            counts["health"] += 1
        if saved.check is not None and rs.counters.check_last is None:
            rs.counters.check_last = CheckRecord(*saved.check)  # why it is down, until the next
        if saved.since is not None and saved.downtime is not None:
            pool.restore_timeline(rs, now - max(wall - saved.since, 0.0), saved.downtime, now)
    persistence = pool.persistence
    if persistence is None:
        if vs_state.persistence and not entries_only:
            log.info(
                "%s: %s has no persistence now; %d entries skipped",
                *(source, pool.name, len(vs_state.persistence)),
            )
        return
    skipped = 0
    for entry in vs_state.persistence:
        rs = pool.by_name.get(entry.real_server)
        if rs is None or rs.name in reset:
            skipped += 1
        elif entry.expires <= wall:
            counts["expired"] += 1
        else:
            persistence.learn(entry.client, rs, entry.expires - wall, now)
            counts["entries"] += 1
    if skipped:
        log.info(
            "%s: %s: %d persistence entries of servers gone or reset skipped",
            *(source, pool.name, skipped),
        )


def read_at_start(server: Server) -> None:
    """At start, before the first accept: `initial_state`, else the state file, if any;
    then the file's parts, unless `initial_state` was a whole process's."""
    path = server.config.global_.state_file
    if server.initial_state is not None:
        restore(server, server.initial_state, "the state passed by the old process")
        if not server.initial_state_is_one_workers:
            return
    elif path is not None:
        data = _read(path, missing_is_news=True)
        if data is not None:
            restore(server, data, f"state file {path}")
    if path is None:
        return
    for part in part_paths(path):  # the other workers' persistence entries (module header)
        data = _read(part, missing_is_news=False)
        if data is not None:
            restore(server, data, f"part {part} of the state file", entries_only=True)


def part_paths(path: str) -> list[str]:
    """The workers' parts of state file `path` that exist: PATH.w2, PATH.w3, ..."""
    folder, base = os.path.split(os.path.abspath(path))
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    prefix = base + ".w"
    found = [n for n in names if n.startswith(prefix) and n[len(prefix) :].isdigit()]
    return [os.path.join(folder, n) for n in sorted(found, key=lambda n: int(n[len(prefix) :]))]


def _read(path: str, missing_is_news: bool) -> bytes | None:
    """The file's bytes, or None (one warning) when it cannot be used (module header:
    "Trusting the file")."""
    try:
        # O_NONBLOCK: a FIFO planted there must not hold the start (it is refused below)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if missing_is_news:
            log.warning("state file %s does not exist yet; starting from the configuration", path)
        return None
    except OSError as exc:
        symlink = exc.errno == errno.ELOOP
        reason = "is a symbolic link" if symlink else f"cannot be read ({exc.strerror})"
        log.warning(_IGNORED, path, reason)
        return None
    with os.fdopen(fd, "rb") as file:
        found = os.fstat(fd)
        mode = stat.S_IMODE(found.st_mode)
        if not stat.S_ISREG(found.st_mode):
            log.warning(_IGNORED, path, "is not a regular file")
        elif mode & 0o022:
            log.warning(_IGNORED, path, f"is writable by group or others (mode {mode:04o})")
        elif found.st_size > MAX_BYTES:
            log.warning(_IGNORED, path, f"is larger than {MAX_BYTES >> 20} MiB")
        else:
            try:
                return file.read(MAX_BYTES + 1)  # one byte beyond: too large is an error
            except OSError as exc:
                log.warning(_IGNORED, path, f"cannot be read ({exc.strerror})")
    return None


_IGNORED = "state file %s %s; ignored, starting from the configuration files"


# -- writing ----------------------------------------------------------------------------


class StateWriter:
    """Writes `server`'s snapshot to `global.state_file` when it changes, at most once a
    second. The path is read from the running configuration at every look, so a reload
    that sets, moves or removes `state_file` takes effect at once."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.enabled = True  # False once another process owns the file (module header)
        # "" writes the file; ".wK" worker K's part of it (module header)
        self.suffix = ""
        # True in a process without workers: the parts are merged into its file, then
        # removed after its first write
        self.merges_parts = True
        self.writes = 0
        self._written: tuple[str, tuple[Any, ...]] | None = None  # (path, fingerprint)
        self._mine: tuple[str, tuple[int, int]] | None = None  # (path, (inode, mtime)) last
        self._error: str | None = None

    @property
    def path(self) -> str | None:
        path = self.server.config.global_.state_file
        return path + self.suffix if self.enabled and path is not None else None

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self.write_if_changed()
            await trio.sleep(INTERVAL)

    async def write_if_changed(self) -> None:
        path = self.path
        if path is None:
            return
        mark = (path, fingerprint(self.server))
        if mark == self._written:
            return
        data = snapshot(self.server)
        if len(data) > MAX_BYTES:  # a start would refuse it: keep the last one instead
            self._failed(path, f"the state is over {MAX_BYTES >> 20} MiB")
            return
        if await trio.to_thread.run_sync(self._write, path, data):
            self._written = mark
            self.writes += 1
            if self.merges_parts and not self.suffix:
                await trio.to_thread.run_sync(_remove_parts, path)

    def _write(self, path: str, data: bytes) -> bool:
        """Atomically replace `path` with `data` (in a thread); False after an error or
        when another process has written the file since this one did (module header)."""
        try:
            if self._mine is not None and self._mine[0] == path:
                try:
                    found = os.lstat(path)
                    identity = (found.st_ino, found.st_mtime_ns)
                except FileNotFoundError:
                    identity = None
                if identity is not None and identity != self._mine[1]:
                    log.info(
                        "state file %s was written by another process (a new lbproxy after "
                        "an upgrade?); this one writes it no more",
                        path,
                    )
                    self.enabled = False
                    return False
            write_atomically(path, data)
            written = os.lstat(path)
            self._mine = (path, (written.st_ino, written.st_mtime_ns))
        except OSError as exc:
            self._failed(path, f"{exc.strerror or exc} ({exc.filename or path})")
            return False
        if self._error is not None:
            log.info("state file %s written again", path)
            self._error = None
        return True

    def _failed(self, path: str, error: str) -> None:
        if error != self._error:  # logged once, until it changes or a write succeeds
            log.error("cannot write state file %s: %s; will retry", path, error)
            self._error = error


def _remove_parts(path: str) -> None:
    for part in part_paths(path):
        with contextlib.suppress(OSError):
            os.unlink(part)
            log.info("state file part %s merged into %s; removed", part, path)


def write_atomically(path: str, data: bytes) -> None:
    """A crash leaves the old file or the new one: temp file, fsync, rename, fsync dir.
    Never through a link (module header): mkstemp opens with O_EXCL|O_NOFOLLOW, and the
    rename replaces whatever is at `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:  # mode 0600: the entries are client addresses
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    directory = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)
