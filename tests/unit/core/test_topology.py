"""RuntimeTopology: runtime additions and removals merged after the files (SPEC §24)."""

from __future__ import annotations

from dataclasses import replace

from lbproxy.config.model import Address, RealServerConfig, VirtualServerConfig
from lbproxy.core.topology import RuntimeTopology


def server(name: str, port: int = 80, **keys) -> RealServerConfig:
    return RealServerConfig(name, Address("10.0.0.1", port), **keys)


def names(vs: VirtualServerConfig) -> list[tuple[str, str]]:
    return [(rs.name, rs.state) for rs in vs.real_servers]


FILE = VirtualServerConfig("web", (), (server("a"), server("b", 81)))


def test_nothing_changed_gives_the_files_as_they_are():
    assert RuntimeTopology().merged(FILE) is FILE


def test_an_added_server_follows_the_files_until_a_file_names_it():
    topology = RuntimeTopology()
    topology.add(server("c", 82, weight=4), {"name": "c"})
    assert names(topology.merged(FILE)) == [("a", "enabled"), ("b", "enabled"), ("c", "enabled")]
    named = replace(FILE, real_servers=(*FILE.real_servers, server("c", 90)))
    merged = topology.merged(named)
    assert merged.real_servers[-1] == server("c", 90)  # the file's entry wins
    assert topology.empty and topology.merged(FILE) is FILE  # and the addition is gone


def test_a_removed_server_drains_while_active_then_stays_removed_while_unchanged():
    topology = RuntimeTopology()
    topology.remove(server("a"), in_file=True, active=3)
    active = {"a": 3}
    assert names(topology.merged(FILE, active.get)) == [("a", "drain"), ("b", "enabled")]
    active["a"] = 0
    assert names(topology.merged(FILE, active.get)) == [("b", "enabled")]
    moved = line_moved = replace(FILE.real_servers[0], line=99)  # where, not what
    assert names(
        topology.merged(replace(FILE, real_servers=(line_moved, FILE.real_servers[1])))
    ) == [("b", "enabled")]
    changed = replace(moved, weight=5)  # the file changes its entry: the file wins
    merged = topology.merged(replace(FILE, real_servers=(changed, FILE.real_servers[1])))
    assert names(merged) == [("a", "enabled"), ("b", "enabled")] and topology.empty


def test_a_removed_added_server_drains_then_goes():
    topology = RuntimeTopology()
    topology.add(server("c", 82), {"name": "c"})
    topology.remove(server("c", 82), in_file=False, active=1)
    active = {"c": 1}
    assert names(topology.merged(FILE, active.get))[-1] == ("c", "drain")
    active["c"] = 0
    assert topology.merged(FILE, active.get) is FILE and topology.empty
