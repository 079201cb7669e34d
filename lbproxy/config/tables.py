"""The keys of each configuration section, the converter that reads each one, and what
each key means.

PURE. The reader (reader.py) walks these tables; nothing else decides which keys exist.
The same tables, through `SECTIONS`, give the configuration reference
(docs/reference/configuration.md, reference.py) and the JSON Schema (`lbproxy schema`,
schema.py), so the three cannot disagree: a key is added here, with `.about(...)`, once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import yaml

from lbproxy.config.model import (
    CHECK_TYPE_KEYS,
    DNS_QUERY_TYPES,
    MAX_WEIGHT,
    AdminConfig,
    AgentCheckConfig,
    ConditioningConfig,
    DnsDiscoveryConfig,
    DnsLocatorConfig,
    DnsRateLimitConfig,
    GlobalConfig,
    HealthCheckConfig,
    OutlierDetectionConfig,
    PersistenceConfig,
    PerSourceConfig,
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
from lbproxy.config.tls_check_keys import (
    alpn_protocols,
    host_header,
    http_method,
    server_name,
    verify_with,
)
from lbproxy.config.values import (
    Converter,
    Invalid,
    accepting,
    address,
    admin_listen,
    admin_socket,
    boolean,
    choice,
    did_you_mean,
    dns_name,
    dns_zone,
    duration,
    duration_or_none,
    group,
    hex_bytes,
    host,
    host_names,
    http_path,
    integer,
    listen_address,
    max_clients,
    member_name,
    networks,
    number,
    oid,
    percentage,
    plain_name,
    record_type,
    redis_key_prefix,
    redis_url,
    regex,
    resolvers,
    responses,
    scalar,
    secret_file,
    shown,
    sni_names,
    snmp_version,
    status_codes,
    string,
    user,
    vs_listen,
    workers,
)
from lbproxy.core import schedulers

# --------------------------------------------------------------------------------------
# The keys of each section and how to read them
# --------------------------------------------------------------------------------------
# Keys map to the dataclass field of the same name; nested sections are read separately.

# The schedulers, what they read and their own keys come from their registry
# (lbproxy/core/schedulers): no scheduler is named here.


@accepting("the name of a scheduler", lambda: {"enum": schedulers.available()})
def _scheduler(node: yaml.Node, label: str) -> str:
    value = scalar(node, label)
    known = schedulers.available()
    if value not in known:
        hint = did_you_mean(value, known)
        hint = f" ({hint})" if hint else ""
        raise Invalid(f"unknown scheduler {shown(node)}{hint}; known: {', '.join(known)}", node)
    return cast(str, value)  # one of `known`


# Schedulers whose weights come from the SNMP poller.
SNMP_SCHEDULERS = tuple(cls.name for cls in schedulers.catalogue() if cls.dynamic_weights)

GLOBAL_FIELDS: dict[str, Converter] = {
    "log_format": choice("text", "json").about(
        "`text`, or `json` (one object per line), on stderr"
    ),
    "drain_timeout": duration(positive=False).about(
        "on SIGTERM/SIGINT, how long connections may finish before the rest are closed"
    ),
    "workers": workers.about(
        "processes sharing the listeners (`auto` = one per CPU); changing it takes a restart"
    ),
    "access_log": boolean.about(
        "one line per connection on logger `lbproxy.access`: client, virtual and real "
        "server, bytes each way, duration, how it ended; with `log_format: json` also as "
        "fields: `start` (ISO 8601, UTC, microseconds), `duration_s`, `client`, "
        "`client_port`, `virtual_server`, `real_server` (null: none), `bytes_in`, "
        "`bytes_out`, `end`, `protocol` (what `lbproxy simulate --replay` reads; see The "
        "access log below)"
    ),
    "state_file": string.about(
        "runtime state kept across restarts: states and weights set at run time, real "
        "servers added and removed at run time, the last load report per server, "
        "persistence entries; written atomically at most "
        "once a second after a change, read at start (a missing or spoilt file is a "
        "warning, never a failed start); opened without following a symlink, and a "
        "symlink, a file over 64 MiB or one writable by group or others is ignored with a "
        "warning; its folder must be writable by `user`",
        default="none",
    ),
    "max_clients": max_clients.about(
        "client connections this process serves at once, every virtual server together "
        "(`workers: N`: each worker's own); one more is closed at accept and counted "
        '(`reason="max_clients"`); `auto`: as many as the open-file limit allows while '
        "10 % of it (at least 64 descriptors) stays free for the admin endpoint, health "
        "checks, SNMP, DNS and Redis",
        default="auto",
    ),
    "user": user.about(
        "once every listener is bound and every secret file read, run as this user (a "
        "name or a numeric id), with no supplementary groups and only "
        "CAP_NET_BIND_SERVICE kept (a reload may bind a port below 1024); workers and "
        "upgrades too. Needs lbproxy started as root; started as root without it, lbproxy "
        "warns",
        default="none",
    ),
    "group": group.about(
        "with `user`: the group to run as (a name or a numeric id)",
        default="the user's own group",
    ),
}

ADMIN_FIELDS: dict[str, Converter] = {
    "listen": admin_listen.about(
        "the admin endpoint (API, `/metrics`, dashboard); `none` turns it off; in a "
        "container `0.0.0.0:9100` with a `token_file`"
    ),
    "token_file": secret_file.about(
        "file holding the bearer token every change over TCP needs (without one the TCP "
        "endpoint is read-only: changes go through `socket`); owned by root or lbproxy's "
        "user and readable by no one else (see Secret files in the configuration reference)",
        default="none",
    ),
    "read_token": boolean.about(
        "`/api/v1` reads over TCP need the token too (none: 401, a wrong one: 403); "
        "`/healthz`, `/readyz` and `/metrics` never do; needs `token_file`"
    ),
    "socket": admin_socket.about(
        "a Unix socket (mode 0600) serving the same API: a change through it needs no "
        "token, only a peer that runs as lbproxy's user or root (reads too); the CLI's "
        "`drain`, `reload`, ... use it by themselves. Default `admin-PORT.sock` (PORT: "
        "`listen`'s) in `$RUNTIME_DIRECTORY` under systemd, else `/run/lbproxy/` as root "
        "or `$XDG_RUNTIME_DIR/lbproxy/`; none when there is no such folder or no `listen`",
        default="`admin-PORT.sock` in the runtime folder",
    ),
    "allowed_hosts": host_names.about(
        "host names the endpoint answers to besides IP addresses and `localhost`: a "
        "request naming another `Host` gets 421, except `/healthz`, `/readyz` and "
        "`/metrics` (a page that rebinds its own name to this address reads nothing)",
        default="none",
    ),
    "max_connections": integer(1).about(
        "admin connections open at once (their descriptors are the data plane's); at "
        "the limit the oldest one still reading its request (or idle) is closed to admit "
        "a new one; read at start",
    ),
    "max_connections_per_source": integer(1).about(
        "admin connections from one client address: a newcomer over it closes that "
        "address's oldest one still reading its request, else it is refused; read at start",
    ),
}

REDIS_FIELDS: dict[str, Converter] = {
    "url": redis_url.about(
        "the Redis (or Valkey) the instances share: `redis://HOST:PORT/DB`, "
        "`rediss://HOST:PORT/DB` (TLS; options `ssl_ca_certs`, `ssl_cert_reqs`, "
        "`ssl_certfile`, `ssl_keyfile`, `ssl_check_hostname`) or `unix:///PATH` (option "
        "`db`); a user name may be given (`redis://lb@host:6379/0`), a password may not",
        default="required",
    ),
    "password_file": secret_file.about(
        "file holding the password (`AUTH`), read at every connection attempt (a rotated "
        "password is picked up while `user` can read it); owned by root or lbproxy's user "
        "and readable by no one else; none: no `AUTH`",
        default="none",
    ),
    "key_prefix": redis_key_prefix.about(
        "every key and channel starts with `PREFIX:`; several clusters may share one Redis "
        "with their own prefixes"
    ),
    "name": member_name.about(
        "this instance's member name; with `workers: N` each worker is a member, `NAME-wI`",
        default="the host name",
    ),
}

CLUSTER_FIELDS: dict[str, Converter] = {
    "key_file": secret_file.about(
        "file holding the key every message and value written to Redis is signed with "
        "(HMAC-SHA256): its content without trailing whitespace, at least 32 bytes (e.g. "
        "`openssl rand -hex 32`); the same on every instance; read with the configuration",
        default="required",
    ),
    "max_entries": integer(1).about(
        "persistence entries a resync reads from Redis, at most (the rest are counted "
        "in `lbproxy_cluster_skipped_total` and not read); a resync reads at most "
        "10,000 fields of the state hash too"
    ),
}

VIRTUAL_SERVER_FIELDS: dict[str, Converter] = {
    "name": plain_name.about("unique name (it appears in API paths and metric labels)"),
    "protocol": choice("tcp", "udp").about(
        "`tcp`, or `udp`: datagrams in sessions per client address (see UDP virtual "
        "servers); a TCP and a UDP virtual server may share an address and port"
    ),
    "listen": vs_listen.about(
        "an address or a list of them; `none`: locator only, nothing is bound"
    ),
    "scheduler": _scheduler.about("how a real server is picked (see Schedulers)"),
    "quiesce": boolean.about(
        "reset the connection table when a real server comes online",
        only=schedulers.reading("quiesce"),
    ),
    "load_source": choice("connections", "snmp", "report").about(
        "`connections` (connections / `max_connections`), `snmp` (value / "
        "`snmp.max_value`) or `report` (pushed by the servers, `PUT .../load`)",
        read_by=schedulers.reading("load_source"),
    ),
    "load_poll_interval": duration(positive=True).about(
        "with `load_source: connections`: how often the load is sampled",
        read_by=schedulers.reading("load_poll_interval"),
    ),
    "slow_start": duration(positive=False).about(
        "ramp a server coming online from 10 % to its full weight over this time (a "
        "scheduler that does not read weights has nothing to ramp)",
        only=schedulers.reading("slow_start"),
    ),
    "connect_timeout": duration(positive=True).about(
        "connecting to a real server; also how long an `accept_proxy` header may take, and "
        "(on an SNI address, the first virtual server's) how long the PROXY header and the "
        "TLS ClientHello may take together"
    ),
    "idle_timeout": duration(positive=True).about(
        "close when neither side sent anything for this long (also bounds half-closed connections)"
    ),
    "retries": integer(0).about("on connect failure, try up to N *other* real servers"),
    "max_connections": integer(0).about(
        "concurrent client connections for this virtual server (0 = unlimited); more are "
        'closed and counted (`reason="max_connections"`)'
    ),
    "allow": networks.about("client networks allowed"),
    "deny": networks.about('client networks refused; deny wins over allow (`reason="acl"`)'),
    "send_proxy": choice("none", "v1", "v2").about(
        "`v1` or `v2`: send a PROXY protocol header to the real server first"
    ),
    "accept_proxy": boolean.about(
        "expect a PROXY v1/v2 header from an upstream balancer; its client address is the "
        "one the ACL checks and `send_proxy` passes on"
    ),
    "accept_proxy_from": networks.about(
        "with `accept_proxy`: the peers (the upstream balancers) whose PROXY header is "
        "believed; a connection from any other is closed before a byte is read "
        '(`reason="proxy_untrusted"`)',
        default="`127.0.0.0/8`, `::1/128`, `10.0.0.0/8`, `172.16.0.0/12`, "
        "`192.168.0.0/16`, `fc00::/7`",
    ),
    # Each scheduler's own keys (maglev's `table_size`, `hash_key`), accepted only with it.
    **schedulers.option_fields(),
    "max_connection_duration": duration_or_none().about(
        "close an established connection this long after its connect, however busy "
        '(`reason="max_duration"`); none: never',
        default="none",
    ),
    "max_connection_duration_jitter": percentage(50).about(
        "spread each connection's `max_connection_duration` uniformly within ± this "
        "percentage (0% to 50%), so connections opened together do not end together",
        default="0%",
    ),
    "sni": sni_names.about(
        "TLS server names routed here from a listen address it shares with other virtual "
        "servers: exact names or `*.example.com` (one label), case-insensitive",
        default="none",
    ),
    "alpn": alpn_protocols.about(
        "TLS ALPN protocol names (exact, case-sensitive, as `acme-tls/1`, `h2`) routed "
        "here from a listen address it shares: a ClientHello offering one of them goes "
        "here before the virtual server of the same `sni` (or of none) without `alpn`",
        default="none (any protocol, or none offered)",
    ),
    "panic_threshold": integer(0, 100).about(
        "percent: when fewer than this share of the enabled non-backup real servers are "
        "available (health up, not ejected) and no backup is up, pick among every enabled "
        "non-backup server as if all were up (Envoy's `healthy_panic_threshold`; `0`: never)"
    ),
}

# Keys of one scheduler's own: an error with any other (not silently unused).
SCHEDULER_OPTION_KEYS = tuple(schedulers.option_fields())

REAL_SERVER_FIELDS: dict[str, Converter] = {
    "name": plain_name.about("unique within the virtual server"),
    "address": address(listen=False).about(
        "`HOST:PORT` (host names are resolved once, when first used)"
    ),
    "weight": integer(0, MAX_WEIGHT).about(
        "static weight (ipvsadm's range); 0 = no new connections"
    ),
    "max_connections": integer(0).about(
        "concurrent connections to this server (0 = unlimited); `least-load` with "
        "`load_source: connections` needs it > 0"
    ),
    "load_factor": number(above=0).about(
        "added to the accumulated load per connection; higher = weaker server",
        read_by=schedulers.reading("load_factor"),
    ),
    "state": choice("enabled", "drain", "disabled").about("at start-up (and after each reload)"),
    "backup": boolean.about(
        "a backup server: new connections only while no primary server is available"
        " (every primary down, drained, disabled or at its max_connections)"
    ),
}

HEALTH_CHECK_FIELDS: dict[str, Converter] = {
    "type": choice(
        "tcp",
        "send_expect",
        "http",
        "tls",
        "pgsql",
        "mysql",
        "redis",
        "smtp",
        "udp",
        "dns",
        "none",
    ).about(
        "`tcp` (connect), `send_expect`, `http`, `tls` (a TLS handshake), a protocol check "
        "(`pgsql`, `mysql`, `redis`, `smtp`), or `none` (passive health only); on a UDP "
        "virtual server `udp` (a datagram, a reply) or `dns` (a query, NOERROR)"
    ),
    "port": integer(1, 65535).about(
        "check this port instead of the real server's (HAProxy's `port`), e.g. a management port",
        default="the real server's",
    ),
    "address": host.about(
        "check this host (a name or an IP, without port) instead of the real server's "
        "(HAProxy's `addr`)",
        default="the real server's",
    ),
    "interval": duration(positive=True).about(
        "time between checks (each server starts at a random offset)"
    ),
    "timeout": duration(positive=True).about("per check"),
    "rise": integer(1).about("good checks in a row to come back up"),
    "fall": integer(1).about("failures in a row to go down"),
    "send": string.about(
        "`send_expect`, `tls` (after the handshake): bytes to send (`\\r\\n` escapes "
        "work); `udp`: the datagram (none: an empty one)",
        default="none",
    ),
    "expect": regex.about(
        "`send_expect` (it needs this or `expect_hex`), `tls` (after the handshake): a "
        "regular expression searched in the first 4 KiB of the answer; `udp`: searched in "
        "the reply (none: any reply)",
        default="none",
    ),
    "query": dns_name.about("`dns` (required there): the name asked for", default="none"),
    "query_type": choice(*DNS_QUERY_TYPES).about(
        "`dns`: the record type asked for; healthy when the answer is NOERROR"
    ),
    "send_hex": hex_bytes.about(
        "`send_expect`: bytes to send, as hex (instead of `send`), for binary protocols",
        default="none",
    ),
    "expect_hex": hex_bytes.about(
        "`send_expect`: bytes to find in the first 4 KiB of the answer, as hex (instead "
        "of `expect`)",
        default="none",
    ),
    "user": string.about(
        "`pgsql`: the user of the StartupMessage (default `lbproxy`); `mysql`: log in as "
        "this user without a password and expect OK (none: read the handshake only)",
        default="none",
    ),
    "database": string.about("`pgsql`: the database asked for", default="the user"),
    "password_file": secret_file.about(
        "`redis`: file holding the password sent with `AUTH` before `PING`; owned by root "
        "or lbproxy's user and readable by no one else",
        default="none",
    ),
    "role": choice("master", "replica").about(
        "`redis`: healthy only with this `role:` in `INFO replication` (`replica` is "
        "Redis's `slave`)",
        default="none",
    ),
    "helo": string.about("`smtp`: the name sent with `EHLO`", default="this host's name"),
    "path": http_path.about("`http`: the path to GET"),
    "expect_status": status_codes.about("`http`: the accepted status codes"),
    "method": http_method.about("`http`: the request's method"),
    "host": host_header.about("`http`: the Host header", default="the real server's address"),
    "expect_body": regex.about(
        "`http`: a regular expression searched in the first 4 KiB of the body",
        default="none (any body)",
    ),
    "tls": boolean.about(
        "`http` (HTTPS), `send_expect`, `redis`, `smtp` (SMTPS): a TLS handshake first, "
        "then the check over TLS (`sni`, `verify`); not `pgsql` nor `mysql`, which start "
        "TLS inside their protocol"
    ),
    "sni": server_name.about(
        "`tls`, and the checks with `tls: true`: the server name sent in the handshake (and "
        "verified with `verify`)",
        default="none (a host name address is sent)",
    ),
    "alpn": alpn_protocols.about(
        "`tls`: the protocols offered (ALPN); the check fails unless the server picks one",
        default="none offered",
    ),
    "verify": verify_with.about(
        "`tls`, and the checks with `tls: true`: `none` (any certificate), or a PEM file of CA "
        "certificates: the chain and the name (`sni`, else the address) are verified",
        default="none",
    ),
    "send_proxy": boolean.about(
        "a PROXY protocol header first on each check connection (before TLS), as HAProxy's "
        "`check-send-proxy`: `true` always (the virtual server's `send_proxy` version, "
        "else v1), `false` never",
        default="as the traffic: when the virtual server has `send_proxy` and the check goes "
        "to the server's own address and port",
    ),
    "on_down": choice("keep", "close").about(
        "`keep` or `close` the established connections of a server that goes down"
    ),
    "on_up": choice("keep", "close_backups").about(
        "`close_backups`: when a primary server comes back up, close the established "
        "connections on the backup servers, so their clients reconnect to the primary"
    ),
}

REAL_SERVER_AGENT_CHECK_FIELDS: dict[str, Converter] = {
    "port": integer(1, 65535).about(
        "the agent's TCP port (required, here or on the virtual server)", default="none"
    ),
    "address": host.about("the agent's host name or IP address", default="the real server's host"),
}

AGENT_CHECK_FIELDS: dict[str, Converter] = {
    **REAL_SERVER_AGENT_CHECK_FIELDS,
    "interval": duration(positive=True).about("time between two answers asked of an agent"),
    "timeout": duration(positive=True).about(
        "connect and answer, together; an agent silent that long changes nothing"
    ),
    "send": string.about(
        "sent to the agent after the connect (`\\r\\n` escapes work, as in "
        '`health_check.send`), e.g. `"state\\n"`',
        default="nothing",
    ),
}

# A real server's own `health_check:`: where its checks go, the rest is the virtual server's.
REAL_SERVER_CHECK_FIELDS: dict[str, Converter] = {
    "port": integer(1, 65535).about(
        "check this port of this server (over the virtual server's `health_check.port`)",
        default="the virtual server's `health_check.port`, else the server's port",
    ),
    "address": host.about(
        "check this host for this server (over the virtual server's `health_check.address`)",
        default="the virtual server's `health_check.address`, else the server's host",
    ),
    "send_proxy": boolean.about(
        "a PROXY protocol header first on this server's check connections, `true` or "
        "`false` (over the virtual server's `health_check.send_proxy`)",
        default="the virtual server's `health_check.send_proxy`",
    ),
}

SNMP_FIELDS: dict[str, Converter] = {
    "oid": oid.about("the OID to GET (default: UCD-SNMP-MIB 1-minute load average × 100)"),
    "version": snmp_version.about('`2c`, `3` or `"3"`'),
    "community": string.about("v2c community"),
    "user": string.about("v3 user (required with version 3)", default="none"),
    "auth_protocol": choice("SHA", "SHA256", "MD5").about("v3 authentication protocol"),
    "auth_key_file": secret_file.about(
        "v3: file holding the authentication passphrase (authNoPriv with this file only); "
        "owned by root or lbproxy's user and readable by no one else",
        default="none",
    ),
    "priv_protocol": choice("AES", "AES256", "DES").about("v3 privacy protocol"),
    "priv_key_file": secret_file.about(
        "v3: file holding the privacy passphrase (authPriv with both files); owned by root "
        "or lbproxy's user and readable by no one else",
        default="none",
    ),
    "host": host.about("where the agent is", default="the real server's host"),
    "port": integer(1, 65535).about("the agent's UDP port"),
    "interval": duration(positive=True).about("poll period"),
    "timeout": duration(positive=True).about("per transmission"),
    "retries": integer(0).about("retransmissions within one poll"),
    "on_no_answer": choice("zero", "hold", "static").about(
        "the dynamic weight after a failed poll: `zero`, `hold` (the last value for "
        "`stale_after`, then 0) or `static` (the configured weight)"
    ),
    "stale_after": duration(positive=True).about(
        "`hold`: how long the last value is kept", default="3 × interval"
    ),
    "smoothing": number(above=0, at_most=1).about("exponential moving average factor (1 = none)"),
    "max_value": integer(1).about(
        "`dwr`: weight = max_value − value; `least-load`: load = value / max_value"
    ),
}

THROTTLE_FIELDS: dict[str, Converter] = {
    "max_connections": integer(1).about(
        "concurrent client connections that make load 1", default="none"
    ),
    "max_rate": number(above=0).about(
        "new connections per second that make load 1 (at least one of the two)",
        default="none",
    ),
    "digg_factor": number(above=1).about("the load at which new connections are refused"),
    "high_idle_timeout": duration(positive=True).about("idle timeout imposed at load 1"),
    "min_idle_timeout": duration(positive=True).about(
        "idle timeout imposed at `digg_factor` and in digg (at most `high_idle_timeout`)"
    ),
    "interval": duration(positive=True).about(
        "how often the monitor re-evaluates while busy (stepping down; going up happens at "
        "the arrival that reaches a threshold)"
    ),
}

PERSISTENCE_FIELDS: dict[str, Converter] = {
    "timeout": duration(positive=True).about(
        "an entry expires this long after the client's last connection ended"
    ),
    "max_entries": integer(1).about("beyond this, the least recently used clients are evicted"),
}

DNS_LOCATOR_FIELDS: dict[str, Converter] = {
    "listen": listen_address.about("the DNS locator, UDP and TCP"),
    "zone": dns_zone.about(
        "the zone it answers for (`VS.ZONE`, `_VS._tcp.ZONE`); any other name is REFUSED"
    ),
    "ttl": integer(0, 2**31 - 1).about("TTL of every answer, seconds (0 = ask again each time)"),
    "allow": networks.about(
        "source networks that may ask; any other source is answered REFUSED over UDP (no "
        "pick is made) and closed before a byte is read over TCP",
        default="`127.0.0.0/8`, `::1/128`, `10.0.0.0/8`, `172.16.0.0/12`, "
        "`192.168.0.0/16`, `fc00::/7`",
    ),
    "tcp_clients_per_source": integer(1).about(
        "concurrent TCP clients from one source prefix, /24 for IPv4 and /56 for IPv6 as "
        "rate limiting counts them (beside the limit of 64 in all); more are closed at "
        "once, before a byte is read"
    ),
    "tcp_idle_timeout": duration(positive=True).about(
        "a TCP client must send each whole query within this, and the next one within "
        "this after an answer (BIND's and Unbound's `tcp-idle-timeout`)"
    ),
    "tcp_lifetime": duration(positive=True).about(
        "a TCP client is closed this long after it connected, however busy (its answer "
        "in progress cut): no client holds one of the 64 places for ever"
    ),
}

DNS_RATE_LIMIT_FIELDS: dict[str, Converter] = {
    "responses_per_second": integer(0).about(
        "UDP answers per second to one source prefix (/24 for IPv4, /56 for IPv6); over "
        "it a query is dropped without a pick (`0`: no limit)"
    ),
    "slip": integer(0).about(
        "every `slip`-th dropped query is answered empty with TC=1, so a real client asks "
        "again over TCP (`0`: drop them all)"
    ),
}

CONDITIONING_FIELDS: dict[str, Converter] = {
    "interval": duration(positive=True).about("time between rounds"),
    "idle_for": duration(positive=False).about(
        "a connection is a candidate only after this long without a byte either way"
    ),
    "max_per_interval": integer(1).about("closed per round, at most"),
    "threshold": number(above=0).about(
        "imbalance, in per-connection steps, that starts rebalancing (also used by `?current=`)"
    ),
}

DNS_DISCOVERY_FIELDS: dict[str, Converter] = {
    "name": dns_name.about(
        "the name to resolve, always as an absolute name (no search domains; a trailing "
        "dot is optional)"
    ),
    "type": record_type.about("the record type to ask for"),
    "port": integer(1, 65535).about(
        "`A`/`AAAA` only, and required there: the port of every address (SRV records "
        "carry their own)",
        default="none",
    ),
    "resolvers": resolvers.about(
        "where to ask; without it `/etc/resolv.conf` is read again each round",
        default="the system's",
    ),
    "interval": duration(positive=True).about("time between the starts of two rounds"),
    "hold": duration(positive=False).about(
        "how long the name must answer empty or NXDOMAIN before its servers are removed "
        "(`0s`: at once)"
    ),
    "timeout": duration(positive=True).about(
        "one round (the query, retries, a second resolver, the address lookups of SRV "
        "targets) gives up after this; a silent resolver delays nothing else"
    ),
    "max_servers": integer(1).about(
        "the most servers taken from one answer; beyond it those of the lowest SRV "
        "priority, then the highest weight, then the name are kept (A/AAAA: the lowest "
        "addresses), and a warning is logged once per change"
    ),
    "allow_addresses": networks.about(
        "networks whose loopback, link-local, unspecified or multicast addresses an "
        "answer may name (e.g. `[127.0.0.0/8]` for real servers on this host); others of "
        "those are refused and counted, and an address of one of lbproxy's own listeners "
        "(admin, DNS locator, virtual servers) always is",
        default="none",
    ),
}

UDP_FIELDS: dict[str, Converter] = {
    "idle_timeout": duration(positive=True).about(
        "a session ends after this long without a datagram either way"
    ),
    "responses": responses.about(
        "replies per request a client gets: the session ends once they all came (`1` for "
        "DNS); `0`: none expected, replies are dropped (syslog); `none`: unlimited",
        default="none",
    ),
    "max_sessions": integer(1).about(
        'sessions in the table; a new client beyond it is dropped (`reason="max_sessions"`)'
    ),
    "max_sessions_per_source": integer(1).about(
        "sessions the client addresses of one source prefix (`source_prefix`) may hold; "
        'beyond: dropped (`reason="per_source"`)'
    ),
}

SOURCE_PREFIX_FIELDS: dict[str, Converter] = {
    "v4": integer(1, 32).about("prefix length of an IPv4 source (32: each address)"),
    "v6": integer(1, 128).about(
        "prefix length of an IPv6 source (64: a host or a site usually holds a whole /64)"
    ),
}

# Keys and sections a UDP virtual server refuses: they speak of TCP connections.
TCP_ONLY_KEYS = (
    "sni",
    "alpn",
    "accept_proxy",
    "accept_proxy_from",
    "send_proxy",
    "queue",
    "conditioning",
    "retries",
    "outlier_detection",
    "max_connection_duration",
    "max_connection_duration_jitter",
    "per_source",
)

OUTLIER_DETECTION_FIELDS: dict[str, Converter] = {
    "consecutive_failures": integer(1).about(
        "client connects to one real server that fail in a row (refused, timeout, or reset "
        "by the server before its first byte) before it is ejected; a connection that "
        "has the server's first byte, or ends without such a reset, starts the count again"
    ),
    "base_ejection_time": duration(positive=True).about(
        "an ejected server gets no new connection for this long times the number of "
        "times it was ejected in a row"
    ),
    "max_ejection_time": duration(positive=True).about(
        "the longest one ejection lasts; at least `base_ejection_time`"
    ),
    "max_ejection_percent": integer(0, 100).about(
        "share of the non-backup real servers (rounded down) ejected at once, at most; "
        "one always stays"
    ),
}

PER_SOURCE_FIELDS: dict[str, Converter] = {
    "max_connections": integer(1).about(
        "open connections one client network may hold; its next is closed at accept "
        '(`rejected{reason="per_source"}`)',
        default="none",
    ),
    "rate": integer(1).about(
        "connections one client network may open within `interval` (a sliding window; "
        "refused ones do not count); beyond: closed at accept (at least one of the two)",
        default="none",
    ),
    "interval": duration(positive=True).about("the window `rate` counts over"),
    "prefix_v4": integer(1, 32).about("prefix length of an IPv4 client network (32: each address)"),
    "prefix_v6": integer(1, 128).about(
        "prefix length of an IPv6 client network (64: a host or a site usually holds a whole /64)"
    ),
    "max_tracked": integer(1).about(
        "client networks remembered; beyond, the least recently seen one without open "
        "connections is forgotten (a refused arrival counts as seen)"
    ),
    "shared": boolean.about(
        "add the other cluster instances' counts, as they last published them (at most 1 s "
        "old); needs `global.cluster`"
    ),
}

QUEUE_FIELDS: dict[str, Converter] = {
    "max": integer(1).about("waiting clients; one more is refused (`queue_full`)"),
    "timeout": duration(positive=True).about(
        "how long a client may wait for a free slot (`queue_timeout`)"
    ),
    "abort_on_close": boolean.about(
        "drop a waiting client that closed its side (sent a FIN) when its turn comes, "
        "as `queue_abandoned`, as it drops one that reset; off: a FIN may be a half-close "
        "(the request sent, the reply awaited) and the client is served"
    ),
}


# --------------------------------------------------------------------------------------
# The tree of sections: where each table applies, for the reader, reference and schema
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    """One mapping of the configuration (or, `many`, a list of them)."""

    fields: Mapping[str, Converter]
    model: type | None  # the dataclass whose field defaults are this section's defaults
    description: str
    sections: Mapping[str, Section] = field(default_factory=dict)
    many: bool = False  # a list of mappings (virtual_servers, real_servers)
    required: tuple[str, ...] = ()
    # Keys whose default is another dataclass's field (a scheduler's `Options`), not `model`'s.
    option_models: Mapping[str, type] = field(default_factory=dict)
    page: str = ""  # the concept page that explains it, relative to docs/
    read_by: tuple[str, ...] = ()  # schedulers that use it; empty: every scheduler
    defaults_from: str = ""  # a section whose values are the defaults ("overrides of")
    only: tuple[str, ...] = ()  # schedulers that alone accept it (another: an error)
    required_unless: Mapping[str, str] = field(default_factory=dict)  # key -> other key
    # What the reader checks across keys, as JSON Schema (`if`/`then`, `anyOf`): the
    # schema's share of the rules that no one key's converter can say.
    rules: tuple[dict[str, Any], ...] = ()


_SNMP = Section(
    SNMP_FIELDS,
    SnmpConfig,
    "the SNMP poller that feeds `dwd`, `dwr` and `least-load` with `load_source: snmp`",
    page="concepts/dynamic-weights.md",
    read_by=schedulers.reading(schedulers.SNMP),
)

SECTIONS = Section(
    {},
    None,
    "A file holds a `global:` section (only one file may), a `virtual_servers:` list, or both.",
    sections={
        "global": Section(
            GLOBAL_FIELDS,
            GlobalConfig,
            "process-wide settings",
            sections={
                "admin": Section(
                    ADMIN_FIELDS,
                    AdminConfig,
                    "the admin endpoint: API, `/metrics`, `/healthz`, `/readyz`, dashboard",
                    page="reference/admin-api.md",
                ),
                "locator": Section(
                    {},
                    None,
                    "the locator's other faces",
                    sections={
                        "dns": Section(
                            DNS_LOCATOR_FIELDS,
                            DnsLocatorConfig,
                            "the DNS locator (only with this block); changing it takes a restart",
                            page="concepts/locator.md",
                            sections={
                                "rate_limit": Section(
                                    DNS_RATE_LIMIT_FIELDS,
                                    DnsRateLimitConfig,
                                    "response rate limiting of UDP answers per source "
                                    "prefix, as BIND's `rate-limit`",
                                    page="concepts/locator.md",
                                )
                            },
                        )
                    },
                    page="concepts/locator.md",
                ),
                "cluster": Section(
                    CLUSTER_FIELDS,
                    None,
                    "several instances as one, through a shared Redis; changing it takes a restart",
                    required=("redis", "key_file"),
                    page="howto/several-instances.md",
                    sections={
                        "redis": Section(
                            REDIS_FIELDS,
                            RedisConfig,
                            "the Redis server: runtime changes, load reports, persistence "
                            "entries and members are shared through it",
                            required=("url",),
                            page="howto/several-instances.md",
                        )
                    },
                ),
            },
        ),
        "virtual_servers": Section(
            VIRTUAL_SERVER_FIELDS,
            VirtualServerConfig,
            "what clients connect to: listen addresses, a scheduler and real servers",
            required=("name", "listen"),
            required_unless={"real_servers": "discovery"},
            option_models=schedulers.option_models(),
            many=True,
            page="concepts/servers.md",
            sections={
                "health_check": Section(
                    HEALTH_CHECK_FIELDS,
                    HealthCheckConfig,
                    "active health checks of every real server",
                    page="concepts/health.md",
                    rules=(
                        {
                            "if": {
                                "properties": {"type": {"const": "send_expect"}},
                                "required": ["type"],
                            },
                            "then": {
                                "anyOf": [{"required": ["expect"]}, {"required": ["expect_hex"]}]
                            },
                        },
                        {
                            "if": {
                                "properties": {"type": {"const": "dns"}},
                                "required": ["type"],
                            },
                            "then": {"required": ["query"]},
                        },
                        # keys of some check types only (CHECK_TYPE_KEYS)
                        *(
                            {
                                "if": {"required": [key]},
                                "then": {
                                    "required": ["type"],
                                    "properties": {"type": {"enum": list(types)}},
                                },
                            }
                            for key, types in CHECK_TYPE_KEYS.items()
                        ),
                    ),
                ),
                "snmp": _SNMP,
                "agent_check": Section(
                    AGENT_CHECK_FIELDS,
                    AgentCheckConfig,
                    "an agent on each real server tells its weight percent, max_connections "
                    "and state (HAProxy's agent-check), beside the health check",
                    page="concepts/agent.md",
                ),
                "throttle": Section(
                    THROTTLE_FIELDS,
                    ThrottleConfig,
                    "admission control (low, high, digg); needs `max_connections` or `max_rate`",
                    page="concepts/throttle.md",
                    rules=(
                        {"anyOf": [{"required": ["max_connections"]}, {"required": ["max_rate"]}]},
                    ),
                ),
                "persistence": Section(
                    PERSISTENCE_FIELDS,
                    PersistenceConfig,
                    "client persistence: a client goes back to its last real server",
                    page="concepts/affinity.md",
                ),
                "per_source": Section(
                    PER_SOURCE_FIELDS,
                    PerSourceConfig,
                    "limits per client network, applied at accept before any byte is read: "
                    "open connections and new connections within a sliding window; needs "
                    "`max_connections` or `rate`",
                    page="concepts/protection.md",
                    rules=({"anyOf": [{"required": ["max_connections"]}, {"required": ["rate"]}]},),
                ),
                "queue": Section(
                    QUEUE_FIELDS,
                    QueueConfig,
                    "clients wait for a server held back by `max_connections` instead of "
                    "being refused; `queue:` alone takes the defaults",
                    page="concepts/front-door.md",
                ),
                "outlier_detection": Section(
                    OUTLIER_DETECTION_FIELDS,
                    OutlierDetectionConfig,
                    "real servers whose connects keep failing are ejected for a while, "
                    "whatever their health check says; `outlier_detection:` alone takes "
                    "the defaults",
                    page="concepts/protection.md",
                ),
                "conditioning": Section(
                    CONDITIONING_FIELDS,
                    ConditioningConfig,
                    "move idle long-lived connections toward the least-loaded server",
                    page="concepts/conditioning.md",
                    only=schedulers.with_load(),
                ),
                "udp": Section(
                    UDP_FIELDS,
                    UdpConfig,
                    "the session table of a virtual server with `protocol: udp`",
                    page="concepts/udp.md",
                    sections={
                        "source_prefix": Section(
                            SOURCE_PREFIX_FIELDS,
                            SourcePrefixConfig,
                            "the prefixes `max_sessions_per_source` counts by, e.g. "
                            "`{v4: 32, v6: 64}`",
                            page="concepts/udp.md",
                        )
                    },
                ),
                "real_servers": Section(
                    REAL_SERVER_FIELDS,
                    RealServerConfig,
                    "the servers connections go to (may be empty or left out with `discovery`)",
                    many=True,
                    required=("name", "address"),
                    page="concepts/servers.md",
                    sections={
                        "health_check": Section(
                            REAL_SERVER_CHECK_FIELDS,
                            RealServerCheckConfig,
                            "where this server's health checks go, e.g. `{port: 8008}`, and "
                            "whether they send a PROXY header; the rest is the virtual "
                            "server's `health_check`",
                            page="concepts/health.md",
                        ),
                        "snmp": Section(
                            SNMP_FIELDS,
                            SnmpConfig,
                            "overrides of the virtual server's `snmp` block, key by key, "
                            "e.g. `{host: 10.0.0.11, port: 1161}`",
                            page="concepts/dynamic-weights.md",
                            defaults_from="virtual_servers[].snmp",
                        ),
                        "agent_check": Section(
                            REAL_SERVER_AGENT_CHECK_FIELDS,
                            AgentCheckConfig,
                            "this server's agent, where it differs from the virtual "
                            "server's `agent_check` (or an agent for this server alone), "
                            "e.g. `{port: 9777, address: 10.0.0.11}`",
                            page="concepts/agent.md",
                            defaults_from="virtual_servers[].agent_check",
                        ),
                    },
                ),
                "discovery": Section(
                    {},
                    None,
                    "real servers from DNS, beside the static ones",
                    required=("dns",),
                    page="concepts/discovery.md",
                    sections={
                        "dns": Section(
                            DNS_DISCOVERY_FIELDS,
                            DnsDiscoveryConfig,
                            "SRV, A or AAAA records, re-resolved every `interval`",
                            required=("name",),
                            page="concepts/discovery.md",
                            rules=(
                                {  # A/AAAA need a port; SRV records carry their own
                                    "if": {
                                        "properties": {"type": {"pattern": "^(?:[Aa]|[Aa]{4})$"}},
                                        "required": ["type"],
                                    },
                                    "then": {"required": ["port"]},
                                    "else": {"properties": {"port": False}},
                                },
                            ),
                        )
                    },
                ),
            },
        ),
    },
)

_VIRTUAL_SERVER = SECTIONS.sections["virtual_servers"]
# Schedulers without a load to balance (SPEC §11): they reject a `conditioning:` block.
UNCONDITIONED_SCHEDULERS = schedulers.without_load()

TOP_LEVEL_SECTIONS = tuple(SECTIONS.sections)
GLOBAL_SECTIONS = tuple(SECTIONS.sections["global"].sections)
LOCATOR_SECTIONS = tuple(SECTIONS.sections["global"].sections["locator"].sections)
DNS_LOCATOR_SECTIONS = tuple(
    SECTIONS.sections["global"].sections["locator"].sections["dns"].sections
)
CLUSTER_SECTIONS = tuple(SECTIONS.sections["global"].sections["cluster"].sections)
VIRTUAL_SERVER_SECTIONS = tuple(SECTIONS.sections["virtual_servers"].sections)
REAL_SERVER_SECTIONS = tuple(SECTIONS.sections["virtual_servers"].sections["real_servers"].sections)
DISCOVERY_SECTIONS = tuple(SECTIONS.sections["virtual_servers"].sections["discovery"].sections)
UDP_SECTIONS = tuple(SECTIONS.sections["virtual_servers"].sections["udp"].sections)


def walk(section: Section = SECTIONS, path: str = "") -> Iterator[tuple[str, Section]]:
    """Every section with its dotted path ("virtual_servers[].health_check"), top first."""
    yield path, section
    for name, child in section.sections.items():
        child_path = f"{path}.{name}" if path else name
        yield from walk(child, child_path + ("[]" if child.many else ""))
