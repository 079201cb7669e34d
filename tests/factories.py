"""Builders of configuration objects for the pure-core tests."""

from __future__ import annotations

import ssl
from typing import Any

import pytest

from lbproxy.config.model import Address, RealServerConfig, SnmpConfig, VirtualServerConfig
from lbproxy.core import schedulers


def real_server(name: str, port: int, **options: Any) -> RealServerConfig:
    return RealServerConfig(name=name, address=Address("127.0.0.1", port), **options)


def virtual_server(scheduler: str, servers: dict[str, dict[str, Any]], **options: Any):
    """`servers`: name -> RealServerConfig options, in configuration order; the
    scheduler's own options (maglev's `table_size=101`) are given as the other keys."""
    algorithm = schedulers.get(scheduler)
    own = {key: options.pop(key) for key in list(options) if key in algorithm.options}
    if own:
        options["options"] = algorithm.Options(**own)
    real = tuple(
        real_server(name, 20000 + i, **opts) for i, (name, opts) in enumerate(servers.items())
    )
    return VirtualServerConfig(
        name="vs",
        listen=(Address("127.0.0.1", 19999),),
        real_servers=real,
        scheduler=scheduler,
        **options,
    )


SNMP = SnmpConfig()


def real_hello(server_name: str | None = "api.example.com", alpn: list[str] | None = None) -> bytes:
    """The first flight of a real TLS client (Python's ssl, OpenSSL), no network;
    `alpn`: the protocols it offers (set_alpn_protocols)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if alpn is not None:
        context.set_alpn_protocols(alpn)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()
