"""`lbproxy check`'s summary of a valid configuration."""

from __future__ import annotations

import json

from lbproxy.config.model import (
    PGSQL_DEFAULT_USER,
    AgentCheckConfig,
    ConditioningConfig,
    Config,
    DnsDiscoveryConfig,
    GlobalConfig,
    HealthCheckConfig,
    RealServerConfig,
    ThrottleConfig,
    VirtualServerConfig,
)
from lbproxy.config.tls_check_keys import describe as describe_tls_check
from lbproxy.core import schedulers

# --------------------------------------------------------------------------------------
# summary (for `lbproxy check`)
# --------------------------------------------------------------------------------------


def summary(config: Config) -> str:
    lines = [_global_summary(config.global_)]
    for vs in config.virtual_servers:
        lines.extend(_virtual_server_summary(vs))
    servers = sum(len(vs.real_servers) for vs in config.virtual_servers)
    lines.append(
        f"{_count(len(config.virtual_servers), 'virtual server')}, {_count(servers, 'real server')}"
    )
    return "\n".join(lines)


def warnings(config: Config) -> list[str]:
    """What `lbproxy check` warns about: valid, but probably not what was meant.

    A scheduler that reads load reports (least-load with `load_source: report`) steps a
    server's load by its reported `per_connection`, by default 1 / max_connections:
    without max_connections that is 0, so a server that never reports (or reports
    without `per_connection`) stays at load 0 and gets every answer and connection,
    however many it was sent."""
    found = []
    for vs in config.virtual_servers:
        if not schedulers.get(vs.scheduler).reads_reports(vs):
            continue
        for rs in vs.real_servers:
            if not rs.max_connections:
                found.append(
                    f"{vs.file}:{rs.line}: {vs.name}/{rs.name} has no max_connections: until"
                    " it reports a per_connection, each answer or connection sent to it adds"
                    " nothing to its load, so one that never reports gets them all"
                )
        if vs.discovery is not None:
            found.append(
                f"{vs.file}:{vs.line}: {vs.name}: discovered real servers have no"
                " max_connections: until one reports a per_connection, each answer or"
                " connection sent to it adds nothing to its load"
            )
    return found


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _global_summary(global_: GlobalConfig) -> str:
    admin = str(global_.admin.listen) if global_.admin.listen else "off"
    text = (
        f"admin {admin}, log {global_.log_format}, workers {global_.workers}, "
        f"drain timeout {global_.drain_timeout:g}s"
    )
    dns = global_.locator.dns
    if dns is not None:
        text += f"\nDNS locator {dns.listen} (UDP and TCP), zone {dns.zone}, ttl {dns.ttl}"
    redis = global_.cluster.redis
    if redis is not None:
        name = redis.name or "the host name"
        auth = f", password from {redis.password_file}" if redis.password_file else ""
        text += f"\ncluster through {redis.url} (keys {redis.key_prefix}:*{auth}), as {name}"
    return text


def _virtual_server_summary(vs: VirtualServerConfig) -> list[str]:
    algorithm = schedulers.get(vs.scheduler)
    scheduler = vs.scheduler
    if vs.quiesce:
        scheduler += ", quiesce"
    scheduler += algorithm.describe_source(vs)
    if vs.slow_start:
        scheduler += f", slow start {vs.slow_start:g}s"
    scheduler += algorithm.describe_options(vs)
    lines = [
        f"virtual server {vs.name} ({vs.file}:{vs.line})",
        f"  listen      {_listen_summary(vs)}",
    ]
    if vs.sni:
        lines.append(f"  sni         {', '.join(vs.sni)}")
    if vs.alpn:
        lines.append(f"  alpn        {', '.join(vs.alpn)}")
    if vs.protocol == "udp":
        lines.append(f"  udp         {_udp_summary(vs)}")
    lines += [
        f"  scheduler   {scheduler}",
        f"  health      {_health_summary(vs.health_check)}",
    ]
    if vs.agent_check is not None:
        lines.append(f"  agent       {agent_summary(vs.agent_check)}")
    if vs.throttle is not None:
        lines.append(f"  throttle    {_throttle_summary(vs.throttle)}")
    if vs.persistence is not None:
        lines.append(
            f"  persistence {vs.persistence.timeout:g}s, "
            f"at most {vs.persistence.max_entries} clients"
        )
    if vs.discovery is not None:
        lines.append(f"  discovery   {discovery_summary(vs.discovery)}")
    if vs.queue is not None:
        closed = ", a client that closes is dropped" if vs.queue.abort_on_close else ""
        lines.append(
            f"  queue       up to {vs.queue.max} clients for {vs.queue.timeout:g}s{closed}"
        )
    if vs.conditioning is not None:
        lines.append(f"  conditioning {_conditioning_summary(vs.conditioning)}")
    outlier = vs.outlier_detection
    if outlier is not None:
        lines.append(
            f"  outliers    ejected after {outlier.consecutive_failures} failed connects in a "
            f"row for {outlier.base_ejection_time:g}s x times in a row (at most "
            f"{outlier.max_ejection_time:g}s), up to {outlier.max_ejection_percent}% at once"
        )
    if vs.panic_threshold:
        lines.append(f"  panic       under {vs.panic_threshold}% of servers available")
    lines.append("  real servers")
    lines.extend(_table([_real_server_row(vs, rs) for rs in vs.real_servers], indent="    "))
    if vs.discovery is not None:
        lines.append("    + discovered (lbproxy check --resolve shows them)")
    return lines


def discovery_summary(dns: DnsDiscoveryConfig) -> str:
    """`SRV _web._tcp.service.consul via 127.0.0.1:8600, every 10s, hold 30s`."""
    what = f"{dns.type} {dns.name}" + (f" port {dns.port}" if dns.port is not None else "")
    via = ", ".join(str(a) for a in dns.resolvers) if dns.resolvers else "the system's resolvers"
    return f"{what} via {via}, every {dns.interval:g}s, hold {dns.hold:g}s"


def _udp_summary(vs: VirtualServerConfig) -> str:
    """Datagrams in sessions (SPEC §19): how a session ends and how many may be open."""
    udp = vs.udp
    if udp.responses is None:
        ends = f"sessions end {udp.idle_timeout:g}s idle"
    elif udp.responses == 0:
        ends = f"no replies, sessions end {udp.idle_timeout:g}s idle"
    else:
        replies = "1 reply" if udp.responses == 1 else f"{udp.responses} replies"
        ends = f"{replies} per request, else {udp.idle_timeout:g}s idle"
    return f"{ends}; at most {udp.max_sessions} sessions, {udp.max_sessions_per_source} per source"


def _listen_summary(vs: VirtualServerConfig) -> str:
    if not vs.listen:
        return "none (locator only)"
    return ", ".join(str(address) for address in vs.listen)


def _conditioning_summary(c: ConditioningConfig) -> str:
    return (
        f"every {c.interval:g}s, idle for {c.idle_for:g}s, at most {c.max_per_interval} "
        f"per interval, threshold {c.threshold:g}"
    )


def _health_summary(check: HealthCheckConfig) -> str:
    """As a person says it: `pgsql as user lbproxy every 2s, rise 2, fall 3`."""
    if check.type == "none":
        return "none"
    where = ""
    if check.address or check.port:
        where = f" on {check.address or 'the server'}" + (
            f" port {check.port}" if check.port else ""
        )
    every = f"every {check.interval:g}s, rise {check.rise}, fall {check.fall}"
    words = _check_words(check)
    if check.tls and check.type in ("send_expect", "redis", "smtp"):
        verified = f"verified by {check.verify}" if check.verify else "not verified"
        sni = f"SNI {check.sni}, " if check.sni else ""
        words += f" over TLS ({sni}{verified})"
    if check.send_proxy is not None:
        words += ", with a PROXY header" if check.send_proxy else ", without a PROXY header"
    return f"{words}{where} {every}"


def _check_words(check: HealthCheckConfig) -> str:
    if check.type == "pgsql":
        user = check.user or PGSQL_DEFAULT_USER
        database = f", database {check.database}" if check.database not in (None, user) else ""
        return f"pgsql as user {user}{database}"
    if check.type == "mysql":
        return f"mysql login as user {check.user}" if check.user else "mysql handshake"
    if check.type == "redis":
        words = "redis PING" + (" after AUTH" if check.password_file else "")
        return words + (f", role {check.role}" if check.role else "")
    if check.type == "smtp":
        return f"smtp EHLO {check.helo or '(this host)'}"
    if check.type == "send_expect" and (check.send_hex or check.expect_hex):
        sent = check.send_hex.hex() if check.send_hex else (check.send or "nothing")
        wanted = check.expect_hex.hex() if check.expect_hex else check.expect
        return f"send_expect {sent}, expect {wanted}"
    return describe_tls_check(check) or check.type


def agent_summary(agent: AgentCheckConfig) -> str:
    """`agent on port 9777 of each real server every 2s (timeout 1s), sends "state\\n"`."""
    if agent.port is None:
        where = "on each real server's own port"
    elif agent.address:
        where = f"at {agent.address}:{agent.port}"
    else:
        where = f"on port {agent.port} of each real server"
    text = f"{where} every {agent.interval:g}s (timeout {agent.timeout:g}s)"
    if agent.send:
        text += f", sends {json.dumps(agent.send)}"
    return text


def _throttle_summary(throttle: ThrottleConfig) -> str:
    limits = []
    if throttle.max_connections is not None:
        limits.append(f"max {throttle.max_connections} connections")
    if throttle.max_rate is not None:
        limits.append(f"max {throttle.max_rate:g} connections/s")
    return ", ".join(limits)


def _real_server_row(vs: VirtualServerConfig, rs: RealServerConfig) -> list[str]:
    row = [rs.name, str(rs.address), f"weight {rs.weight}", rs.state]
    if rs.backup:
        row.append("backup")
    if vs.scheduler in schedulers.reading("load_factor"):
        row.append(f"load factor {rs.load_factor:g}")
    if rs.max_connections:
        row.append(f"max {rs.max_connections} connections")
    own = rs.health_check
    if own is not None and (own.address or own.port) and vs.health_check.type != "none":
        row.append(
            f"checked on {own.address or vs.health_check.address or rs.address.host}"
            f" port {own.port or vs.health_check.port or rs.address.port}"
        )
    if own is not None and own.send_proxy is not None and vs.health_check.type != "none":
        row.append(
            "checks with a PROXY header" if own.send_proxy else "checks without a PROXY header"
        )
    if rs.snmp is not None and vs.scheduler in schedulers.reading(schedulers.SNMP):
        row.append(f"snmp {rs.snmp.host}:{rs.snmp.port}")
    if rs.agent_check is not None:
        row.append(f"agent {rs.agent_check.address or rs.address.host}:{rs.agent_check.port}")
    return row


def _table(rows: list[list[str]], indent: str) -> list[str]:
    """Left-aligned columns."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(max(map(len, rows)))]
    return [
        indent + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
        for row in rows
    ]
