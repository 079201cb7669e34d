"""The keys of each configuration section and the converter that reads each one.

PURE. The reader (reader.py) walks these tables; nothing else decides which keys exist.
"""

from __future__ import annotations

from lbproxy.config.model import MAX_WEIGHT
from lbproxy.config.values import (
    Converter,
    _address,
    _admin_listen,
    _boolean,
    _choice,
    _dns_name,
    _dns_zone,
    _duration,
    _host,
    _http_path,
    _integer,
    _listen_address,
    _name,
    _networks,
    _number,
    _oid,
    _record_type,
    _regex,
    _resolvers,
    _scheduler,
    _sni_names,
    _snmp_version,
    _status_codes,
    _string,
    _table_size,
    _vs_listen,
    _workers,
)

# --------------------------------------------------------------------------------------
# The keys of each section and how to read them
# --------------------------------------------------------------------------------------
# Keys map to the dataclass field of the same name; nested sections are read separately.

_TOP_LEVEL_SECTIONS = ("global", "virtual_servers")

_GLOBAL_FIELDS: dict[str, Converter] = {
    "log_format": _choice("text", "json"),
    "drain_timeout": _duration(positive=False),
    "workers": _workers,
    "access_log": _boolean,
}
_GLOBAL_SECTIONS = ("admin", "locator")

_ADMIN_FIELDS: dict[str, Converter] = {
    "listen": _admin_listen,
    "token_file": _string,
}

_VIRTUAL_SERVER_FIELDS: dict[str, Converter] = {
    "name": _name,
    "listen": _vs_listen,
    "scheduler": _scheduler,
    "quiesce": _boolean,
    "load_source": _choice("connections", "snmp", "report"),
    "load_poll_interval": _duration(positive=True),
    "slow_start": _duration(positive=False),
    "connect_timeout": _duration(positive=True),
    "idle_timeout": _duration(positive=True),
    "retries": _integer(0),
    "max_connections": _integer(0),
    "allow": _networks,
    "deny": _networks,
    "send_proxy": _choice("none", "v1", "v2"),
    "accept_proxy": _boolean,
    "table_size": _table_size,
    "hash_key": _choice("source", "source_port"),
    "sni": _sni_names,
}
_VIRTUAL_SERVER_SECTIONS = (
    "health_check",
    "snmp",
    "throttle",
    "persistence",
    "queue",
    "conditioning",
    "real_servers",
    "discovery",
)

_REAL_SERVER_FIELDS: dict[str, Converter] = {
    "name": _name,
    "address": _address(listen=False),
    "weight": _integer(0, MAX_WEIGHT),
    "max_connections": _integer(0),
    "load_factor": _number(above=0),
    "state": _choice("enabled", "drain", "disabled"),
    "backup": _boolean,
}
_REAL_SERVER_SECTIONS = ("snmp",)

_HEALTH_CHECK_FIELDS: dict[str, Converter] = {
    "type": _choice("tcp", "send_expect", "http", "none"),
    "interval": _duration(positive=True),
    "timeout": _duration(positive=True),
    "rise": _integer(1),
    "fall": _integer(1),
    "send": _string,
    "expect": _regex,
    "path": _http_path,
    "expect_status": _status_codes,
    "on_down": _choice("keep", "close"),
}

_SNMP_FIELDS: dict[str, Converter] = {
    "oid": _oid,
    "version": _snmp_version,
    "community": _string,
    "user": _string,
    "auth_protocol": _choice("SHA", "SHA256", "MD5"),
    "auth_key_file": _string,
    "priv_protocol": _choice("AES", "AES256", "DES"),
    "priv_key_file": _string,
    "host": _host,
    "port": _integer(1, 65535),
    "interval": _duration(positive=True),
    "timeout": _duration(positive=True),
    "retries": _integer(0),
    "on_no_answer": _choice("zero", "hold", "static"),
    "stale_after": _duration(positive=True),
    "smoothing": _number(above=0, at_most=1),
    "max_value": _integer(1),
}

_THROTTLE_FIELDS: dict[str, Converter] = {
    "max_connections": _integer(1),
    "max_rate": _number(above=0),
    "digg_factor": _number(above=1),
    "high_idle_timeout": _duration(positive=True),
    "min_idle_timeout": _duration(positive=True),
    "interval": _duration(positive=True),
}

_PERSISTENCE_FIELDS: dict[str, Converter] = {
    "timeout": _duration(positive=True),
    "max_entries": _integer(1),
}

# Keys that only the maglev scheduler reads: an error with any other (not silently unused).
_MAGLEV_KEYS = ("table_size", "hash_key")
_LOCATOR_SECTIONS = ("dns",)

_DNS_LOCATOR_FIELDS: dict[str, Converter] = {
    "listen": _listen_address,
    "zone": _dns_zone,
    "ttl": _integer(0, 2**31 - 1),
}

_CONDITIONING_FIELDS: dict[str, Converter] = {
    "interval": _duration(positive=True),
    "idle_for": _duration(positive=False),
    "max_per_interval": _integer(1),
    "threshold": _number(above=0),
}

# Schedulers without a load to balance (SPEC §11): they reject a `conditioning:` block.
_UNCONDITIONED_SCHEDULERS = ("rr", "wrr", "first", "maglev")

_DISCOVERY_SECTIONS = ("dns",)

_DNS_DISCOVERY_FIELDS: dict[str, Converter] = {
    "name": _dns_name,
    "type": _record_type,
    "port": _integer(1, 65535),
    "resolvers": _resolvers,
    "interval": _duration(positive=True),
    "hold": _duration(positive=False),
    "timeout": _duration(positive=True),
}

_QUEUE_FIELDS: dict[str, Converter] = {
    "max": _integer(1),
    "timeout": _duration(positive=True),
}

# Schedulers whose weights come from the SNMP poller.
_SNMP_SCHEDULERS = ("dwd", "dwr")
