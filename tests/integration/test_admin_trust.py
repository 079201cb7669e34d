"""The admin endpoint's trust boundary over TCP (SPEC §21), against real `lbproxy run`
processes: every change needs the bearer token (none: read-only), `read_token`, reload
and upgrade take only the running configuration's paths and quote nothing of another
file, and the CLI's choice of endpoint (its admin socket on this host, else TCP with a
token it never sends in clear text to a host that is not loopback, no redirect)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from tests import tools
from tests.integration.harness import (
    admin_socket_path,
    ask_name,
    free_port,
    http,
    local_http,
    ready,
    run_cli,
    vs_config,
    wait_for,
    with_admin,
    workers_config,
)

pytestmark = pytest.mark.integration

TOKEN = "trust-boundary-token"
SECRET = "root:$y$j9T$SECRETHASHSECRETHASH:20228:0:99999:7:::"


def token_file(folder: Path) -> Path:
    path = folder / "admin.token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


def admin_url(admin_port: int, path: str = "") -> str:
    return f"http://127.0.0.1:{admin_port}{path}"


def state_of(admin_port: int, rs: str) -> str:
    status, body = http(
        "GET", admin_url(admin_port, f"/api/v1/virtual-servers/web/real-servers/{rs}")
    )
    assert status == 200, body
    return json.loads(body)["state"]


def as_nobody_curl(*args: str) -> tuple[int, str]:
    """`runuser -u nobody -- curl -s ... -w '\\n%{http_code}'`: (status, body)."""
    out = subprocess.run(
        ["runuser", "-u", "nobody", "--", "curl", "-s", "-w", "\n%{http_code}", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    body, _, status = out.stdout.rpartition("\n")
    return int(status or 0), body


@tools.requires("curl", package="curl")
@pytest.mark.parametrize("workers", [1, 2])
def test_another_local_user_can_neither_read_a_file_nor_disable_a_server(
    name_servers, lbproxy, workers
):
    """Another local user, `nobody` with curl: over TCP without a token the endpoint is
    read-only. The upgrade naming /etc/shadow and the PATCH to disabled are refused
    (403, naming token_file and the admin socket); nothing of /etc/shadow is quoted, no
    process is started, the server stays enabled."""
    servers = name_servers("a")
    port, admin_port = free_port(), free_port()
    if workers == 1:
        config = with_admin(
            vs_config(port, servers, "rr", "health_check: {type: none}"), admin_port
        )
    else:
        config = workers_config(port, servers, admin_port)
    proxy = lbproxy(config)
    wait_for(lambda: ready(admin_port), what="/readyz")

    status, body = as_nobody_curl(
        "-XPOST", f"127.0.0.1:{admin_port}/api/v1/upgrade", "-d", '{"config":["/etc/shadow"]}'
    )
    assert status == 403, body
    error = json.loads(body)["error"]
    assert "token_file" in error and admin_socket_path(admin_port) in error, error
    shadow = Path("/etc/shadow").read_text().splitlines()
    assert "root:" not in body and not any(line in body for line in shadow if line)

    status, body = as_nobody_curl(
        "-XPATCH",
        f"127.0.0.1:{admin_port}/api/v1/virtual-servers/web/real-servers/a",
        "-d",
        '{"state":"disabled"}',
    )
    assert status == 403 and "read-only over TCP" in json.loads(body)["error"], body
    assert state_of(admin_port, "a") == "enabled"
    assert ask_name(port) == "a"
    assert "upgrade: started" not in proxy.log()
    # Reads stay open, as before.
    assert as_nobody_curl(admin_url(admin_port, "/api/v1/virtual-servers"))[0] == 200


def test_every_change_over_tcp_needs_the_token_loopback_or_not(name_servers, lbproxy, tmp_path):
    """With a token_file: PATCH, PUT (load report), reload and upgrade from loopback
    without the token are 401, with a wrong one 403; with it, a change is applied."""
    servers = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    config = with_admin(vs_config(port, servers, "rr"), admin_port, token_file(tmp_path))
    lbproxy(config)
    changes = [
        ("PATCH", "/api/v1/virtual-servers/web/real-servers/a", {"state": "drain"}),
        ("PUT", "/api/v1/virtual-servers/web/real-servers/a/load", {"load": 0.5}),
        ("POST", "/api/v1/reload", {}),
        ("POST", "/api/v1/upgrade", {}),
    ]
    for method, path, body in changes:
        assert http(method, admin_url(admin_port, path), body)[0] == 401, path
        assert http(method, admin_url(admin_port, path), body, token="nope")[0] == 403, path
    assert state_of(admin_port, "a") == "enabled"
    status, body = http("PATCH", admin_url(admin_port, changes[0][1]), changes[0][2], token=TOKEN)
    assert status == 200 and json.loads(body)["state"] == "drain"


def test_read_token_makes_api_reads_need_the_token_but_never_the_probes(
    name_servers, lbproxy, tmp_path
):
    servers = name_servers("a")
    port, admin_port = free_port(), free_port()
    config = with_admin(vs_config(port, servers, "rr"), admin_port, token_file(tmp_path))
    lbproxy(config.replace("admin: {", "admin: {read_token: true, ", 1))
    for path in ("/api/v1/virtual-servers", "/api/v1/virtual-servers/web/real-servers/a"):
        assert http("GET", admin_url(admin_port, path))[0] == 401, path
        assert http("GET", admin_url(admin_port, path), token="nope")[0] == 403, path
        assert http("GET", admin_url(admin_port, path), token=TOKEN)[0] == 200, path
    for path in ("/healthz", "/readyz", "/metrics", "/"):
        assert http("GET", admin_url(admin_port, path))[0] == 200, path
    # The admin socket needs no token, reads included.
    assert local_http("GET", admin_url(admin_port, "/api/v1/virtual-servers"))[0] == 200


def test_read_token_without_a_token_file_is_a_configuration_error(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "global:\n  admin: {listen: 127.0.0.1:9199, read_token: true}\n"
        "virtual_servers: [{name: web, listen: 127.0.0.1:9198, "
        "real_servers: [{name: a, address: 127.0.0.1:1}]}]\n"
    )
    out = run_cli("check", str(config))
    assert out.returncode == 2
    assert f"{config}:2: global.admin.read_token needs global.admin.token_file" in out.stderr


def test_reload_and_upgrade_over_tcp_take_only_the_running_paths(name_servers, lbproxy, tmp_path):
    """With the token: a reload or an upgrade naming another file is 403 naming the rule,
    and reads nothing; the running path itself, or a link to it, is accepted. Through
    the admin socket another file may be named (a reload from it)."""
    servers = name_servers("a")
    port, admin_port = free_port(), free_port()
    config = with_admin(vs_config(port, servers, "rr"), admin_port, token_file(tmp_path))
    proxy = lbproxy(config)
    secret = tmp_path / "secret.yaml"
    secret.write_text(SECRET + "\n")
    for route in ("reload", "upgrade"):
        url = admin_url(admin_port, f"/api/v1/{route}")
        status, body = http("POST", url, {"config": [str(secret)]}, token=TOKEN)
        assert status == 403, body
        error = json.loads(body)["error"]
        assert "running configuration's own paths" in error and str(proxy.config_path) in error
        assert "SECRETHASH" not in body.decode()
    link = tmp_path / "link.yaml"
    link.symlink_to(proxy.config_path)
    status, body = http(
        "POST", admin_url(admin_port, "/api/v1/reload"), {"config": [str(link)]}, token=TOKEN
    )
    assert status == 200, body
    # Through the socket: any path, here a second file adding a virtual server.
    other_port = free_port()
    other = tmp_path / "other.yaml"
    other.write_text(
        proxy.config_path.read_text()
        + f"  - name: more\n    listen: 127.0.0.1:{other_port}\n    real_servers:\n"
        + f"      - {{name: a, address: 127.0.0.1:{servers[0].port}}}\n"
    )
    status, body = local_http(
        "POST", admin_url(admin_port, "/api/v1/reload"), {"config": [str(other)]}
    )
    assert status == 200, body
    assert ask_name(other_port) == "a"
    # Now `other` is the running configuration: over TCP it is the one path allowed.
    status, _ = http(
        "POST", admin_url(admin_port, "/api/v1/reload"), {"config": [str(other)]}, token=TOKEN
    )
    assert status == 200


def test_an_error_in_a_file_outside_the_running_configuration_is_not_quoted_over_tcp(
    name_servers, lbproxy, tmp_path
):
    """The running configuration is a folder; a file that appears in it later (here a
    link to a file of secrets) makes a reload and an upgrade fail: over TCP their errors
    give that file's FILE:LINE and no more, through the admin socket the whole message."""
    servers = name_servers("a")
    port, admin_port = free_port(), free_port()
    folder = tmp_path / "conf"
    folder.mkdir()
    text = with_admin(vs_config(port, servers, "rr"), admin_port, token_file(tmp_path))
    proxy = lbproxy(text, start=False, name="conf/web.yaml")
    proxy.config_path = folder  # `lbproxy run conf/`
    proxy.start()
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET + "\n")
    planted = folder / "zz.yaml"
    planted.symlink_to(secret)
    reload_url = admin_url(admin_port, "/api/v1/reload")
    status, body = http("POST", reload_url, {}, token=TOKEN)
    assert status == 400, body
    errors = json.loads(body)["errors"]
    assert any(e.startswith(f"{planted}:1: invalid") for e in errors), errors
    assert "SECRETHASH" not in body.decode() and "root:" not in body.decode()
    status, body = http("POST", admin_url(admin_port, "/api/v1/upgrade"), {}, token=TOKEN)
    assert status == 400, body
    assert json.loads(body)["exit"] == 2
    assert "SECRETHASH" not in body.decode() and "root:" not in body.decode()
    # Through the socket the operator reads the reader's own message.
    status, body = local_http("POST", reload_url, {})
    assert status == 400 and "SECRETHASH" in body.decode()
    assert ask_name(port) == "a"  # still serving the old configuration


# -- the CLI ------------------------------------------------------------------------------


def test_the_cli_uses_the_admin_socket_on_this_host_and_says_so(name_servers, lbproxy):
    servers = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    lbproxy(with_admin(vs_config(port, servers, "rr"), admin_port))
    admin = admin_url(admin_port)
    out = run_cli("status", "--verbose", "--admin", admin)
    assert out.returncode == 0, out.stderr
    assert f"using the admin socket {admin_socket_path(admin_port)} (no token)" in out.stderr
    for host in ("127.0.0.1", "localhost"):
        drained = run_cli("drain", "web", "a", "--admin", f"http://{host}:{admin_port}")
        assert drained.returncode == 0, drained.stderr
        assert "web/a: state drain" in drained.stdout
        assert run_cli("enable", "web", "a", "--admin", f"{host}:{admin_port}").returncode == 0
    assert run_cli("reload", "--admin", admin).returncode == 0


def test_without_a_socket_the_cli_goes_over_tcp_and_a_change_needs_a_token(name_servers, lbproxy):
    servers = name_servers("a")
    port, admin_port = free_port(), free_port()
    lbproxy(with_admin(vs_config(port, servers, "rr"), admin_port, socket="none"))
    admin = admin_url(admin_port)
    assert not os.path.exists(admin_socket_path(admin_port))
    out = run_cli("status", "--verbose", "--admin", admin)
    assert out.returncode == 0
    assert f"using the admin endpoint {admin} over TCP (no token)" in out.stderr
    out = run_cli("drain", "web", "a", "--admin", admin)
    assert out.returncode == 1
    assert "HTTP 403: read-only over TCP" in out.stderr and "token_file" in out.stderr
    assert "there is none now" in out.stderr  # no admin socket to send the user to


def test_socket_names_a_socket_of_its_own(name_servers, lbproxy, tmp_path):
    """`socket: PATH`: not in a folder the CLI looks in; `--socket PATH` names it."""
    servers = name_servers("a")
    port, admin_port = free_port(), free_port()
    path = tmp_path / "lb.sock"
    lbproxy(with_admin(vs_config(port, servers, "rr"), admin_port, socket=str(path)))
    assert (path.stat().st_mode & 0o777) == 0o600
    assert not os.path.exists(admin_socket_path(admin_port))
    admin = admin_url(admin_port)
    assert run_cli("drain", "web", "a", "--admin", admin).returncode == 1  # TCP, no token
    out = run_cli("drain", "web", "a", "--admin", admin, "--socket", str(path))
    assert out.returncode == 0, out.stderr
    out = run_cli("status", "-v", "--socket", str(path))
    assert f"using the admin socket {path}" in out.stderr and out.returncode == 0


def test_the_cli_never_sends_the_token_in_clear_to_an_address_that_is_not_loopback(
    name_servers, lbproxy, monkeypatch
):
    """0.0.0.0 reaches this host's 127.0.0.1 listener, but it is not a loopback address:
    with a token the CLI refuses it (exit 2) unless --insecure; `localhost` counts as
    loopback."""
    servers = name_servers("a")
    port, admin_port = free_port(), free_port()
    lbproxy(with_admin(vs_config(port, servers, "rr"), admin_port, socket="none"))
    monkeypatch.setenv("LBPROXY_TOKEN", TOKEN)
    out = run_cli("status", "--admin", f"http://0.0.0.0:{admin_port}")
    assert out.returncode == 2
    assert "not sending the admin token in clear text" in out.stderr and "--insecure" in out.stderr
    out = run_cli("status", "--admin", f"http://0.0.0.0:{admin_port}", "--insecure")
    assert out.returncode == 0, out.stderr
    assert run_cli("status", "--admin", f"http://localhost:{admin_port}").returncode == 0


class _Recorder(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.server.requests.append((self.path, self.headers.get("Authorization")))
        if self.server.redirect_to:
            self.send_response(302)
            self.send_header("Location", self.server.redirect_to)
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            body = b'{"virtual_servers": [], "cluster": null}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def _recorder(redirect_to: str | None) -> HTTPServer:
    server = HTTPServer(("127.0.0.1", free_port()), _Recorder)
    server.requests = []  # type: ignore[attr-defined]
    server.redirect_to = redirect_to  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_cli_follows_no_redirect_and_sends_the_token_once(monkeypatch):
    target = _recorder(None)
    redirector = _recorder(f"http://127.0.0.1:{target.server_port}/api/v1/virtual-servers")
    try:
        monkeypatch.setenv("LBPROXY_TOKEN", TOKEN)
        out = run_cli("status", "--admin", f"http://127.0.0.1:{redirector.server_port}")
        assert out.returncode == 1
        assert "HTTP 302" in out.stderr and "lbproxy follows none" in out.stderr
        assert redirector.requests == [("/api/v1/virtual-servers", f"Bearer {TOKEN}")]
        assert target.requests == []  # the token went nowhere else
    finally:
        for server in (target, redirector):
            server.shutdown()
            server.server_close()
