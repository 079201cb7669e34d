"""Real servers added and removed at run time (SPEC §24): kept apart from the files.

PURE. One `RuntimeTopology` per virtual server holds the servers added through the API
and those removed, and merges them into what the files say each time the server's
configuration is applied (start, reload, a change), so that:

- an added server is listed after the file's, until a file names a server of that name
  (the file's entry wins, and the addition is forgotten);
- a removed server is left out while the files name it with the entry it had when it
  was removed; a file that changes or drops that entry wins (the removal is forgotten);
- a removed server that still has connections is listed as `drain` (no new ones) until
  `active(name)` is 0, then dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from lbproxy.config.model import RealServerConfig, VirtualServerConfig

__all__ = ["RuntimeTopology"]


@dataclass
class RuntimeTopology:
    added: dict[str, RealServerConfig] = field(default_factory=dict)
    # name -> the added server's entry as it was given (a JSON object's keys), to pass on
    # (state file, cluster, workers) and read again there
    entries: dict[str, dict[str, object]] = field(default_factory=dict)
    # name -> the file's entry when it was removed (None: it was an added server)
    removed: dict[str, RealServerConfig | None] = field(default_factory=dict)
    # removed servers still listed (as drain) while they have connections
    leaving: dict[str, RealServerConfig] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.leaving)

    def add(self, rs: RealServerConfig, entry: dict[str, object]) -> None:
        self.added[rs.name] = rs
        self.entries[rs.name] = entry
        self.removed.pop(rs.name, None)
        self.leaving.pop(rs.name, None)

    def remove(self, rs: RealServerConfig, in_file: bool, active: int) -> None:
        """Remove `rs` (as it is configured now); `in_file`: a file names it."""
        self.added.pop(rs.name, None)
        self.entries.pop(rs.name, None)
        if in_file:
            self.removed[rs.name] = rs
        if active > 0:
            self.leaving[rs.name] = rs

    def removed_from_files(self) -> tuple[tuple[str, str], ...]:
        """The removed servers a file names: (name, address) each."""
        return tuple((name, str(rs.address)) for name, rs in self.removed.items() if rs)

    def fingerprint(self) -> tuple[object, ...]:
        """Changes whenever what is kept across a restart does."""
        return tuple(self.added), self.removed_from_files()

    def merged(
        self, vs: VirtualServerConfig, active: Callable[[str], int] = lambda name: 0
    ) -> VirtualServerConfig:
        """`vs` as the files say, with the runtime additions and removals applied."""
        if self.empty:
            return vs
        file = {rs.name: rs for rs in vs.real_servers}
        for name, entry in list(self.removed.items()):
            if entry is None or file.get(name) != entry:
                del self.removed[name]  # the file changed or dropped it: the file wins
                if name in file:
                    self.leaving.pop(name, None)
        for name in [name for name in self.added if name in file]:
            del self.added[name]  # a file now names it: the file's entry wins
            del self.entries[name]
        for name in [name for name in self.leaving if active(name) == 0]:
            del self.leaving[name]
        servers = []
        for rs in vs.real_servers:
            if rs.name in self.leaving:
                servers.append(replace(rs, state="drain"))
            elif rs.name not in self.removed:
                servers.append(rs)
        servers.extend(self.added.values())
        servers.extend(
            replace(rs, state="drain")
            for name, rs in self.leaving.items()
            if name not in file and name not in self.added
        )
        if [id(rs) for rs in servers] == [id(rs) for rs in vs.real_servers]:
            return vs
        return replace(vs, real_servers=tuple(servers))
