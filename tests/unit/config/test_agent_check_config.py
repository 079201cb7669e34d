"""`agent_check` in the configuration (SPEC §22): the virtual server's block, a real
server's own `port`/`address` over it, and FILE:LINE problems for bad values."""

from __future__ import annotations

from pathlib import Path

import yaml

from lbproxy.config.model import AgentCheckConfig
from lbproxy.config.reader import load
from tests.unit.config.support import problems, schema_validator, write

GOOD = """\
virtual_servers:
  - name: db
    listen: 127.0.0.1:5432
    agent_check: {port: 9777, interval: 5s, timeout: 500ms, send: "state\\n"}
    real_servers:
      - {name: a, address: 10.0.0.1:5432}
      - {name: b, address: 10.0.0.2:5432, agent_check: {port: 9778, address: 10.0.9.2}}
"""


def test_the_virtual_servers_block_and_a_real_servers_own(tmp_path: Path) -> None:
    [vs] = load([write(tmp_path, "db.yaml", GOOD)]).virtual_servers
    assert vs.agent_check == AgentCheckConfig(port=9777, interval=5.0, timeout=0.5, send="state\n")
    a, b = vs.real_servers
    assert a.agent_check is None  # the virtual server's applies as it is
    assert b.agent_check == AgentCheckConfig(
        port=9778, address="10.0.9.2", interval=5.0, timeout=0.5, send="state\n"
    )
    assert not list(schema_validator().iter_errors(yaml.safe_load(GOOD)))


def test_a_real_server_alone_may_have_an_agent(tmp_path: Path) -> None:
    text = """\
    virtual_servers:
      - name: db
        listen: 127.0.0.1:5432
        real_servers:
          - {name: a, address: 10.0.0.1:5432, agent_check: {port: 9777}}
          - {name: b, address: 10.0.0.2:5432}
    """
    [vs] = load([write(tmp_path, "db.yaml", text)]).virtual_servers
    assert vs.agent_check is None
    assert vs.real_servers[0].agent_check == AgentCheckConfig(port=9777)
    assert vs.real_servers[1].agent_check is None


def test_bad_values_are_reported_with_file_and_line(tmp_path: Path) -> None:
    text = """\
    virtual_servers:
      - name: db
        listen: 127.0.0.1:5432
        agent_check: {interval: 0s, timeout: soon, sendd: x}
        real_servers:
          - {name: a, address: 10.0.0.1:5432}
          - {name: b, address: 10.0.0.2:5432, agent_check: {port: 70000}}
          - {name: c, address: 10.0.0.3:5432, agent_check: {port: 1, interval: 1s}}
          - {name: d, address: 10.0.0.4:5432, agent_check: {port: 1, address: "no such!"}}
    """
    path = write(tmp_path, "db.yaml", text)
    assert problems([path]) == [
        f"{path}:4: agent_check.interval must be a duration (250ms, 5s, 2m, 1h or seconds)"
        " > 0, got '0s'",
        f"{path}:4: agent_check.timeout must be a duration (250ms, 5s, 2m, 1h or seconds)"
        " > 0, got 'soon'",
        f"{path}:4: unknown key 'sendd' in agent_check of virtual server db (did you mean 'send'?)",
        f"{path}:6: real server a: agent_check needs 'port' (here or on the virtual server)",
        f"{path}:7: agent_check.port must be an integer from 1 to 65535, got 70000",
        f"{path}:8: unknown key 'interval' in agent_check of real server c",
        f"{path}:9: agent_check.address must be a host name or IP address, got 'no such!'"
        " ('no such!' is not an IP address or host name)",
    ]


def test_discovery_needs_the_port_on_the_virtual_server(tmp_path: Path) -> None:
    text = """\
    virtual_servers:
      - name: db
        listen: 127.0.0.1:5432
        agent_check: {interval: 1s}
        discovery: {dns: {name: db.example.com}}
    """
    path = write(tmp_path, "db.yaml", text)
    assert problems([path]) == [
        f"{path}:4: agent_check needs 'port' (discovered servers have no agent_check)"
    ]
