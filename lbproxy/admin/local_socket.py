"""The admin socket: the admin API on a Unix socket, for the host's own operator (SPEC §21).

Over TCP a change needs the bearer token; through this socket it needs none, because
the kernel says who is asking: the socket file is mode 0600, and every connection's
peer uid (SO_PEERCRED) must be the process's own or root's, else each request, reads
too, is refused (403). So `lbproxy drain web a` works on the host as the user lbproxy
runs as, or as root, with no token to hand out, as HAProxy's stats socket and
`nginx -s` do.

Where it lives: `global.admin.socket`, else `admin-PORT.sock` (PORT: the TCP admin
port, so two lbproxy processes with different admin ports never meet) in the runtime
folder: `$RUNTIME_DIRECTORY` under systemd (`RuntimeDirectory=lbproxy` makes it
/run/lbproxy), else `/run/lbproxy/` as root, else `$XDG_RUNTIME_DIR/lbproxy/`; the folder
is created 0700 when missing, and a folder that another user owns or may write to is
not used. The CLI looks in the same folders (`client_paths`).

`bind` is the one function that creates the socket: at start, with the other listeners,
before anything else runs (so a later privilege drop can hand the file to the new user).
A socket file already there is removed only when nothing answers on it (left by a
process that died); one that answers belongs to a live process, and the start fails as
a taken TCP port does.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import struct
from collections.abc import Mapping

from lbproxy.config.model import ADMIN_SOCKET_DEFAULT

log = logging.getLogger("lbproxy.admin")

SYSTEM_FOLDER = "/run/lbproxy"  # root's, and systemd's RuntimeDirectory=lbproxy
USER_SUBFOLDER = "lbproxy"  # under $XDG_RUNTIME_DIR
PROBE_TIMEOUT = 1.0  # connecting to a socket file to see whether a process answers
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


class AdminSocketError(Exception):
    """The admin socket cannot be created (the message names the path and why)."""


def socket_name(port: int) -> str:
    return f"admin-{port}.sock"


def _runtime_directory(environ: Mapping[str, str]) -> str | None:
    """systemd's RuntimeDirectory= (the first, when the unit names several)."""
    value = environ.get("RUNTIME_DIRECTORY", "")
    first = value.split(":", 1)[0]
    return first if first.startswith("/") else None


def _xdg_folder(environ: Mapping[str, str]) -> str | None:
    xdg = environ.get("XDG_RUNTIME_DIR", "")
    return os.path.join(xdg, USER_SUBFOLDER) if xdg.startswith("/") else None


def server_folder(environ: Mapping[str, str] | None = None, euid: int | None = None) -> str | None:
    """The runtime folder this process puts its default socket in (not created here)."""
    env = os.environ if environ is None else environ
    uid = os.geteuid() if euid is None else euid
    systemd = _runtime_directory(env)
    if systemd is not None:
        return systemd
    if uid == 0:
        return SYSTEM_FOLDER
    return _xdg_folder(env)


def configured_path(
    setting: str | None, port: int | None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The path `global.admin.socket` names: itself, None for `none`, or for the default
    `admin-PORT.sock` in the runtime folder (None without a TCP port or a folder)."""
    if setting != ADMIN_SOCKET_DEFAULT:
        return setting
    folder = server_folder(environ)
    if port is None or folder is None:
        return None
    return os.path.join(folder, socket_name(port))


def client_paths(port: int, environ: Mapping[str, str] | None = None) -> list[str]:
    """Where a client looks for the socket of the lbproxy whose TCP admin port is
    `port`, in order: every folder a server may have chosen (for the CLI's own user,
    for root's lbproxy, and for a systemd unit's RuntimeDirectory=lbproxy)."""
    env = os.environ if environ is None else environ
    folders = [_runtime_directory(env), SYSTEM_FOLDER, _xdg_folder(env)]
    paths: list[str] = []
    for folder in folders:
        if folder is not None:
            path = os.path.join(folder, socket_name(port))
            if path not in paths:
                paths.append(path)
    return paths


def prepare_default_folder(path: str) -> bool:
    """Make sure the default socket's folder is there (created 0700 when missing) and
    safe: owned by this user or root and writable by nobody else. False (logged): no
    default socket."""
    folder = os.path.dirname(path)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        log.warning("no admin socket: cannot create %s: %s", folder, exc.strerror)
        return False
    try:
        info = os.lstat(folder)
    except OSError as exc:
        log.warning("no admin socket: %s: %s", folder, exc.strerror)
        return False
    if not stat.S_ISDIR(info.st_mode):
        log.warning("no admin socket: %s is not a folder", folder)
        return False
    if info.st_uid not in (0, os.geteuid()) or info.st_mode & 0o022:
        log.warning(
            "no admin socket: %s belongs to uid %d or others may write to it (mode %o); "
            "set global.admin.socket to a path in a folder of lbproxy's own",
            folder,
            info.st_uid,
            stat.S_IMODE(info.st_mode),
        )
        return False
    return True


def bind(path: str, backlog: int = socket.SOMAXCONN) -> socket.socket:
    """Create the admin socket at `path`: listening, the file mode 0600. A socket file
    there that nothing answers on is removed first; anything else there is an error
    (AdminSocketError): lbproxy never removes what is not a dead socket."""
    try:
        info: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        message = f"cannot listen on the admin socket {path}: {exc.strerror}"
        raise AdminSocketError(message) from None
    if info is not None:
        if not stat.S_ISSOCK(info.st_mode):
            raise AdminSocketError(
                f"cannot listen on the admin socket {path}: the path exists and is not a socket"
            )
        if answers(path):
            raise AdminSocketError(
                f"cannot listen on the admin socket {path}: another process answers on it "
                "(another lbproxy with this admin port?); set global.admin.socket to another "
                "path, or to none"
            )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by a process that is gone
        log.info("admin socket %s: removed the one a stopped process left", path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # The file is created 0600 (no moment with a wider mode): at start nothing else runs
    # that would create a file under this umask.
    umask = os.umask(0o177)
    bound = False
    try:
        sock.bind(path)
        bound = True
        os.chmod(path, 0o600)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        if bound:
            unlink(path)
        message = f"cannot listen on the admin socket {path}: {exc.strerror}"
        raise AdminSocketError(message) from None
    finally:
        os.umask(umask)
    sock.setblocking(False)
    return sock


def answers(path: str, timeout: float = PROBE_TIMEOUT) -> bool:
    """True when the socket file `path` may belong to a live process: one accepts on
    it, or it is another user's, which we may not connect to (not ours to remove)."""
    return _probe(path, timeout) is not False


def connects(path: str, timeout: float = PROBE_TIMEOUT) -> bool:
    """True when this process can connect to the socket file `path` now (a client
    choosing it)."""
    return _probe(path, timeout) is True


def _probe(path: str, timeout: float) -> bool | None:
    """Connect to `path`: True connected, False nothing there or nothing accepting,
    None cannot tell (not allowed, or no answer in time)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EAGAIN) or isinstance(exc, TimeoutError):
            return None
        return False
    finally:
        probe.close()
    return True


def unlink(path: str) -> None:
    """Remove the socket file at `path` when the process stops (not after a hand-over:
    the new process serves on it)."""
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (None: unknown)."""
    try:
        _pid, uid, _gid = _CREDENTIALS.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
        )
    except (OSError, AttributeError, struct.error):
        return None
    return int(uid)


def trusted(uid: int | None) -> bool:
    """A peer that may use the admin socket: this process's user or root."""
    return uid is not None and uid in (0, os.geteuid())
