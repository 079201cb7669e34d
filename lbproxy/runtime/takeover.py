"""The new process of an upgrade (`lbproxy run --upgrade-fd FD`): it takes the hand-over
from the process that started it, then serves as a Server or as the supervisor of
`workers: N` (the whole exchange, and the old process's side: runtime/upgrade.py)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys

from lbproxy.config.model import Config, ConfigError
from lbproxy.config.reader import load
from lbproxy.config.secret_files import SECRETS
from lbproxy.runtime import process_title, workers
from lbproxy.runtime import server as runtime
from lbproxy.runtime.inherit import PREVIOUS, Passed
from lbproxy.runtime.upgrade import STDERR, receive_message, send_message

log = logging.getLogger("lbproxy.upgrade")


def run_new(fd: int, config_paths: list[str], log_level: str) -> int:
    """`lbproxy run --upgrade-fd FD`: take over from the process that started this one."""
    process_title.set_title(process_title.TAKING_OVER)
    channel = socket.socket(fileno=fd)
    try:
        config = load(config_paths)
    except ConfigError as exc:
        messages = [str(problem) for problem in exc.problems]
        for message in messages:
            print(message, file=sys.stderr)
        with contextlib.suppress(OSError):
            send_message(channel, {"error": "invalid configuration", "errors": messages})
        return 2
    try:
        hello, fds = receive_message(channel)
    except (OSError, ValueError) as exc:
        print(f"lbproxy: no hand-over from the running lbproxy: {exc}", file=sys.stderr)
        return 1
    if hello is None or len(fds) != len(hello.get("sockets", ())):
        print("lbproxy: the hand-over ended early", file=sys.stderr)
        return 1
    secrets = hello.get("secrets")
    SECRETS.remember(secrets if isinstance(secrets, dict) else {})
    problem = _workers_change(hello.get("workers"), config)
    if problem:
        print(f"lbproxy: {problem}", file=sys.stderr)
        for number in fds:
            os.close(number)
        with contextlib.suppress(OSError):
            send_message(channel, {"error": problem, "errors": [problem]})
        return 1
    named = dict(zip(hello["sockets"], fds, strict=True))
    old_stderr = named.pop(STDERR, None)
    state = hello.get("state")  # restored before the first accept (runtime/state.py)
    passed = []
    for name, number in named.items():
        sock = socket.socket(fileno=number)
        sock.setblocking(False)
        passed.append(Passed(sock, name, PREVIOUS))

    stderr = [old_stderr]

    def restore_stderr() -> None:
        """The pipe to the old process ends here (idempotent)."""
        fd = stderr.pop() if stderr else None
        if fd is not None:
            os.dup2(fd, 2)
            os.close(fd)

    def ready(*_: object) -> None:
        process_title.set_title(process_title.SERVING)  # the old one renames itself now
        with contextlib.suppress(OSError):
            send_message(channel, {"ready": True, "pid": os.getpid()})
        channel.close()
        log.info("took over from pid %s (upgrade)", hello.get("pid"))
        restore_stderr()

    if config.global_.workers > 1:  # a supervisor: its workers accept on these sockets
        return workers.run(
            config,
            config_paths=config_paths,
            log_level=log_level,
            passed=passed,
            on_ready=ready,
            handed=hello,
            # before the workers start, who would inherit the pipe as their stderr and
            # keep it open (and lose their lines once the old process is gone)
            on_bound=restore_stderr,
        )
    return runtime.run(
        config,
        config_paths=config_paths,
        log_level=log_level,
        on_started=ready,
        passed=passed,
        main_pid=True,
        initial_state=state.encode() if isinstance(state, str) else None,
        # from a supervisor: one worker's state; the file's parts hold the others' entries
        initial_state_is_one_workers=_from_workers(hello.get("workers")),
    )


def _from_workers(old: object) -> bool:
    """True when the old process was a supervisor (`workers` > 1)."""
    return isinstance(old, int) and not isinstance(old, bool) and old > 1


def _workers_change(old: object, config: Config) -> str:
    """Why this upgrade cannot be made, or "": `workers` 1 <-> N with the DNS locator.

    The locator's TCP socket is the process's own without workers and each worker's
    own (SO_REUSEPORT) with them, and it is not handed over: the old process answers
    on it through its drain. A new process of the other kind cannot bind beside it
    (a listening TCP socket without SO_REUSEPORT admits no other), so it would fail on
    "address in use"; this says why first. UDP virtual servers and TCP do change over."""
    new = config.global_.workers
    dns = config.global_.locator.dns
    if not isinstance(old, int) or dns is None or (old > 1) == (new > 1):
        return ""
    return (
        f"workers {old} -> {new} with the DNS locator ({dns.listen}) takes a restart: its "
        "sockets cannot go over between a process without workers and workers"
    )
