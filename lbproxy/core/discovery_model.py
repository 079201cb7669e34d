"""Real servers from DNS answers, and which of them to keep when answers go wrong (SPEC §14).

PURE: no trio, no sockets, no clock — `DiscoveryState.record` takes `now`. The trio side
(discovery.py) asks the resolver and hands over what came back; this module owns the rest:

- *Answers -> servers* (`servers_from_srv`, `servers_from_addresses`): one
  RealServerConfig per target and port, named `HOST:PORT` (SRV: the target without its
  trailing dot; A/AAAA: the address, `[v6]:PORT` for IPv6), at one address: a target
  with several is one server at its lowest (IPv4 first; logged once per target), since
  one server per address would need names other than HOST:PORT, which SPEC §14 gives and
  the admin API's paths use. An SRV record's weight is the
  static weight, 0 included, except that a priority whose records all have weight 0
  gives each of them weight 1 (RFC 2782 chooses among them alike); the records of the
  lowest priority are the primaries and every higher priority is `backup` (RFC 2782: "a
  client MUST attempt to contact the target host with the lowest-numbered priority it
  can reach"). Anything unusable — the
  target `.` ("decidedly not available", RFC 2782), port 0, a name that is no host name —
  is skipped and reported, never raised: these values come from the network.
- *What to keep* (`DiscoveryState`): HAProxy's resolvers keep a server through resolution
  errors and remove it only after `hold obsolete`; Envoy's STRICT_DNS keeps the last
  hosts on a failed resolution. Here a round that failed (timeout, SERVFAIL, REFUSED, an
  unreachable resolver) keeps the last known set and is logged once per streak; an empty
  answer or NXDOMAIN removes servers only once the name has answered so for `hold`.
- *The merge* (`DiscoveryState.merged`): the virtual server's static `real_servers`, then
  the discovered servers in the order they first appeared (so a change does not reorder
  the others). A server that left the answers stays listed with state `drain` while it
  has connections and disappears with the last of them; a static server's name wins
  over a discovered one.

- *Which addresses may be used* (`AddressPolicy`, SPEC §21): an answer comes from the
  network, and a real server is where clients' bytes go. An address of one of this
  process's own listeners (the admin endpoint, the DNS locator, a virtual server; a
  wildcard listener is every local address on its port) is never used — a client would
  reach the admin endpoint as a local peer; a loopback, link-local, unspecified or
  multicast address only inside `allow_addresses`. Refused servers are left out of the
  Resolution and listed in it with their reason; `DiscoveryState` counts them every
  round and logs them once per change.

The merged configuration is applied by the reload path (`Server.apply_discovered`,
`Pool.reconfigure`), so added servers come online, removed ones drain and unchanged ones
keep everything the pool keeps.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from lbproxy.config.model import (
    Address,
    Config,
    DnsDiscoveryConfig,
    IPNetwork,
    RealServerConfig,
    SnmpConfig,
    VirtualServerConfig,
)
from lbproxy.config.values import parse_address

log = logging.getLogger("lbproxy.discovery_model")

RESULTS = ("ok", "empty", "nxdomain", "error")  # lbproxy_discovery_resolutions_total
# lbproxy_discovery_refused_total's reasons (AddressPolicy)
REFUSALS = ("self", "loopback", "link_local", "unspecified", "multicast")
MAX_UINT16 = 65535


@dataclass(frozen=True, slots=True)
class SrvRecord:
    """One SRV record as the resolver gave it (RFC 2782 fields; the target as text)."""

    priority: int
    weight: int
    port: int
    target: str  # absolute, with its trailing dot, as dnspython prints it


@dataclass(frozen=True, slots=True)
class Resolution:
    """One round's outcome: what the metric counts, and the servers of an ok answer."""

    result: str  # ok | empty | nxdomain | error
    servers: tuple[RealServerConfig, ...] = ()
    detail: str = ""  # why: an error, or the records skipped
    beyond: int = 0  # servers of the answer left out by `max_servers`
    refused: tuple[tuple[str, str], ...] = ()  # (server name, REFUSALS reason), left out
    # SRV targets with several addresses: (host, how many, the one used)
    multiple: tuple[tuple[str, int, str], ...] = ()


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True)
class AddressPolicy:
    """Which addresses of an answer may be real servers (SPEC §21).

    `own`: the (address, port) of every listener of this process, addresses as
    `ipaddress` objects; `wildcard_ports`: the ports of listeners bound to every
    address (0.0.0.0, ::). `refusal` needs to know which addresses are this host's
    (`is_local`: the caller asks the system; the unspecified and loopback addresses
    are local without asking).
    """

    allow: tuple[IPNetwork, ...] = ()
    own: frozenset[tuple[IPAddress, int]] = frozenset()
    wildcard_ports: frozenset[int] = frozenset()

    def refusal(self, address: Address, is_local: Callable[[IPAddress], bool]) -> str | None:
        """Why `address` may not be used (one of REFUSALS), or None when it may."""
        host = address.host
        try:
            ip = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            # A host name, resolved when connecting; `localhost` names loopback there.
            lower = host.lower().rstrip(".")
            if lower == "localhost" or lower.endswith(".localhost"):
                # 127.0.0.1 or ::1: a listener on either is refused; either allowed will do
                port = address.port
                reasons = {self._refusal(ip, port, is_local) for ip in (_LOOPBACK_V4, _LOOPBACK_V6)}
                return "self" if "self" in reasons else None if None in reasons else "loopback"
            return None
        return self._refusal(ip, address.port, is_local)

    def _refusal(
        self, ip: IPAddress, port: int, is_local: Callable[[IPAddress], bool]
    ) -> str | None:
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        special = _special(ip)
        if (ip, port) in self.own:
            return "self"
        # A wildcard listener is every local address on its port; a connection to the
        # unspecified address reaches whatever listens locally on the port.
        wildcard = port in self.wildcard_ports
        if special == "unspecified" and (wildcard or any(p == port for _, p in self.own)):
            return "self"
        local = special == "loopback" or (special in (None, "link_local") and is_local(ip))
        if wildcard and local:
            return "self"
        if special is None or any(ip.version == net.version and ip in net for net in self.allow):
            return None
        return special


_LOOPBACK_V4 = ipaddress.ip_address("127.0.0.1")
_LOOPBACK_V6 = ipaddress.ip_address("::1")


def _special(ip: IPAddress) -> str | None:
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link_local"
    if ip.is_multicast:
        return "multicast"
    return None


def address_policy(config: Config, allow: tuple[IPNetwork, ...]) -> AddressPolicy:
    """The policy of a discovery block with `allow`, for the listeners `config` binds."""
    addresses: list[Address] = []
    admin = config.global_.admin.listen
    if admin is not None:
        addresses.append(admin)
    if config.global_.locator.dns is not None:
        addresses.append(config.global_.locator.dns.listen)
    for vs in config.virtual_servers:
        addresses.extend(vs.listen)
    own: set[tuple[IPAddress, int]] = set()
    wildcard: set[int] = set()
    for address in addresses:
        host = address.host
        hosts = ("127.0.0.1", "::1") if host == "localhost" else (host,)
        for text in hosts:
            try:
                ip = ipaddress.ip_address(text.split("%", 1)[0])
            except ValueError:
                continue
            if ip.version == 6 and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped
            if ip.is_unspecified:
                wildcard.add(address.port)
            own.add((ip, address.port))
    return AddressPolicy(allow, frozenset(own), frozenset(wildcard))


def target_host(target: str) -> str:
    """The host name of an SRV target: no trailing dot, lower case (DNS ignores case)."""
    return target[:-1].lower() if target.endswith(".") else target.lower()


def discovered_server(
    name: str, address: Address, weight: int = 1, *, backup: bool = False
) -> RealServerConfig:
    """A discovered real server with the defaults of a static one (SPEC §9)."""
    return RealServerConfig(name, address, weight=weight, backup=backup, discovered=True)


def servers_from_srv(
    records: Iterable[SrvRecord], addresses: Mapping[str, str] | None = None
) -> tuple[tuple[RealServerConfig, ...], list[str]]:
    """The servers of an SRV answer, sorted by priority then name, and what was skipped.

    `addresses` maps a target's host name (no trailing dot, lower case) to an IP address
    found for it (the answer's additional section, or a lookup through the same
    resolvers); a target without one keeps its host name as the address, resolved when
    connecting. A target:port listed twice counts once, at its lowest priority and, at
    that priority, its highest weight.
    """
    addresses = addresses or {}
    skipped: list[str] = []
    best: dict[str, tuple[int, int, Address]] = {}  # name -> (priority, -weight, address)
    for record in records:
        why = _unusable(record)
        if why:
            fields = f"{record.priority} {record.weight} {record.port} {record.target}"
            skipped.append(f"{fields}: {why}")
            continue
        host = target_host(record.target)
        try:
            named = parse_address(f"{host}:{record.port}")
        except ValueError as exc:
            skipped.append(f"{record.target} port {record.port}: {exc}")
            continue
        name = f"{named.host}:{named.port}"
        address = _address_of(addresses.get(named.host), named)
        key = (record.priority, -record.weight, address)
        if name not in best or key[:2] < best[name][:2]:
            best[name] = key
    if not best:
        return (), skipped
    primary = min(priority for priority, _, _ in best.values())
    # RFC 2782: when every record of a priority has weight 0 they are chosen alike.
    # CoreDNS gives each record of a headless service floor(100/N), so beyond 100
    # endpoints every weight is 0: taken literally, nobody would be served.
    weighted = {priority for priority, negative_weight, _ in best.values() if negative_weight}
    ordered = sorted(best.items(), key=lambda item: (item[1][0], item[0]))
    servers = tuple(
        discovered_server(
            name,
            address,
            -negative_weight if priority in weighted else 1,
            backup=priority > primary,
        )
        for name, (priority, negative_weight, address) in ordered
    )
    return servers, skipped


def best_records(records: Iterable[SrvRecord], max_servers: int) -> tuple[list[SrvRecord], int]:
    """At most `max_servers` of an SRV answer's records, and how many servers were left
    out: one record per target:port (its lowest priority, then highest weight), those of
    the lowest priority, then the highest weight, then the name (`host:port`) first.

    Applied before the targets are looked up, so a huge answer costs no lookups for the
    servers it will not keep. Unusable records pass through (servers_from_srv reports
    them)."""
    best: dict[str, tuple[tuple[int, int, str], SrvRecord]] = {}
    unusable = []
    for record in records:
        if _unusable(record):
            unusable.append(record)
            continue
        name = f"{target_host(record.target)}:{record.port}"
        key = (record.priority, -record.weight, name)
        if name not in best or key < best[name][0]:
            best[name] = (key, record)
    if len(best) <= max_servers:
        return [*(record for _, record in best.values()), *unusable], 0
    kept = sorted(best.values(), key=lambda item: item[0])[:max_servers]
    return [*(record for _, record in kept), *unusable], len(best) - max_servers


def _unusable(record: SrvRecord) -> str:
    for field_name in ("priority", "weight", "port"):
        value = getattr(record, field_name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_UINT16:
            return f"{field_name} {value!r} is not in 0..{MAX_UINT16}"
    if record.port == 0:
        return "port 0"
    if not isinstance(record.target, str) or record.target in (".", ""):
        return "no target (the service is not available there)"
    # dnspython prints a space in a label as \032; a raw one is no host name, and
    # parse_address would strip it into another name.
    if any(ch.isspace() for ch in record.target):
        return f"target {record.target!r} is not a host name"
    return ""


def _address_of(ip: str | None, named: Address) -> Address:
    if ip is None:
        return named
    try:
        return Address(str(ipaddress.ip_address(ip)), named.port)
    except ValueError:
        return named


def servers_from_addresses(
    addresses: Iterable[str],
    port: int,
    known: dict[str, tuple[tuple[int, int], RealServerConfig]] | None = None,
) -> tuple[tuple[RealServerConfig, ...], list[str]]:
    """The servers of an A or AAAA answer, sorted by address, and what was skipped.

    `known` (optional, for one port) keeps each address text's sort key and server
    between calls, so an answer of thousands in which one address changed parses one;
    it is left holding the addresses of this answer only.
    """
    skipped: list[str] = []
    previous = known or {}
    found: dict[str, tuple[tuple[int, int], RealServerConfig]] = {}
    for text in addresses:
        entry = previous.get(text) if isinstance(text, str) else None
        if entry is None:
            try:
                ip = ipaddress.ip_address(text)
            except (ValueError, TypeError):
                skipped.append(f"{text!r}: not an IP address")
                continue
            address = Address(str(ip), port)
            entry = ((ip.version, int(ip)), discovered_server(str(address), address))
        found[text] = entry
    if known is not None:
        known.clear()
        known.update(found)
    # Two texts of one address (`::1`, `0::1`) are one server.
    unique = {rs.name: (key, rs) for key, rs in found.values()}
    return tuple(rs for _, rs in sorted(unique.values(), key=lambda item: item[0])), skipped


def resolution(
    servers: tuple[RealServerConfig, ...],
    skipped: list[str],
    max_servers: int | None = None,
    beyond: int = 0,
    refuse: Callable[[Address], str | None] | None = None,
    multiple: tuple[tuple[str, int, str], ...] = (),
) -> Resolution:
    """An answer's Resolution: `empty` when no record in it was usable. Servers that
    `refuse` names a reason for are left out and listed in `refused`. With
    `max_servers`, servers past it are left out (A/AAAA: the lowest addresses are kept,
    `servers` being sorted by address) and counted in `beyond`."""
    refused: list[tuple[str, str]] = []
    if refuse is not None:
        kept = []
        for rs in servers:
            reason = refuse(rs.address)
            if reason is None:
                kept.append(rs)
            else:
                refused.append((rs.name, reason))
        if refused:
            servers = tuple(kept)
    detail = "skipped " + "; ".join(skipped) if skipped else ""
    if max_servers is not None and len(servers) > max_servers:
        beyond += len(servers) - max_servers
        servers = servers[:max_servers]
    return Resolution(
        "ok" if servers else "empty", servers, detail, beyond, tuple(refused), multiple
    )


class DiscoveryState:
    """The discovered servers of one virtual server and the streaks that decide them.

    `record` is called once per round with its Resolution and the time; it returns True
    when the set to apply changed. `merged` gives the configuration to apply.
    """

    def __init__(self, vs_name: str, config: DnsDiscoveryConfig) -> None:
        self.vs_name = vs_name
        self.config = config
        # Every discovered server still listed, in the order it first appeared; the
        # names in `leaving` are no longer in the answers and are listed as `drain`.
        self.servers: dict[str, RealServerConfig] = {}
        self.leaving: set[str] = set()
        self.answered = False  # an ok answer came at least once
        self.results: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # by REFUSALS reason, every round
        self._last_refused: tuple[tuple[str, str], ...] = ()
        self._multiple: set[str] = set()  # targets said to have several addresses
        self.error_streak = 0
        self.empty_since: float | None = None
        self._shadowed: set[str] = set()  # discovered names a static server has: warned
        self._last_skipped = ""
        self._last_beyond = 0  # servers left out by max_servers in the last ok answer
        self._applied: tuple[RealServerConfig, ...] | None = None  # the last set replaced
        # name -> (discovered config, snmp block of the VS, the config as merged)
        self._prepared: dict[str, tuple[RealServerConfig, SnmpConfig | None, RealServerConfig]] = {}

    @property
    def what(self) -> str:
        return f"{self.vs_name}: discovery {self.config.type} {self.config.name}"

    @property
    def current(self) -> list[str]:
        """The names in the last answer that counted (not leaving), in listed order."""
        return [name for name in self.servers if name not in self.leaving]

    def record(self, outcome: Resolution, now: float) -> bool:
        """Count one round's outcome and update the set; True when it changed."""
        self.results[outcome.result] += 1
        if outcome.result == "error":
            if not self.error_streak:
                kept = (
                    f"keeping the last {len(self.current)} discovered server(s)"
                    if self.answered
                    else "no answer yet: only the static real servers serve"
                )
                log.warning("%s: resolution failed (%s); %s", self.what, outcome.detail, kept)
            self.error_streak += 1
            return False
        if self.error_streak:
            log.info("%s: resolving again after %d failed round(s)", self.what, self.error_streak)
            self.error_streak = 0
        if outcome.detail and outcome.detail != self._last_skipped:
            log.warning("%s: %s", self.what, outcome.detail)
        self._last_skipped = outcome.detail
        self._count_refused(outcome.refused)
        if outcome.result == "ok":
            self._say_multiple(outcome.multiple)
            if outcome.beyond != self._last_beyond:  # once per change, not every round
                if outcome.beyond:
                    log.warning(
                        "%s: the answer has %d servers, beyond max_servers %d: keeping "
                        "the %d of the lowest priority, highest weight, then name",
                        self.what,
                        len(outcome.servers) + outcome.beyond,
                        self.config.max_servers,
                        len(outcome.servers),
                    )
                else:
                    log.info("%s: the answer fits max_servers again", self.what)
                self._last_beyond = outcome.beyond
            if self.empty_since is not None and self.current:
                log.info("%s: answering again; keeping its servers", self.what)
            self.empty_since = None
            self.answered = True
            return self._replace(outcome.servers)
        # empty or nxdomain: only after `hold`
        if self.empty_since is None:
            self.empty_since = now
            if self.current:
                log.warning(
                    "%s: %s; its %d server(s) go in %gs unless it answers again",
                    self.what,
                    "NXDOMAIN" if outcome.result == "nxdomain" else "no records",
                    len(self.current),
                    self.config.hold,
                )
        if self.current and now - self.empty_since >= self.config.hold:
            log.warning(
                "%s: still %s after %gs: removing its %d server(s)",
                self.what,
                "NXDOMAIN" if outcome.result == "nxdomain" else "without records",
                self.config.hold,
                len(self.current),
            )
            return self._replace(())
        return False

    def _say_multiple(self, multiple: tuple[tuple[str, int, str], ...]) -> None:
        """Once per target (again only if it had one address meanwhile): a target of
        several addresses is one real server, at one of them."""
        for host, count, used in multiple:
            if host not in self._multiple:
                log.info(
                    "%s: SRV target %s has %d addresses; only %s is used (one real "
                    "server per target and port, at its lowest address)",
                    self.what,
                    host,
                    count,
                    used,
                )
        self._multiple = {host for host, _, _ in multiple}

    def _count_refused(self, refused: tuple[tuple[str, str], ...]) -> None:
        """Count this round's refused addresses; log them when they changed."""
        for _, reason in refused:
            self.refused[reason] += 1
        if refused == self._last_refused:
            return
        self._last_refused = refused
        if refused:
            listed = ", ".join(f"{name} ({reason})" for name, reason in refused)
            log.warning(
                "%s: not using %s: %s (the process's own listeners are never used; "
                "the others only inside discovery.dns.allow_addresses)",
                self.what,
                "this address" if len(refused) == 1 else f"these {len(refused)} addresses",
                listed,
            )
        else:
            log.info("%s: no address of the answer is refused any more", self.what)

    def _replace(self, servers: tuple[RealServerConfig, ...]) -> bool:
        if servers is self._applied:
            return False  # the same answer as last round (discovery.LastAnswer): no change
        self._applied = servers
        wanted = {rs.name: rs for rs in servers}
        changed = False
        for name in self.current:
            if name not in wanted:
                self.leaving.add(name)  # dropped by `merged` once it has no connection
                changed = True
        for name, rs in wanted.items():
            if name in self.leaving:
                self.leaving.discard(name)
                changed = True
            if self.servers.get(name) != rs:
                self.servers[name] = rs  # a new name goes last; a known one keeps its place
                changed = True
        return changed

    def forget_idle(self, active: Callable[[str], int]) -> bool:
        """Drop leaving servers without connections (`active(name)`); True if any went."""
        gone = [name for name in self.leaving if active(name) == 0]
        for name in gone:
            self.leaving.discard(name)
            del self.servers[name]
        return bool(gone)

    def merged(
        self, vs: VirtualServerConfig, active: Callable[[str], int] = lambda name: 0
    ) -> VirtualServerConfig:
        """`vs` (as its file says) with the discovered servers after its static ones.

        A leaving server is listed as `drain` while `active(name)` > 0, and dropped once
        it is 0. The virtual server's snmp block (with the server's own host) is given to
        each discovered server, as a static server without overrides gets it.
        """
        self.forget_idle(active)
        static = {rs.name for rs in vs.real_servers}
        discovered = []
        for name, rs in self.servers.items():
            if name in static:
                if name not in self._shadowed:
                    self._shadowed.add(name)
                    log.warning(
                        "%s: %s is a static real server; the static one is kept", self.what, name
                    )
                continue
            discovered.append(self._prepare(name, rs, vs.snmp))
        for name in self._prepared.keys() - self.servers.keys():
            del self._prepared[name]
        if not discovered:
            return vs
        return replace(vs, real_servers=(*vs.real_servers, *discovered))

    def _prepare(
        self, name: str, rs: RealServerConfig, snmp: SnmpConfig | None
    ) -> RealServerConfig:
        """`rs` as merged: the VS's snmp block, the discovery block's line, `drain` if
        leaving; kept from one merge to the next while `rs` and the block stay the same."""
        cached = self._prepared.get(name)
        if cached is None or cached[0] is not rs or cached[1] is not snmp:
            merged = replace(rs, snmp=_snmp_for(snmp, rs.address), line=self.config.line)
            cached = self._prepared[name] = (rs, snmp, merged)
        return replace(cached[2], state="drain") if name in self.leaving else cached[2]


def _snmp_for(snmp: SnmpConfig | None, address: Address) -> SnmpConfig | None:
    if snmp is None:
        return None
    return replace(snmp, host=snmp.host or address.host)
