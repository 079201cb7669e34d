"""The configuration model: frozen, typed objects the rest of lbproxy reads.

PURE: no trio, no sockets, no clock. The dataclasses below are the contract the rest of
lbproxy reads; defaults are the ones of SPEC §2 and §9, and the configuration reference
(docs/reference/configuration.md) and `lbproxy schema` show them from here. The package's
other modules fill them: values.py (`parse_duration`, `parse_address`, the converters
that check one value each), tables.py (the keys of each section), reader.py (each section
into its dataclass, the checks across files, `load`), summary.py (`summary` for `lbproxy
check`), and reference.py and schema.py (the tables as a page and as a JSON Schema).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from lbproxy.core.schedulers.default import DEFAULT as DEFAULT_SCHEDULER

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    line: int  # 1-based
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


class ConfigError(Exception):
    """Raised by `load` with every problem found, in file and line order."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


@dataclass(frozen=True, slots=True)
class Address:
    host: str  # "127.0.0.1", "::1", "0.0.0.0", "::" or a host name (real servers only)
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


# `global.admin.socket` unset: admin-PORT.sock in the runtime folder (admin/local_socket.py)
ADMIN_SOCKET_DEFAULT = "default"


@dataclass(frozen=True, slots=True)
class AdminConfig:
    listen: Address | None = Address("127.0.0.1", 9100)  # None: `listen: none`
    token_file: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # besides IP literals and localhost (SPEC §16)
    max_connections: int = 256  # at the limit the oldest one still reading is closed
    # The Unix socket serving the same API (SPEC §21): a path, None (`none`), or
    # ADMIN_SOCKET_DEFAULT. Through it a change needs no token, only the right peer uid.
    socket: str | None = ADMIN_SOCKET_DEFAULT
    read_token: bool = False  # /api/v1 reads over TCP need the token too
    max_connections_per_source: int = 32  # admin connections from one client address


# Loopback and the private ranges: who may ask the DNS locator (SPEC §16) and whose PROXY
# header is believed (SPEC §21) by default.
PRIVATE_NETWORKS: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in ("127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")
)
DNS_ALLOW_DEFAULT = PRIVATE_NETWORKS
PROXY_FROM_DEFAULT = PRIVATE_NETWORKS


@dataclass(frozen=True, slots=True)
class DnsRateLimitConfig:
    """`global.locator.dns.rate_limit`: response rate limiting per source prefix (BIND RRL)."""

    responses_per_second: int = 100  # per /24 (IPv4) or /56 (IPv6); 0 = no limit
    slip: int = 2  # every slip-th query over the limit is answered empty with TC=1; 0 = never


@dataclass(frozen=True, slots=True)
class DnsLocatorConfig:
    """`global.locator.dns`: the DNS face of the locator (SPEC §10, §16)."""

    listen: Address = Address("127.0.0.1", 5353)  # UDP and TCP
    zone: str = "lb.internal."  # absolute, lower case, ending in a dot
    ttl: int = 0  # of every answer; 0 = ask again each time
    allow: tuple[IPNetwork, ...] = DNS_ALLOW_DEFAULT  # other sources: REFUSED, no pick
    rate_limit: DnsRateLimitConfig = DnsRateLimitConfig()
    tcp_clients_per_source: int = 16  # concurrent TCP clients of one /24 (IPv6: /56)
    tcp_idle_timeout: float = 10.0  # to read a message, and to wait for the next one
    tcp_lifetime: float = 60.0  # a TCP client is closed this long after it connected


@dataclass(frozen=True, slots=True)
class LocatorConfig:
    dns: DnsLocatorConfig | None = None  # None: no DNS locator


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """`global.cluster.redis`: the Redis (or Valkey) server the instances share (SPEC §18)."""

    url: str  # redis://HOST:PORT/DB | rediss://HOST:PORT/DB | unix:///PATH (no password)
    password_file: str | None = None  # the password (AUTH), read at start; none: no AUTH
    key_prefix: str = "lbproxy"  # every key and channel starts with "PREFIX:"
    name: str | None = None  # this instance's member name; None: the host name


MAX_CLUSTER_STATE_FIELDS = 10_000  # fields of the cluster's state hash a resync reads
MIN_CLUSTER_KEY = 32  # bytes of global.cluster.key_file's key, at least


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    redis: RedisConfig | None = None  # None: no cluster, every instance on its own
    key_file: str | None = None  # the file of the key every message is signed with
    # The key itself, read from key_file with the configuration (config/secret_files.py).
    key: bytes = field(default=b"", repr=False)
    max_entries: int = 200_000  # persistence entries a resync reads, at most


@dataclass(frozen=True, slots=True)
class GlobalConfig:
    admin: AdminConfig = AdminConfig()
    locator: LocatorConfig = LocatorConfig()
    cluster: ClusterConfig = ClusterConfig()
    log_format: str = "text"  # text | json
    drain_timeout: float = 30.0
    access_log: bool = False  # one INFO line per connection on logger lbproxy.access
    workers: int = 1  # `auto` is resolved to os.cpu_count() by the loader
    state_file: str | None = None  # runtime state kept across restarts (SPEC §17)
    # Clients served at once by this process; None: derived from RLIMIT_NOFILE so that a
    # reserve of descriptors stays free (SPEC §21, lbproxy/net/descriptors.py).
    max_clients: int | None = None
    # The account to run as once bound (SPEC §21): a name or an id as written; None: stay
    user: str | None = None
    group: str | None = None  # None: the user's own group


# The record types a `dns` health check may ask for (SPEC §19).
DNS_QUERY_TYPES = ("A", "AAAA", "CNAME", "MX", "NS", "PTR", "SOA", "SRV", "TXT")


# The check types that talk a protocol after the connect (lbproxy/wire/health).
PROTOCOL_CHECKS = ("pgsql", "mysql", "redis", "smtp")
# Keys of one or a few check types only: another type refuses them (config/reader.py).
CHECK_TYPE_KEYS: dict[str, tuple[str, ...]] = {
    "user": ("pgsql", "mysql"),
    "database": ("pgsql",),
    "password_file": ("redis",),
    "role": ("redis",),
    "helo": ("smtp",),
    "send_hex": ("send_expect",),
    "expect_hex": ("send_expect",),
}
PGSQL_DEFAULT_USER = "lbproxy"


@dataclass(frozen=True, slots=True)
class HealthCheckConfig:
    # tcp | send_expect | http | tls | udp | dns | pgsql | mysql | redis | smtp | none
    type: str = "tcp"
    interval: float = 2.0
    timeout: float = 1.0
    rise: int = 2
    fall: int = 3
    send: str | None = None  # send_expect
    expect: str | None = None  # send_expect: regular expression
    path: str = "/"  # http
    expect_status: tuple[int, ...] = (200,)  # http
    on_down: str = "keep"  # keep | close: what happens to established connections
    on_up: str = "keep"  # keep | close_backups: a primary back up closes the backups' connections
    query: str | None = None  # dns: the name asked for
    query_type: str = "A"  # dns: one of DNS_QUERY_TYPES
    # TLS and HTTPS checks (SPEC §22; config/tls_check_keys.py says which type takes which)
    tls: bool = False  # http: over TLS
    sni: str | None = None  # tls, https: the server name sent; None: none (an IP) or the host
    alpn: tuple[str, ...] = ()  # tls: the protocols offered; one must be agreed
    verify: str | None = None  # tls, https: a CA file; None: any certificate is accepted
    method: str = "GET"  # http
    host: str | None = None  # http: the Host header; None: the address
    expect_body: str | None = None  # http: regular expression searched in the body's 4 KiB
    # Where the checks go, and the protocol checks' keys (CHECK_TYPE_KEYS)
    port: int | None = None  # None: the real server's own port
    address: str | None = None  # a host name or IP; None: the real server's own host
    send_hex: bytes | None = None  # send_expect: binary bytes to send (instead of `send`)
    expect_hex: bytes | None = None  # send_expect: bytes to find (instead of `expect`)
    user: str | None = None  # pgsql (None: PGSQL_DEFAULT_USER), mysql (None: no login)
    database: str | None = None  # pgsql; None: the user's name
    password_file: str | None = None  # redis: AUTH with this file's content
    role: str | None = None  # redis: master | replica; None: PING only
    helo: str | None = None  # smtp: the EHLO name; None: this host's name
    # PROXY header first on each check connection (control/checks.py `check_proxy_header`):
    # None: as the data path, when the check goes to the server's own address and port
    send_proxy: bool | None = None


@dataclass(frozen=True, slots=True)
class AgentCheckConfig:
    """`agent_check` (SPEC §22): HAProxy's agent-check, beside the health check. On a
    real server, the virtual server's block with the real server's `port` and
    `address` on top."""

    port: int | None = None  # required once the blocks are merged
    address: str | None = None  # None: the real server's own host
    interval: float = 2.0
    timeout: float = 1.0
    send: str = ""  # sent after the connect (escapes as health_check.send); "": nothing


@dataclass(frozen=True, slots=True)
class RealServerCheckConfig:
    """A real server's own `health_check: {port, address, send_proxy}`: where its checks
    go, and whether they begin with a PROXY header (over the virtual server's)."""

    port: int | None = None
    address: str | None = None
    send_proxy: bool | None = None


@dataclass(frozen=True, slots=True)
class SnmpConfig:
    oid: str = "1.3.6.1.4.1.2021.10.1.5.1"
    version: str = "2c"  # "2c" | "3"
    community: str = "public"
    user: str | None = None
    auth_protocol: str = "SHA"  # SHA | SHA256 | MD5
    auth_key_file: str | None = None
    priv_protocol: str = "AES"  # AES | AES256 | DES
    priv_key_file: str | None = None
    host: str | None = None  # None: the real server's own address host
    port: int = 161
    interval: float = 5.0
    timeout: float = 1.0
    retries: int = 1
    on_no_answer: str = "zero"  # zero | hold | static
    stale_after: float | None = None  # None: 3 x interval
    smoothing: float = 1.0  # 0 < a <= 1
    max_value: int = 100


@dataclass(frozen=True, slots=True)
class ThrottleConfig:
    max_connections: int | None = None
    max_rate: float | None = None
    digg_factor: float = 2.0
    high_idle_timeout: float = 49.0
    min_idle_timeout: float = 1.0
    interval: float = 1.0


# The largest static weight, in the file and at run time (PATCH, `set-weight`): ipvsadm's
# bound ("the valid values of weight are 0 through to 65535"), and a DNS SRV weight's.
MAX_WEIGHT = 65535


@dataclass(frozen=True, slots=True)
class PersistenceConfig:
    timeout: float = 300.0  # an entry expires this long after its last connection ended
    max_entries: int = 100000  # least recently used entries beyond this are evicted


@dataclass(frozen=True, slots=True)
class QueueConfig:
    max: int = 1000  # waiting clients; one more is refused (queue_full)
    timeout: float = 5.0  # seconds a client may wait for a free slot (queue_timeout)
    abort_on_close: bool = False  # a client that sent its FIN is dropped at its turn too


@dataclass(frozen=True, slots=True)
class OutlierDetectionConfig:
    consecutive_failures: int = 5  # connect failures in a row that eject a server
    base_ejection_time: float = 30.0  # seconds; times the ejections in a row
    max_ejection_time: float = 300.0  # seconds; an ejection never lasts longer
    max_ejection_percent: int = 50  # of the non-backup servers (rounded down) at once


@dataclass(frozen=True, slots=True)
class PerSourceConfig:
    """`per_source:` of a TCP virtual server (SPEC §23): limits per client network."""

    max_connections: int | None = None  # open connections per network; None: no limit
    rate: int | None = None  # accepted connections per network within `interval`
    interval: float = 1.0  # the sliding window `rate` counts over
    prefix_v4: int = 32
    prefix_v6: int = 64
    max_tracked: int = 100_000  # networks remembered (least recently seen idle go first)
    shared: bool = False  # add the cluster's other instances' counts (needs global.cluster)


@dataclass(frozen=True, slots=True)
class ConditioningConfig:
    """`conditioning:` of a virtual server: Geode's load conditioning (SPEC §11)."""

    interval: float = 300.0  # Geode's load-conditioning-interval default, 5 minutes
    idle_for: float = 30.0  # only connections idle this long are candidates
    max_per_interval: int = 10  # at most this many closed per interval
    threshold: float = 10.0  # Geode's locator-load-imbalance-threshold


# Geode's default imbalance threshold, for `?current=` on a virtual server that has no
# `conditioning:` block (LocatorLoadSnapshot.DEFAULT_LOAD_IMBALANCE_THRESHOLD).
DEFAULT_IMBALANCE_THRESHOLD = 10.0


@dataclass(frozen=True, slots=True)
class SourcePrefixConfig:
    """`udp.source_prefix`: the prefix lengths `max_sessions_per_source` counts by."""

    v4: int = 32
    v6: int = 64


@dataclass(frozen=True, slots=True)
class UdpConfig:
    """`udp:` of a virtual server with `protocol: udp` (SPEC §19): its session table."""

    idle_timeout: float = 30.0  # a session without datagrams this long ends
    responses: int | None = None  # replies per request; 0: none expected; None: unlimited
    max_sessions: int = 10000  # the table's size; a new client beyond it is dropped
    max_sessions_per_source: int = 100  # sessions one source prefix may hold
    source_prefix: SourcePrefixConfig = SourcePrefixConfig()


@dataclass(frozen=True, slots=True)
class RealServerConfig:
    name: str
    address: Address
    weight: int = 1
    max_connections: int = 0  # 0 = unlimited
    load_factor: float = 1.0
    state: str = "enabled"  # enabled | drain | disabled
    backup: bool = False  # takes connections only while no primary is online (SPEC §13)
    snmp: SnmpConfig | None = None  # the VS block merged with this server's overrides
    health_check: RealServerCheckConfig | None = None  # None: checked where it is served
    line: int = field(default=0, compare=False)  # where, not what: moving lines is no change
    discovered: bool = False  # made from a DNS answer (discovery.dns), not read from a file
    agent_check: AgentCheckConfig | None = None  # merged with the virtual server's; None: none


@dataclass(frozen=True, slots=True)
class DnsDiscoveryConfig:
    """`discovery.dns` of a virtual server (SPEC §14): real servers from SRV/A/AAAA."""

    name: str  # resolved as an absolute name: no search domains
    type: str = "SRV"  # SRV | A | AAAA
    port: int | None = None  # A/AAAA only (required there); SRV records carry their port
    resolvers: tuple[Address, ...] = ()  # empty: the system's (/etc/resolv.conf)
    interval: float = 10.0  # re-resolve period; the answers' TTL is not used
    hold: float = 30.0  # empty answers or NXDOMAIN this long before servers go
    timeout: float = 2.0  # bound of one round, so a silent resolver stalls nothing
    max_servers: int = 1000  # beyond it: lowest priority, highest weight, then name
    # loopback, link-local, unspecified and multicast answers used only inside these
    allow_addresses: tuple[IPNetwork, ...] = ()
    line: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class VirtualServerConfig:
    name: str
    listen: tuple[Address, ...]
    real_servers: tuple[RealServerConfig, ...]
    scheduler: str = DEFAULT_SCHEDULER
    quiesce: bool = False
    load_source: str = "connections"  # connections | snmp | report
    load_poll_interval: float = 5.0
    slow_start: float = 0.0
    connect_timeout: float = 3.0
    idle_timeout: float = 300.0
    retries: int = 2
    max_connections: int = 0  # 0 = unlimited
    allow: tuple[IPNetwork, ...] = (
        ipaddress.ip_network("0.0.0.0/0"),
        ipaddress.ip_network("::/0"),
    )
    deny: tuple[IPNetwork, ...] = ()
    send_proxy: str = "none"  # none | v1 | v2
    accept_proxy: bool = False
    # Peers whose PROXY header is believed (SPEC §21); another is closed unread.
    accept_proxy_from: tuple[IPNetwork, ...] = PROXY_FROM_DEFAULT
    health_check: HealthCheckConfig = HealthCheckConfig()
    snmp: SnmpConfig | None = None  # None: no `snmp:` block
    throttle: ThrottleConfig | None = None  # None: no admission control
    # The scheduler's own options (its `Options` dataclass, lbproxy/core/schedulers), read
    # from keys beside these; None: it has none, or its defaults.
    options: Any = None
    persistence: PersistenceConfig | None = None  # None: no client persistence
    discovery: DnsDiscoveryConfig | None = None  # None: only the static real_servers
    queue: QueueConfig | None = None  # None: a full pool refuses (max_connections)
    per_source: PerSourceConfig | None = None  # None: no limit per client network
    # TLS server names routed here from a shared listen address (lower case); (): the
    # default of its addresses, or a virtual server alone on them
    sni: tuple[str, ...] = ()
    # TLS ALPN protocol names routed here (exact, case-sensitive; tried before the same
    # `sni` without `alpn`); (): any protocol, or none offered
    alpn: tuple[str, ...] = ()
    conditioning: ConditioningConfig | None = None  # None: connections are never moved
    outlier_detection: OutlierDetectionConfig | None = None  # None: no server is ejected
    panic_threshold: int = 0  # percent of enabled primaries available; 0: never panic
    max_connection_duration: float | None = None  # None: a connection lasts as it will
    max_connection_duration_jitter: float = 0.0  # percent, 0..50
    protocol: str = "tcp"  # tcp | udp (SPEC §19)
    udp: UdpConfig = UdpConfig()  # read only with protocol: udp
    agent_check: AgentCheckConfig | None = None  # None: no agent check (SPEC §22)
    file: str = field(default="", compare=False)
    line: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class Config:
    global_: GlobalConfig = GlobalConfig()
    virtual_servers: tuple[VirtualServerConfig, ...] = ()
    files: tuple[str, ...] = field(default=())
    # Every file the configuration names that holds a secret (token, password, keys), to
    # be read before the privileges are dropped (config/secret_files.py)
    secret_files: tuple[str, ...] = field(default=(), compare=False)
