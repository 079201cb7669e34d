"""systemd's notify protocol (`Type=notify`, sd_notify(3)), written by hand.

systemd passes `$NOTIFY_SOCKET`: a path (`/run/systemd/notify`) or an abstract socket
name (`@/org/freedesktop/systemd1/notify/...`, the `@` standing for a leading NUL byte)
of an AF_UNIX datagram socket. Each message is one datagram of `KEY=VALUE` lines:

    READY=1                          every listener is bound (lbproxy run) or every
                                     worker is ready (workers > 1, the supervisor)
    RELOADING=1 + MONOTONIC_USEC=N   a reload starts (SIGHUP, POST /api/v1/reload);
                                     `Type=notify-reload` wants the CLOCK_MONOTONIC time
    READY=1                          ... and is over, applied or refused
    STOPPING=1                       SIGTERM/SIGINT/SIGUSR1/SIGQUIT: draining
    STATUS=...                       one line for `systemctl status`
    MAINPID=N + READY=1              the new process of `lbproxy upgrade` is ready: it
                                     is the service's main process from now on

The protocol is a single sendto(), so no library is needed (python-systemd wraps
libsystemd's sd_notify, which does just this). Without `$NOTIFY_SOCKET` every method
returns at once. A socket that is gone, full or refused is logged once and never stops
the proxy: notifications are advice to the service manager, not part of serving.

`from_environment()` removes the variable from the environment (sd_notify's
`unset_environment`), so the processes lbproxy starts — the workers of `workers: N` —
never notify. The one exception is the new process of `lbproxy upgrade`
(runtime/upgrade.py), given the variable back: it sends `MAINPID=` with its first
`READY=1`, which is why the unit says `NotifyAccess=all`.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("lbproxy.notify")

ENVIRONMENT = "NOTIFY_SOCKET"
STATUS_INTERVAL = 5.0  # seconds between STATUS= updates while running


class Notifier:
    """Sends notifications to one address; a Notifier without an address does nothing."""

    def __init__(self, address: str | None = None) -> None:
        self.address = address or None
        self._target: str | bytes | None = None
        self._sock: socket.socket | None = None
        self._failed = False  # a send failed; logged once
        # `lbproxy upgrade` (runtime/upgrade.py): the new process says MAINPID= with its
        # first READY=1, so systemd follows it (NotifyAccess=all in the unit)
        self.main_pid = False
        if self.address is not None:
            if self.address.startswith("@"):  # abstract namespace: a leading NUL byte
                self._target = b"\0" + self.address[1:].encode()
            elif self.address.startswith("/"):
                self._target = self.address
            else:  # vsock:... and other forms systemd knows: not for a local daemon
                log.warning("%s=%s is not a Unix socket path; not notifying", ENVIRONMENT, address)
                self.address = None

    @classmethod
    def from_environment(cls) -> Notifier:
        """The Notifier `$NOTIFY_SOCKET` asks for, taking the variable out of the
        environment so child processes do not inherit it."""
        return cls(os.environ.pop(ENVIRONMENT, None))

    @property
    def enabled(self) -> bool:
        return self._target is not None

    def send(self, *lines: str) -> bool:
        """Send one datagram of `KEY=VALUE` lines; True when it was sent."""
        if self._target is None:
            return False
        message = "\n".join(lines).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)  # never stall the event loop on a full queue
            self._sock.sendto(message, self._target)
        except OSError as exc:
            if not self._failed:
                log.warning("cannot notify %s: %s", self.address, exc.strerror or exc)
                self._failed = True
            return False
        if self._failed:
            log.info("notifying %s again", self.address)
            self._failed = False
        return True

    def ready(self, status: str | None = None) -> bool:
        if self.main_pid:  # the first READY=1 of a process that replaces the main one
            self.main_pid = False
            return self.send(f"MAINPID={os.getpid()}", "READY=1", *_status(status))
        return self.send("READY=1", *_status(status))

    def reloading(self) -> bool:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}", "STATUS=reloading")

    def stopping(self, status: str | None = None) -> bool:
        return self.send("STOPPING=1", *_status(status))

    def status(self, status: str) -> bool:
        return self.send(*_status(status))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _status(text: str | None) -> list[str]:
    return [] if text is None else ["STATUS=" + " ".join(text.split())]  # one line


def status_line(virtual_servers: int, active: int | None, extra: str = "") -> str:
    """`STATUS=` text: "2 virtual servers, 5 active connections"."""
    parts = [f"{virtual_servers} virtual server{'s' if virtual_servers != 1 else ''}"]
    if active is not None:
        parts.append(f"{active} active connection{'s' if active != 1 else ''}")
    if extra:
        parts.append(extra)
    return ", ".join(parts)
