"""Listening sockets this process did not bind: systemd's (socket activation) and those
of the lbproxy it replaces (`lbproxy upgrade`, lbproxy/runtime/upgrade.py).

systemd (sd_listen_fds(3)) passes descriptors 3, 4, ... with three variables:
`LISTEN_PID` (the process they are for: a child that inherits the environment must not
take them), `LISTEN_FDS` (how many) and `LISTEN_FDNAMES` (colon-separated names, from
`FileDescriptorName=`; "unknown" when the unit gives none). They are read once and
taken out of the environment (sd_listen_fds' `unset_environment`), so the processes
lbproxy starts never see them.

A passed socket feeds the listen address it is matched to, and that address is not
bound again — which is the whole point: the socket, and the connections the kernel
queues on it while no lbproxy runs, outlive the process. The match, for each address
the configuration listens on (`Inherited.take`):

  1. by the hand-over name: the previous lbproxy names each socket after the address
     in its own configuration ("127.0.0.1:8080", "[::]:53/udp", "admin 127.0.0.1:9100"),
     so a port-0 address or a host name matches exactly what it was;
  2. by name = a virtual server's name (`FileDescriptorName=web`), when that virtual
     server listens on this one address (of the socket's type): the bound address may
     differ in form (systemd's `ListenStream=80` is [::]:80, dual-stack, for a
     configured 0.0.0.0:80); `admin` and `dns` name the admin endpoint and the DNS
     locator;
  3. by bound address: the socket's own address equals the configured one.

A systemd socket that nothing matches is an error at start (systemd would queue
connections on it that nobody accepts); so is one of the wrong kind (a stream socket
that is not listening: `Accept=yes` is not for lbproxy). An address that no socket
matches is bound as usual; when that fails, the error says which sockets were passed,
so the missing `ListenStream=` is plain.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass

from lbproxy.config.model import Address
from lbproxy.dataplane.listener import BindError

log = logging.getLogger("lbproxy.inherit")

SD_LISTEN_FDS_START = 3  # systemd's first passed descriptor
ENVIRONMENT = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
SYSTEMD = "systemd"
PREVIOUS = "the previous lbproxy"


class InheritError(BindError):
    """Passed sockets that do not fit the configuration: exit code 1, as a failed bind."""


@dataclass(eq=False)
class Passed:
    """One passed socket, the name it came with, and whether an address took it."""

    sock: socket.socket
    name: str
    origin: str  # SYSTEMD or PREVIOUS
    used: bool = False

    @property
    def udp(self) -> bool:
        return self.sock.type == socket.SOCK_DGRAM

    def bound(self) -> str:
        try:
            host, port = self.sock.getsockname()[:2]
        except (OSError, ValueError):
            return "?"
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"

    def describe(self) -> str:
        kind = "UDP" if self.udp else "TCP"
        return f"{self.origin}'s socket {self.name!r} ({kind} {self.bound()})"

    def bound_to(self, address: Address) -> bool:
        """The socket's own address is `address` (host compared as an IP address)."""
        try:
            host, port = self.sock.getsockname()[:2]
            wanted = "127.0.0.1" if address.host == "localhost" else address.host
            return port == address.port and ipaddress.ip_address(host) == ipaddress.ip_address(
                wanted
            )
        except (OSError, ValueError):
            return False


class Inherited:
    """The passed sockets of one start, taken one address at a time."""

    def __init__(self, passed: Iterable[Passed]) -> None:
        self.passed = list(passed)

    def __bool__(self) -> bool:
        return bool(self.passed)

    @classmethod
    def from_systemd(cls, environ: MutableMapping[str, str] | None = None) -> Inherited:
        """systemd's sockets for this process (none without `LISTEN_FDS`), the three
        variables taken out of the environment either way. InheritError on a socket
        lbproxy cannot serve."""
        env = os.environ if environ is None else environ
        values = {name: env.pop(name, None) for name in ENVIRONMENT}
        count, pid = values["LISTEN_FDS"], values["LISTEN_PID"]
        if count is None:
            return cls(())
        if pid is not None and pid.strip() != str(os.getpid()):
            log.debug("LISTEN_PID=%s is another process's; no socket taken", pid)
            return cls(())
        try:
            n = int(count)
        except ValueError:
            raise InheritError(f"LISTEN_FDS={count!r} is not a number") from None
        names = (values["LISTEN_FDNAMES"] or "").split(":") if values["LISTEN_FDNAMES"] else []
        passed = []
        problems = []
        for i in range(n):
            fd = SD_LISTEN_FDS_START + i
            name = names[i] if i < len(names) and names[i] else "unknown"
            try:
                os.set_inheritable(fd, False)  # systemd leaves them inheritable (no CLOEXEC)
                sock = socket.socket(fileno=fd)
            except OSError as exc:
                problems.append(f"systemd's descriptor {fd} ({name!r}): {exc.strerror or exc}")
                continue
            entry = Passed(sock, name, SYSTEMD)
            problem = _unusable(sock)
            if problem:
                problems.append(f"{entry.describe()} {problem}")
                sock.close()
                continue
            sock.setblocking(False)
            passed.append(entry)
        if problems:
            for entry in passed:
                entry.sock.close()
            raise InheritError("; ".join(problems))
        if passed:
            log.info("socket activation: %s", ", ".join(f"{p.name} {p.bound()}" for p in passed))
        return cls(passed)

    def take(
        self, key: str, address: Address, *, udp: bool, names: Iterable[str] = ()
    ) -> socket.socket | None:
        """The passed socket for the listener named `key` on `address` (see the module
        header for the order), or None: the caller binds it. `names` are the names that
        may stand for this address alone (virtual servers with this one address)."""
        candidates = [
            p
            for p in self.passed
            if not p.used and p.udp == udp and p.sock.family != socket.AF_UNIX
        ]
        names = set(names)
        for rule in (
            lambda p: p.name == key,
            lambda p: p.name in names,
            lambda p: p.bound_to(address),
        ):
            for entry in candidates:
                if rule(entry):
                    entry.used = True
                    log.debug("%s: %s", key, entry.describe())
                    return entry.sock
        return None

    def give_back(self, sock: socket.socket) -> bool:
        """A listener on `sock` is closed by a reload: when `sock` is systemd's, keep it
        for a later reload that adds the address back (True; the caller closes `sock`, a
        duplicate stays here). systemd holds the socket open anyway, so binding the
        address again would fail ("address in use"), and connections wait in its queue
        meanwhile as they do while no lbproxy runs. The previous lbproxy's sockets are
        not kept (False): closing them is what refuses connections to a dropped address."""
        for entry in self.passed:
            if entry.used and entry.sock is sock and entry.origin == SYSTEMD:
                entry.sock = sock.dup()
                entry.used = False
                return True
        return False

    def close_unused_previous(self) -> None:
        """After a reload: the sockets a supervisor sent for it that it did not take
        (the reload failed), closed; systemd's stay (give_back)."""
        for entry in self.unused():
            if entry.origin == PREVIOUS:
                entry.sock.close()
                entry.used = True

    def unused(self) -> list[Passed]:
        return [p for p in self.passed if not p.used]

    def check_all_used(self) -> None:
        """After the first bind: systemd's sockets that no address took are an error;
        the previous lbproxy's are closed (the new configuration dropped the address)."""
        unmatched = []
        for entry in self.unused():
            if entry.origin == SYSTEMD:
                unmatched.append(entry.describe())
            else:
                log.info("%s: not in the configuration any more; closed", entry.describe())
                entry.sock.close()
                entry.used = True
        if unmatched:
            raise InheritError(
                f"{', '.join(unmatched)} matches no virtual server: name it after one"
                " (FileDescriptorName=), or bind it to a configured listen address"
            )

    def missing(self, address: str) -> str:
        """Text added to a failed bind of `address`: which sockets systemd passed (the
        hint is about its socket unit; a previous lbproxy's or a supervisor's sockets are
        the configuration's own addresses, nothing to add anywhere)."""
        given = ", ".join(f"{p.name} {p.bound()}" for p in self.passed if p.origin == SYSTEMD)
        if not given:
            return ""
        return f" (not among the sockets passed: {given}; add it to lbproxy.socket)"

    def close(self) -> None:
        for entry in self.unused():
            entry.sock.close()


def _unusable(sock: socket.socket) -> str:
    """Why lbproxy cannot serve on a passed socket, or ""."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return "is not an IPv4 or IPv6 socket"
    if sock.type == socket.SOCK_STREAM:
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return "is not listening (Accept=yes passes connections: use Accept=no)"
    elif sock.type != socket.SOCK_DGRAM:
        return "is neither a stream nor a datagram socket"
    return ""
