"""`global.cluster` (SPEC §18, §21): every key read, its defaults, and each mistake a
FILE:LINE problem (a password in the URL, an unknown scheme or option, a bad prefix, a
missing, unreadable or short key file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lbproxy.config.model import ClusterConfig, RedisConfig
from lbproxy.config.reader import load
from lbproxy.config.summary import summary
from tests.unit.config.support import messages, problems, write

VS = """
virtual_servers:
  - name: web
    listen: 127.0.0.1:8080
    real_servers: [{name: a, address: 127.0.0.1:1}]
"""


KEY = "0123456789abcdef" * 4  # 64 bytes, as `openssl rand -hex 32` writes them


def key_file(tmp_path: Path, text: str = KEY + "\n") -> Path:
    path = tmp_path / "cluster.key"
    path.write_text(text)
    path.chmod(0o600)
    return path


def cluster_file(tmp_path: Path, redis: str, key: str | None = None) -> str:
    key = key if key is not None else f"key_file: {key_file(tmp_path)}\n    "
    text = f"global:\n  cluster:\n    {key}redis: {redis}\n{VS}"
    return write(tmp_path, "lb.yaml", text)


def test_every_key_and_the_defaults(tmp_path):
    path = cluster_file(
        tmp_path,
        "{url: 'rediss://lb@redis.internal:6380/2?ssl_ca_certs=/etc/ca.pem', "
        "password_file: /etc/lbproxy/redis.password, key_prefix: 'prod:lb', name: lb-1}",
    )
    assert load([path]).global_.cluster == ClusterConfig(
        RedisConfig(
            url="rediss://lb@redis.internal:6380/2?ssl_ca_certs=/etc/ca.pem",
            password_file="/etc/lbproxy/redis.password",
            key_prefix="prod:lb",
            name="lb-1",
        ),
        key_file=str(tmp_path / "cluster.key"),
        key=KEY.encode(),  # without the trailing newline
    )
    minimal = load([cluster_file(tmp_path, "{url: 'unix:///run/redis/redis.sock?db=1'}")])
    assert minimal.global_.cluster.redis == RedisConfig("unix:///run/redis/redis.sock?db=1")
    assert (minimal.global_.cluster.redis.key_prefix, minimal.global_.cluster.redis.name) == (
        "lbproxy",
        None,
    )
    assert minimal.global_.cluster.max_entries == 200_000
    assert KEY not in repr(minimal)  # the key is never shown
    assert load([write(tmp_path, "plain.yaml", VS)]).global_.cluster == ClusterConfig(None)


def test_the_summary_names_the_cluster(tmp_path):
    path = cluster_file(tmp_path, "{url: 'redis://10.0.0.5:6379/0', name: lb-1}")
    assert "cluster through redis://10.0.0.5:6379/0 (keys lbproxy:*), as lb-1" in summary(
        load([path])
    )


@pytest.mark.parametrize(
    ("redis", "expected"),
    [
        ("{url: 'redis://:pw@h:6379/0'}", "put the password in password_file, not in the URL"),
        ("{url: 'http://h/'}", "the scheme is redis, rediss or unix"),
        ("{url: 'redis://h:port/0'}", "the port is not a number"),
        ("{url: 'redis://h:0/0'}", "port 0"),
        ("{url: 'redis:///0'}", "no host"),
        ("{url: 'redis://h/zero'}", "the path is a database number"),
        ("{url: 'redis://h/0?timeout=5'}", "unknown URL option 'timeout' (options: none)"),
        ("{url: 'unix://relative.sock'}", "unix:///ABSOLUTE/PATH"),
        ("{url: 5}", "cluster.redis.url must be"),
        ("{url: 'redis://h/0', key_prefix: 'a*'}", "cluster.redis.key_prefix must be"),
        ("{url: 'redis://h/0', name: 'lb 1'}", "cluster.redis.name must be"),
        ("{url: 'redis://h/0', nam: x}", "unknown key 'nam' in global.cluster.redis"),
        ("{name: x}", "global.cluster.redis needs 'url'"),
    ],
)
def test_mistakes_are_problems_at_their_line(tmp_path, redis, expected):
    found = problems([cluster_file(tmp_path, redis)])
    assert any(expected in problem and "lb.yaml:4: " in problem for problem in found), found


def test_a_cluster_without_a_backend_is_a_problem(tmp_path):
    path = write(tmp_path, "lb.yaml", f"global:\n  cluster: {{}}\n{VS}")
    assert any("global.cluster needs 'redis'" in m for m in messages([path]))


def test_the_key_file_is_required_and_read_with_the_configuration(tmp_path):
    found = problems([cluster_file(tmp_path, "{url: 'redis://h/0'}", key="")])
    assert found == [f"{tmp_path / 'lb.yaml'}:2: global.cluster needs 'key_file'"], found
    missing = tmp_path / "nowhere.key"
    found = problems([cluster_file(tmp_path, "{url: 'redis://h/0'}", f"key_file: {missing}\n    ")])
    assert found == [
        f"{tmp_path / 'lb.yaml'}:3: cannot read global.cluster.key_file {missing}: "
        "No such file or directory"
    ], found


@pytest.mark.parametrize("text", ["short-key\n", "x" * 31 + "\n\n  \n", "\n"])
def test_a_key_shorter_than_32_bytes_is_a_problem_at_its_line(tmp_path, text):
    path = key_file(tmp_path, text)
    found = problems([cluster_file(tmp_path, "{url: 'redis://h/0'}", f"key_file: {path}\n    ")])
    assert len(found) == 1 and found[0].startswith(f"{tmp_path / 'lb.yaml'}:3: "), found
    assert str(path) in found[0] and ("at least 32" in found[0] or "is empty" in found[0])


def test_max_entries(tmp_path):
    key = f"key_file: {key_file(tmp_path)}\n    max_entries: 5000\n    "
    assert (
        load([cluster_file(tmp_path, "{url: 'redis://h/0'}", key)]).global_.cluster.max_entries
        == 5000
    )
    key = f"key_file: {key_file(tmp_path)}\n    max_entries: 0\n    "
    assert any(
        "cluster.max_entries must be" in p
        for p in problems([cluster_file(tmp_path, "{url: 'redis://h/0'}", key)])
    )
