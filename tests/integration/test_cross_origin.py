"""Mutations from a web page of another origin are refused (cross-site request forgery).

A page of any site a browser on the proxy's host has open can send a "simple" POST (no
CORS pre-check) to 127.0.0.1:9100. Over TCP every change needs the token (SPEC §21),
which such a page does not have; besides, browsers name that page in `Origin`, and
lbproxy refuses a change whose `Origin` is not the endpoint itself before it looks at
the token, so the page learns nothing. Real processes, real HTTP.
"""

from __future__ import annotations

import http.client
import json

import pytest

from tests.integration.harness import (
    free_port,
    metrics,
    ready,
    sample,
    vs_config,
    wait_for,
    with_admin,
    workers_config,
)

TOKEN = "cross-origin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}  # a change over TCP needs it (SPEC §21)


def with_token(config: str, tmp_path) -> str:
    token_file = tmp_path / "admin.token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    return config.replace("admin: {", f"admin: {{token_file: {token_file}, ", 1)


def request(admin_port: int, method: str, path: str, body: bytes, headers: dict) -> tuple:
    connection = http.client.HTTPConnection("127.0.0.1", admin_port, timeout=10)
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        connection.close()


def state_of_b(admin_port: int) -> str:
    status, document = request(
        admin_port, "GET", "/api/v1/virtual-servers/web/real-servers/b", b"", {}
    )
    assert status == 200
    return document["state"]


# What a page on another site can make a browser send: a form POST (text/plain) and,
# after a pre-check this endpoint does not grant, a PATCH; both name the page's origin.
FOREIGN = ["http://attacker.example", "http://127.0.0.1:1", "null"]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_change_from_another_origin_is_refused_and_changes_nothing(
    name_servers, lbproxy, workers, tmp_path
):
    servers = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    if workers == 1:
        config = with_admin(vs_config(port, servers, "rr"), admin_port)
    else:
        config = workers_config(port, servers, admin_port)
    lbproxy(with_token(config, tmp_path))
    wait_for(lambda: ready(admin_port), what="/readyz")
    own = f"127.0.0.1:{admin_port}"
    patch = "/api/v1/virtual-servers/web/real-servers/b"
    reloads = sample(metrics(admin_port), "lbproxy_config_reloads_total", result="ok")

    for origin in FOREIGN:
        headers = {"Origin": origin, "Content-Type": "text/plain"}
        status, answer = request(admin_port, "POST", "/api/v1/reload", b"x", headers)
        assert status == 403, (origin, answer)
        assert "cross-origin change refused" in answer["error"]
        status, answer = request(admin_port, "PATCH", patch, b'{"state": "drain"}', headers)
        assert status == 403, (origin, answer)
    assert state_of_b(admin_port) == "enabled"
    assert sample(metrics(admin_port), "lbproxy_config_reloads_total", result="ok") == reloads

    # The endpoint's own pages (the dashboard) and clients that send no Origin (curl,
    # lbproxy's CLI) are served as before, with the token.
    status, _ = request(
        admin_port, "PATCH", patch, b'{"state": "drain"}', {"Origin": f"http://{own}", **AUTH}
    )
    assert status == 200
    assert state_of_b(admin_port) == "drain"
    status, _ = request(admin_port, "POST", "/api/v1/reload", b"", AUTH)
    assert status == 200
    assert sample(metrics(admin_port), "lbproxy_config_reloads_total", result="ok") == reloads + 1


# DNS rebinding: a page on evil.example rebinds its name to 127.0.0.1;
# its requests then name evil.example in both Host and Origin, so the Origin check alone
# passes them. A Host that is no IP literal, not localhost and not listed gets 421.
def rebound(admin_port: int, name: str = "evil.example") -> dict:
    return {"Host": f"{name}:{admin_port}", "Origin": f"http://{name}:{admin_port}"}


@pytest.mark.parametrize("workers", [1, 2])
def test_a_rebound_host_name_is_answered_421_and_changes_nothing(
    name_servers, lbproxy, workers, tmp_path
):
    servers = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    if workers == 1:
        config = with_admin(vs_config(port, servers, "rr"), admin_port)
    else:
        config = workers_config(port, servers, admin_port)
    config = config.replace(
        f"admin: {{listen: 127.0.0.1:{admin_port}",
        f"admin: {{allowed_hosts: [LB.Example.com], listen: 127.0.0.1:{admin_port}",
    )
    lbproxy(with_token(config, tmp_path))
    wait_for(lambda: ready(admin_port), what="/readyz")
    patch = "/api/v1/virtual-servers/web/real-servers/b"
    reloads = sample(metrics(admin_port), "lbproxy_config_reloads_total", result="ok")
    evil = rebound(admin_port)

    # The two requests, as curl sent them: PATCH (JSON) and a text/plain reload.
    status, answer = request(
        admin_port,
        "PATCH",
        patch,
        b'{"state":"drain"}',
        {**evil, "Content-Type": "application/json"},
    )
    assert status == 421, answer
    assert "global.admin.allowed_hosts" in answer["error"]
    status, answer = request(
        admin_port, "POST", "/api/v1/reload", b"", {**evil, "Content-Type": "text/plain"}
    )
    assert status == 421, answer
    # Nor can the page read anything: the API, the dashboard.
    for path in ("/api/v1/virtual-servers", patch, "/"):
        connection = http.client.HTTPConnection("127.0.0.1", admin_port, timeout=10)
        connection.request("GET", path, headers=evil)
        assert connection.getresponse().status == 421, path
        connection.close()
    assert state_of_b(admin_port) == "enabled"
    assert sample(metrics(admin_port), "lbproxy_config_reloads_total", result="ok") == reloads

    # Probes and scrapers may name the host: these routes change nothing.
    for path in ("/healthz", "/readyz", "/metrics"):
        connection = http.client.HTTPConnection("127.0.0.1", admin_port, timeout=10)
        connection.request("GET", path, headers={"Host": f"lb-0.internal:{admin_port}"})
        assert connection.getresponse().status == 200, path
        connection.close()

    # By IP (v4, v6 literal), localhost, and a listed name (any case): served.
    for host in (
        f"127.0.0.1:{admin_port}",
        "[::1]",
        f"localhost:{admin_port}",
        "127.0.0.1",
        "lb.localhost",
    ):
        status, _ = request(admin_port, "GET", patch, b"", {"Host": host})
        assert status == 200, host
    status, _ = request(
        admin_port,
        "PATCH",
        patch,
        b'{"state": "drain"}',
        {**rebound(admin_port, "lb.example.COM"), **AUTH},
    )
    assert status == 200
    assert state_of_b(admin_port) == "drain"
