"""Keeping a subsystem's tasks in step with the configuration: the one reconciler.

Every control-plane subsystem runs one task per thing the configuration asks for: a
health check per real server (checks.py), an SNMP poller per polled real server
(snmp.py), a throttle monitor or a conditioning monitor per virtual server with the block
(throttle_monitor.py, conditioning.py), a discovery task per virtual server with
`discovery.dns` (discovery.py). After start-up, after every reload and after a discovery
round the runtime calls each one's `sync(virtual_servers, nursery)`, the same call for
all five. A subsystem says only what it wants -- a key per task and the spec the task runs
with (`wanted`) -- and how to run one (`start`); `Reconciler.sync` compares that with
what runs, once, for all of them: a key no longer wanted is stopped, a new one started,
one whose spec changed restarted (or retuned in place, for a subsystem that can, as the
throttle monitor takes new limits without losing its state). This is the level-triggered
"reconcile" of a Kubernetes controller: the desired state is recomputed whole each time,
so a sync missed or repeated changes nothing.

Each task runs in its own cancel scope in the caller's nursery; stopping cancels the
scope. A subsystem's task catches its own expected errors (an exception escaping would
cancel the nursery it shares with the proxy).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import trio

if TYPE_CHECKING:
    from lbproxy.core.pool import Pool

__all__ = ["Configured", "Reconciler", "Task"]

K = TypeVar("K")  # what a task is for: a real server, a virtual server, a name
S = TypeVar("S")  # what it runs with: compared (==) to decide a restart


class Configured(Protocol):
    """A running virtual server as the control plane reads it: its name and its pool.

    The data plane's VirtualServer (dataplane/virtual_server.py) is one; control and
    dataplane are sibling layers, so this names what is read instead of importing it.
    """

    @property
    def name(self) -> str: ...

    @property
    def pool(self) -> Pool: ...


class Task(Generic[S]):
    """One running task: the spec it was started with and the scope that stops it."""

    __slots__ = ("cancel_scope", "spec")

    def __init__(self, spec: S) -> None:
        self.spec = spec
        self.cancel_scope = trio.CancelScope()


class Reconciler(Generic[K, S]):
    """One task per wanted key, in step with the configuration (see the module header).

    A subsystem subclasses it and defines `wanted` and `start`; `retune`, `stopped` and
    `describe` are optional hooks.
    """

    def __init__(self) -> None:
        self._tasks: dict[K, Task[S]] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    # -- the subsystem's part -------------------------------------------------------

    def wanted(self, virtual_servers: Iterable[Configured]) -> Mapping[K, S]:
        """What should run now: key -> spec, from the running virtual servers."""
        raise NotImplementedError

    def start(self, key: K, spec: S) -> Callable[[], Awaitable[object]]:
        """The body of a new task for `key` (called in sync; the body runs in its scope)."""
        raise NotImplementedError

    def retune(self, key: K, spec: S) -> bool:
        """Apply a changed spec to the running task in place; False: restart it."""
        return False

    def stopped(self, key: K) -> None:
        """Called after `key`'s task was cancelled for good (not for a restart)."""

    def describe(self, key: K, event: str) -> str | None:
        """The reload summary's line for `event` ("added", "changed" in place,
        "restarted", "removed"), if any."""
        return None

    # -- the one reconciliation -----------------------------------------------------

    def sync(self, virtual_servers: Iterable[Configured], nursery: trio.Nursery) -> list[str]:
        """Start, restart, retune or stop tasks to match the running configuration;
        returns what changed, for the reload summary. Synchronous: new tasks start in
        `nursery` at its next scheduling round."""
        wanted = self.wanted(virtual_servers)
        changes: list[str] = []
        restarted = set()
        for key, task in list(self._tasks.items()):
            if key not in wanted:
                task.cancel_scope.cancel()
                del self._tasks[key]
                self.stopped(key)
                self._note(changes, key, "removed")
            elif wanted[key] != task.spec:
                if self.retune(key, wanted[key]):
                    task.spec = wanted[key]
                    self._note(changes, key, "changed")
                else:  # started again below with the new spec
                    task.cancel_scope.cancel()
                    del self._tasks[key]
                    restarted.add(key)
        for key, spec in wanted.items():
            if key not in self._tasks:
                task = self._tasks[key] = Task(spec)
                nursery.start_soon(_run, self.start(key, spec), task.cancel_scope)
                self._note(changes, key, "restarted" if key in restarted else "added")
        return changes

    def _note(self, changes: list[str], key: K, event: str) -> None:
        line = self.describe(key, event)
        if line is not None:
            changes.append(line)


async def _run(body: Callable[[], Awaitable[object]], cancel_scope: trio.CancelScope) -> None:
    with cancel_scope:
        await body()
