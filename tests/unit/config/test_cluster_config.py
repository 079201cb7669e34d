"""`global.cluster.redis` (SPEC §18): every key read, its defaults, and each mistake a
FILE:LINE problem (a password in the URL, an unknown scheme or option, a bad prefix)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lbproxy.config.model import ClusterConfig, RedisConfig
from lbproxy.config.reader import load
from lbproxy.config.summary import summary
from tests.unit.config.test_config import messages, problems, write

VS = """
virtual_servers:
  - name: web
    listen: 127.0.0.1:8080
    real_servers: [{name: a, address: 127.0.0.1:1}]
"""


def cluster_file(tmp_path: Path, redis: str) -> str:
    return write(tmp_path, "lb.yaml", f"global:\n  cluster:\n    redis: {redis}\n{VS}")


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
        )
    )
    minimal = load([cluster_file(tmp_path, "{url: 'unix:///run/redis/redis.sock?db=1'}")])
    assert minimal.global_.cluster.redis == RedisConfig("unix:///run/redis/redis.sock?db=1")
    assert (minimal.global_.cluster.redis.key_prefix, minimal.global_.cluster.redis.name) == (
        "lbproxy",
        None,
    )
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
    assert any(expected in problem and "lb.yaml:3: " in problem for problem in found), found


def test_a_cluster_without_a_backend_is_a_problem(tmp_path):
    path = write(tmp_path, "lb.yaml", f"global:\n  cluster: {{}}\n{VS}")
    assert any("global.cluster needs 'redis'" in m for m in messages([path]))
