"""Secret files and the account to run as (SPEC §21): who may own a token, password or key
file and who may read it, checked by `load` at the key's line; `global.user` and
`global.group` names and ids; the contents kept for after the privilege drop."""

from __future__ import annotations

import grp
import os
import pwd
from pathlib import Path

import pytest

from lbproxy.config.reader import load
from lbproxy.config.secret_files import SecretFiles
from tests.unit.config.support import messages, problems, write

VS = """
virtual_servers:
  - name: web
    listen: 127.0.0.1:8080
    real_servers: [{name: a, address: 127.0.0.1:1}]
"""

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="gives files to other users")


def nobody() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody")


def token_config(tmp_path: Path, token: Path, account: str = "") -> str:
    text = f"global:\n{account}  admin: {{token_file: {token}}}\n{VS}"
    return write(tmp_path, "lb.yaml", text)


def secret(tmp_path: Path, mode: int, uid: int = 0, gid: int = 0, name: str = "token") -> Path:
    path = tmp_path / name
    path.write_text("t0ken\n")
    os.chown(path, uid, gid)
    path.chmod(mode)
    return path


@as_root
@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_root_owned_file_only_root_reads_is_fine(tmp_path, mode):
    token = secret(tmp_path, mode)
    config = load([token_config(tmp_path, token)])
    assert config.secret_files == (str(token),)


@as_root
@pytest.mark.parametrize(
    ("mode", "problem"),
    [
        (0o644, "is open to other users (mode 0644, owner root)"),
        (0o602, "is open to other users (mode 0602, owner root)"),
        (0o620, "is writable by its group (mode 0620, owner root)"),
        (0o660, "is writable by its group (mode 0660, owner root)"),
    ],
)
def test_a_file_others_may_read_or_write_is_an_error_at_its_line(tmp_path, mode, problem):
    token = secret(tmp_path, mode)
    path = token_config(tmp_path, token)
    assert problems([path]) == [
        f"{path}:2: admin.token_file {token} {problem}: `chmod 600 {token}`"
    ]


@as_root
def test_group_read_only_for_a_root_owned_file_of_lbproxys_own_group(tmp_path):
    """PostgreSQL's rule for its key file, and a Kubernetes Secret with fsGroup."""
    own = secret(tmp_path, 0o640, gid=os.getegid(), name="own")
    assert load([token_config(tmp_path, own)]).secret_files == (str(own),)
    other_gid = next(g.gr_gid for g in grp.getgrall() if g.gr_gid != os.getegid())
    other = secret(tmp_path, 0o440, gid=other_gid, name="other")
    (message,) = messages([token_config(tmp_path, other)])
    assert "is readable by its group (mode 0440, owner root)" in message
    # the group of global.user counts as lbproxy's own (it runs as that group)
    account = nobody()
    mounted = secret(tmp_path, 0o440, gid=account.pw_gid, name="mounted")
    load([token_config(tmp_path, mounted, "  user: nobody\n")])
    # ... for a root-owned file only
    theirs = secret(tmp_path, 0o640, uid=account.pw_uid, gid=account.pw_gid, name="theirs")
    (message,) = messages([token_config(tmp_path, theirs, "  user: nobody\n")])
    assert "is readable by its group (mode 0640, owner nobody)" in message


@as_root
def test_owned_by_root_or_by_the_user_lbproxy_runs_as(tmp_path):
    account = nobody()
    token = secret(tmp_path, 0o600, uid=account.pw_uid, gid=account.pw_gid)
    path = token_config(tmp_path, token)
    assert problems([path]) == [
        f"{path}:2: admin.token_file {token} is owned by nobody (mode 0600), not by root or "
        f"the user lbproxy runs as: `chown root {token}` (or to lbproxy's user)"
    ]
    load([token_config(tmp_path, token, "  user: nobody\n")])  # global.user's own file


@as_root
def test_a_link_is_judged_by_the_file_it_names(tmp_path):
    """A mounted Kubernetes Secret is a link into ..data/; what it names is what is read."""
    link = tmp_path / "token-link"
    link.symlink_to(secret(tmp_path, 0o600))
    load([token_config(tmp_path, link)])
    (tmp_path / "token").chmod(0o644)
    (message,) = messages([token_config(tmp_path, link)])
    assert "is open to other users (mode 0644" in message


def test_a_missing_file_is_left_to_its_reader(tmp_path):
    """`lbproxy check` on a machine without the secret: not an ownership problem."""
    assert load([token_config(tmp_path, tmp_path / "absent")]).secret_files == (
        str(tmp_path / "absent"),
    )


def test_every_secret_key_is_listed_once(tmp_path):
    key = tmp_path / "c"
    key.write_text("k" * 32)
    key.chmod(0o600)
    path = write(
        tmp_path,
        "lb.yaml",
        f"""\
global:
  admin: {{token_file: {tmp_path}/t}}
  cluster:
    redis: {{url: "redis://127.0.0.1:1/0", password_file: {tmp_path}/p}}
    key_file: {tmp_path}/c
virtual_servers:
  - name: web
    listen: 127.0.0.1:8080
    scheduler: dwd
    snmp: {{version: 3, user: u, auth_key_file: {tmp_path}/a, priv_key_file: {tmp_path}/k}}
    real_servers:
      - {{name: a, address: 127.0.0.1:1, snmp: {{auth_key_file: {tmp_path}/a}}}}
""",
    )
    assert load([path]).secret_files == tuple(f"{tmp_path}/{name}" for name in "tcpak")


def test_user_and_group_names_and_ids(tmp_path):
    account = nobody()
    for user, group in (("nobody", None), (str(account.pw_uid), None), ("nobody", "0")):
        text = f"global:\n  user: {user}\n" + (f"  group: {group}\n" if group else "") + VS
        config = load([write(tmp_path, "lb.yaml", text)])
        assert (config.global_.user, config.global_.group) == (user, group)
    # an id without an entry needs the group said
    unknown = next(uid for uid in range(50000, 60000) if not _has_uid(uid))
    path = write(tmp_path, "lb.yaml", f"global:\n  user: {unknown}\n{VS}")
    assert problems([path]) == [
        f"{path}:2: global.user: user {unknown} has no entry on this system to give its "
        "group: set group"
    ]
    load([write(tmp_path, "lb.yaml", f"global:\n  user: {unknown}\n  group: {unknown}\n{VS}")])


@pytest.mark.parametrize(
    ("lines", "problem"),
    [
        ("  user: no-such-user-here\n", "2: user: no user 'no-such-user-here' on this system"),
        ("  user: nobody\n  group: no-such-group\n", "3: group: no group 'no-such-group'"),
        ("  group: nogroup\n", "2: global.group needs global.user"),
        ("  user: [a]\n", "2: user must be a user name or a numeric id, got a list"),
    ],
)
def test_account_mistakes(tmp_path, lines, problem):
    nobody()
    path = write(tmp_path, "lb.yaml", f"global:\n{lines}{VS}")
    found = problems([path])
    assert any(p.startswith(f"{path}:{problem}") for p in found), found


def _has_uid(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def test_contents_read_before_stay_when_the_file_cannot_be_read_any_more(tmp_path):
    """After the drop, a root-owned 0600 file is refused: what was read before is used;
    one that can be read is read again (a rotated password)."""
    store = SecretFiles()
    path = tmp_path / "password"
    path.write_text("first\n")
    assert store.read(str(path)) == "first\n"
    path.write_text("rotated\n")
    assert store.read(str(path)) == "rotated\n"
    if os.geteuid() != 0:  # root reads it anyway: test_privileges.py shows it as nobody
        path.chmod(0)
        assert store.read(str(path)) == "rotated\n"
        path.chmod(0o600)
    later = SecretFiles()
    later.remember(store.contents())
    assert later.contents()[str(path)] == "rotated\n"
    path.unlink()
    with pytest.raises(FileNotFoundError):  # removed, not refused: said as it is
        later.read(str(path))
