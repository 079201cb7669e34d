"""Secret files (SPEC §21): a token, password or key file that someone else may read or
write, or that another user owns, is a configuration error at its line, for `lbproxy
check`, `lbproxy run` and a reload (which keeps the running configuration)."""

from __future__ import annotations

import grp
import os
import pwd
from pathlib import Path

import pytest

from tests.integration.harness import ask_name, closed_without_a_byte, free_port, http, run_cli

pytestmark = pytest.mark.integration


def secret(path: Path, text: str, mode: int, owner: str = "root", group: str = "root") -> Path:
    path.write_text(text + "\n")
    os.chown(path, pwd.getpwnam(owner).pw_uid, grp.getgrnam(group).gr_gid)
    path.chmod(mode)
    return path


def other_group() -> str:
    """A group lbproxy (root here) does not run as."""
    for name in ("nogroup", "daemon", "users"):
        try:
            if grp.getgrnam(name).gr_gid != os.getegid():
                return name
        except KeyError:
            continue
    pytest.skip("no second group on this machine")


@pytest.mark.skipif(os.geteuid() != 0, reason="gives files to other users")
def test_check_and_run_refuse_open_or_foreign_secret_files(tmp_path, name_servers):
    (server,) = name_servers("a")
    token = secret(tmp_path / "admin.token", "t0ken", 0o644)
    password = secret(tmp_path / "redis.password", "pw", 0o640, group=other_group())
    key = secret(tmp_path / "priv.key", "priv-passphrase", 0o600, owner="daemon")
    auth = secret(tmp_path / "auth.key", "auth-passphrase", 0o600)
    cluster_key = secret(tmp_path / "cluster.key", "k" * 32, 0o604)
    config = tmp_path / "lbproxy.yaml"
    config.write_text(
        f"""\
global:
  admin: {{listen: 127.0.0.1:{free_port()}, token_file: {token}}}
  cluster:
    redis: {{url: "redis://127.0.0.1:1/0", password_file: {password}}}
    key_file: {cluster_key}
virtual_servers:
  - name: web
    listen: 127.0.0.1:{free_port()}
    scheduler: dwd
    snmp: {{version: 3, user: u, auth_key_file: {auth},
            priv_key_file: {key}}}
    real_servers:
      - {{name: a, address: 127.0.0.1:{server.port}}}
"""
    )
    expected = [
        f"{config}:2: admin.token_file {token} is open to other users (mode 0644, owner root)",
        f"{config}:4: cluster.redis.password_file {password} is readable by its group "
        "(mode 0640, owner root)",
        f"{config}:5: cluster.key_file {cluster_key} is open to other users "
        "(mode 0604, owner root)",
        f"{config}:11: snmp.priv_key_file {key} is owned by daemon (mode 0600)",
    ]
    for command in ("check", "run"):
        result = run_cli(command, str(config), timeout=30)
        assert result.returncode == 2, (command, result)
        lines = result.stderr.splitlines()
        for line in expected:
            assert any(found.startswith(line) for found in lines), (line, result.stderr)
        assert str(auth) not in result.stderr  # root's, mode 0600: fine
        assert "configuration invalid (4 problems)" in result.stderr


def test_a_reload_with_an_open_secret_file_keeps_the_running_configuration(
    tmp_path, lbproxy, name_servers
):
    (server,) = name_servers("a")
    token = tmp_path / "admin.token"
    token.write_text("t0ken\n")
    token.chmod(0o600)
    port, added, admin = free_port(), free_port(), free_port()

    def config(listen: str) -> str:
        return f"""\
global:
  admin: {{listen: 127.0.0.1:{admin}, token_file: {token}}}
virtual_servers:
  - name: web
    listen: {listen}
    real_servers:
      - {{name: a, address: 127.0.0.1:{server.port}}}
"""

    proxy = lbproxy(config(f"127.0.0.1:{port}"), wait_ports=[port, admin])
    proxy.config_path.write_text(config(f"[127.0.0.1:{port}, 127.0.0.1:{added}]"))
    token.chmod(0o604)
    status, body = http("POST", f"http://127.0.0.1:{admin}/api/v1/reload", {}, token="t0ken")
    assert status == 400, body
    assert f"token_file {token} is open to other users (mode 0604" in body.decode()
    assert ask_name(port) == "a"
    assert not closed_without_a_byte(added)  # refused: the new address was never bound
    assert "reload failed; the running configuration is unchanged" in proxy.log()

    token.chmod(0o600)
    status, body = http("POST", f"http://127.0.0.1:{admin}/api/v1/reload", {}, token="t0ken")
    assert status == 200, body
    assert ask_name(added) == "a"
