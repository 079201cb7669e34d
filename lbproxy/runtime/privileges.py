"""Running as `global.user` and `global.group` (SPEC §21): the privilege drop.

lbproxy is started as root to bind ports below 1024 and read secrets only root may read;
once every listener is bound and every secret read (lbproxy/config/secret_files.py), it
becomes the configured account for good, as OpenSSH's privilege separation and HAProxy's
`user`/`group` do. `drop()` is called by the one process that binds: the Server just
after binding (lbproxy/runtime/server.py), the supervisor of `workers: N` before it
starts a worker (lbproxy/runtime/workers/). Its steps, in this order (each one needs
the privilege the next one gives up):

    chown        the paths created as root that the account must own afterwards
                 (`owned`: the workers' socket folder, an admin socket)
    no new privs PR_SET_NO_NEW_PRIVS: no program started from here on gains a privilege
                 (a set-user-ID binary, file capabilities), whatever it is
    setgroups([]), setgid(gid)      no supplementary groups; real, effective and saved gid
    PR_SET_KEEPCAPS, setuid(uid)    real, effective and saved uid; the permitted
                 capabilities survive the change of uid (the flag is cleared again after)
    capset       of them all, only CAP_NET_BIND_SERVICE stays (effective, permitted,
                 inheritable), and it is raised in the ambient set, so the processes
                 lbproxy starts (`python -m lbproxy` for an upgrade, each worker) have it
                 too: a reload, a worker or the new process of an upgrade can still bind
                 a port below 1024. systemd's `AmbientCapabilities=CAP_NET_BIND_SERVICE`
                 with `User=` gives the same state.
    verify       getresuid/getresgid are the account's three times, no group is left,
                 and setuid(0) fails: else PrivilegeError, and lbproxy exits.

The capability calls go through ctypes to the C library (capset(2), prctl(2)); the two
packages on PyPI for them (python-prctl, a C extension that needs libcap's headers to
build, and pyprctl) have had no release since 2020 and 2021, for five system calls.

A process that does not run as root cannot change its account: when it already runs as
`global.user` (systemd's `User=`, or a worker or upgrade started after the drop) there
is nothing to do; as another user, the setting is ignored with a warning, as nginx
ignores `user` then. Without `global.user`, a process started as root warns once.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterable

from lbproxy.config.accounts import AccountError, RunAs, run_as
from lbproxy.config.model import GlobalConfig

log = logging.getLogger("lbproxy.privileges")

CAP_NET_BIND_SERVICE = 10
_CAPABILITY_VERSION_3 = 0x20080522  # two 32-bit words per set
PR_SET_KEEPCAPS = 8
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_RAISE = 2


class PrivilegeError(Exception):
    """The change of account failed or could be undone; the message says what."""


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, call: str) -> None:
    if result != 0:
        number = ctypes.get_errno()
        raise PrivilegeError(f"{call}: {os.strerror(number)}")


def _prctl(option: int, arg: int, arg3: int = 0) -> None:
    _check(
        _libc.prctl(
            ctypes.c_int(option),
            ctypes.c_ulong(arg),
            ctypes.c_ulong(arg3),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        ),
        f"prctl({option})",
    )


def capabilities() -> tuple[int, int, int]:
    """This thread's (effective, permitted, inheritable) capability sets, as bit masks."""
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capget(ctypes.byref(header), data), "capget")
    low, high = data[0], data[1]
    return (
        low.effective | high.effective << 32,
        low.permitted | high.permitted << 32,
        low.inheritable | high.inheritable << 32,
    )


def _set_capabilities(mask: int) -> None:
    """Effective, permitted and inheritable: exactly `mask`."""
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    for i in range(2):
        word = (mask >> (32 * i)) & 0xFFFFFFFF
        data[i].effective = data[i].permitted = data[i].inheritable = word
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def account(global_: GlobalConfig) -> RunAs | None:
    """The account `global.user`/`global.group` name (the reader checked they exist;
    one removed since is a PrivilegeError)."""
    try:
        return run_as(global_.user, global_.group)
    except AccountError as exc:
        raise PrivilegeError(f"global.user: {exc}") from None


def warn_if_root(global_: GlobalConfig) -> None:
    """At start: root without `global.user` keeps every privilege while serving."""
    if global_.user is None and os.geteuid() == 0:
        log.warning(
            "running as root: set global.user (and global.group) to run as an account of "
            "its own once the listeners are bound"
        )


def drop(global_: GlobalConfig, owned: Iterable[str] = ()) -> None:
    """Become `global.user`/`global.group` now (module header); nothing without `user`.

    `owned`: paths this process created as root that the account must own afterwards
    (chowned first). Raises PrivilegeError when the change fails; the caller exits."""
    target = account(global_)
    if target is None:
        return
    if target.uid == 0:
        log.warning("global.user %s is root: lbproxy keeps every privilege", target.user)
        return
    if os.geteuid() != 0:
        if os.geteuid() != target.uid:
            log.warning(
                "global.user %s ignored: lbproxy runs as uid %d, not root, and cannot "
                "change its user",
                target.user,
                os.geteuid(),
            )
        return
    for path in owned:
        try:
            os.chown(path, target.uid, target.gid, follow_symlinks=False)
        except OSError as exc:
            raise PrivilegeError(f"cannot give {path} to {target.user}: {exc.strerror}") from None
    _, permitted, _ = capabilities()
    keep = permitted & (1 << CAP_NET_BIND_SERVICE)
    try:
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        os.setgroups([])
        os.setgid(target.gid)
        _prctl(PR_SET_KEEPCAPS, 1)
        os.setuid(target.uid)
        _prctl(PR_SET_KEEPCAPS, 0)
        _set_capabilities(keep)
        if keep:
            _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_NET_BIND_SERVICE)
    except OSError as exc:
        raise PrivilegeError(f"cannot run as {target}: {exc.strerror}") from None
    _verify(target, keep)
    log.info(
        "running as %s, no supplementary groups%s",
        target,
        ", with CAP_NET_BIND_SERVICE (ports below 1024)" if keep else "",
    )


def _verify(target: RunAs, keep: int) -> None:
    """The drop holds: the ids are the account's, no group is left, no way back."""
    if os.getresuid() != (target.uid,) * 3 or os.getresgid() != (target.gid,) * 3:
        raise PrivilegeError(
            f"after the change to {target}: uids {os.getresuid()}, gids {os.getresgid()}"
        )
    if os.getgroups():
        raise PrivilegeError(f"after the change to {target}: groups {os.getgroups()} remain")
    if capabilities()[1] & ~keep:
        raise PrivilegeError(f"after the change to {target}: capabilities remain")
    try:
        os.setuid(0)
    except PermissionError:
        return
    raise PrivilegeError(f"after the change to {target}: setuid(0) succeeded")
