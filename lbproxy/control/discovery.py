"""DNS discovery on trio: one task per virtual server with `discovery.dns` (SPEC §14).

Each round asks the name through dnspython's asynchronous resolver (it runs on trio
through sniffio: `dns.asyncbackend` picks its trio backend by itself), turns the answer
into a `Resolution` (discovery_model.py decides everything else, without a clock), and
when the set changed asks the Server to apply the merged configuration through the
reload path (`Server.apply_discovered`). Nothing is written by hand: queries, retries
over TCP for a truncated answer and the reading of /etc/resolv.conf are dnspython's.

Rounds start every `interval` (the answers' TTL is not used, as HAProxy's `hold valid`
and Envoy's `dns_refresh_rate` do not wait for it either). A round — the query, and the
address lookups of SRV targets the answer brought no address for — is bounded by
`timeout` under a trio cancel scope as well as by the resolver's own lifetime, so a
silent resolver delays nothing but its own virtual server's next answer.

While a removed server still has connections the task looks at it every LEAVING_POLL
seconds, so that it disappears from the list shortly after its last connection closes.

Each answer is screened (discovery_model.AddressPolicy): an address of one of this
process's listeners is never used, nor a loopback, link-local, unspecified or multicast
one outside `allow_addresses`. Whether an address is this host's (for a wildcard
listener) is asked of the kernel: binding a socket to it succeeds only if it is.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import astuple
from typing import Any, Protocol

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver
import dns.rrset
import trio

from lbproxy.config.model import (
    Address,
    Config,
    DnsDiscoveryConfig,
    IPNetwork,
    VirtualServerConfig,
)
from lbproxy.control.reconcile import Configured, Reconciler
from lbproxy.core.discovery_model import (
    AddressPolicy,
    DiscoveryState,
    IPAddress,
    Resolution,
    SrvRecord,
    address_policy,
    best_records,
    resolution,
    servers_from_addresses,
    servers_from_srv,
    target_host,
)

log = logging.getLogger("lbproxy.discovery")

LEAVING_POLL = 0.1  # seconds between looks at removed servers that still have connections
LOOKUP_CONCURRENCY = 16  # SRV target lookups in flight at once, per round


# -- one resolution -------------------------------------------------------------------


def make_resolver(config: DnsDiscoveryConfig) -> dns.asyncresolver.Resolver:
    """A resolver for `config.resolvers`, else the system's (/etc/resolv.conf, read
    again each round, so an edit there is followed). Raises dns.resolver.
    NoResolverConfiguration when there is neither."""
    if config.resolvers:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [
            dns.nameserver.Do53Nameserver(address.host, address.port)
            for address in config.resolvers
        ]
    else:
        resolver = dns.asyncresolver.Resolver()
    resolver.cache = None  # every round asks again
    resolver.lifetime = config.timeout
    # Leave time to ask a second resolver when the first is silent.
    resolver.timeout = config.timeout / min(2, len(resolver.nameservers) or 1)
    return resolver


class LastAnswer:
    """The last answer of one virtual server's name and its Resolution.

    Most rounds bring the same answer again; giving back the same Resolution (the same
    tuple of servers, which DiscoveryState recognises at once) spares parsing and
    comparing thousands of servers every `interval` on the event loop.
    """

    def __init__(self) -> None:
        self.raw: object = None
        self.outcome: Resolution | None = None
        self.addresses: dict = {}  # servers_from_addresses's `known`

    def convert(self, raw: object, make: Callable[[], Resolution]) -> Resolution:
        if self.outcome is None or raw != self.raw:
            self.raw, self.outcome = raw, make()
        return self.outcome


def is_local(ip: IPAddress) -> bool:
    """Is `ip` an address of this host? (Binding to it succeeds only then.)"""
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(ip), 0))
    except OSError:
        return False
    return True


async def resolve(
    config: DnsDiscoveryConfig, last: LastAnswer | None = None, policy: AddressPolicy | None = None
) -> Resolution:
    """One round: the name's servers, or why there are none; never raises (but Cancelled).

    `last` (the task's) gives back its Resolution when the answer and the policy are the
    same as last time. `policy`: which addresses may be used (default: the special
    addresses outside `allow_addresses` are refused; no listener is known).
    """
    last = last or LastAnswer()
    policy = policy or AddressPolicy(config.allow_addresses)
    locals_seen: dict[IPAddress, bool] = {}

    def refuse(address: Address) -> str | None:
        return policy.refusal(address, lambda ip: _cached(locals_seen, ip))

    try:
        resolver = make_resolver(config)
    except dns.exception.DNSException as exc:
        return Resolution("error", detail=f"no resolvers: {exc}")
    deadline = trio.current_time() + config.timeout
    answer = None
    with trio.move_on_at(deadline):
        try:
            # Absolute: a discovery name never goes through resolv.conf's search domains.
            name = dns.name.from_text(config.name)
            answer = await resolver.resolve(
                name, config.type, search=False, raise_on_no_answer=False
            )
        except dns.resolver.NXDOMAIN:
            return Resolution("nxdomain")
        except dns.resolver.NoAnswer:
            return Resolution("empty")
        except (dns.exception.DNSException, OSError, ValueError) as exc:
            return Resolution("error", detail=str(exc) or type(exc).__name__)
    if answer is None:
        return Resolution("error", detail=f"no answer within {config.timeout:g}s")
    if answer.rrset is None:
        return Resolution("empty")
    if config.type != "SRV":
        assert config.port is not None  # the loader requires it for A/AAAA
        port = config.port
        addresses = tuple(sorted(r.address for r in answer))
        return last.convert(
            (addresses, config.max_servers, policy),
            lambda: resolution(
                *servers_from_addresses(addresses, port, last.addresses),
                config.max_servers,
                refuse=refuse,
            ),
        )
    records, beyond = best_records(srv_records(answer.rrset), config.max_servers)
    several: dict[str, int] = {}  # target host -> how many addresses it has (> 1)
    glued = glue(answer.response.additional, several)  # target host -> address
    missing = {target_host(r.target) for r in records} - glued.keys() - {""}
    if missing:
        # Within the same round: a target not found by then keeps its name.
        with trio.move_on_at(deadline):
            await _lookup(resolver, missing, glued, several)
    used = {target_host(r.target) for r in records}
    multiple = tuple(sorted((h, n, glued[h]) for h, n in several.items() if h in used))
    raw = (sorted(map(astuple, records)), sorted(glued.items()), multiple, beyond, policy)
    return last.convert(
        raw,
        lambda: resolution(
            *servers_from_srv(records, glued), beyond=beyond, refuse=refuse, multiple=multiple
        ),
    )


def _cached(seen: dict[IPAddress, bool], ip: IPAddress) -> bool:
    found = seen.get(ip)
    if found is None:
        found = seen[ip] = is_local(ip)
    return found


def srv_records(rrset: Iterable[Any]) -> list[SrvRecord]:
    """The SRV rdatas of an answer as plain records (the target as dnspython prints it)."""
    return [SrvRecord(r.priority, r.weight, r.port, r.target.to_text()) for r in rrset]


def glue(
    additional: Iterable[dns.rrset.RRset], several: dict[str, int] | None = None
) -> dict[str, str]:
    """Addresses the answer brought for its targets (Consul and dnsmasq send them); a
    target with more than one is counted in `several` (host -> how many)."""
    found: dict[str, set[str]] = {}
    for rrset in additional:
        if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            found.setdefault(target_host(rrset.name.to_text()), set()).update(
                r.address for r in rrset
            )
    if several is not None:
        several.update((host, len(ips)) for host, ips in found.items() if len(ips) > 1)
    # One real server per target and port (its name is HOST:PORT), so one address: the
    # lowest, a stable choice that does not flap from round to round.
    return {host: min(ips, key=_ip_order) for host, ips in found.items() if ips}


def _ip_order(text: str) -> tuple[int, int]:
    """IPv4 first, then by number (10.0.0.9 before 10.0.0.10); text that is no address
    last (dnspython gives none such; the answer is the network's)."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return (7, 0)
    return (ip.version, int(ip))


async def _lookup(
    resolver: dns.asyncresolver.Resolver,
    hosts: set[str],
    addresses: dict[str, str],
    several: dict[str, int] | None = None,
) -> None:
    """Find an address for each SRV target the answer had none for, A then AAAA, each
    target once (`hosts` is a set), at most LOOKUP_CONCURRENCY at a time (an answer of
    thousands of targets must not become thousands of queries at once); a target that
    has none keeps its name (resolved when connecting)."""
    limiter = trio.CapacityLimiter(LOOKUP_CONCURRENCY)

    async def one(host: str) -> None:
        async with limiter:
            await _lookup_one(resolver, host, addresses, several)

    async with trio.open_nursery() as nursery:
        for host in sorted(hosts):
            nursery.start_soon(one, host)


async def _lookup_one(
    resolver: dns.asyncresolver.Resolver,
    host: str,
    addresses: dict[str, str],
    several: dict[str, int] | None = None,
) -> None:
    """One target's address, A then AAAA, into `addresses` (the lowest, as `glue`
    chooses; more than one counted in `several`); nothing when it has none."""
    for rdtype in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(
                dns.name.from_text(host), rdtype, search=False, raise_on_no_answer=False
            )
        except (dns.exception.DNSException, OSError, ValueError):
            continue
        if answer.rrset is not None and len(answer.rrset):
            found = {r.address for r in answer}
            addresses[host] = min(found, key=_ip_order)
            if several is not None and len(found) > 1:
                several[host] = len(found)
            return


# -- the task of one virtual server ---------------------------------------------------


class DiscoveryTarget(Protocol):
    """What a discovery task needs from the Server (kept small: no import of server)."""

    def apply_discovered(self, vs_name: str) -> list[str]: ...

    def discovered_active(self, vs_name: str, rs_name: str) -> int: ...

    def discovery_policy(self, allow: tuple[IPNetwork, ...]) -> AddressPolicy:
        """Which addresses an answer may name, for this process's listeners now."""
        ...


class Discoveries(Reconciler[str, DnsDiscoveryConfig]):
    """The discovery state and task of every virtual server that has `discovery.dns`.

    A state outlives reloads (a reload re-merges the servers found so far); a task is
    restarted when the block changes, with the state it had (the last set stays until
    the new name answers). Kept in step by the one reconciler (reconcile.py).
    """

    def __init__(self, target: DiscoveryTarget) -> None:
        super().__init__()
        self.target = target
        self.states: dict[str, DiscoveryState] = {}

    def merged(
        self, vs: VirtualServerConfig, target: DiscoveryTarget | None = None
    ) -> VirtualServerConfig:
        """`vs` with its discovered servers (as the reload and each change apply it)."""
        state = self.states.get(vs.name)
        if state is None or vs.discovery is None:
            return vs
        if target is None:
            return state.merged(vs)
        return state.merged(vs, lambda rs: target.discovered_active(vs.name, rs))

    def wanted(self, virtual_servers: Iterable[Configured]) -> dict[str, DnsDiscoveryConfig]:
        """The blocks configured; a state for each (made here, kept while configured)."""
        wanted = {}
        for vs in virtual_servers:
            config = vs.pool.config.discovery
            if config is not None:
                wanted[vs.name] = config
        for name in list(self.states):
            if name not in wanted:
                del self.states[name]
        for name, config in wanted.items():
            state = self.states.get(name)
            if state is None:
                state = self.states[name] = DiscoveryState(name, config)
                log.info(
                    "%s: discovering real servers from %s %s; static real servers only "
                    "until it answers",
                    name,
                    config.type,
                    config.name,
                )
            state.config = config
        return wanted

    def start(self, key: str, spec: DnsDiscoveryConfig) -> Callable[[], Awaitable[None]]:
        return functools.partial(self._run, self.states[key], self.target)

    @staticmethod
    async def _run(state: DiscoveryState, target: DiscoveryTarget) -> None:
        config = state.config
        vs_name = state.vs_name

        def active(rs_name: str) -> int:
            return target.discovered_active(vs_name, rs_name)

        last = LastAnswer()
        while True:
            started = trio.current_time()
            next_round = started + config.interval
            try:
                policy = target.discovery_policy(config.allow_addresses)
                outcome = await resolve(config, last, policy)
                if state.record(outcome, trio.current_time()):
                    target.apply_discovered(vs_name)
                # Removed servers with connections: drop each once its last one closed.
                while state.leaving and trio.current_time() < next_round:
                    await trio.sleep(min(LEAVING_POLL, next_round - trio.current_time()))
                    if any(active(name) == 0 for name in state.leaving):
                        target.apply_discovered(vs_name)
            except Exception:
                # A bug here must not take the proxy down with it (its exception
                # would cancel the service nursery): log it, try again next round.
                log.exception("%s: discovery round failed; trying again", vs_name)
            await trio.sleep_until(next_round)


# -- lbproxy check --resolve ----------------------------------------------------------


async def resolve_all(config: Config) -> list[tuple[VirtualServerConfig, Resolution]]:
    """Resolve every discovery name once, all at once (`lbproxy check --resolve`), with
    the address policy `config`'s listeners make."""
    found: dict[str, Resolution] = {}
    servers = [vs for vs in config.virtual_servers if vs.discovery is not None]

    async def one(vs: VirtualServerConfig) -> None:
        assert vs.discovery is not None
        policy = address_policy(config, vs.discovery.allow_addresses)
        found[vs.name] = await resolve(vs.discovery, policy=policy)

    async with trio.open_nursery() as nursery:
        for vs in servers:
            nursery.start_soon(one, vs)
    return [(vs, found[vs.name]) for vs in servers]
