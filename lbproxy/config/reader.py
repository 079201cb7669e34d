"""Reading YAML files into the model: lines kept, every problem reported at once.

PURE. `load(paths)` reads every file, keeps the line of every node (PyYAML's composed
nodes carry `start_mark`), checks across files (duplicate names, port clashes, a single
`global:`) and raises a `ConfigError` listing every `Problem(file, line, message)`.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from lbproxy.config.accounts import AccountError, run_as
from lbproxy.config.model import (
    CHECK_TYPE_KEYS,
    MIN_CLUSTER_KEY,
    PROTOCOL_CHECKS,
    PROXY_FROM_DEFAULT,
    Address,
    AdminConfig,
    AgentCheckConfig,
    ClusterConfig,
    ConditioningConfig,
    Config,
    ConfigError,
    DnsDiscoveryConfig,
    DnsLocatorConfig,
    DnsRateLimitConfig,
    GlobalConfig,
    HealthCheckConfig,
    LocatorConfig,
    OutlierDetectionConfig,
    PersistenceConfig,
    PerSourceConfig,
    Problem,
    QueueConfig,
    RealServerCheckConfig,
    RealServerConfig,
    RedisConfig,
    SnmpConfig,
    SourcePrefixConfig,
    ThrottleConfig,
    UdpConfig,
    VirtualServerConfig,
)
from lbproxy.config.secret_files import SECRETS, secret_file_problem
from lbproxy.config.tables import (
    ADMIN_FIELDS,
    AGENT_CHECK_FIELDS,
    CLUSTER_FIELDS,
    CLUSTER_SECTIONS,
    CONDITIONING_FIELDS,
    DISCOVERY_SECTIONS,
    DNS_DISCOVERY_FIELDS,
    DNS_LOCATOR_FIELDS,
    DNS_LOCATOR_SECTIONS,
    DNS_RATE_LIMIT_FIELDS,
    GLOBAL_FIELDS,
    GLOBAL_SECTIONS,
    HEALTH_CHECK_FIELDS,
    LOCATOR_SECTIONS,
    OUTLIER_DETECTION_FIELDS,
    PER_SOURCE_FIELDS,
    PERSISTENCE_FIELDS,
    QUEUE_FIELDS,
    REAL_SERVER_AGENT_CHECK_FIELDS,
    REAL_SERVER_CHECK_FIELDS,
    REAL_SERVER_FIELDS,
    REAL_SERVER_SECTIONS,
    REDIS_FIELDS,
    SCHEDULER_OPTION_KEYS,
    SNMP_FIELDS,
    SOURCE_PREFIX_FIELDS,
    TCP_ONLY_KEYS,
    THROTTLE_FIELDS,
    TOP_LEVEL_SECTIONS,
    UDP_FIELDS,
    UDP_SECTIONS,
    VIRTUAL_SERVER_FIELDS,
    VIRTUAL_SERVER_SECTIONS,
)
from lbproxy.config.tls_check_keys import misplaced_keys
from lbproxy.config.values import Converter, Invalid, did_you_mean, shown
from lbproxy.core import schedulers

# --------------------------------------------------------------------------------------
# Reading one file: mappings with lines, unknown and duplicate keys
# --------------------------------------------------------------------------------------


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


_STRING_TAG = "tag:yaml.org,2002:str"
_NULL_TAG = "tag:yaml.org,2002:null"


def _is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == _NULL_TAG


@dataclass
class _Section:
    """One YAML mapping, read: the valid values and where every key was."""

    line: int  # of the key that introduced the mapping, else of the mapping itself
    values: dict[str, Any] = field(default_factory=dict)  # converted, valid values only
    nodes: dict[str, yaml.Node] = field(default_factory=dict)  # every known key's value
    key_lines: dict[str, int] = field(default_factory=dict)  # every key present

    def line_of(self, key: str) -> int:
        return self.key_lines.get(key, self.line)


@dataclass(frozen=True)
class _SecretRead:
    """A file that holds a secret, named at `file:line` by key `label`."""

    file: str
    line: int
    label: str
    path: str


class _Document:
    """One configuration file: composes it and reports problems against it."""

    def __init__(
        self, file: str, problems: list[Problem], secrets: list[_SecretRead] | None = None
    ):
        self.file = file
        self.problems = problems
        self.secrets = secrets if secrets is not None else []  # checked once `user` is known

    def error(self, line: int, message: str) -> None:
        self.problems.append(Problem(self.file, line, message))

    def compose(self) -> yaml.Node | None:
        """The root node, or None for an empty or unreadable file (reported)."""
        try:
            with open(self.file, encoding="utf-8") as stream:
                return yaml.compose(stream, Loader=yaml.SafeLoader)
        except OSError as exc:
            self.error(1, f"cannot read: {exc.strerror or exc}")
        except UnicodeDecodeError as exc:
            self.error(1, f"cannot read: not UTF-8 text ({exc.reason})")
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            context = f" ({exc.context})" if exc.context else ""
            self.error(mark.line + 1 if mark else 1, f"YAML syntax error: {exc.problem}{context}")
        except yaml.YAMLError as exc:  # e.g. a control character: no mark, only a position
            self.error(1, f"YAML error: {exc}")
        return None

    def section(
        self,
        node: yaml.Node,
        where: str,
        fields: Mapping[str, Converter],
        nested: Collection[str] = (),
        *,
        prefix: str = "",
        line: int | None = None,
    ) -> _Section | None:
        """Read a mapping: convert `fields`, keep `nested` sections' nodes for the caller.

        `where` names the mapping in messages ("virtual server web"); `prefix` qualifies
        its keys in messages ("health_check."). An empty value counts as an empty mapping,
        so `health_check:` with nothing under it means "all defaults". Returns None (and
        reports) when the node is not a mapping.
        """
        section = _Section(line if line is not None else _line(node))
        if _is_null(node):
            return section
        if not isinstance(node, yaml.MappingNode):
            self.error(_line(node), f"{where} must be a mapping, got {shown(node)}")
            return None
        known = [*fields, *nested]
        for key_node, value_node in node.value:
            key = self._key(key_node, section, where, known)
            if key is None:
                continue
            section.nodes[key] = value_node
            if key in fields:
                try:
                    section.values[key] = value = fields[key](value_node, prefix + key)
                except Invalid as exc:
                    self.error(_line(exc.node or value_node), exc.message)
                    continue
                if fields[key].secret:
                    read = _SecretRead(self.file, _line(value_node), prefix + key, value)
                    self.secrets.append(read)
        return section

    def _key(
        self, key_node: yaml.Node, section: _Section, where: str, known: Collection[str]
    ) -> str | None:
        """The key as a known, first-seen string; anything else is reported, giving None."""
        line = _line(key_node)
        # Only plain strings: YAML would read `yes:` as True and `1:` as an int.
        is_string = isinstance(key_node, yaml.ScalarNode) and key_node.tag == _STRING_TAG
        key: str | None = key_node.value if is_string else None
        if key is None:
            self.error(line, f"keys must be strings, got {shown(key_node)} in {where}")
            return None
        if key in section.key_lines:
            first = section.key_lines[key]
            self.error(line, f"duplicate key {key!r} in {where} (first at line {first})")
            return None
        section.key_lines[key] = line
        if key not in known:
            hint = did_you_mean(key, known)
            self.error(line, f"unknown key {key!r} in {where}" + (f" ({hint})" if hint else ""))
            return None
        return key

    def require(self, section: _Section, where: str, *keys: str) -> None:
        for key in keys:
            if key not in section.key_lines:
                self.error(section.line, f"{where} needs {key!r}")


def _peek_name(node: yaml.Node) -> str | None:
    """The `name:` of a mapping before it is read, to say where its problems are."""
    if not isinstance(node, yaml.MappingNode):
        return None
    for key_node, value_node in node.value:
        if key_node.value == "name" and isinstance(value_node, yaml.ScalarNode):
            return value_node.value or None
    return None


# --------------------------------------------------------------------------------------
# Sections -> dataclasses
# --------------------------------------------------------------------------------------


@dataclass
class _GlobalRead:
    config: GlobalConfig
    file: str
    line: int  # of the `global:` key
    admin_line: int | None  # of `admin.listen`; None when it is the default
    dns_line: int = 0  # of `locator.dns.listen` (or of `dns:`)


@dataclass
class _VirtualServerRead:
    """What the checks across files need, known even when the virtual server is invalid."""

    file: str
    line: int
    name: str | None
    name_line: int
    listen: list[tuple[Address, int]]  # each address with its own line
    config: VirtualServerConfig | None  # None when a problem prevented building it
    sni: list[tuple[str, int]] = field(default_factory=list)  # each name with its line
    alpn: list[tuple[str, int]] = field(default_factory=list)  # each protocol with its line
    accept_proxy: tuple[bool, int] = (False, 0)  # and the line of the key, 0: default
    accept_proxy_from: tuple[Any, int] = ((), 0)  # the networks, and the key's line
    protocol: str = "tcp"  # a TCP and a UDP listener on one address do not clash
    shared_line: int = 0  # of `per_source.shared: true`, which needs global.cluster; 0: none


def _nested(
    doc: _Document,
    parent: _Section,
    key: str,
    where: str,
    fields: Mapping[str, Converter],
    nested: Collection[str] = (),
    *,
    prefix: str = "",
) -> _Section | None:
    """The section under `parent[key]`; None when it is absent or not a mapping."""
    node = parent.nodes.get(key)
    if node is None:
        return None
    return doc.section(node, where, fields, nested, prefix=prefix, line=parent.line_of(key))


def _read_file(
    doc: _Document, root: yaml.Node
) -> tuple[_GlobalRead | None, list[_VirtualServerRead]]:
    top = doc.section(root, "the top level", {}, TOP_LEVEL_SECTIONS)
    if top is None:
        return None, []
    global_read = _read_global(doc, top) if "global" in top.nodes else None
    return global_read, _read_virtual_servers(doc, top)


def _read_global(doc: _Document, top: _Section) -> _GlobalRead:
    line = top.line_of("global")
    section = _nested(doc, top, "global", "global", GLOBAL_FIELDS, GLOBAL_SECTIONS)
    section = section or _Section(line)
    admin = _nested(doc, section, "admin", "global.admin", ADMIN_FIELDS, prefix="admin.")
    admin = admin or _Section(line)
    if admin.values.get("read_token") and not admin.values.get("token_file"):
        doc.error(
            admin.key_lines["read_token"],
            "global.admin.read_token needs global.admin.token_file (the token reads ask for)",
        )
    locator, dns_line = _read_locator(doc, section)
    _check_account(doc, section)
    config = GlobalConfig(
        admin=AdminConfig(**admin.values),
        locator=locator,
        cluster=_read_cluster(doc, section),
        **section.values,
    )
    read = _GlobalRead(config, doc.file, line, admin.key_lines.get("listen"))
    read.dns_line = dns_line
    return read


def _check_account(doc: _Document, section: _Section) -> None:
    """`global.user` and `global.group` together name an account (accounts.py)."""
    if "group" in section.key_lines and "user" not in section.key_lines:
        doc.error(section.line_of("group"), "global.group needs global.user")
    user = section.values.get("user")
    if user is not None and "group" not in section.key_lines:
        try:
            run_as(user, None)
        except AccountError as exc:
            doc.error(section.line_of("user"), f"global.user: {exc}")


def _check_secret_files(
    secrets: list[_SecretRead], global_: GlobalConfig, problems: list[Problem]
) -> tuple[str, ...]:
    """The rule of secret_files.py for every secret file named; the files, once each.

    The owners a secret file may have: root, the user this process runs as now (it reads
    the file at start) and `global.user` (it reads it again after the drop)."""
    owners, groups = {0, os.geteuid()}, {os.getegid()}
    try:
        account = run_as(global_.user, global_.group)
    except AccountError:  # reported where `user` is
        account = None
    if account is not None:
        owners.add(account.uid)
        groups.add(account.gid)
    for read in secrets:
        problem = secret_file_problem(read.path, read.label, owners, groups)
        if problem is not None:
            problems.append(Problem(read.file, read.line, problem))
    return tuple(dict.fromkeys(read.path for read in secrets))


def _read_locator(doc: _Document, section: _Section) -> tuple[LocatorConfig, int]:
    """`global.locator`, and the line of its DNS listen address (for port clashes)."""
    locator = _nested(
        doc, section, "locator", "global.locator", {}, LOCATOR_SECTIONS, prefix="locator."
    )
    if locator is None:
        return LocatorConfig(), 0
    dns = _nested(
        doc,
        locator,
        "dns",
        "global.locator.dns",
        DNS_LOCATOR_FIELDS,
        DNS_LOCATOR_SECTIONS,
        prefix="locator.dns.",
    )
    if dns is None:
        return LocatorConfig(), 0
    rate_limit = _nested(
        doc,
        dns,
        "rate_limit",
        "global.locator.dns.rate_limit",
        DNS_RATE_LIMIT_FIELDS,
        prefix="locator.dns.rate_limit.",
    )
    values = dict(dns.values)
    if rate_limit is not None:
        values["rate_limit"] = DnsRateLimitConfig(**rate_limit.values)
    return LocatorConfig(DnsLocatorConfig(**values)), dns.line_of("listen")


def _read_cluster(doc: _Document, section: _Section) -> ClusterConfig:
    """`global.cluster` (SPEC §18): today one backend, `redis`."""
    cluster = _nested(
        doc,
        section,
        "cluster",
        "global.cluster",
        CLUSTER_FIELDS,
        CLUSTER_SECTIONS,
        prefix="cluster.",
    )
    if cluster is None:
        return ClusterConfig()
    doc.require(cluster, "global.cluster", "key_file")
    key = _read_cluster_key(doc, cluster)
    redis = _nested(
        doc, cluster, "redis", "global.cluster.redis", REDIS_FIELDS, prefix="cluster.redis."
    )
    if redis is None:
        if "redis" not in cluster.key_lines:
            doc.error(cluster.line, "global.cluster needs 'redis'")
        return ClusterConfig()
    doc.require(redis, "global.cluster.redis", "url")
    if "url" not in redis.values or key is None:
        return ClusterConfig()
    return ClusterConfig(RedisConfig(**redis.values), key=key, **cluster.values)


def _read_cluster_key(doc: _Document, cluster: _Section) -> bytes | None:
    """The key in `global.cluster.key_file`, or None (reported) when it cannot be used."""
    path = cluster.values.get("key_file")
    if path is None:
        return None
    line = cluster.line_of("key_file")
    try:
        key = SECRETS.read(path).rstrip().encode()
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        doc.error(line, f"cannot read global.cluster.key_file {path}: {reason}")
        return None
    if len(key) < MIN_CLUSTER_KEY:
        doc.error(
            line,
            f"global.cluster.key_file {path} holds {len(key)} bytes; a key has at least "
            f"{MIN_CLUSTER_KEY} (make one with `openssl rand -hex 32 > {path}`)",
        )
        return None
    return key


def _read_virtual_servers(doc: _Document, top: _Section) -> list[_VirtualServerRead]:
    node = top.nodes.get("virtual_servers")
    if node is None or _is_null(node):
        return []
    if not isinstance(node, yaml.SequenceNode):
        doc.error(_line(node), f"virtual_servers must be a list, got {shown(node)}")
        return []
    reads = (_read_virtual_server(doc, item) for item in node.value)
    return [read for read in reads if read is not None]


def _read_virtual_server(doc: _Document, node: yaml.Node) -> _VirtualServerRead | None:
    name = _peek_name(node)
    where = f"virtual server {name}" if name else "virtual server"
    vs = doc.section(node, where, VIRTUAL_SERVER_FIELDS, VIRTUAL_SERVER_SECTIONS)
    if vs is None:
        return None
    # With discovery, the static real servers may be empty or left out (SPEC §14).
    discovers = "discovery" in vs.nodes
    doc.require(vs, where, "name", "listen", *(() if discovers else ("real_servers",)))
    health_check = _read_health_check(doc, vs, where)
    snmp = _nested(doc, vs, "snmp", f"snmp of {where}", SNMP_FIELDS, prefix="snmp.")
    throttle = _read_throttle(doc, vs, where)
    persistence = _read_persistence(doc, vs, where)
    discovery = _read_discovery(doc, vs, where)
    queue = _nested(doc, vs, "queue", f"queue of {where}", QUEUE_FIELDS, prefix="queue.")
    per_source, shared_line = _read_per_source(doc, vs, where)
    conditioning = _read_conditioning(doc, vs, where)
    outlier_detection = _read_outlier_detection(doc, vs, where)
    udp = _read_udp(doc, vs, where)
    if udp is not None and "type" not in _health_keys(vs):
        # A TCP connect says nothing of a UDP service: passive health only by default.
        health_check = replace(health_check, type="none")
    agent = _nested(
        doc, vs, "agent_check", f"agent_check of {where}", AGENT_CHECK_FIELDS, prefix="agent_check."
    )
    real_servers = _read_real_servers(doc, vs, snmp, allow_empty=discovers, vs_agent=agent)
    if agent is not None and discovers and "port" not in agent.key_lines:
        doc.error(agent.line, "agent_check needs 'port' (discovered servers have no agent_check)")

    config = None
    if "name" in vs.values and "listen" in vs.values and (real_servers or discovery):
        values = dict(vs.values)
        options = {key: values.pop(key) for key in SCHEDULER_OPTION_KEYS if key in values}
        config = VirtualServerConfig(
            **values,
            options=_scheduler_options(values.get("scheduler"), options),
            real_servers=tuple(real_servers),
            health_check=health_check,
            snmp=_snmp_config(snmp.values, default_host=None) if snmp else None,
            throttle=throttle,
            persistence=persistence,
            discovery=discovery,
            queue=QueueConfig(**queue.values) if queue is not None else None,
            per_source=per_source,
            conditioning=conditioning,
            outlier_detection=outlier_detection,
            udp=udp or UdpConfig(),
            agent_check=AgentCheckConfig(**agent.values) if agent is not None else None,
            file=doc.file,
            line=vs.line,
        )
        _check_scheduler_needs(doc, vs, config)
        _check_conditioning(doc, vs, config)
    if "max_connection_duration_jitter" in vs.key_lines and (
        vs.values.get("max_connection_duration") is None
    ):
        doc.error(
            vs.line_of("max_connection_duration_jitter"),
            "max_connection_duration_jitter needs max_connection_duration",
        )
    listen = list(
        zip(vs.values.get("listen", ()), _item_lines(vs.nodes.get("listen")), strict=False)
    )
    sni = list(zip(vs.values.get("sni", ()), _item_lines(vs.nodes.get("sni")), strict=False))
    seen: dict[str, int] = {}
    for name, line in sni:
        if name in seen:
            doc.error(line, f"duplicate sni name {name!r} (first at line {seen[name]})")
        seen.setdefault(name, line)
    alpn = list(zip(vs.values.get("alpn", ()), _item_lines(vs.nodes.get("alpn")), strict=False))
    seen.clear()
    for protocol, line in alpn:
        if protocol in seen:
            doc.error(
                line, f"duplicate alpn protocol {protocol!r} (first at line {seen[protocol]})"
            )
        seen.setdefault(protocol, line)
    accept_proxy = (vs.values.get("accept_proxy", False), vs.key_lines.get("accept_proxy", 0))
    accept_proxy_from = (
        vs.values.get("accept_proxy_from", PROXY_FROM_DEFAULT),
        vs.key_lines.get("accept_proxy_from", 0),
    )
    if accept_proxy_from[1] and not accept_proxy[0]:
        doc.error(accept_proxy_from[1], "accept_proxy_from needs accept_proxy: true")
    protocol = vs.values.get("protocol", "tcp")
    return _VirtualServerRead(
        doc.file,
        vs.line,
        vs.values.get("name"),
        vs.line_of("name"),
        listen,
        config,
        sni=sni,
        alpn=alpn,
        accept_proxy=accept_proxy,
        accept_proxy_from=accept_proxy_from,
        protocol=protocol,
        shared_line=shared_line,
    )


def _health_keys(vs: _Section) -> set[str]:
    """The keys written under `health_check:` (none when it is not a mapping)."""
    node = vs.nodes.get("health_check")
    if not isinstance(node, yaml.MappingNode):
        return set()
    return {key.value for key, _ in node.value if isinstance(key, yaml.ScalarNode)}


# Health check types that speak TCP: meaningless against a UDP service.
_TCP_CHECKS = ("tcp", "send_expect", "http", "tls", *PROTOCOL_CHECKS)
# And those that speak UDP (lbproxy/control/checks.py sends them as datagrams).
_UDP_CHECKS = ("udp", "dns")


def _read_udp(doc: _Document, vs: _Section, where: str) -> UdpConfig | None:
    """`udp:` and the keys a UDP virtual server refuses; None for a TCP one (SPEC §19)."""
    udp = _nested(doc, vs, "udp", f"udp of {where}", UDP_FIELDS, UDP_SECTIONS, prefix="udp.")
    source_prefix = None
    if udp is not None:
        source_prefix = _nested(
            doc,
            udp,
            "source_prefix",
            f"udp.source_prefix of {where}",
            SOURCE_PREFIX_FIELDS,
            prefix="udp.source_prefix.",
        )
    if vs.values.get("protocol", "tcp") != "udp":
        if udp is not None:
            doc.error(vs.line_of("udp"), "udp: needs protocol: udp on the virtual server")
        return None
    for key in TCP_ONLY_KEYS:
        if key in vs.key_lines:
            doc.error(vs.line_of(key), f"{key} is for TCP; a UDP virtual server refuses it")
    check = vs.nodes.get("health_check")
    if check is not None and "type" in _health_keys(vs):
        for key, value in check.value:
            if key.value == "type" and getattr(value, "value", None) in _TCP_CHECKS:
                doc.error(
                    _line(value),
                    f"health_check type {value.value} is for TCP; a UDP virtual server "
                    "takes udp, dns or none (passive: ICMP port unreachable)",
                )
    if udp is None:
        return UdpConfig()
    if source_prefix is None:
        return UdpConfig(**udp.values)
    return UdpConfig(**udp.values, source_prefix=SourcePrefixConfig(**source_prefix.values))


def _item_lines(node: yaml.Node | None) -> list[int]:
    """The line of each item of a list, or of a lone value."""
    if node is None:
        return []
    if isinstance(node, yaml.SequenceNode):
        return [_line(item) for item in node.value]
    return [_line(node)]


def _read_health_check(doc: _Document, vs: _Section, where: str) -> HealthCheckConfig:
    section = _nested(
        doc,
        vs,
        "health_check",
        f"health_check of {where}",
        HEALTH_CHECK_FIELDS,
        prefix="health_check.",
    )
    if section is None:
        return HealthCheckConfig()
    check = HealthCheckConfig(**section.values)
    if check.type == "send_expect" and not section.nodes.keys() & {"expect", "expect_hex"}:
        doc.error(
            section.line_of("type"), "health_check type send_expect needs 'expect' or 'expect_hex'"
        )
    for key, types in CHECK_TYPE_KEYS.items():
        if key in section.key_lines and check.type not in types:
            doc.error(
                section.line_of(key),
                f"health_check.{key} is for {' and '.join(types)} checks, not {check.type}",
            )
    for text, binary in (("send", "send_hex"), ("expect", "expect_hex")):
        if text in section.key_lines and binary in section.key_lines:
            doc.error(
                section.line_of(binary),
                f"health_check has both '{text}' and '{binary}': give one",
            )
    if check.type == "dns" and "query" not in section.nodes:
        doc.error(section.line_of("type"), "health_check type dns needs 'query' (a name)")
    for key, message in misplaced_keys(check, section.nodes):
        doc.error(section.line_of(key), message)
    if check.type in _UDP_CHECKS and vs.values.get("protocol", "tcp") != "udp":
        doc.error(
            section.line_of("type"),
            f"health_check type {check.type} is for UDP; it needs protocol: udp",
        )
    return check


def _read_per_source(
    doc: _Document, vs: _Section, where: str
) -> tuple[PerSourceConfig | None, int]:
    """`per_source:` (SPEC §23), and the line of `shared: true` (0: not shared)."""
    section = _nested(
        doc, vs, "per_source", f"per_source of {where}", PER_SOURCE_FIELDS, prefix="per_source."
    )
    if section is None:
        return None, 0
    if not section.nodes.keys() & {"max_connections", "rate"}:
        doc.error(section.line, "per_source needs max_connections or rate (or both)")
    config = PerSourceConfig(**section.values)
    return config, section.line_of("shared") if config.shared else 0


def _check_shared_per_source(
    servers: list[_VirtualServerRead], global_: GlobalConfig, problems: list[Problem]
) -> None:
    """`per_source.shared: true` adds the cluster's counts: there must be a cluster."""
    if global_.cluster.redis is not None:
        return
    for vs in servers:
        if vs.shared_line:
            problems.append(
                Problem(vs.file, vs.shared_line, "per_source.shared needs global.cluster")
            )


def _read_throttle(doc: _Document, vs: _Section, where: str) -> ThrottleConfig | None:
    section = _nested(
        doc, vs, "throttle", f"throttle of {where}", THROTTLE_FIELDS, prefix="throttle."
    )
    if section is None:
        return None
    if not section.nodes.keys() & {"max_connections", "max_rate"}:
        doc.error(section.line, "throttle needs max_connections or max_rate (or both)")
    throttle = ThrottleConfig(**section.values)
    if throttle.min_idle_timeout > throttle.high_idle_timeout:
        key = "min_idle_timeout" if "min_idle_timeout" in section.nodes else "high_idle_timeout"
        doc.error(
            section.line_of(key),
            f"throttle.min_idle_timeout ({throttle.min_idle_timeout:g}s) must not exceed "
            f"throttle.high_idle_timeout ({throttle.high_idle_timeout:g}s)",
        )
    return throttle


def _read_persistence(doc: _Document, vs: _Section, where: str) -> PersistenceConfig | None:
    section = _nested(
        doc,
        vs,
        "persistence",
        f"persistence of {where}",
        PERSISTENCE_FIELDS,
        prefix="persistence.",
    )
    return None if section is None else PersistenceConfig(**section.values)


def _read_conditioning(doc: _Document, vs: _Section, where: str) -> ConditioningConfig | None:
    section = _nested(
        doc,
        vs,
        "conditioning",
        f"conditioning of {where}",
        CONDITIONING_FIELDS,
        prefix="conditioning.",
    )
    return None if section is None else ConditioningConfig(**section.values)


def _read_outlier_detection(
    doc: _Document, vs: _Section, where: str
) -> OutlierDetectionConfig | None:
    section = _nested(
        doc,
        vs,
        "outlier_detection",
        f"outlier_detection of {where}",
        OUTLIER_DETECTION_FIELDS,
        prefix="outlier_detection.",
    )
    if section is None:
        return None
    outlier = OutlierDetectionConfig(**section.values)
    if outlier.base_ejection_time > outlier.max_ejection_time:
        key = "base_ejection_time" if "base_ejection_time" in section.nodes else "max_ejection_time"
        doc.error(
            section.line_of(key),
            f"outlier_detection.base_ejection_time ({outlier.base_ejection_time:g}s) must not "
            f"exceed outlier_detection.max_ejection_time ({outlier.max_ejection_time:g}s)",
        )
    return outlier


def _scheduler_options(name: str | None, values: dict[str, Any]) -> Any:
    """The scheduler's `Options` from its keys (those of another are reported by
    `_check_scheduler_needs`); None for a scheduler without options."""
    algorithm = schedulers.get(name or schedulers.DEFAULT)
    if algorithm.Options is None:
        return None
    return algorithm.Options(**{key: v for key, v in values.items() if key in algorithm.options})


def _check_conditioning(doc: _Document, vs: _Section, config: VirtualServerConfig) -> None:
    """Conditioning moves connections by load: a scheduler without one cannot have it."""
    if config.conditioning is not None and not schedulers.get(config.scheduler).has_load():
        doc.error(
            vs.line_of("conditioning"),
            f"conditioning needs a scheduler with a load ({', '.join(schedulers.with_load())}"
            f"); scheduler {config.scheduler} has none",
        )


def _read_real_servers(
    doc: _Document,
    vs: _Section,
    vs_snmp: _Section | None,
    *,
    allow_empty: bool = False,
    vs_agent: _Section | None = None,
) -> list[RealServerConfig]:
    node = vs.nodes.get("real_servers")
    if node is None or (allow_empty and _is_null(node)):
        return []  # reported by `require`
    if not isinstance(node, yaml.SequenceNode):
        doc.error(vs.line_of("real_servers"), f"real_servers must be a list, got {shown(node)}")
        return []
    if not node.value and not allow_empty:
        doc.error(vs.line_of("real_servers"), "real_servers is empty: a virtual server needs one")
        return []
    servers: list[RealServerConfig] = []
    first_lines: dict[str, int] = {}
    for item in node.value:
        read = _read_real_server(doc, item, vs_snmp, vs_agent)
        if read is None:
            continue
        section, config = read
        name = section.values.get("name")
        if name in first_lines:
            doc.error(
                section.line_of("name"),
                f"duplicate real server name {name!r} (first at line {first_lines[name]})",
            )
        elif name is not None:
            first_lines[name] = section.line_of("name")
        if config is not None:
            servers.append(config)
    return servers


def _read_discovery(doc: _Document, vs: _Section, where: str) -> DnsDiscoveryConfig | None:
    section = _nested(doc, vs, "discovery", f"discovery of {where}", {}, DISCOVERY_SECTIONS)
    if section is None:
        return None
    if "dns" not in section.key_lines:
        doc.error(section.line, "discovery needs 'dns'")
        return None
    dns = _nested(
        doc,
        section,
        "dns",
        f"discovery.dns of {where}",
        DNS_DISCOVERY_FIELDS,
        prefix="discovery.dns.",
    )
    if dns is None:
        return None
    doc.require(dns, "discovery.dns", "name")
    record_type = dns.values.get("type", "SRV")
    if "type" in dns.nodes and "type" not in dns.values:
        return None  # an unknown type: reported; whether a port belongs is unknown too
    if record_type == "SRV" and "port" in dns.nodes:
        doc.error(
            dns.line_of("port"),
            "discovery.dns.port is only for type A or AAAA: SRV records carry their own port",
        )
        return None
    if record_type != "SRV" and "port" not in dns.nodes:
        doc.error(
            dns.line_of("type"),
            f"discovery.dns type {record_type} needs 'port' ({record_type} records carry none)",
        )
        return None
    if "name" not in dns.values or ("port" in dns.nodes and "port" not in dns.values):
        return None  # reported
    return DnsDiscoveryConfig(**dns.values, line=dns.line)


def _read_real_server(
    doc: _Document, node: yaml.Node, vs_snmp: _Section | None, vs_agent: _Section | None = None
) -> tuple[_Section, RealServerConfig | None] | None:
    name = _peek_name(node)
    where = f"real server {name}" if name else "real server"
    rs = doc.section(node, where, REAL_SERVER_FIELDS, REAL_SERVER_SECTIONS)
    if rs is None:
        return None
    doc.require(rs, where, "name", "address")
    rs_snmp = _nested(doc, rs, "snmp", f"snmp of {where}", SNMP_FIELDS, prefix="snmp.")
    agent = _real_server_agent(doc, rs, vs_agent, where)
    rs_check = _nested(
        doc,
        rs,
        "health_check",
        f"health_check of {where}",
        REAL_SERVER_CHECK_FIELDS,
        prefix="health_check.",
    )
    if "name" not in rs.values or "address" not in rs.values:
        return rs, None
    snmp = _real_server_snmp(doc, vs_snmp, rs_snmp, rs.values["address"].host)
    health_check = RealServerCheckConfig(**rs_check.values) if rs_check else None
    return rs, RealServerConfig(
        **rs.values, snmp=snmp, health_check=health_check, agent_check=agent, line=rs.line
    )


def _real_server_agent(
    doc: _Document, rs: _Section, vs_agent: _Section | None, where: str
) -> AgentCheckConfig | None:
    """A real server's own `agent_check` on top of the virtual server's; None when it
    has none (the virtual server's block, if any, applies as it is)."""
    own = _nested(
        doc,
        rs,
        "agent_check",
        f"agent_check of {where}",
        REAL_SERVER_AGENT_CHECK_FIELDS,
        prefix="agent_check.",
    )
    has_port = any(block is not None and "port" in block.key_lines for block in (vs_agent, own))
    if (vs_agent is not None or own is not None) and not has_port:
        line = own.line if own is not None else rs.line
        doc.error(line, f"{where}: agent_check needs 'port' (here or on the virtual server)")
    if own is None:
        return None
    values = dict(vs_agent.values) if vs_agent is not None else {}
    values.update(own.values)
    return AgentCheckConfig(**values)


def _real_server_snmp(
    doc: _Document, vs_snmp: _Section | None, rs_snmp: _Section | None, host: str
) -> SnmpConfig | None:
    """The virtual server's snmp block with the real server's overrides on top."""
    blocks = [block for block in (vs_snmp, rs_snmp) if block is not None]
    if not blocks:
        return None
    values: dict[str, Any] = {}
    for block in blocks:
        values.update(block.values)
    snmp = _snmp_config(values, default_host=host)
    if snmp.version == "3" and snmp.user is None:
        # Report where version 3 was asked for; one virtual-server block shared by many
        # real servers gives the same problem each time, which `load` reports once.
        setter = next(block for block in reversed(blocks) if "version" in block.values)
        doc.error(setter.line_of("version"), "snmp version 3 needs 'user'")
    return snmp


def _snmp_config(values: Mapping[str, Any], *, default_host: str | None) -> SnmpConfig:
    snmp = SnmpConfig(**values)
    stale_after = snmp.stale_after if snmp.stale_after is not None else 3 * snmp.interval
    return replace(snmp, host=snmp.host or default_host, stale_after=stale_after)


def _check_scheduler_needs(doc: _Document, vs: _Section, config: VirtualServerConfig) -> None:
    """What the scheduler needs (its registry entry says), and no option of another."""
    algorithm = schedulers.get(config.scheduler)
    for key in SCHEDULER_OPTION_KEYS:
        if key in vs.key_lines and key not in algorithm.options:
            doc.error(
                vs.line_of(key), f"{key} applies to scheduler {schedulers.option_owner(key)} only"
            )
    # Common keys only some schedulers read (quiesce, slow_start, ...): written with
    # another they would do nothing, which must not pass silently.
    for key, converter in VIRTUAL_SERVER_FIELDS.items():
        if (
            converter.only
            and key not in SCHEDULER_OPTION_KEYS
            and key in vs.key_lines
            and config.scheduler not in converter.only
        ):
            plural = "s" if len(converter.only) > 1 else ""
            doc.error(
                vs.line_of(key),
                f"{key} applies to scheduler{plural} {', '.join(converter.only)} only "
                f"(scheduler {config.scheduler} has no use for it)",
            )
    for where, message in algorithm.problems(config):
        line = vs.line_of(where) if isinstance(where, str) else where.line
        doc.error(line, message)


# --------------------------------------------------------------------------------------
# Checks across files
# --------------------------------------------------------------------------------------


def _at(file: str, first_file: str, first_line: int) -> str:
    """Where the first of two things is, seen from a problem in `file`."""
    return f"line {first_line}" if file == first_file else f"{first_file}:{first_line}"


def _single_global(reads: list[_GlobalRead], problems: list[Problem]) -> GlobalConfig:
    if not reads:
        return GlobalConfig()
    first = reads[0]
    for extra in reads[1:]:
        where = _at(extra.file, first.file, first.line)
        problems.append(
            Problem(extra.file, extra.line, f"only one file may hold global: (first at {where})")
        )
    return first.config


def _check_unique_names(servers: list[_VirtualServerRead], problems: list[Problem]) -> None:
    first: dict[str, _VirtualServerRead] = {}
    for vs in servers:
        if vs.name is None:
            continue
        if vs.name not in first:
            first[vs.name] = vs
            continue
        where = _at(vs.file, first[vs.name].file, first[vs.name].name_line)
        problems.append(
            Problem(
                vs.file,
                vs.name_line,
                f"duplicate virtual server name {vs.name!r} (first at {where})",
            )
        )


@dataclass(frozen=True)
class _Claim:
    """A listen address taken, and by what."""

    address: Address
    what: str  # "0.0.0.0:80 of virtual server web", "the admin endpoint 127.0.0.1:9100"
    file: str | None  # None: a default, not written anywhere
    line: int
    vs: _VirtualServerRead | None = None  # the virtual server that listens there
    protocol: str = "tcp"  # a UDP socket and a TCP one may share an address and port

    def describe(self, seen_from: str) -> str:
        if self.file is None:
            return f"{self.what} (the default; set global.admin.listen to move it)"
        return f"{self.what} at {_at(seen_from, self.file, self.line)}"


def _check_port_clashes(
    servers: list[_VirtualServerRead], global_read: _GlobalRead | None, problems: list[Problem]
) -> None:
    """Report every listen address that another listener (or the admin endpoint) has."""
    claims = _admin_claims(global_read) + _locator_claims(global_read, problems)
    for vs in servers:
        owner = f"virtual server {vs.name}" if vs.name else "a virtual server"
        for address, line in vs.listen:
            clash = next(
                (
                    claim
                    for claim in claims
                    if claim.protocol == vs.protocol
                    and _clashes(address, claim.address)
                    # Two virtual servers on the very same address share it when one
                    # of them routes by SNI or ALPN (SPEC §13; two without are two
                    # defaults: a clash). The rest is `_check_shared_addresses`' job.
                    and not (
                        claim.vs not in (None, vs)
                        and (vs.sni or claim.vs.sni or vs.alpn or claim.vs.alpn)
                        and _same(address, claim.address)
                    )
                ),
                None,
            )
            if clash is not None:
                problems.append(
                    Problem(
                        vs.file,
                        line,
                        f"listen address {address} clashes with {clash.describe(vs.file)}",
                    )
                )
            what = f"{address} of {owner}" + (" (udp)" if vs.protocol == "udp" else "")
            claims.append(_Claim(address, what, vs.file, line, vs, vs.protocol))


def _admin_claims(global_read: _GlobalRead | None) -> list[_Claim]:
    admin = global_read.config.admin if global_read else GlobalConfig().admin
    if admin.listen is None:
        return []
    what = f"the admin endpoint {admin.listen}"
    if global_read is None or global_read.admin_line is None:
        return [_Claim(admin.listen, what, None, 0)]
    return [_Claim(admin.listen, what, global_read.file, global_read.admin_line)]


def _locator_claims(global_read: _GlobalRead | None, problems: list[Problem]) -> list[_Claim]:
    """The DNS locator's TCP and UDP ports."""
    dns = global_read.config.locator.dns if global_read else None
    if dns is None or global_read is None:
        return []
    line = global_read.dns_line or global_read.line
    claim = _Claim(dns.listen, f"the DNS locator {dns.listen}", global_read.file, line)
    for admin in _admin_claims(global_read):
        if _clashes(dns.listen, admin.address):
            problems.append(
                Problem(
                    global_read.file,
                    line,
                    f"{claim.what} clashes with {admin.describe(global_read.file)}",
                )
            )
    return [claim, replace(claim, protocol="udp")]


def _clashes(a: Address, b: Address) -> bool:
    """Would binding both fail? A wildcard host takes the port for its whole family."""
    if a.port != b.port:
        return False
    ip_a, ip_b = _listen_ip(a.host), _listen_ip(b.host)
    if ip_a.version != ip_b.version:
        return False
    return ip_a == ip_b or ip_a.is_unspecified or ip_b.is_unspecified


def _same(a: Address, b: Address) -> bool:
    return a.port == b.port and _listen_ip(a.host) == _listen_ip(b.host)


def _check_shared_addresses(servers: list[_VirtualServerRead], problems: list[Problem]) -> None:
    """Virtual servers on one address (SPEC §13): no name routed to two of them, and
    one way of reading the PROXY header (it is read before the ClientHello, so before
    the virtual server is known). Two defaults are a clash (`_check_port_clashes`)."""
    groups: dict[tuple[Any, ...], list[tuple[_VirtualServerRead, Address, int]]] = {}
    for vs in servers:
        for address, line in vs.listen:
            key = (_listen_ip(address.host), address.port, vs.protocol)
            group = groups.setdefault(key, [])
            if not any(other is vs for other, _, _ in group):
                group.append((vs, address, line))
    for group in groups.values():
        if len(group) < 2:
            continue
        # Each (sni name or None, alpn protocol or None) routes to one virtual server.
        routes: dict[tuple[str | None, str | None], tuple[_VirtualServerRead, int]] = {}
        first_vs, _, first_line = group[0]
        for vs, address, line in group:
            for route, route_line in _route_keys(vs, line):
                if route == (None, None):
                    continue  # two defaults: `_check_port_clashes` says so
                if route in routes:
                    other, other_line = routes[route]
                    problems.append(
                        Problem(
                            vs.file,
                            route_line,
                            f"{_route_words(route)} on {address} is routed to virtual server "
                            f"{other.name} already (at {_at(vs.file, other.file, other_line)})",
                        )
                    )
                else:
                    routes[route] = (vs, route_line)
            if vs.accept_proxy[0] != first_vs.accept_proxy[0]:
                problems.append(
                    Problem(
                        vs.file,
                        vs.accept_proxy[1] or line,
                        f"virtual servers sharing {address} must agree on accept_proxy "
                        f"({first_vs.name} at {_at(vs.file, first_vs.file, first_line)} has "
                        f"{str(first_vs.accept_proxy[0]).lower()})",
                    )
                )
            elif vs.accept_proxy[0] and set(vs.accept_proxy_from[0]) != set(
                first_vs.accept_proxy_from[0]
            ):
                # The header is read before the virtual server is known: one list of
                # trusted peers for the address.
                problems.append(
                    Problem(
                        vs.file,
                        vs.accept_proxy_from[1] or line,
                        f"virtual servers sharing {address} must agree on accept_proxy_from "
                        f"(see {first_vs.name} at {_at(vs.file, first_vs.file, first_line)})",
                    )
                )


def _route_keys(
    vs: _VirtualServerRead, listen_line: int
) -> list[tuple[tuple[str | None, str | None], int]]:
    """The (sni name, alpn protocol) pairs a virtual server takes on its address, each
    with the line to blame: the protocol's, else the name's, else the listen line."""
    names: list[tuple[str | None, int]] = list(vs.sni) or [(None, listen_line)]
    protocols: list[tuple[str | None, int]] = list(vs.alpn) or [(None, 0)]
    keys: dict[tuple[str | None, str | None], int] = {}  # a duplicate is reported already
    for name, name_line in names:
        for protocol, protocol_line in protocols:
            keys.setdefault((name, protocol), protocol_line or name_line)
    return list(keys.items())


def _route_words(route: tuple[str | None, str | None]) -> str:
    name, protocol = route
    if protocol is None:
        return f"sni name {name!r}"
    if name is None:
        return f"alpn protocol {protocol!r} without sni"
    return f"sni name {name!r} with alpn protocol {protocol!r}"


def _listen_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address("127.0.0.1" if host == "localhost" else host)


# --------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------


def load(paths: Sequence[str | os.PathLike[str]]) -> Config:
    """Read and validate configuration files and folders; ConfigError lists every problem."""
    problems: list[Problem] = []
    files = _expand(paths, problems)
    global_reads: list[_GlobalRead] = []
    servers: list[_VirtualServerRead] = []
    secrets: list[_SecretRead] = []
    unreadable = bool(problems)  # a path that is not there (_expand said so)
    for file in files:
        doc = _Document(file, problems, secrets)
        reported = len(problems)
        root = doc.compose()
        if root is None:
            unreadable = unreadable or len(problems) > reported  # (an empty file is not)
            continue
        global_read, file_servers = _read_file(doc, root)
        if global_read is not None:
            global_reads.append(global_read)
        servers.extend(file_servers)

    global_ = _single_global(global_reads, problems)
    secret_files = _check_secret_files(secrets, global_, problems)
    _check_unique_names(servers, problems)
    _check_port_clashes(servers, global_reads[0] if global_reads else None, problems)
    _check_shared_addresses(servers, problems)
    _check_shared_per_source(servers, global_, problems)
    # A file that could not be read or parsed is the problem to fix first: its virtual
    # servers are missing because of it, so "none configured" would only mislead.
    if not servers and (files or paths) and not unreadable:
        first = files[0] if files else os.fsdecode(paths[0])
        problems.append(Problem(first, 1, "no virtual servers configured"))
    if problems:
        raise ConfigError(_in_order(problems))
    return Config(
        global_=global_,
        virtual_servers=tuple(vs.config for vs in servers if vs.config is not None),
        files=tuple(files),
        secret_files=secret_files,
    )


def _expand(paths: Sequence[str | os.PathLike[str]], problems: list[Problem]) -> list[str]:
    """Files to read: each path itself, or a folder's *.yaml and *.yml in name order."""
    if not paths:
        problems.append(Problem("<command line>", 0, "no configuration file or folder given"))
    files: list[str] = []
    for path in map(os.fsdecode, paths):
        if not os.path.isdir(path):
            files.append(path)  # a missing file is reported when it is read
            continue
        try:
            names = sorted(os.listdir(path))
        except OSError as exc:
            problems.append(Problem(path, 1, f"cannot read folder: {exc.strerror or exc}"))
            continue
        for name in names:
            joined = os.path.join(path, name)
            if name.endswith((".yaml", ".yml")) and os.path.isfile(joined):
                files.append(joined)
    return files


def _in_order(problems: list[Problem]) -> list[Problem]:
    """Sorted by file and line; a problem found several times is reported once."""
    return sorted(dict.fromkeys(problems), key=lambda p: (p.file, p.line))


# -- a real server added at run time (POST .../real-servers) -----------------------------

RUNTIME_SOURCE = "body"  # the `file` of a runtime real server's problems


def read_real_server(entry: object, vs: VirtualServerConfig) -> RealServerConfig | list[str]:
    """A real server's entry given at run time (a JSON object, as a `real_servers` item
    of a file would be), read by the same code as a file's, with `vs`'s `snmp` and
    `agent_check` blocks under it as in the file; the server, or every problem found.

    An entry naming a file (a key file of `snmp`) is refused: a request never makes the
    process read a file of its choosing.
    """
    if not isinstance(entry, dict):
        return [f"the body must be a JSON object (a real server's keys), got {_kind(entry)}"]
    try:
        text = yaml.safe_dump(entry, allow_unicode=True, sort_keys=False)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        return [f"the body cannot be read: {exc}"]
    if node is None:
        return ["the body is empty"]
    problems: list[Problem] = []
    doc = _Document(RUNTIME_SOURCE, problems)
    read = _read_real_server(doc, node, _given(vs.snmp), _given(vs.agent_check))
    problems.extend(
        Problem(RUNTIME_SOURCE, secret.line, f"{secret.label}: a file is not accepted here")
        for secret in doc.secrets
    )
    if problems or read is None or read[1] is None:
        return [problem.message for problem in dict.fromkeys(problems)] or ["not a real server"]
    return read[1]


def _given(block: Any) -> _Section | None:
    """A block already read (a dataclass) as the section it was read from."""
    if block is None:
        return None
    values = {name: getattr(block, name) for name in block.__dataclass_fields__}
    values = {name: value for name, value in values.items() if value is not None}
    return _Section(0, values, key_lines=dict.fromkeys(values, 0))


def _kind(value: object) -> str:
    return {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )
