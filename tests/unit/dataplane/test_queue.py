"""The connection queue (lbproxy/dataplane/queue.py) on trio's mock clock, with a real pool.

The end-to-end behaviour (real clients through a real lbproxy) is in
tests/integration/test_front_door.py; here the hand-over rules are driven directly.
"""

from __future__ import annotations

import trio
import trio.testing

from lbproxy.config.model import QueueConfig
from lbproxy.core.pool import Pool
from lbproxy.dataplane.queue import Queue, sync
from tests.factories import virtual_server


def full_pool(slots: int = 1, **queue) -> tuple[Pool, Queue, list]:
    config = virtual_server("rr", {"a": {"max_connections": slots}}, queue=QueueConfig(**queue))
    pool = Pool(config, 0.0)
    q, _ = sync(None, pool)
    assert q is not None
    leases = [pool.take(pool.pick(0.0), 0.0) for _ in range(slots)]
    return pool, q, leases


async def client(
    pool: Pool, q: Queue, name: str, served: list, leases: list, gone: set | None = None
) -> None:
    """The handler's part: wait if it must, then pick and take before a checkpoint.
    A client whose name is put in `gone` has reset its connection."""
    left = (lambda: name in gone) if gone is not None else None
    reason = await q.wait(left) if q.must_wait() else None
    if reason is not None:
        served.append((name, reason))
        return
    rs = pool.pick(trio.current_time())
    assert rs is not None, f"{name} was let through without a free server"
    leases.append(pool.take(rs, trio.current_time()))
    served.append((name, "served"))
    q.kick()


def test_a_freed_slot_goes_to_the_oldest_waiter_not_a_newcomer():
    async def main() -> None:
        pool, q, leases = full_pool()
        served: list = []
        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(client, pool, q, f"c{i}", served, leases)
                await trio.sleep(0.01)
            assert q.stats.queued == 5 and served == []
            for i in range(5):
                pool.drop(leases.pop(0), trio.current_time())  # the slot frees...
                # ...and a newcomer arrives in the same instant: it must queue
                nursery.start_soon(client, pool, q, f"late{i}", served, leases)
                await trio.sleep(0.01)
                assert served[-1] == (f"c{i}", "served")
            assert [name for name, _ in served] == ["c0", "c1", "c2", "c3", "c4"]
            for _ in range(5):
                pool.drop(leases.pop(0), trio.current_time())
                await trio.sleep(0.01)
        assert [name for name, _ in served[5:]] == [f"late{i}" for i in range(5)]
        assert q.stats.queued == 0 and q.stats.waits.count == 10

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_two_slots_free_at_once_serve_the_two_oldest():
    async def main() -> None:
        pool, q, leases = full_pool(slots=2)
        served: list = []
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(client, pool, q, f"c{i}", served, leases)
                await trio.sleep(0.01)
            pool.drop(leases.pop(0), trio.current_time())
            pool.drop(leases.pop(0), trio.current_time())  # no new transition: room for 2
            await trio.sleep(0.01)
            assert served == [("c0", "served"), ("c1", "served")]
            nursery.cancel_scope.cancel()
        assert q.stats.queued == 0  # the cancelled waiters left the queue

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_timeout_and_full():
    async def main() -> None:
        pool, q, leases = full_pool(max=2, timeout=5.0)
        served: list = []
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(client, pool, q, f"c{i}", served, leases)
                await trio.sleep(1.0)
            assert served == [("c2", "queue_full")]
            await trio.sleep(2.5)  # c0 has waited 5.5 s, c1 4.5 s
            assert served[1:] == [("c0", "queue_timeout")]
            pool.drop(leases.pop(0), trio.current_time())
            await trio.sleep(0.01)
        assert served[2:] == [("c1", "served")]
        assert q.stats.waits.count == 2  # c0's timed-out wait counts, c2 never waited

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_waiter_that_left_gives_its_turn_to_the_next():
    async def main() -> None:
        pool, q, leases = full_pool(timeout=5.0)
        served: list = []
        gone: set = set()
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(client, pool, q, f"c{i}", served, leases, gone)
                await trio.sleep(0.01)
            gone.add("c0")
            pool.drop(leases.pop(0), trio.current_time())
            await trio.sleep(0.01)
            assert served == [("c0", "queue_abandoned"), ("c1", "served")]
            assert len(leases) == 1 and q.stats.queued == 1
            gone.add("c2")
            await trio.sleep(5.0)  # c2's timeout: it had left, so it counts as such
            assert served[2:] == [("c2", "queue_abandoned")]
        assert q.stats.queued == 0 and q.stats.waits.count == 3

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_queue_removed_by_a_reload_lets_its_waiters_go():
    async def main() -> None:
        pool, q, leases = full_pool()
        served: list = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client, pool, q, "c0", served, leases)
            await trio.sleep(0.01)
            pool.reconfigure(
                virtual_server("rr", {"a": {"max_connections": 2}}), trio.current_time()
            )
            q2, change = sync(q, pool)
            assert q2 is None and change == "queue removed"
            await trio.sleep(0.01)
        assert served == [("c0", "served")]  # max_connections 2 now: it got the room

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
