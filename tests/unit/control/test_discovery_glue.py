"""The addresses an SRV answer brings for its targets (control/discovery.py `glue`),
from real dnspython rrsets."""

from __future__ import annotations

import dns.rrset

from lbproxy.control.discovery import glue


def test_a_target_of_several_addresses_gets_its_lowest_and_is_counted():
    additional = [
        dns.rrset.from_text("a.node.test.", 0, "IN", "A", "10.0.0.10", "10.0.0.9"),
        dns.rrset.from_text("A.node.test.", 0, "IN", "AAAA", "::1"),
        dns.rrset.from_text("b.node.test.", 0, "IN", "A", "10.0.0.2"),
        dns.rrset.from_text("c.node.test.", 0, "IN", "AAAA", "2001:db8::2", "2001:db8::10"),
    ]
    several: dict[str, int] = {}
    assert glue(additional, several) == {
        "a.node.test": "10.0.0.9",  # IPv4 first, then by number, not by text
        "b.node.test": "10.0.0.2",
        "c.node.test": "2001:db8::2",
    }
    assert several == {"a.node.test": 3, "c.node.test": 2}
