"""The cluster sync's decisions (control/cluster.py) without Redis: which change wins,
what is applied, what is counted and logged. The target is a small recorder standing in
for the server (its own apply side is tested end to end in tests/integration)."""

from __future__ import annotations

import itertools
import logging
import time

import trio

from lbproxy.config.model import ClusterConfig, RedisConfig
from lbproxy.control.cluster import Cluster
from lbproxy.wire.cluster_messages import Change, Signer, encode_change, next_version

KEY = b"k" * 32
SIGNER = Signer(KEY, "lbproxy")


class Recorder:
    def __init__(self, known=("a", "b")) -> None:
        self.known = set(known)
        self.applied: list[tuple[str, str, object]] = []

    def pools(self):
        return []

    def apply_change(self, change: Change) -> bool:
        if change.real_server not in self.known:
            return False
        self.applied.append((change.kind, change.real_server, change.value))
        return True

    def apply_entries(self, batch, now):
        return 0, len(batch.entries)


def in_trio(function):
    result = []

    async def main():
        result.append(function())

    trio.run(main)
    return result[0]


def cluster(target=None) -> Cluster:
    config = ClusterConfig(RedisConfig("redis://127.0.0.1:1/0", name="lb1"), "key", KEY)
    return Cluster(config, target or Recorder())


def weight(value: int, version: int, origin: str = "lb2", rs: str = "a", signer=SIGNER) -> bytes:
    body = encode_change(Change("weight", "web", rs, value, None, version, origin))
    return signer.sign("change", body)


def test_of_two_changes_the_higher_wins_in_either_order():
    for order in itertools.permutations([weight(3, 100, "lb2"), weight(7, 200, "lb3")]):
        sync = cluster()
        in_trio(lambda s=sync, o=order: [s._receive_change(m) for m in o])
        assert sync.records["weight/web/a"].value == 7
        assert sync.target.applied[-1] == ("weight", "a", 7)


def test_equal_versions_are_decided_by_the_origin_name():
    sync = cluster()
    in_trio(lambda: [sync._receive_change(weight(v, 100, o)) for v, o in ((5, "lb9"), (4, "lb3"))])
    assert sync.records["weight/web/a"].value == 5  # "lb9" > "lb3"
    assert sync.target.applied == [("weight", "a", 5)]


def test_a_local_change_is_versioned_above_everything_seen():
    sync = cluster()
    far = next_version(time.time() + 50, 0)  # from an instance whose clock is 50 s ahead
    in_trio(lambda: sync._receive_change(weight(2, far)))
    sync.publish("weight", "web", "a", 9)
    mine = sync.pending["weight/web/a"]
    assert mine.version == far + 1 and mine.origin == "lb1"
    # an older change arriving late is ignored and does not undo the local one
    in_trio(lambda: sync._receive_change(weight(1, far - 5)))
    assert sync.records["weight/web/a"] is mine
    assert sync.target.applied == [("weight", "a", 2)]


def test_a_higher_change_drops_the_pending_local_one():
    sync = cluster()
    sync.publish("weight", "web", "a", 9)
    version = sync.pending["weight/web/a"].version
    in_trio(lambda: sync._receive_change(weight(4, version + 1)))
    assert sync.pending == {}
    assert sync.records["weight/web/a"].value == 4


def test_unknown_servers_and_garbage_are_counted_and_logged_once_a_minute(caplog):
    sync = cluster()
    caplog.set_level(logging.WARNING, logger="lbproxy.cluster")

    def feed():
        for i in range(5):
            sync._receive_change(weight(1, 100 + i, rs="zz"))
            sync._receive_change(SIGNER.sign("change", b"\xff"))  # signed, but garbage
        sync._receive_change(weight(6, 300))  # still applied afterwards

    in_trio(feed)
    assert dict(sync.ignored) == {"unknown": 5, "garbage": 5}
    assert sync.messages["invalid", "in"] == 5 and sync.messages["weight", "in"] == 6
    assert "weight/web/zz" not in sync.records  # unknown here: not kept either
    assert sync.target.applied == [("weight", "a", 6)]
    lines = [r.getMessage() for r in caplog.records]
    assert sum("(unknown)" in line for line in lines) == 1
    assert sum("(garbage)" in line for line in lines) == 1


def test_a_change_stored_under_another_field_is_refused():
    sync = cluster()
    in_trio(lambda: sync._receive_change(weight(5, 100, rs="b"), field=b"weight/web/a"))
    assert sync.ignored["invalid"] == 1 and sync.target.applied == []


def test_reapply_puts_every_known_change_back_after_a_reload():
    sync = cluster()
    in_trio(lambda: sync._receive_change(weight(5, 100)))
    sync.publish("state", "web", "b", "drain")
    sync.target.applied.clear()
    sync.reapply()
    assert sorted(sync.target.applied) == [("state", "b", "drain"), ("weight", "a", 5)]


def test_a_version_more_than_a_minute_ahead_is_refused():
    sync = cluster()
    forged = next_version(time.time() + 90, 0)  # would win every field for ever
    in_trio(lambda: sync._receive_change(weight(9, forged)))
    assert sync.ignored["future"] == 1 and sync.target.applied == []
    assert sync.last_version < forged  # the local clock was not pulled forward
    sync.publish("weight", "web", "a", 2)
    assert sync.pending["weight/web/a"].version < forged
    in_trio(lambda: sync._receive_change(weight(9, next_version(time.time() + 30, 0))))
    assert sync.target.applied == [("weight", "a", 9)]  # within a minute: a clock's drift


def test_a_change_not_signed_with_the_key_is_refused():
    sync = cluster()
    body = encode_change(Change("state", "web", "a", "disabled", None, 1, "mallory"))
    other = Signer(b"x" * 32, "lbproxy")  # another cluster's key
    elsewhere = Signer(KEY, "other-prefix")  # the key, but another cluster's prefix
    for data in (body, other.sign("change", body), elsewhere.sign("change", body),
                 SIGNER.sign("member", body), b"0" * 64 + b"." + body):  # fmt: skip
        in_trio(lambda d=data: sync._receive_change(d))
    assert sync.ignored == {"signature": 5} and sync.target.applied == []
    in_trio(lambda: sync._receive_change(SIGNER.sign("change", body)))
    assert sync.target.applied == [("state", "a", "disabled")]


def test_lbproxy_without_a_cluster_never_imports_coredis():
    """coredis takes longer to import than the rest of lbproxy: every start (and every
    worker) would pay for it; it is imported when a cluster first connects."""
    import subprocess
    import sys

    code = "import sys, lbproxy.cli, lbproxy.runtime.server, lbproxy.runtime.workers; " \
           "print('coredis' in sys.modules, 'anyio' in sys.modules)"  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]
