"""The DNS locator's source ACL and response rate limiting, on a passed-in clock."""

from __future__ import annotations

import ipaddress

from lbproxy.config.model import DNS_ALLOW_DEFAULT
from lbproxy.locator.dns_rate_limit import ANSWER, DROP, REFUSE, SLIP, SourcePolicy


def test_the_default_allow_list_is_loopback_and_the_private_ranges():
    policy = SourcePolicy(DNS_ALLOW_DEFAULT, 0, 2)
    for host in ("127.0.0.1", "::1", "10.1.2.3", "172.31.0.1", "192.168.9.9", "fd00::1"):
        assert policy.allowed(host), host
    for host in ("8.8.8.8", "172.32.0.1", "2001:db8::1", "::ffff:8.8.8.8", "bogus"):
        assert not policy.allowed(host), host
    assert policy.allowed("::ffff:10.0.0.1")  # a mapped address is its IPv4 one
    assert policy.verdict("8.8.8.8", 0.0) == REFUSE


def test_over_the_limit_every_slip_th_is_truncated_and_the_next_second_starts_again():
    policy = SourcePolicy(DNS_ALLOW_DEFAULT, 3, 2)
    got = [policy.verdict("10.0.0.1", 5.1) for _ in range(7)]
    assert got == [ANSWER] * 3 + [DROP, SLIP, DROP, SLIP]
    # the same /24 shares the window; another /24 has its own
    assert policy.verdict("10.0.0.200", 5.9) == DROP
    assert policy.verdict("10.0.1.1", 5.9) == ANSWER
    assert policy.verdict("10.0.0.1", 6.0) == ANSWER


def test_ipv6_prefixes_are_56_bits_and_zero_turns_it_off():
    policy = SourcePolicy([ipaddress.ip_network("fc00::/7")], 1, 0)
    assert policy.verdict("fd00:0:0:1::1", 0.0) == ANSWER
    assert policy.verdict("fd00:0:0:ff::2", 0.0) == DROP  # the same /56, slip 0: drop
    assert policy.verdict("fd00:0:0:100::1", 0.0) == ANSWER  # another /56
    unlimited = SourcePolicy(DNS_ALLOW_DEFAULT, 0, 2)
    assert {unlimited.verdict("127.0.0.1", 0.0) for _ in range(1000)} == {ANSWER}


EVERYWHERE = (ipaddress.ip_network("0.0.0.0/0"),)


def other(i: int) -> str:
    """An address in the `i`-th /24 from 11.0.0.0."""
    return f"{11 + (i >> 16)}.{i >> 8 & 255}.{i & 255}.1"


def test_a_flood_of_other_prefixes_does_not_reset_a_limited_source():
    """The table forgets the least recently seen prefix, not all of them: 65,536 and
    more other prefixes (spoofed sources, within one second) leave a source that keeps
    asking counted, and still limited."""
    from lbproxy.locator.dns_rate_limit import MAX_PREFIXES

    policy = SourcePolicy(EVERYWHERE, 5, 0)
    attacker = "10.200.0.1"
    assert [policy.verdict(attacker, 7.0) for _ in range(5)] == [ANSWER] * 5
    verdicts = []
    for i in range(MAX_PREFIXES + 5000):  # others, each a /24 of its own, same second
        assert policy.verdict(other(i), 7.5) == ANSWER
        if i % 1000 == 0:
            verdicts.append(policy.verdict(attacker, 7.5))
    assert set(verdicts) == {DROP}  # its count survived every eviction
    assert policy.prefixes == MAX_PREFIXES
    assert policy.verdict(attacker, 8.0) == ANSWER  # a new second: a new window


def test_a_prefix_not_seen_for_longest_is_the_one_forgotten():
    from lbproxy.locator.dns_rate_limit import MAX_PREFIXES

    policy = SourcePolicy(EVERYWHERE, 1, 0)
    assert policy.verdict("10.255.255.1", 0.0) == ANSWER  # the oldest, then never again
    for i in range(MAX_PREFIXES - 1):
        policy.verdict(other(i), 0.0)
    assert policy.verdict(other(0), 0.0) == DROP  # seen: still counted (and now recent)
    policy.verdict("192.168.0.1", 0.0)  # one more prefix: 10.255.255.0/24 goes
    assert policy.prefixes == MAX_PREFIXES
    assert policy.verdict("10.255.255.1", 0.0) == ANSWER  # forgotten: a new window
    assert policy.verdict(other(0), 0.0) == DROP
