"""Files that hold secrets: `global.admin.token_file`, `global.cluster.key_file`,
`global.cluster.redis.password_file`, a `redis` health check's `password_file`, SNMPv3's
`auth_key_file` and `priv_key_file` (SPEC §21): who may own them, and their contents
once read.

PURE in the sense of the configuration package (no trio, no sockets, no clock); like
the reader, it reads files.

The rule (`secret_file_problem`), applied by the reader to every key whose converter is
`values._secret_file`, so `lbproxy check`, `lbproxy run` and a reload all refuse such a
file at its line: a secret file must be owned by root or by the user lbproxy runs as
(the process's own, or `global.user`), and neither readable nor writable by others nor
writable by its group. Readable by its group only when root owns it and the group is
the one lbproxy runs as: PostgreSQL's rule for its key file (root-owned, mode 0640), and
the only way a Kubernetes pod that does not run as root reads a mounted Secret without
making it world-readable (`defaultMode: 0440` with `fsGroup`, files owned by root).
OpenSSH refuses a group-readable key for the same reason: anyone who can read the
token, the Redis password or an SNMP key can steer the balancer.

The contents (`SecretFiles`, one per process: `SECRETS`): every read goes through
`SECRETS.read(path)`, which reads the file again each time (a rotated password is
picked up) and keeps what it read. When a later read is refused for lack of permission
(the process has since changed to `global.user`, who cannot read a root-owned 0600
file; or it was started by such a process: an upgrade, a worker), the contents read
before are given instead. The runtime reads every secret the configuration names
before it drops its privileges (`read_all`), passes what it has to the new process of
an upgrade and to each worker (`contents`, `remember`), and so a secret readable only
by root keeps working after the drop; changing it then takes a restart. A secret
readable by `global.user` itself (owned by it, mode 0600) is re-read as before.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Collection, Iterable, Mapping


def _owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def secret_file_problem(
    path: str, label: str, owners: Collection[int], groups: Collection[int]
) -> str | None:
    """Why the file at `path` may not hold a secret, or None. `owners`: the uids that may
    own it (root's and lbproxy's); `groups`: the gids lbproxy runs with, whose members
    may read a root-owned file. A file that cannot be looked at is not judged here:
    reading it reports why."""
    try:
        found = os.stat(path)
    except (OSError, ValueError):
        return None
    mode = stat.S_IMODE(found.st_mode)
    shown = f"mode {mode:04o}, owner {_owner_name(found.st_uid)}"
    if found.st_uid not in owners:
        return (
            f"{label} {path} is owned by {_owner_name(found.st_uid)} (mode {mode:04o}), not by "
            f"root or the user lbproxy runs as: `chown root {path}` (or to lbproxy's user)"
        )
    if mode & 0o006:
        return f"{label} {path} is open to other users ({shown}): `chmod 600 {path}`"
    if mode & 0o020:
        return f"{label} {path} is writable by its group ({shown}): `chmod 600 {path}`"
    if mode & 0o040 and not (found.st_uid == 0 and found.st_gid in groups):
        return (
            f"{label} {path} is readable by its group ({shown}): `chmod 600 {path}` (a "
            "root-owned file may be readable by the group lbproxy runs as, not by another)"
        )
    return None


class SecretFiles:
    """The contents of the secret files this process has read, by absolute path (module
    header)."""

    def __init__(self) -> None:
        self._contents: dict[str, str] = {}

    def read(self, path: str) -> str:
        """The file's text, read now; when reading it is refused for lack of permission,
        the text read before, if any (else the PermissionError). Other errors (no such
        file, not UTF-8) are raised: the file changed, and the caller says so."""
        key = os.path.abspath(path)
        try:
            with open(path, encoding="utf-8") as file:
                text = file.read()
        except PermissionError:
            if key in self._contents:
                return self._contents[key]
            raise
        self._contents[key] = text
        return text

    def read_all(self, paths: Iterable[str]) -> None:
        """Read each file now (before the privileges are dropped); a file that cannot be
        read is left to its reader, which reports it."""
        for path in paths:
            try:
                self.read(path)
            except (OSError, ValueError):
                continue

    def contents(self) -> dict[str, str]:
        """What was read, by path: for the process an upgrade starts, and for workers."""
        return dict(self._contents)

    def remember(self, contents: Mapping[str, str]) -> None:
        """Contents read by the process that started this one (kept where this one has
        read nothing itself)."""
        for path, text in contents.items():
            if isinstance(path, str) and isinstance(text, str):
                self._contents.setdefault(os.path.abspath(path), text)


SECRETS = SecretFiles()
