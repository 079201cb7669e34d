"""At start, every address that cannot be bound is named in one go: the admin endpoint's
and every listener's, each with its address and what it was for, then exit 1 (SPEC §1)
with nothing left bound. An operator fixes them all at once instead of meeting the next
clash only after fixing the first."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from collections.abc import Iterator

import pytest

from tests.integration.harness import (
    admin_socket_path,
    ask_name,
    free_port,
    local_http,
    run_cli,
    vs_config,
    with_admin,
)


@contextlib.contextmanager
def held(*ports: int) -> Iterator[None]:
    """Listening sockets on `ports`, held by the test: lbproxy cannot bind them."""
    with contextlib.ExitStack() as stack:
        for port in ports:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", port))
            sock.listen()
        yield


def config(admin: int, web: int, api: int, workers: int) -> str:
    return f"""\
global:
  workers: {workers}
  admin: {{listen: 127.0.0.1:{admin}}}
virtual_servers:
  - name: web
    listen: 127.0.0.1:{web}
    real_servers: [{{name: a, address: 127.0.0.1:9}}]
  - name: api
    listen: 127.0.0.1:{api}
    real_servers: [{{name: a, address: 127.0.0.1:9}}]
"""


def bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("workers", [1, 2])
def test_every_address_in_use_is_named_at_once(tmp_path, workers):
    admin, web, api, free = free_port(), free_port(), free_port(), free_port()
    path = tmp_path / "lbproxy.yaml"
    path.write_text(config(admin, web, api, workers).replace(f":{api}", f":{free}"))
    # The admin port and one listener's taken; the other listener's free.
    with held(admin, web):
        out = run_cli("run", str(path), timeout=60)
    assert out.returncode == 1, out.stderr
    errors = [line for line in out.stderr.splitlines() if " ERROR " in line]
    assert any(
        f"cannot listen on 127.0.0.1:{admin}: Address already in use" in line
        and "admin endpoint" in line
        for line in errors
    ), out.stderr
    assert any(
        f"cannot listen on 127.0.0.1:{web}: Address already in use" in line
        and "virtual server web" in line
        for line in errors
    ), out.stderr
    assert len(errors) == 2, out.stderr  # one line per address, the free one not named
    assert "Traceback" not in out.stderr
    assert "started" not in out.stderr  # no worker, no listener served
    assert bindable(free) and bindable(admin) and bindable(web)  # nothing left bound
    assert not os.path.exists(admin_socket_path(admin))  # nor an admin socket left behind


def test_three_addresses_in_use_three_lines(tmp_path):
    admin, web, api = free_port(), free_port(), free_port()
    path = tmp_path / "lbproxy.yaml"
    path.write_text(config(admin, web, api, 1))
    with held(admin, web, api):
        out = run_cli("run", str(path), timeout=60)
    assert out.returncode == 1, out.stderr
    named = set(re.findall(r"cannot listen on 127\.0\.0\.1:(\d+)", out.stderr))
    assert named == {str(admin), str(web), str(api)}, out.stderr


def test_a_reload_names_every_address_it_cannot_bind_and_keeps_serving(
    lbproxy, name_servers, tmp_path
):
    (server,) = name_servers("a")
    port, admin, first, second = free_port(), free_port(), free_port(), free_port()
    config = with_admin(vs_config(port, [server]), admin)
    proxy = lbproxy(config, [port])
    wider = config.replace(
        f"listen: 127.0.0.1:{port}", f"listen: [127.0.0.1:{port}, 127.0.0.1:{first}]"
    ) + (
        f"  - name: api\n    listen: 127.0.0.1:{second}\n"
        f"    real_servers: [{{name: a, address: 127.0.0.1:{server.port}}}]\n"
    )
    proxy.config_path.write_text(wider)
    with held(first, second):
        status, body = local_http("POST", f"http://127.0.0.1:{admin}/api/v1/reload", {})
    assert status == 400, body
    errors = json.loads(body)["errors"]
    assert any(f"127.0.0.1:{first}" in error and "virtual server web" in error for error in errors)
    assert any(f"127.0.0.1:{second}" in error and "virtual server api" in error for error in errors)
    assert len(errors) == 2, errors
    assert ask_name(port) == "a"  # the running configuration serves on
