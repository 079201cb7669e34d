"""core/client_address.py: the ACL's verdict per address (remembered, bounded) and the
key a UDP source counts under for max_sessions_per_source (SPEC §21: /64 for IPv6)."""

from __future__ import annotations

import ipaddress

import pytest

from lbproxy.config.model import PRIVATE_NETWORKS
from lbproxy.core import client_address
from lbproxy.core.client_address import SourceFilter, covers_everyone, source_key


def nets(*texts: str):
    return tuple(ipaddress.ip_network(t) for t in texts)


EVERYONE = nets("0.0.0.0/0", "::/0")


def test_the_default_acl_admits_everyone_without_a_lookup():
    acl = SourceFilter(EVERYONE)
    assert acl.everyone and covers_everyone(EVERYONE)
    assert acl.admits("anything at all")  # not even parsed
    assert not covers_everyone(EVERYONE, nets("10.0.0.0/8"))
    assert not covers_everyone(nets("0.0.0.0/0"))  # IPv6 clients are not all admitted


@pytest.mark.parametrize(
    ("host", "admitted"),
    [
        ("127.0.0.1", True),
        ("10.1.2.3", True),
        ("172.31.255.255", True),
        ("172.32.0.1", False),
        ("192.168.7.7", True),
        ("203.0.113.9", False),
        ("::1", True),
        ("fd00::5", True),
        ("2001:db8::1", False),
        ("::ffff:10.0.0.1", True),  # an IPv4 client on an IPv6 socket is IPv4
        ("::ffff:203.0.113.9", False),
        ("fe80::1%eth0", False),  # a zone is dropped: fe80::/10 is not listed
        ("not an address", False),
    ],
)
def test_the_private_ranges_as_accept_proxy_from(host, admitted):
    trusted = SourceFilter(PRIVATE_NETWORKS)
    assert trusted.admits(host) is admitted
    assert trusted.admits(host) is admitted  # remembered, the same
    assert trusted.decide(host) is admitted


def test_deny_wins_over_allow():
    acl = SourceFilter(nets("10.0.0.0/8"), nets("10.9.0.0/16"))
    assert acl.admits("10.1.0.1") and not acl.admits("10.9.0.1")


class Counting(SourceFilter):
    __slots__ = ("decided",)

    def decide(self, host: str) -> bool:
        self.decided += 1
        return super().decide(host)


def test_verdicts_are_remembered_up_to_a_bound(monkeypatch):
    monkeypatch.setattr(client_address, "REMEMBERED", 8)
    acl = Counting(nets("10.0.0.0/8"))
    acl.decided = 0
    for _ in range(3):
        assert acl.admits("10.0.0.1") and not acl.admits("192.0.2.1")
    assert acl.decided == 2  # each address parsed once
    for i in range(20):  # many sources: the table starts afresh, never grows past 8
        assert acl.admits(f"10.0.1.{i}")
        assert len(acl._verdicts) <= 8
    assert acl.decided == 22


def test_source_keys_at_full_length_are_the_address_itself():
    assert source_key("192.0.2.1", 32, 64) == "192.0.2.1"
    assert source_key("2001:db8::1", 32, 128) == "2001:db8::1"


def test_ipv6_sources_share_a_slash_64_by_default():
    one = source_key("2001:db8:1:2::1", 32, 64)
    assert one == source_key("2001:db8:1:2:ffff:ffff:ffff:ffff", 32, 64)
    assert one == source_key("2001:0db8:0001:0002:0000:0000:0000:0099", 32, 64)
    assert one != source_key("2001:db8:1:3::1", 32, 64)  # the next /64
    assert source_key("fe80::1%eth0", 32, 64) == source_key("fe80::2", 32, 64)


def test_ipv4_sources_share_their_prefix_when_asked():
    assert source_key("127.0.0.2", 24, 64) == source_key("127.0.0.3", 24, 64)
    assert source_key("127.0.0.2", 24, 64) != source_key("127.0.1.2", 24, 64)
    assert source_key("127.0.0.2", 32, 64) != source_key("127.0.0.3", 32, 64)
    # an IPv4 client on an IPv6 socket counts as that IPv4 address
    assert source_key("::ffff:127.0.0.2", 24, 64) == source_key("127.0.0.9", 24, 64)
    assert source_key("::ffff:127.0.0.2", 32, 64) == source_key("127.0.0.2", 32, 64)
    # IPv4 and IPv6 never share a key
    assert source_key("0.0.0.1", 1, 1) != source_key("::1", 1, 1)
