"""`global.user` and `global.group`: the account lbproxy runs as once it has bound its
listeners and read its secrets (SPEC §21), from a name or a numeric id.

PURE in the sense of the configuration package: no trio, no sockets, no clock. Names are
looked up in the system's user and group databases (pwd, grp: /etc/passwd or NSS), as
HAProxy's and nginx's `user` directives are, so that a misspelt name is a
configuration error at its line, not a failed start. A numeric id needs no entry (a
container may run as an id of its own); then `group` must say the group, since no
entry gives the user's own.

lbproxy/runtime/privileges.py changes to the account; the reader (reader.py) uses it
to know which owners a secret file may have (secret_files.py).
"""

from __future__ import annotations

import grp
import pwd
from dataclasses import dataclass

MAX_ID = 2**32 - 2  # (uid_t)-1 means "unchanged" to setresuid


class AccountError(ValueError):
    """A user or group that does not exist; the message says which."""


@dataclass(frozen=True, slots=True)
class RunAs:
    """The account to run as: ids, and names for messages."""

    uid: int
    gid: int
    user: str  # as configured, or the name of the id when it has one
    group: str

    def __str__(self) -> str:
        return f"user {self.user} (uid {self.uid}), group {self.group} (gid {self.gid})"


def numeric_id(text: str) -> int | None:
    """`65534` -> 65534; None for a name."""
    if text.isascii() and text.isdigit():
        number = int(text)
        if number > MAX_ID:
            raise AccountError(f"{text} is not a user or group id (0..{MAX_ID})")
        return number
    return None


def user_ids(user: str) -> tuple[int, int | None, str]:
    """(uid, the user's own gid or None, name) of a user name or id; AccountError if unknown."""
    number = numeric_id(user)
    try:
        entry = pwd.getpwuid(number) if number is not None else pwd.getpwnam(user)
    except ValueError:  # a NUL in the name: no such user can exist
        raise AccountError(f"no user {user!r} on this system") from None
    except KeyError:
        if number is not None:
            return number, None, user  # an id of its own, without a database entry
        raise AccountError(f"no user {user!r} on this system") from None
    return entry.pw_uid, entry.pw_gid, entry.pw_name


def group_id(group: str) -> tuple[int, str]:
    """(gid, name) of a group name or id; AccountError if unknown."""
    number = numeric_id(group)
    try:
        entry = grp.getgrgid(number) if number is not None else grp.getgrnam(group)
    except ValueError:  # a NUL in the name: no such group can exist
        raise AccountError(f"no group {group!r} on this system") from None
    except KeyError:
        if number is not None:
            return number, group
        raise AccountError(f"no group {group!r} on this system") from None
    return entry.gr_gid, entry.gr_name


def run_as(user: str | None, group: str | None) -> RunAs | None:
    """The account `global.user`/`global.group` name, None without `user`; AccountError
    when either is unknown, or the user has no entry to give its group and `group` is
    not set."""
    if user is None:
        return None
    uid, own_gid, user_name = user_ids(user)
    if group is not None:
        gid, group_name = group_id(group)
    elif own_gid is not None:
        gid = own_gid
        try:
            group_name = grp.getgrgid(gid).gr_name
        except KeyError:
            group_name = str(gid)
    else:
        raise AccountError(f"user {user} has no entry on this system to give its group: set group")
    return RunAs(uid, gid, user_name, group_name)
