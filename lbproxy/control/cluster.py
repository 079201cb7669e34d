"""Several lbproxy instances acting as one: shared runtime state through Redis (SPEC §18).

What is shared, and how (every key and channel starts with `key_prefix:`):

    PREFIX:state           hash, one field per kind and real server ("weight/web/a"):
                           the latest runtime change (state, weight, load report),
                           written only if its version is higher (the CAS script below)
    PREFIX:changes         channel: each change that won, published by that script
    PREFIX:p:VS:CLIENT     a persistence entry: when it expires and the real server's
                           name, with a Redis TTL equal to the time it has left
                           (`persistence.timeout` when new)
    PREFIX:entries         channel: batches of the entries one instance created or moved
    PREFIX:member:NAME     an instance's heartbeat, refreshed every HEARTBEAT seconds,
                           expiring after MEMBER_TTL
    PREFIX:members         hash: member name -> its last heartbeat (for "last seen")
    PREFIX:sources         channel: each instance's per-source counts (`per_source.shared`)
                           of each such virtual server, every SOURCES_INTERVAL

Every value and message is signed with the cluster's key (wire/cluster_messages.py's
`Signer`); what is not signed with it, or was made more than MAX_AHEAD seconds ahead of
this instance's clock, is ignored and counted ("signature", "future"): whoever can
write to Redis without the key can steer nothing.

The theory is HAProxy's peers (doc/peers-v2.0.txt): updates are pushed asynchronously,
never on the request path, and a node that (re)connects resynchronises in full. Nothing
here runs per connection or per locate: a change made through the admin API is applied
locally first and queued (`publish`); the connection path only writes the persistence
entries it creates or moves into the table's outbox (core/persistence.py); a background
task flushes both, batched and pipelined. What arrives from the others is applied to
the local pools, so every lookup stays local.

Versions (wire/cluster_messages.py): a hybrid logical clock, ties broken by the
instance name. Every instance keeps, per field, the highest change it has seen
(`records`) and applies a received one only when it is higher, and Redis keeps the
highest through the CAS script, so two changes to one server settle on the later one
everywhere, whatever order they arrive in.

One session is one connection to Redis: subscribe (first, so that nothing published
from then on is missed), resynchronise (push every change this instance knows, with its
version, so that a Redis that restarted empty is rebuilt and a change made while it was
away is published; read the hash back and apply what is newer; push every live
persistence entry, for the same reason, and read every shared entry), then receive,
flush and heartbeat until anything fails. Then the instance serves on its local state
— changes made meanwhile are applied locally and wait in `pending` — and reconnects
with a growing delay (at most MAX_BACKOFF), logging the outage once. Health checks,
throttles and counters are not shared: each instance measures its own (as HAProxy's
peers share stick tables only).
The per-source counts of a virtual server with `per_source.shared` are (SPEC §23): each
instance publishes its networks' open connections and recent arrivals every
SOURCES_INTERVAL and adds the others' latest publications (dropped after SOURCES_TTL
without one, and all at once when the session ends: alone, an instance serves on its
own counts) to its table's limits; nothing is asked of Redis per connection.

Everything read from Redis is hostile input: its MAC checked, decoded and validated
whole by the codec, and names are looked up in this instance's configuration; anything
else is ignored, counted in `ignored` by reason and logged at most once a minute per
reason. What is read is bounded: a resync reads at most `max_entries` persistence
entries and MAX_STATE_FIELDS fields of the state hash (the rest is counted in `skipped`,
not read), and every received message is applied in a step of its own between which
the data plane runs.
"""

from __future__ import annotations

import logging
import math
import os
import random
import secrets
import socket
import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from lbproxy.config.model import MAX_CLUSTER_STATE_FIELDS, ClusterConfig, RedisConfig
from lbproxy.config.secret_files import SECRETS
from lbproxy.core.per_source import NetworkKey, PerSourceTable, network_of_text, network_text
from lbproxy.core.pool import Pool
from lbproxy.wire.cluster_messages import (
    INSTANCE,
    KIND_CHANGE,
    KIND_ENTRIES,
    KIND_MEMBER,
    KIND_SOURCES,
    MAC_SIZE,
    MAX_AHEAD,
    MAX_ENTRIES,
    MAX_TTL_MS,
    Change,
    EntryBatch,
    Member,
    MessageError,
    RemoteEntry,
    Signer,
    SourceCounts,
    batches,
    client_address,
    decode_change,
    decode_entries,
    decode_entry_value,
    decode_member,
    decode_sources,
    encode_change,
    encode_entry_value,
    encode_member,
    encode_rows,
    encode_sources,
    entries_prefix,
    entry_kind,
    next_version,
    source_batches,
    version_time,
)

if TYPE_CHECKING:
    import coredis

# coredis (and anyio under it) is imported when a cluster first connects, not with this
# module: it takes longer to import than the rest of lbproxy, and every `lbproxy run`,
# `check` and worker would pay for it, clustered or not.

log = logging.getLogger("lbproxy.cluster")

HEARTBEAT = 1.0  # seconds between heartbeats (and member list refreshes)
MEMBER_TTL = 10.0  # a member that stopped beating disappears after this
FLUSH_INTERVAL = 0.05  # how often the persistence outboxes are looked at
TIMEOUT = 1.0  # connect, and each command: a slow Redis counts as gone after this
MAX_BACKOFF = 1.0  # reconnect attempts at most this far apart (auth failures: 5 s)
MAX_AUTH_BACKOFF = 5.0
LIST_FOR = 300.0  # members seen within this long are listed (alive or not)
FORGET_AFTER = 3600.0  # members not seen for this long leave the members hash
MAX_MEMBERS = 1000  # a members hash larger than this is not read
SCAN_COUNT = 1000  # fields per HSCAN step of the state hash
# Persistence keys per step of a resync's read (and state fields applied per step): the
# step's answer is checked and applied before the next is asked for, and the data plane
# runs in between (~10-20 us an entry: a step is a few milliseconds).
ENTRIES_STEP = 250
FLUSH_STEP = 1000  # persistence entries per write of an outbox (5 batches of MAX_ENTRIES)
LOG_EVERY = 60.0  # an ignored message's reason is logged at most this often
START_WAIT = 5.0  # the longest a start waits for the first sync
MAX_STATE_FIELDS = MAX_CLUSTER_STATE_FIELDS  # fields of the state hash a resync reads
COUNT_STEP = 10_000  # keys Redis looks at per step when counting the entries not read
MAX_COUNT_STEPS = 10_000  # steps of that count, at most (a keyspace of 100M keys)
RESYNC_TIMEOUT = 60.0  # a resync not done by then ends the session (and is retried)
# per_source.shared: how often each instance publishes its counts and applies the others'
# (a count is then at most about twice this old), and how long an instance's last
# publication counts without a newer one: twice the interval, so that a publication a
# little late is no gap, and an instance gone silent stops counting within TTL plus an
# interval (1.5 s). While Redis is away the others' counts do not count at all.
SOURCES_INTERVAL = 0.5
SOURCES_TTL = 1.0
SOURCES_STEP = 1000  # networks counted between two turns of the data plane
KIND_INVALID = "invalid"
# This process's instance id, inherited by the processes it starts: the new process of an
# upgrade (the same instance, which must not take its predecessor for another one with
# its name) and the workers of a supervisor (each a member of its own, `NAME-wK`).
INSTANCE_VARIABLE = "LBPROXY_CLUSTER_INSTANCE"


# Write a change only if it is higher than the one stored, and then publish it; answer 1,
# or the stored change that wins. The stored value may be anything (anyone can write to
# Redis): one that does not decode to a versioned object loses, and one that does but
# whose MAC is wrong (Lua cannot check it) is answered back, found wrong by the caller
# and overwritten with ARGV[5] = "force". A value is "MAC.BODY" (65 bytes, then JSON).
COMPARE_AND_SET = """
local stored = redis.call('HGET', KEYS[1], ARGV[1])
if stored and ARGV[5] ~= 'force' then
  local ok, old = pcall(cjson.decode, string.sub(stored, 66))
  if ok and type(old) == 'table' and type(old.version) == 'number'
      and type(old.origin) == 'string' then
    local version = tonumber(ARGV[3])
    if old.version > version or (old.version == version and old.origin >= ARGV[4]) then
      return stored
    end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PUBLISH', KEYS[2], ARGV[2])
return 1
"""


# Write one batch of persistence entries and publish it, in one command: the per-entry
# work (a SET with its TTL) is Redis', not a command built in Python per entry.
# ARGV: the key prefix, the signed batch, then (client, signed value, TTL ms) per entry.
WRITE_ENTRIES = """
for i = 3, #ARGV, 3 do
  redis.call('SET', ARGV[1] .. ARGV[i], ARGV[i + 1], 'PX', ARGV[i + 2])
end
redis.call('PUBLISH', KEYS[1], ARGV[2])
return (#ARGV - 2) / 3
"""

# One SCAN step over the persistence keys, with each key's value and PTTL: one command
# and one answer per step, [cursor, key, value, pttl, key, value, pttl, ...]. A key that
# holds no string (anyone may write anything there) answers an empty value.
READ_ENTRIES = """
local found = redis.call('SCAN', ARGV[1], 'MATCH', ARGV[2], 'COUNT', ARGV[3])
local out = {found[1]}
for _, key in ipairs(found[2]) do
  local value = redis.pcall('GET', key)
  if type(value) ~= 'string' then value = '' end
  out[#out + 1] = key
  out[#out + 1] = value
  out[#out + 1] = redis.call('PTTL', key)
end
return out
"""

# One step of counting the keys that match a pattern, inside Redis: the names are not
# sent (a resync counts the persistence entries it does not read). Answers the next
# cursor and how many keys this step found.
COUNT_KEYS = """
local found = redis.call('SCAN', ARGV[1], 'MATCH', ARGV[2], 'COUNT', ARGV[3])
return {found[1], #found[2]}
"""


class ClusterTarget(Protocol):
    """What the sync applies changes to: the running server (lbproxy/runtime/server.py).

    Each call applies one validated change locally, without publishing it again, and
    returns False when this instance has no such virtual or real server."""

    def pools(self) -> Iterable[Pool]: ...

    def apply_change(self, change: Change) -> bool: ...

    def apply_entries(self, batch: EntryBatch, now: float) -> tuple[int, int]:
        """(applied, unknown) entries of one batch."""
        ...

    def shared_sources(self) -> dict[str, PerSourceTable]:
        """The per-source tables of the virtual servers with `per_source.shared`."""
        ...


class PasswordError(Exception):
    """The password file cannot be read."""


def read_password(path: str) -> str:
    """The Redis password in `path`, read at every connection (a rotated password is
    picked up) through config/secret_files.py, as every secret."""
    try:
        password = SECRETS.read(path).strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise PasswordError(f"cannot read password_file {path}: {reason}") from None
    if not password:
        raise PasswordError(f"password_file {path} is empty")
    return password


def instance_id() -> str:
    """This process's instance id: the one of the lbproxy that started it, else a new
    random one; exported so that the processes it starts inherit it."""
    value = os.environ.get(INSTANCE_VARIABLE, "")
    if not INSTANCE.fullmatch(value):
        value = secrets.token_hex(8)
        os.environ[INSTANCE_VARIABLE] = value
    return value


def member_name(config: RedisConfig) -> str:
    """This instance's name in the cluster: `name:`, else the host name (shortened to
    what a member name allows)."""
    if config.name:
        return config.name
    host = socket.gethostname().split(".")[0]
    cleaned = "".join(c if c.isalnum() or c in "_.-" else "-" for c in host)[:64]
    return cleaned or "lbproxy"


def _outage(exc: BaseException) -> tuple[str, str]:
    """(category, text) of what ended a session; category "bug" for anything that is
    not Redis or the network failing."""
    import anyio
    import coredis.exceptions

    # anyio's errors of a stream closed under coredis when the connection drops
    closed = anyio.ClosedResourceError | anyio.BrokenResourceError | anyio.EndOfStream
    leaves = list(_leaves(exc))
    for leaf in leaves:
        if isinstance(leaf, coredis.exceptions.AuthenticationRequiredError):
            return "auth", "it needs a password: set global.cluster.redis.password_file"
        if isinstance(leaf, coredis.exceptions.AuthenticationError):
            return "auth", f"the password was refused ({str(leaf).rstrip('.')})"
        if isinstance(leaf, PasswordError):
            return "auth", str(leaf)
    for leaf in leaves:
        if isinstance(leaf, coredis.exceptions.RedisError | OSError | TimeoutError | closed):
            return "unreachable", str(leaf) or type(leaf).__name__
        if isinstance(leaf, trio.TooSlowError):
            return "unreachable", f"no answer within {TIMEOUT:g}s"
    leaf = leaves[0] if leaves else exc
    return "bug", f"{type(leaf).__name__}: {leaf}"


def _leaves(exc: BaseException) -> Iterable[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


class Cluster:
    def __init__(self, cluster: ClusterConfig, target: ClusterTarget, name: str | None = None):
        assert cluster.redis is not None
        config = self.config = cluster.redis
        self.target = target
        self.name = name or member_name(config)
        self.instance = instance_id()
        # Another instance heartbeats under this name: when it was last seen doing so
        # (the run's clock), and the value this one last wrote to its heartbeat key
        # (a different one found there before the next write: someone else wrote it).
        self.clash_seen: float | None = None
        self._clash_logged = False
        self._last_beat: bytes | None = None
        self.signer = Signer(cluster.key, config.key_prefix)
        self.max_entries = cluster.max_entries
        prefix = config.key_prefix
        self.state_key = f"{prefix}:state"
        self.changes_channel = f"{prefix}:changes"
        self.entries_channel = f"{prefix}:entries"
        self.entry_prefix = f"{prefix}:p:"
        self.member_prefix = f"{prefix}:member:"
        self.members_key = f"{prefix}:members"
        self.sources_channel = f"{prefix}:sources"
        # per_source.shared: the others' last publication, per (virtual server, origin):
        # when it came (the run's clock), when it was made, and its counts per network.
        self.remote_sources: dict[tuple[str, str], tuple[float, float, dict[str, tuple[int, int]]]]
        self.remote_sources = {}
        self.connected = False
        self.members: list[Member] = []  # seen within LIST_FOR, by name
        self.alive: set[str] = set()  # members whose heartbeat key lives
        self.messages: Counter[tuple[str, str]] = Counter()  # (kind, direction)
        self.ignored: Counter[str] = Counter()  # by reason
        self.skipped: Counter[str] = Counter()  # not read by a resync: "entries", "state"
        self.records: dict[str, Change] = {}  # the highest change known, per field
        self.pending: dict[str, Change] = {}  # local changes not yet written to Redis
        self.last_version = 0
        self.last_lag = 0.0  # of the last change received from another instance
        self.lost_at: float | None = None  # when Redis went away (None: never, or connected)
        self.sessions = 0  # connections made, for tests and the log
        self._wake = trio.Event()
        self._write_entries_script: Any = None  # registered on the session's client
        self._count_keys_script: Any = None
        self._own_batches = entries_prefix(self.name, self.instance)
        self._resync_wanted = False
        self._logged: dict[str, float] = {}  # reason -> when last logged
        self._suppressed: Counter[str] = Counter()

    # -- what the server calls -------------------------------------------------------

    def publish(
        self, kind: str, vs: str, rs: str, value: Any, per_connection: float | None = None
    ) -> None:
        """A runtime change was applied locally: version it and queue it for Redis."""
        self.last_version = next_version(time.time(), self.last_version)
        change = Change(kind, vs, rs, value, per_connection, self.last_version, self.name)
        self.records[change.field] = change
        self.pending[change.field] = change
        self._wake.set()

    def reapply(self) -> None:
        """After a reload applied the files: the cluster's changes again on top (a
        server that is not configured any more is skipped), and a resync so that
        servers the reload added get theirs."""
        for change in list(self.records.values()):
            # Added and removed servers are kept by the server itself across a reload
            # (and a file that now names one wins): not applied again.
            if change.kind != "topology":
                self.target.apply_change(change)
        self._resync_wanted = True
        self._wake.set()

    @property
    def sync_lag(self) -> float:
        """lbproxy_cluster_sync_lag_seconds: while connected, how long the last change
        received from another instance took from its making there to its applying here;
        while Redis is away, how long it has been away."""
        if not self.connected:
            return 0.0 if self.lost_at is None else max(0.0, trio.current_time() - self.lost_at)
        return self.last_lag

    @property
    def name_clash(self) -> bool:
        """Another live instance heartbeats under this instance's name (seen within
        MEMBER_TTL): lbproxy_cluster_name_clash, the document's `name_clash`."""
        return self.clash_seen is not None and trio.current_time() - self.clash_seen < MEMBER_TTL

    def document(self) -> dict[str, Any]:
        """The JSON document's "cluster" object (SPEC §18)."""
        return {
            "name": self.name,
            "name_clash": self.name_clash,
            "connected": self.connected,
            "members": [
                {"name": m.name, "last_seen": m.last_seen, "alive": m.name in self.alive}
                for m in self.members
            ],
        }

    # -- the connection loop -----------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
        """Connect, sync, serve; on any failure, serve locally and reconnect. Reports
        started once the first attempt has synced or failed, so that the instance
        starts from the cluster's state when Redis is there, and at once when not."""
        first = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._loop, first)
            # A Redis that answers, but slowly (a huge state, a loaded server), delays
            # the start by START_WAIT at most: then the instance serves from its files
            # and the sync goes on beside it.
            with trio.move_on_after(START_WAIT):
                await first.wait()
            task_status.started()

    async def _loop(self, first: trio.Event) -> None:
        attempt = 0
        logged: str | None = None  # the category of the outage already logged
        while True:
            ended: ExceptionGroup[Exception] | None = None
            try:
                await self._session(first)
            except* trio.Cancelled:
                # Shutting down. coredis' own clean-up may fail on the way out (it
                # unsubscribes on a connection already closed): only the cancellation
                # goes on.
                raise
            except* Exception as group:
                ended = group
            if ended is not None:  # (a session never ends without an exception)
                exc = ended.exceptions[0] if len(ended.exceptions) == 1 else ended
                category, text = _outage(exc)
                if self.connected:  # it had worked: a new outage, logged, a new back-off
                    attempt, logged = 0, None
                self._disconnected()
                if category == "bug":
                    if self._may_log("bug"):
                        log.error("internal error, reconnecting", exc_info=exc)
                elif logged != category:
                    where = self._where()
                    if category == "auth":
                        log.error(
                            "Redis at %s refused this instance: %s; serving on "
                            "local state, unclustered, and retrying every few seconds",
                            where,
                            text,
                        )
                    else:
                        log.warning(
                            "Redis at %s is unreachable (%s); serving on local state and retrying",
                            where,
                            text,
                        )
                    logged = category
                first.set()
                cap = MAX_AUTH_BACKOFF if category == "auth" else MAX_BACKOFF
                delay = min(cap, 0.05 * 2**attempt) * random.uniform(0.5, 1.0)
                attempt = min(attempt + 1, 16)
                await trio.sleep(delay)

    def _disconnected(self) -> None:
        if self.connected or self.lost_at is None:
            self.lost_at = trio.current_time()
        self.connected = False
        self._trim_outboxes()
        self._forget_remote_sources()

    def _forget_remote_sources(self) -> None:
        """The session is over: the others' per-source counts can no longer be renewed
        nor expired (that is `_sources`' work, gone with the session), so they stop
        counting now and each shared table serves on this instance's own counts until
        the others publish again. O(remote networks), once per outage."""
        self.remote_sources.clear()
        for table in self.target.shared_sources().values():
            table.set_remote({})

    def _trim_outboxes(self) -> None:
        """While Redis is away the outboxes only grow: keep each within its table's
        size (the oldest changes go first; they are the likeliest to be stale)."""
        for pool in self.target.pools():
            persistence = pool.persistence
            if persistence is None:
                continue
            if persistence.outbox is None:
                persistence.outbox = {}
            excess = len(persistence.outbox) - persistence.max_entries
            for key in list(persistence.outbox)[: max(0, excess)]:
                del persistence.outbox[key]

    def share_entries(self) -> None:
        """Give every persistence table an outbox (at start and after a reload, which
        may have added one), so that entries made while Redis is away are kept."""
        for pool in self.target.pools():
            if pool.persistence is not None and pool.persistence.outbox is None:
                pool.persistence.outbox = {}

    def _where(self) -> str:
        return self.config.url

    def _client(self) -> coredis.Redis[bytes]:
        import coredis
        from coredis.retry import NoRetryPolicy

        password = None
        if self.config.password_file:
            password = read_password(self.config.password_file)  # each time: rotation
        return coredis.Redis.from_url(
            self.config.url,
            password=password,
            connect_timeout=TIMEOUT,
            stream_timeout=TIMEOUT,
            retry_policy=NoRetryPolicy(),  # this loop reconnects, and resyncs
            client_name=f"lbproxy-{self.name}",
        )

    async def _session(self, first: trio.Event) -> None:
        self._write_entries_script = self._count_keys_script = None
        async with self._client() as client:
            cas = client.register_script(COMPARE_AND_SET)
            async with client.pubsub(
                channels=[self.changes_channel, self.entries_channel, self.sources_channel],
                retry_policy=None,
                ignore_subscribe_messages=True,
            ) as subscriber:
                with trio.fail_after(RESYNC_TIMEOUT):
                    await self._resync(client, cas, every_entry=True)
                was_lost = self.lost_at
                self.connected = True
                self.lost_at = None
                self.sessions += 1
                if was_lost is not None:
                    log.warning(
                        "Redis at %s is reachable after %.1fs; resynced",
                        self._where(),
                        trio.current_time() - was_lost,
                    )
                else:
                    log.info("joined through Redis at %s as %s", self._where(), self.name)
                first.set()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._receive, subscriber)
                    nursery.start_soon(self._heartbeats, client)
                    nursery.start_soon(self._flushes, client, cas)
                    nursery.start_soon(self._sources, client)

    # -- resync ---------------------------------------------------------------------

    async def _resync(
        self, client: coredis.Redis[bytes], cas: Any, every_entry: bool = False
    ) -> None:
        self._resync_wanted = False
        await self._heartbeat(client)
        # 1. Every change known here, with its version: a Redis that restarted empty is
        #    rebuilt, and what was changed here meanwhile is published; the script keeps
        #    whichever is higher.
        await self._write_changes(client, cas, list(self.records.values()))
        # 2. The cluster's state: what is higher than ours applies here.
        await self._read_state(client)
        # 3. Persistence: ours out (at a new session every live entry, not only the
        #    outbox: a Redis that restarted empty gets them back), everyone's in.
        if every_entry:
            await self._share_every_entry()
        await self._flush_entries(client)
        await self._read_entries(client)

    async def _share_every_entry(self) -> None:
        """Every live persistence entry into its table's outbox (learned ones too: the
        instance that made one may be gone), ENTRIES_STEP at a time with the data plane
        running in between. Once per session: O(entries), nothing per connection."""
        now = trio.current_time()
        for pool in list(self.target.pools()):
            persistence = pool.persistence
            if persistence is None or persistence.outbox is None:
                continue
            for done, entry in enumerate(list(persistence.entries.values()), 1):
                if entry.active or entry.expires > now:
                    entry.shared = now
                    persistence.outbox.setdefault(entry.key, entry)
                if done % ENTRIES_STEP == 0:
                    await trio.lowlevel.checkpoint()
                    if persistence.outbox is None:  # the table was dropped meanwhile
                        break

    async def _read_state(self, client: coredis.Redis[bytes]) -> None:
        """The state hash, at most MAX_STATE_FIELDS of its fields (the rest counted)."""
        size = await client.hlen(self.state_key)
        if size <= MAX_STATE_FIELDS:
            stored = list((await client.hgetall(self.state_key)).items())
        else:
            stored = []
            cursor: int | None = 0
            while True:
                cursor, found = await client.hscan(self.state_key, cursor, count=SCAN_COUNT)
                assert isinstance(found, dict)
                stored.extend(found.items())
                if len(stored) >= MAX_STATE_FIELDS or cursor == 0:
                    break
            stored = stored[:MAX_STATE_FIELDS]
            self._skip("state", size - len(stored), f"{self.state_key} has {size} fields")
        for done, (field, data) in enumerate(stored, 1):
            self._receive_change(data, field=field)
            if done % ENTRIES_STEP == 0:  # a step's worth, then the data plane's turn
                await trio.lowlevel.checkpoint()

    async def _read_entries(self, client: coredis.Redis[bytes]) -> None:
        """Every shared persistence entry, at most `max_entries` of them (the rest are
        counted inside Redis, not read), a SCAN step at a time: each step is one command
        (the READ_ENTRIES script) and is applied before the next is sent."""
        prefix = self.entry_prefix.encode()
        pattern = self.entry_prefix + "*"
        script = client.register_script(READ_ENTRIES)
        cursor, read = b"0", 0
        while True:
            answer: list[Any] = await script(keys=[], args=[cursor, pattern, ENTRIES_STEP])
            cursor, rows = answer[0], answer[1:]
            found = len(rows) // 3
            room = self.max_entries - read
            if found > room:
                self._skip("entries", found - room, self._beyond_entries())
                rows = rows[: 3 * room]
            read += len(rows) // 3
            self._read_entry_rows(rows, prefix, trio.current_time())
            if cursor == b"0":
                return
            if read >= self.max_entries:
                break
        beyond = await self._count_keys(client, cursor, pattern)
        self._skip("entries", beyond, self._beyond_entries())

    def _beyond_entries(self) -> str:
        return (
            f"more than global.cluster.max_entries ({self.max_entries}) persistence "
            f"entries under {self.entry_prefix}: the rest are not read"
        )

    async def _count_keys(self, client: coredis.Redis[bytes], cursor: bytes, pattern: str) -> int:
        """How many keys match `pattern` from `cursor` on, counted inside Redis."""
        script = self._count_keys_script or client.register_script(COUNT_KEYS)
        self._count_keys_script = script
        total = 0
        for _ in range(MAX_COUNT_STEPS):
            step: list[Any] = await script(keys=[], args=[cursor, pattern, COUNT_STEP])
            cursor, found = step[0], int(step[1])
            total += found
            if cursor == b"0":
                break
        return total

    def _read_entry_rows(self, rows: list[Any], prefix: bytes, now: float) -> None:
        """Apply the rows (key, value, PTTL) of one READ_ENTRIES step."""
        wall_ms = time.time() * 1000
        by_vs: dict[str, list[RemoteEntry]] = {}
        for i in range(0, len(rows) - 2, 3):
            key, value, ttl = rows[i], rows[i + 1], rows[i + 2]
            if not value or not isinstance(ttl, int) or ttl <= 0:
                continue  # expired meanwhile, no TTL, or not a string: not one of ours
            try:
                vs, _, client_text = key[len(prefix) :].decode("ascii").partition(":")
                body = self.signer.open(entry_kind(vs, client_text), value)
                server, expires_ms = decode_entry_value(body)
                left = min(ttl, int(expires_ms - wall_ms), MAX_TTL_MS)
                if left <= 0:
                    continue
                entry = RemoteEntry(client_address(client_text), server, left)
            except UnicodeDecodeError:
                self._ignore("invalid", f"persistence key {key[:80]!r}")
                continue
            except MessageError as exc:
                self._ignore(exc.reason, f"persistence key {key[:80]!r}: {exc.detail}")
                continue
            by_vs.setdefault(vs, []).append(entry)
        for vs, entries in by_vs.items():
            for batch in batches("", vs, entries):
                self._apply_entries(batch, now)

    def _skip(self, what: str, count: int, why: str) -> None:
        """Count `count` entries or fields a resync does not read; say why (once a
        minute at most)."""
        if count <= 0:
            return
        self.skipped[what] += count
        if why and self._may_log(f"skipped {what}"):
            log.warning("resync: %s; counted in lbproxy_cluster_skipped_total", why)

    # -- receiving ------------------------------------------------------------------

    async def _receive(self, subscriber: Any) -> None:
        async for message in subscriber:
            if message.get("type") != "message":
                continue
            channel, data = message.get("channel"), message.get("data")
            if channel == self.changes_channel.encode():
                self._receive_change(data)
            elif channel == self.entries_channel.encode():
                self._receive_entries(data)
            elif channel == self.sources_channel.encode():
                self._receive_sources(data, trio.current_time())
            # One message (at most MAX_ENTRIES entries) per step: a flood of them
            # leaves the data plane its turns.
            await trio.lowlevel.checkpoint()
        import coredis.exceptions

        raise coredis.exceptions.ConnectionError("the subscription ended")

    def _receive_change(self, data: object, field: bytes | None = None) -> str | None:
        """Apply a change read from Redis if it is valid and newer; the reason it was
        ignored, or None."""
        try:
            change = decode_change(self.signer.open(KIND_CHANGE, data))
            if field is not None and field != change.field.encode():
                raise MessageError("invalid", f"stored under {field[:80]!r}, not {change.field}")
        except MessageError as exc:
            self.messages[KIND_INVALID, "in"] += 1
            self._ignore(exc.reason, exc.detail)
            return exc.reason
        self.messages[change.kind, "in"] += 1
        return self._consider(change)

    def _consider(self, change: Change) -> str | None:
        """Apply `change` if it is higher than what this instance knows of its field."""
        if version_time(change.version) > time.time() + MAX_AHEAD:
            self._ignore("future", f"{change.field}: made more than {MAX_AHEAD:g}s ahead")
            return "future"
        self.last_version = max(self.last_version, change.version)
        known = self.records.get(change.field)
        if known is not None and known.order >= change.order:
            return None  # our own, an echo, or older: nothing to do
        if not self.target.apply_change(change):
            where = f"{change.virtual_server}/{change.real_server}"
            self._ignore("unknown", f"{change.kind} of {where}")
            return "unknown"
        self.records[change.field] = change
        self.pending.pop(change.field, None)  # a local change of this field lost to it
        if change.origin != self.name:
            self.last_lag = max(0.0, time.time() - version_time(change.version))
        return None

    def _receive_entries(self, data: object) -> None:
        if isinstance(data, bytes) and data.startswith(self._own_batches, MAC_SIZE + 1):
            # Our own batch, back from the channel: not checked nor decoded (a batch
            # costs as much to read as to apply). A forged one that claims to be ours
            # is passed over too.
            return
        try:
            batch = decode_entries(self.signer.open(KIND_ENTRIES, data))
        except MessageError as exc:
            self.messages[KIND_INVALID, "in"] += 1
            self._ignore(exc.reason, exc.detail)
            return
        self.messages[KIND_ENTRIES, "in"] += 1
        if batch.origin == self.name and batch.instance == self.instance:
            return  # ours (or our upgrade's; the workers of one supervisor differ by name)
        age = time.time() - batch.time
        if age < -MAX_AHEAD:
            self._ignore("future", f"entries of {batch.origin}: made {-age:.0f}s ahead")
            return
        self._apply_entries(_aged(batch, age), trio.current_time())

    def _receive_sources(self, data: object, now: float) -> None:
        """Keep another instance's per-source counts (applied by `_sources`)."""
        try:
            counts = decode_sources(self.signer.open(KIND_SOURCES, data))
        except MessageError as exc:
            self.messages[KIND_INVALID, "in"] += 1
            self._ignore(exc.reason, exc.detail)
            return
        self.messages[KIND_SOURCES, "in"] += 1
        if counts.origin == self.name and counts.instance == self.instance:
            return
        if counts.time > time.time() + MAX_AHEAD:
            self._ignore("future", f"per-source counts of {counts.origin}: made ahead")
            return
        # one per sender: two instances with one name each count
        key = (counts.virtual_server, f"{counts.origin}/{counts.instance or ''}")
        known = self.remote_sources.get(key)
        rows = {network: (open_, recent) for network, open_, recent in counts.networks}
        if known is None or counts.time > known[1]:
            self.remote_sources[key] = (now, counts.time, rows)
        elif counts.time == known[1]:  # another part of the same publication
            known[2].update(rows)

    async def _sources(self, client: coredis.Redis[bytes]) -> None:
        """per_source.shared: every SOURCES_INTERVAL, publish this instance's counts and
        give each table the others' latest."""
        while True:
            await trio.sleep(SOURCES_INTERVAL)
            tables = self.target.shared_sources()
            now = trio.current_time()
            await self.apply_sources(tables, now)
            wall = round(time.time(), 3)
            publications = [
                (vs, await self._local_sources(vs, table, now, wall))
                for vs, table in tables.items()
            ]
            async with client.pipeline(transaction=False) as pipe:
                for _, messages in publications:
                    for counts in messages:
                        data = self.signer.sign(KIND_SOURCES, encode_sources(counts))
                        pipe.publish(self.sources_channel, data)
                        self.messages[KIND_SOURCES, "out"] += 1

    async def _local_sources(
        self, vs: str, table: PerSourceTable, now: float, wall: float
    ) -> list[SourceCounts]:
        """This instance's counts of one table, as messages; the data plane runs every
        SOURCES_STEP networks (a table may hold many)."""
        limits = table.limits
        rows = []
        for done, (key, open_, recent) in enumerate(table.local_counts(now), 1):
            text = network_text(key, limits.prefix_v4, limits.prefix_v6)
            if text is not None:
                rows.append((text, open_, recent))
            if done % SOURCES_STEP == 0:
                await trio.lowlevel.checkpoint()
        return source_batches(self.name, vs, wall, rows, self.instance)

    async def apply_sources(self, tables: dict[str, PerSourceTable], now: float) -> None:
        """The sum of the others' latest counts, into each shared table; a publication
        older than SOURCES_TTL is dropped. The data plane runs every SOURCES_STEP
        networks."""
        done = 0
        sums: dict[str, dict[NetworkKey, tuple[int, int]]] = {vs: {} for vs in tables}
        for (vs, origin), (received, _, rows) in list(self.remote_sources.items()):
            if now - received > SOURCES_TTL:
                latest = self.remote_sources.get((vs, origin))
                if latest is not None and latest[0] == received:  # none newer came meanwhile
                    del self.remote_sources[vs, origin]
                continue
            table = tables.get(vs)
            if table is None:
                continue
            limits = table.limits
            total = sums[vs]
            for text, (open_, recent) in list(rows.items()):
                done += 1
                if done % SOURCES_STEP == 0:
                    await trio.lowlevel.checkpoint()
                key = network_of_text(text, limits.prefix_v4, limits.prefix_v6)
                if key is not None:
                    was = total.get(key, (0, 0))
                    total[key] = (was[0] + open_, was[1] + recent)
        for vs, table in tables.items():
            table.set_remote(sums[vs])

    def _apply_entries(self, batch: EntryBatch, now: float) -> None:
        if not batch.entries:
            return
        _, unknown = self.target.apply_entries(batch, now)
        if unknown:
            self._ignore("unknown", f"{unknown} persistence entries of {batch.virtual_server}")

    def _ignore(self, reason: str, detail: str) -> None:
        """Count and log (at most once a minute per reason) a message not applied."""
        self.ignored[reason] += 1
        if not self._may_log(reason):
            return
        more = self._suppressed.pop(reason, 0)
        log.warning(
            "ignored a message from Redis (%s): %s%s",
            reason,
            detail,
            f" (and {more} more since the last report)" if more else "",
        )

    def _may_log(self, reason: str) -> bool:
        """True at most once every LOG_EVERY seconds per reason (others are counted)."""
        now = trio.current_time()
        last = self._logged.get(reason)
        if last is not None and now - last < LOG_EVERY:
            self._suppressed[reason] += 1
            return False
        self._logged[reason] = now
        return True

    # -- writing --------------------------------------------------------------------

    async def _flushes(self, client: coredis.Redis[bytes], cas: Any) -> None:
        while True:
            with trio.move_on_after(FLUSH_INTERVAL):
                await self._wake.wait()
            self._wake = trio.Event()
            if self._resync_wanted:
                await self._resync(client, cas)
            if self.pending:
                await self._write_changes(client, cas, list(self.pending.values()))
            await self._flush_entries(client)

    async def _write_changes(
        self, client: coredis.Redis[bytes], cas: Any, changes: list[Change], force: bool = False
    ) -> None:
        if not changes:
            return
        keys = [self.state_key, self.changes_channel]
        mode = "force" if force else ""
        async with client.pipeline(transaction=False) as pipe:
            requests = [
                cas(
                    keys=keys,
                    args=[
                        c.field,
                        self.signer.sign(KIND_CHANGE, encode_change(c)),
                        str(c.version),
                        c.origin,
                        mode,
                    ],
                    client=pipe,
                )
                for c in changes
            ]
        forged = []
        for change, request in zip(changes, requests, strict=True):
            answer = await request
            if self.pending.get(change.field) is change:
                del self.pending[change.field]
            if answer == 1:
                self.messages[change.kind, "out"] += 1
            elif isinstance(answer, bytes):  # Redis holds a higher one: it wins here too,
                ignored = self._receive_change(answer, field=change.field.encode())
                if ignored == "signature":  # unless it is not signed: then it is replaced
                    forged.append(change)
        if forged and not force:
            await self._write_changes(client, cas, forged, force=True)

    async def _flush_entries(self, client: coredis.Redis[bytes]) -> None:
        for pool in list(self.target.pools()):
            persistence = pool.persistence
            if persistence is None:
                continue
            if persistence.outbox is None:
                persistence.outbox = {}
                continue
            if not persistence.outbox:
                continue
            outbox, persistence.outbox = persistence.outbox, {}
            timeout, table = persistence.timeout, persistence.entries
            # FLUSH_STEP entries per write: a large outbox (after an outage, at a new
            # session) is written in parts, each signed and sent before the next.
            pending = list(outbox.items())
            for start in range(0, len(pending), FLUSH_STEP):
                now = trio.current_time()
                rows = []  # [client, real server, ttl_ms], as encode_rows writes them
                for key, entry in pending[start : start + FLUSH_STEP]:
                    ttl = timeout if entry.active else entry.expires - now
                    if ttl > 0 and table.get(key) is entry:
                        rows.append([key, entry.server.name, math.ceil(ttl * 1000)])
                try:
                    await self._write_entries(client, pool.name, rows)
                except BaseException:
                    # Not written: back in the outbox, behind what came in meanwhile.
                    if persistence.outbox is not None:
                        for key, entry in pending[start:]:
                            persistence.outbox.setdefault(key, entry)
                    raise

    async def _write_entries(
        self, client: coredis.Redis[bytes], vs: str, rows: list[list[Any]]
    ) -> None:
        if not rows:
            return
        script = self._write_entries_script or client.register_script(WRITE_ENTRIES)
        self._write_entries_script = script
        keys, prefix = [self.entries_channel], f"{self.entry_prefix}{vs}:"
        wall = round(time.time(), 3)
        wall_ms = int(wall * 1000)
        sign = self.signer.sign
        cut = range(0, len(rows), MAX_ENTRIES)
        async with client.pipeline(transaction=False) as pipe:
            for i in cut:
                part = rows[i : i + MAX_ENTRIES]
                batch = sign(KIND_ENTRIES, encode_rows(self.name, vs, part, wall, self.instance))
                args: list[Any] = [prefix, batch]
                for key, server, ttl_ms in part:
                    value = encode_entry_value(server, wall_ms + ttl_ms)
                    args += [key, sign(entry_kind(vs, key), value), ttl_ms]
                script(keys=keys, args=args, client=pipe)
        self.messages[KIND_ENTRIES, "out"] += len(cut)

    # -- members --------------------------------------------------------------------

    async def _heartbeats(self, client: coredis.Redis[bytes]) -> None:
        while True:
            await trio.sleep(HEARTBEAT)
            await self._heartbeat(client)

    async def _heartbeat(self, client: coredis.Redis[bytes]) -> None:
        """Refresh this instance's heartbeat key and its line in the members hash, and
        read the members back: those seen within LIST_FOR, alive while their
        heartbeat key lives; lines older than FORGET_AFTER are removed."""
        wall = time.time()
        me = Member(self.name, round(wall, 3), self.instance)
        data = self.signer.sign(KIND_MEMBER, encode_member(me))
        async with client.pipeline(transaction=False) as pipe:
            # what is there before this write: another instance's with this name?
            found_request = pipe.get(self.member_prefix + self.name)
            pipe.set(self.member_prefix + self.name, data, px=int(MEMBER_TTL * 1000))
            pipe.hset(self.members_key, {self.name: data})
            count_request = pipe.hlen(self.members_key)
        self._check_name(await found_request)
        self._last_beat = data
        if await count_request > MAX_MEMBERS:
            self._ignore("oversized", f"{self.members_key} has more than {MAX_MEMBERS} fields")
            self.members, self.alive = [me], {self.name}
            return
        members: dict[str, Member] = {}
        stale: list[bytes] = []
        for field, value in (await client.hgetall(self.members_key)).items():
            try:
                member = decode_member(self.signer.open(KIND_MEMBER, value))
                if field != member.name.encode():
                    raise MessageError("invalid", f"member {member.name} under {field[:80]!r}")
            except MessageError as exc:
                self._ignore(exc.reason, f"heartbeat: {exc.detail}")
                stale.append(field)
                continue
            if member.last_seen > wall + MAX_AHEAD:
                self._ignore("future", f"heartbeat of {member.name}: {MAX_AHEAD:g}s ahead")
                continue
            if wall - member.last_seen > FORGET_AFTER:
                stale.append(field)
            elif wall - member.last_seen <= LIST_FOR:
                members[member.name] = member
        if stale:
            await client.hdel(self.members_key, stale)
        members[self.name] = me
        names = sorted(members)
        beating = await client.mget([self.member_prefix + name for name in names])
        self.members = [members[name] for name in names]
        self.alive = {name for name, value in zip(names, beating, strict=True) if value}
        self.alive.add(self.name)

    def _check_name(self, found: bytes | None) -> None:
        """`found`, this name's heartbeat key before this instance's write: another
        instance id there, written after this instance's last heartbeat (not a value
        left by a process that stopped before this one started: this one has not
        written yet then), means another live instance uses this name. Then each takes
        the other's persistence entries and per-source counts as any other member's;
        both show as one member, and this says so (once in the log, and while it
        lasts in the metric and the document)."""
        if found is None or self._last_beat is None or found == self._last_beat:
            return
        try:
            other = decode_member(self.signer.open(KIND_MEMBER, found))
        except MessageError:
            return  # forged or foreign: the members hash read reports those
        if other.instance is None or other.instance == self.instance or other.name != self.name:
            return  # an older lbproxy cannot be told apart; ours: an upgrade's
        self.clash_seen = trio.current_time()
        if not self._clash_logged:
            self._clash_logged = True
            log.warning(
                "another lbproxy instance (id %s) is in the cluster under this "
                "instance's name %r (this one: id %s): both show as one member; give "
                "each instance its own global.cluster.redis.name (the default is the "
                "host name, which cloned hosts share)",
                other.instance,
                self.name,
                self.instance,
            )


def _aged(batch: EntryBatch, age: float) -> EntryBatch:
    """`batch` with each entry's time left counted from now: `age` seconds after the
    batch was made (entries with none left are dropped)."""
    if age < 0.001:
        return batch
    age_ms = math.ceil(age * 1000)
    entries = tuple(
        RemoteEntry(e.client, e.real_server, e.ttl_ms - age_ms)
        for e in batch.entries
        if e.ttl_ms > age_ms
    )
    return EntryBatch(batch.origin, batch.virtual_server, entries, batch.time, batch.instance)
