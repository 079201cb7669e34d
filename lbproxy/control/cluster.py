"""Several lbproxy instances acting as one: shared runtime state through Redis (SPEC §18).

What is shared, and how (every key and channel starts with `key_prefix:`):

    PREFIX:state           hash, one field per kind and real server ("weight/web/a"):
                           the latest runtime change (state, weight, load report),
                           written only if its version is higher (the CAS script below)
    PREFIX:changes         channel: each change that won, published by that script
    PREFIX:p:VS:CLIENT     a persistence entry: the real server's name, with a Redis TTL
                           equal to the time it has left (`persistence.timeout` when new)
    PREFIX:entries         channel: batches of the entries one instance created or moved
    PREFIX:member:NAME     an instance's heartbeat, refreshed every HEARTBEAT seconds,
                           expiring after MEMBER_TTL
    PREFIX:members         hash: member name -> its last heartbeat (for "last seen")

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
away is published; read the hash back and apply what is newer; push the persistence
outbox and read every shared entry), then receive, flush and heartbeat until anything
fails. Then the instance serves on its local state — changes made meanwhile are applied
locally and wait in `pending` — and reconnects with a growing delay (at most
MAX_BACKOFF), logging the outage once. Health checks, throttles and counters are not
shared: each instance measures its own (as HAProxy's peers share stick tables only).

Everything read from Redis is hostile input: decoded and validated whole by the codec,
and names are looked up in this instance's configuration; anything else is ignored,
counted in `ignored` by reason and logged at most once a minute per reason.
"""

from __future__ import annotations

import logging
import math
import random
import socket
import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from lbproxy.config.model import RedisConfig
from lbproxy.config.secret_files import SECRETS
from lbproxy.core.pool import Pool
from lbproxy.wire.cluster_messages import (
    MAX_ENTRIES,
    Change,
    EntryBatch,
    Member,
    MessageError,
    RemoteEntry,
    batches,
    client_address,
    decode_change,
    decode_entries,
    decode_member,
    encode_change,
    encode_member,
    encode_rows,
    entries_prefix,
    next_version,
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
SCAN_COUNT = 1000  # keys per SCAN step, and per pipeline when reading them back
LOG_EVERY = 60.0  # an ignored message's reason is logged at most this often
START_WAIT = 5.0  # the longest a start waits for the first sync
# A change whose version is further ahead of this instance's clock than this is refused
# ("invalid"): one forged with the highest version would otherwise win every field for
# ever, and pull every instance's clock (next_version) with it.
MAX_AHEAD = 3600.0
KIND_ENTRIES, KIND_INVALID = "entries", "invalid"


# Write a change only if it is higher than the one stored, and then publish it; answer 1,
# or the stored change that wins. The stored value may be anything (anyone can write to
# Redis): one that does not decode to a versioned object loses.
COMPARE_AND_SET = """
local stored = redis.call('HGET', KEYS[1], ARGV[1])
if stored then
  local ok, old = pcall(cjson.decode, stored)
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
# work (a SET with its TTL) is Redis', not a command built in Python per entry. The batch
# is our own (encode_rows), so it decodes.
WRITE_ENTRIES = """
local batch = cjson.decode(ARGV[2])
for _, entry in ipairs(batch.entries) do
  redis.call('SET', ARGV[1] .. entry[1], entry[2], 'PX', entry[3])
end
redis.call('PUBLISH', KEYS[1], ARGV[2])
return #batch.entries
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


class PasswordError(Exception):
    """The password file cannot be read."""


def read_password(path: str) -> str:
    try:
        password = SECRETS.read(path).strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise PasswordError(f"cannot read password_file {path}: {reason}") from None
    if not password:
        raise PasswordError(f"password_file {path} is empty")
    return password


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
    def __init__(self, config: RedisConfig, target: ClusterTarget, name: str | None = None):
        self.config = config
        self.target = target
        self.name = name or member_name(config)
        prefix = config.key_prefix
        self.state_key = f"{prefix}:state"
        self.changes_channel = f"{prefix}:changes"
        self.entries_channel = f"{prefix}:entries"
        self.entry_prefix = f"{prefix}:p:"
        self.member_prefix = f"{prefix}:member:"
        self.members_key = f"{prefix}:members"
        self.connected = False
        self.members: list[Member] = []  # seen within LIST_FOR, by name
        self.alive: set[str] = set()  # members whose heartbeat key lives
        self.messages: Counter[tuple[str, str]] = Counter()  # (kind, direction)
        self.ignored: Counter[str] = Counter()  # by reason
        self.records: dict[str, Change] = {}  # the highest change known, per field
        self.pending: dict[str, Change] = {}  # local changes not yet written to Redis
        self.last_version = 0
        self.last_lag = 0.0  # of the last change received from another instance
        self.lost_at: float | None = None  # when Redis went away (None: never, or connected)
        self.sessions = 0  # connections made, for tests and the log
        self._wake = trio.Event()
        self._write_entries_script: Any = None  # registered on the session's client
        self._own_batches = entries_prefix(self.name)
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

    def document(self) -> dict[str, Any]:
        """The JSON document's "cluster" object (SPEC §18)."""
        return {
            "name": self.name,
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
        self._write_entries_script = None
        async with self._client() as client:
            cas = client.register_script(COMPARE_AND_SET)
            async with client.pubsub(
                channels=[self.changes_channel, self.entries_channel],
                retry_policy=None,
                ignore_subscribe_messages=True,
            ) as subscriber:
                with trio.fail_after(max(10 * TIMEOUT, 30.0)):
                    await self._resync(client, cas)
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

    # -- resync ---------------------------------------------------------------------

    async def _resync(self, client: coredis.Redis[bytes], cas: Any) -> None:
        self._resync_wanted = False
        await self._heartbeat(client)
        # 1. Every change known here, with its version: a Redis that restarted empty is
        #    rebuilt, and what was changed here meanwhile is published; the script keeps
        #    whichever is higher.
        await self._write_changes(client, cas, list(self.records.values()))
        # 2. The cluster's state: what is higher than ours applies here.
        stored = await client.hgetall(self.state_key)
        for field, data in stored.items():
            self._receive_change(data, field=field)
        # 3. Persistence: ours out, everyone's in.
        await self._flush_entries(client)
        await self._read_entries(client)

    async def _read_entries(self, client: coredis.Redis[bytes]) -> None:
        now = trio.current_time()
        prefix = self.entry_prefix.encode()
        keys: list[bytes] = []
        async for key in client.scan_iter(match=self.entry_prefix + "*", count=SCAN_COUNT):
            keys.append(key)
            if len(keys) >= SCAN_COUNT:
                await self._read_entry_keys(client, keys, prefix, now)
                keys = []
        if keys:
            await self._read_entry_keys(client, keys, prefix, now)

    async def _read_entry_keys(
        self, client: coredis.Redis[bytes], keys: list[bytes], prefix: bytes, now: float
    ) -> None:
        async with client.pipeline(transaction=False) as pipe:
            requests = [(pipe.get(key), pipe.pttl(key)) for key in keys]
        by_vs: dict[str, list[RemoteEntry]] = {}
        for key, (value_request, ttl_request) in zip(keys, requests, strict=True):
            value, ttl = await value_request, await ttl_request
            try:
                vs, _, client_text = key[len(prefix) :].decode("ascii").partition(":")
                server = (value or b"").decode("ascii")
                entry = RemoteEntry(client_address(client_text), server, int(ttl))
                if ttl <= 0 or not vs:
                    continue  # expired meanwhile, or no TTL: not one of ours
                by_vs.setdefault(vs, []).append(entry)
            except (UnicodeDecodeError, ValueError, MessageError):
                self._ignore("invalid", f"persistence key {key[:80]!r}")
        for vs, entries in by_vs.items():
            for batch in batches("", vs, entries):
                self._apply_entries(batch, now)

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
        import coredis.exceptions

        raise coredis.exceptions.ConnectionError("the subscription ended")

    def _receive_change(self, data: object, field: bytes | None = None) -> None:
        try:
            change = decode_change(data)
            if field is not None and field != change.field.encode():
                raise MessageError("invalid", f"stored under {field[:80]!r}, not {change.field}")
        except MessageError as exc:
            self.messages[KIND_INVALID, "in"] += 1
            self._ignore(exc.reason, exc.detail)
            return
        self.messages[change.kind, "in"] += 1
        self._consider(change)

    def _consider(self, change: Change) -> None:
        """Apply `change` if it is higher than what this instance knows of its field."""
        if version_time(change.version) > time.time() + MAX_AHEAD:
            self._ignore("invalid", f"{change.field}: a version {MAX_AHEAD:g}s ahead or more")
            return
        self.last_version = max(self.last_version, change.version)
        known = self.records.get(change.field)
        if known is not None and known.order >= change.order:
            return  # our own, an echo, or older: nothing to do
        if not self.target.apply_change(change):
            where = f"{change.virtual_server}/{change.real_server}"
            self._ignore("unknown", f"{change.kind} of {where}")
            return
        self.records[change.field] = change
        self.pending.pop(change.field, None)  # a local change of this field lost to it
        if change.origin != self.name:
            self.last_lag = max(0.0, time.time() - version_time(change.version))

    def _receive_entries(self, data: object) -> None:
        if isinstance(data, bytes) and data.startswith(self._own_batches):
            # Our own batch, back from the channel: not decoded (a batch costs as much to
            # read as to apply). A forged one that claims to be ours is ignored too.
            return
        try:
            batch = decode_entries(data)
        except MessageError as exc:
            self.messages[KIND_INVALID, "in"] += 1
            self._ignore(exc.reason, exc.detail)
            return
        self.messages[KIND_ENTRIES, "in"] += 1
        if batch.origin != self.name:
            self._apply_entries(batch, trio.current_time())

    def _apply_entries(self, batch: EntryBatch, now: float) -> None:
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
        self, client: coredis.Redis[bytes], cas: Any, changes: list[Change]
    ) -> None:
        if not changes:
            return
        keys = [self.state_key, self.changes_channel]
        async with client.pipeline(transaction=False) as pipe:
            requests = [
                cas(
                    keys=keys,
                    args=[c.field, encode_change(c), str(c.version), c.origin],
                    client=pipe,
                )
                for c in changes
            ]
        for change, request in zip(changes, requests, strict=True):
            answer = await request
            if self.pending.get(change.field) is change:
                del self.pending[change.field]
            if answer == 1:
                self.messages[change.kind, "out"] += 1
            elif isinstance(answer, bytes):  # Redis holds a higher one: it wins here too
                self._receive_change(answer, field=change.field.encode())

    async def _flush_entries(self, client: coredis.Redis[bytes]) -> None:
        now = trio.current_time()
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
            rows = []  # [client, real server, ttl_ms], as encode_rows writes them
            timeout, table = persistence.timeout, persistence.entries
            for key, entry in outbox.items():
                ttl = timeout if entry.active else entry.expires - now
                if ttl > 0 and table.get(key) is entry:
                    rows.append([key, entry.server.name, math.ceil(ttl * 1000)])
            try:
                await self._write_entries(client, pool.name, rows)
            except BaseException:
                # Not written: back in the outbox, behind what came in meanwhile.
                for key, entry in outbox.items():
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
        cut = range(0, len(rows), MAX_ENTRIES)
        async with client.pipeline(transaction=False) as pipe:
            for i in cut:
                batch = encode_rows(self.name, vs, rows[i : i + MAX_ENTRIES])
                script(keys=keys, args=[prefix, batch], client=pipe)
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
        me = Member(self.name, round(wall, 3))
        data = encode_member(me)
        async with client.pipeline(transaction=False) as pipe:
            pipe.set(self.member_prefix + self.name, data, px=int(MEMBER_TTL * 1000))
            pipe.hset(self.members_key, {self.name: data})
            count_request = pipe.hlen(self.members_key)
        if await count_request > MAX_MEMBERS:
            self._ignore("oversized", f"{self.members_key} has more than {MAX_MEMBERS} fields")
            self.members, self.alive = [me], {self.name}
            return
        members: dict[str, Member] = {}
        stale: list[bytes] = []
        for field, value in (await client.hgetall(self.members_key)).items():
            try:
                member = decode_member(value)
                if field != member.name.encode():
                    raise MessageError("invalid", f"member {member.name} under {field[:80]!r}")
            except MessageError as exc:
                self._ignore(exc.reason, f"heartbeat: {exc.detail}")
                stale.append(field)
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
