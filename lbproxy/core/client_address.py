"""What a client's address decides: whether it is let in, and whose share it counts in.

PURE. Two small things that every connection or UDP session asks of its source address,
kept cheap because they are asked per connection:

- `SourceFilter`: an `allow`/`deny` pair of network lists (a virtual server's ACL, its
  `accept_proxy_from`), with its verdict per address string remembered. Parsing an
  address and testing it against a list of networks costs microseconds; a dict lookup
  of the string the accept gave costs tens of nanoseconds, and a service sees the same
  clients (or the same few PROXY senders) again and again. A filter that admits everyone
  (`allow` 0.0.0.0/0 and ::/0, no `deny`: the default ACL) answers without a lookup.
  The memory is bounded (`REMEMBERED` addresses; then it starts afresh), so a flood of
  new sources costs each its parse and no more.
- `source_key`: the key a UDP session's source counts under for
  `udp.max_sessions_per_source` (SPEC §21): the address itself at a full-length prefix,
  else its network at `udp.source_prefix` (/64 for IPv6 by default: one host, or one
  customer, holds a whole /64, so a cap per address would not hold it).

An IPv4 client on an IPv6 socket (`::ffff:a.b.c.d`) is the IPv4 address, and an IPv6
zone (`fe80::1%eth0`) is dropped, as the networks of a configuration have none.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

__all__ = ["REMEMBERED", "SourceFilter", "covers_everyone", "source_key"]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Verdicts remembered per filter; past it the table is emptied and refilled.
REMEMBERED = 4096

_EVERY_V4 = ipaddress.ip_network("0.0.0.0/0")
_EVERY_V6 = ipaddress.ip_network("::/0")


def covers_everyone(allow: Iterable[IPNetwork], deny: Iterable[IPNetwork] = ()) -> bool:
    """Whether this allow/deny pair admits every address (no address need be parsed)."""
    allow = tuple(allow)
    return not tuple(deny) and _EVERY_V4 in allow and _EVERY_V6 in allow


def _address(host: str) -> IPAddress | None:
    """The IP address of an accepted peer's host string (None: not an IP address)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class SourceFilter:
    """`allow`, then `deny` (deny wins), over the networks given; `admits(host)` is asked
    per connection with the host string accept() returned."""

    __slots__ = ("_allow", "_deny", "_verdicts", "everyone")

    def __init__(self, allow: Iterable[IPNetwork], deny: Iterable[IPNetwork] = ()) -> None:
        self._allow = tuple(allow)
        self._deny = tuple(deny)
        self.everyone = covers_everyone(self._allow, self._deny)
        self._verdicts: dict[str, bool] = {}

    def admits(self, host: str) -> bool:
        if self.everyone:
            return True
        verdict = self._verdicts.get(host)
        if verdict is None:
            verdicts = self._verdicts
            if len(verdicts) >= REMEMBERED:
                verdicts.clear()
            verdict = verdicts[host] = self.decide(host)
        return verdict

    def decide(self, host: str) -> bool:
        """The verdict for `host`, worked out (not remembered)."""
        ip = _address(host)
        if ip is None:
            return False
        version = ip.version
        if any(ip in net for net in self._deny if net.version == version):
            return False
        return any(ip in net for net in self._allow if net.version == version)


def source_key(host: str, v4: int, v6: int) -> object:
    """What `host` counts under at prefix lengths `v4` and `v6`: the host string itself
    at a full-length prefix (no parse: the common IPv4 case), else (version, network
    number). Not an IP address: the string itself."""
    if ":" not in host:
        if v4 >= 32:
            return host
    elif v6 >= 128 and "." not in host and "%" not in host:
        return host
    ip = _address(host)
    if ip is None:
        return host
    if ip.version == 4:
        if v4 >= 32:
            return ip.compressed
        return 4, int(ip) >> (32 - v4)
    if v6 >= 128:
        return ip.compressed
    return 6, int(ip) >> (128 - v6)
