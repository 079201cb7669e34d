"""What the tests of per-client limits share: clients from a chosen loopback address,
whether one was served, and instances of a cluster on one real redis-server whose
virtual server shares its `per_source` limits (`shared: true`)."""

from __future__ import annotations

import socket

from tests.integration.harness import get_json, read_name
from tests.integration.redis_server import RedisServer


def connect_from(source: str, port: int, timeout: float = 10.0) -> socket.socket:
    """A client connected from the loopback address `source`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return sock


def served(sock: socket.socket) -> bool:
    """The real server's name came (served), or the proxy closed the client with nothing
    sent (refused: FIN or RST). The client sends nothing, and `connect_timeout` is a
    minute: a close within the socket's timeout was decided before a byte was read."""
    try:
        return read_name(sock) != ""
    except ConnectionResetError:
        return False


CLUSTER_KEY = "per-source-test-key-" + "0123456789abcdef" * 3


def shared_config(redis: RedisServer, name: str, port: int, admin: int, server, limits: str) -> str:
    """An instance of a cluster on `redis` (its key in a 0600 file), one virtual server
    with `per_source: {limits, shared: true}` in front of `server`."""
    key = redis.folder / "cluster.key"
    if not key.exists():
        key.write_text(CLUSTER_KEY + "\n")
        key.chmod(0o600)
    return (
        "global:\n"
        f"  admin: {{listen: 127.0.0.1:{admin}}}\n"
        "  drain_timeout: 2s\n"
        "  cluster:\n"
        f"    key_file: {key}\n"
        f"    redis: {{url: '{redis.url}', name: {name}}}\n"
        "virtual_servers:\n"
        "  - name: web\n"
        f"    listen: 127.0.0.1:{port}\n"
        "    health_check: {type: none}\n"
        "    connect_timeout: 60s\n"
        f"    per_source: {{{limits}, shared: true}}\n"
        f"    real_servers: [{{name: {server.name}, address: '127.0.0.1:{server.port}'}}]\n"
    )


def cluster_connected(admin: int) -> bool:
    return bool((virtual_servers_json(admin).get("cluster") or {}).get("connected"))


def virtual_servers_json(admin: int) -> dict:
    return get_json(admin, "/api/v1/virtual-servers")
