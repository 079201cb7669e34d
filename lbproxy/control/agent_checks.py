"""Agent checks (SPEC §22, HAProxy's agent-check): one trio task per real server whose
virtual server (or itself) has an `agent_check` block.

Every `interval` the task connects to the agent (`port`, on `address` or the real
server's host), sends `send` if set, and reads one line, at most 512 bytes, within
`timeout` for the whole exchange. The line is parsed by the pure parser (wire/agent.py)
and a good answer goes to `Pool.apply_agent`, which keeps the agent's state and weight
apart from the operator's (core/agent.py). Each exchange is counted in
`RealServer.counters.agent_checks` (`lbproxy_agent_checks_total{result}`):

    ok          a good answer (whatever it says: `down` is a good answer too)
    fail        the connect failed, or the agent closed without sending a line
    timeout     no connect or no whole line within `timeout`
    bad_answer  a line longer than 512 bytes, an unknown word, a weight above 256%

Anything but `ok` changes nothing: the agent is advice beside the health check, and an
agent that is gone or talks nonsense must not take a server out (as HAProxy, which
ignores an agent it cannot reach). The agent's down word takes health down; with
`health_check.on_down: close` the server's connections are then closed, as when the
health check takes it down.

Tasks are kept in step with the configuration by the one reconciler (reconcile.py); an
agent check removed by a reload forgets what the agent said (`Pool.clear_agent`).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable, Iterable

import trio

from lbproxy.config.model import Address, AgentCheckConfig
from lbproxy.control.checks import decode_send
from lbproxy.control.reconcile import Configured, Reconciler
from lbproxy.core.agent import RESULTS
from lbproxy.core.health import health_changed
from lbproxy.core.pool import Pool, RealServer
from lbproxy.net.accept import CAPACITY_ERRNOS, LocalCapacityError
from lbproxy.net.barrier import record
from lbproxy.wire.agent import LINE_LIMIT, AgentAnswer, BadAnswer, describe, line_of, parse

log = logging.getLogger("lbproxy.agent")

OK, FAIL, TIMEOUT, BAD_ANSWER = RESULTS  # lbproxy_agent_checks_total{result}

Spec = tuple[AgentCheckConfig, Address, Pool]


def agent_address(rs: RealServer, check: AgentCheckConfig) -> Address:
    """Where `rs`'s agent listens: `address` (else the real server's host) and `port`."""
    return Address(check.address or rs.address.host, check.port or 0)


async def ask_agent(
    address: Address, check: AgentCheckConfig
) -> tuple[str, AgentAnswer | None, str]:
    """One exchange with the agent at `address`: (result, the good answer or None, the
    reason for the log). Raises LocalCapacityError when this process is out of
    descriptors (nothing is then known of the agent)."""
    received = bytearray()
    connected = False
    try:
        with trio.fail_after(check.timeout):
            stream = await _connect(address)
            connected = True
            async with stream:
                if check.send:
                    await stream.send_all(decode_send(check.send))
                while True:
                    chunk = await stream.receive_some(LINE_LIMIT + 2 - len(received))
                    received += chunk
                    line = line_of(bytes(received), closed=not chunk)
                    if line is not None:
                        break
    except trio.TooSlowError:
        if not connected:
            return TIMEOUT, None, f"connect did not complete within {check.timeout:g}s"
        return TIMEOUT, None, f"no whole line within {check.timeout:g}s"
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        return FAIL, None, _describe(exc)
    if isinstance(line, BadAnswer):
        return BAD_ANSWER, None, line.why
    if not received:
        return FAIL, None, "closed without a line"
    answer = parse(line)
    if isinstance(answer, BadAnswer):
        return BAD_ANSWER, None, answer.why
    return OK, answer, describe(answer)


async def _connect(address: Address) -> trio.SocketStream:
    """A connected stream to the agent; OSError (its errno kept, for the log) when the
    name does not resolve or the connect fails, LocalCapacityError when this process
    cannot create a socket."""
    try:
        infos = await trio.socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve {address.host}: {exc.strerror}") from None
    family, kind, _, _, sockaddr = infos[0]
    try:
        sock = trio.socket.socket(family, kind)
    except OSError as exc:
        if exc.errno in CAPACITY_ERRNOS:
            raise LocalCapacityError(_describe(exc)) from None
        raise
    try:
        await sock.connect(sockaddr)
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno).lower()
    return str(exc) or type(exc).__name__


class AgentChecks(Reconciler[RealServer, Spec]):
    """One agent task per real server with an agent check (reconcile.py)."""

    def __init__(self) -> None:
        super().__init__()
        self._pools: dict[RealServer, Pool] = {}  # the pool of each server with a task

    def wanted(self, virtual_servers: Iterable[Configured]) -> dict[RealServer, Spec]:
        wanted = {}
        for vs in virtual_servers:
            pool = vs.pool
            for rs in pool.servers:
                check = rs.config.agent_check or pool.config.agent_check
                if check is not None and check.port is not None:
                    wanted[rs] = (check, agent_address(rs, check), pool)
        return wanted

    def start(self, key: RealServer, spec: Spec) -> Callable[[], Awaitable[None]]:
        check, address, pool = spec
        self._pools[key] = pool
        return functools.partial(_run, pool, key, check, address)

    def stopped(self, key: RealServer) -> None:
        pool = self._pools.pop(key, None)
        if pool is not None and not key.removed:
            pool.clear_agent(key, trio.current_time())


async def _run(pool: Pool, rs: RealServer, check: AgentCheckConfig, address: Address) -> None:
    out_of_capacity = False
    # The kind of failure (fail, timeout, bad_answer) of the current run of failed
    # exchanges, None after a good answer: a run is logged at INFO once, and again when
    # its kind changes (an agent that closed now talks nonsense), not at every check.
    failing: str | None = None
    await trio.sleep(random.uniform(0, check.interval))
    next_at = trio.current_time()
    while True:
        result: str | None = None
        try:
            result, answer, reason = await ask_agent(address, check)
        except LocalCapacityError as exc:
            if not out_of_capacity:
                log.warning("%s/%s: agent check skipped: %s", pool.name, rs.name, exc)
                out_of_capacity = True
        except Exception as exc:  # a bug here must not stop the proxy
            record("agent", exc, f"{pool.name}/{rs.name}")
            result, answer, reason = FAIL, None, type(exc).__name__
        if result is not None:
            out_of_capacity = False
            rs.counters.agent_checks[result] += 1
            if answer is not None:
                failing = None
                _apply(pool, rs, answer, reason)
            elif failing != result:
                failing = result
                log.info("%s/%s: agent %s (%s); no change", pool.name, rs.name, result, reason)
            else:
                log.debug("%s/%s: agent %s (%s)", pool.name, rs.name, result, reason)
        next_at = max(next_at + check.interval, trio.current_time())
        await trio.sleep_until(next_at)


def _apply(pool: Pool, rs: RealServer, answer: AgentAnswer, said: str) -> None:
    before = rs.agent.document() if rs.agent is not None else {}
    changed = pool.apply_agent(rs, answer, trio.current_time(), time.time())
    after = rs.agent.document() if rs.agent is not None else {}
    # A state or limit change is news for the operator; an agent that follows its
    # load may change its weight at every answer, which would flood the log at INFO.
    news = any(before.get(k) != after.get(k) for k in ("state", "max_connections"))
    if news or before.get("weight_percent") != after.get("weight_percent"):
        level = logging.INFO if news else logging.DEBUG
        log.log(level, "%s/%s: agent says %r", pool.name, rs.name, said)
    if changed is not None:  # health turned: on_down / on_up close and count as for a check
        health_changed(pool, rs, changed)
