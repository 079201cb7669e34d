"""A process's admin socket (lbproxy/admin/local_socket.py): taken over from the lbproxy
this one replaces (`lbproxy upgrade`), or created, at start with the other listeners.

An upgrade hands the listening Unix socket over as it hands over the TCP ones (named
`admin socket PATH`): the new process accepts on the same socket, so a client of the
socket (`lbproxy drain` during an upgrade) is never refused, and the file is never
removed and made again. The old process then leaves the file in place when it exits.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

from lbproxy.admin import local_socket
from lbproxy.config.model import ADMIN_SOCKET_DEFAULT, GlobalConfig
from lbproxy.dataplane.listener import BindError
from lbproxy.runtime.inherit import Inherited

log = logging.getLogger("lbproxy.admin")

HANDOVER_PREFIX = "admin socket "  # + its path: the hand-over's name for it


def handover_name(path: str) -> str:
    return HANDOVER_PREFIX + path


@dataclass(eq=False)
class AdminSocket:
    """The listening admin socket, its path, and whether its file is this process's to
    remove when it stops."""

    sock: socket.socket
    path: str
    # Taken from the previous lbproxy: until this process serves, that one still does
    # (a failed upgrade leaves it serving), and the file stays.
    taken_over: bool = False
    handed_over: bool = False  # an upgrade's new process serves on it now

    def owned_paths(self) -> list[str]:
        """What `global.user` must own once lbproxy drops root (runtime/privileges.py):
        the socket file, so that user's own CLI may use it too. Its folder is left as it
        is (it may be shared: /run/lbproxy); a process that dropped root may not remove
        the file when it stops, and the next start replaces the file it left."""
        return [self.path]

    def close(self, *, serving: bool = True) -> None:
        """Close it; the file goes too, unless another process serves on it: the new
        one after an upgrade, or (`serving` False: this one never served) the old one."""
        self.sock.close()
        if not self.handed_over and (serving or not self.taken_over):
            local_socket.unlink(self.path)


def open_admin_socket(global_: GlobalConfig, inherited: Inherited) -> AdminSocket | None:
    """The admin socket this configuration asks for, or None.

    The previous lbproxy's, when it served the same path; else created here
    (`local_socket.bind`, the one place it is made). A previous lbproxy's socket on
    another path is closed and its file removed. BindError when it cannot be created
    (another process answers on the path, or the path is not a socket)."""
    admin = global_.admin
    port = admin.listen.port if admin.listen is not None else None
    path = local_socket.configured_path(admin.socket, port)
    taken = None
    for entry in inherited.passed:
        if entry.used or not entry.name.startswith(HANDOVER_PREFIX):
            continue
        entry.used = True
        if entry.name == handover_name(path or ""):
            taken = entry.sock
        else:  # the new configuration names another path, or none
            entry.sock.close()
            local_socket.unlink(entry.name.removeprefix(HANDOVER_PREFIX))
    if path is None:
        if admin.listen is not None and admin.socket == ADMIN_SOCKET_DEFAULT:
            log.info(
                "no admin socket: no runtime folder ($RUNTIME_DIRECTORY, or "
                "$XDG_RUNTIME_DIR when not root); set global.admin.socket to have one"
            )
        return None
    if taken is not None:
        return AdminSocket(taken, path, taken_over=True)
    if admin.socket == ADMIN_SOCKET_DEFAULT and not local_socket.prepare_default_folder(path):
        return None
    try:
        sock = local_socket.bind(path)
    except local_socket.AdminSocketError as exc:
        raise BindError(str(exc)) from None
    log.info("admin socket: %s", path)
    return AdminSocket(sock, path)
