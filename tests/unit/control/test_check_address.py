"""Where a real server's checks go: its own `health_check: {port, address}` over the
virtual server's `health_check` `port` and `address`, over where it is served."""

from __future__ import annotations

from lbproxy.config.model import Address, HealthCheckConfig, RealServerCheckConfig
from lbproxy.control.checks import check_address

SERVED = Address("10.0.0.11", 5432)


def test_served_address_without_overrides():
    assert check_address(SERVED, HealthCheckConfig(), None) == SERVED
    assert check_address(SERVED, HealthCheckConfig(), RealServerCheckConfig()) == SERVED


def test_virtual_server_port_and_address():
    check = HealthCheckConfig(port=8008)
    assert check_address(SERVED, check, None) == Address("10.0.0.11", 8008)
    check = HealthCheckConfig(address="mgmt.example", port=8008)
    assert check_address(SERVED, check, None) == Address("mgmt.example", 8008)


def test_a_real_servers_own_keys_win_key_by_key():
    check = HealthCheckConfig(address="10.9.9.9", port=8008)
    own_port = RealServerCheckConfig(port=8009)
    assert check_address(SERVED, check, own_port) == Address("10.9.9.9", 8009)
    own_host = RealServerCheckConfig(address="10.0.0.21")
    assert check_address(SERVED, check, own_host) == Address("10.0.0.21", 8008)
    assert check_address(SERVED, HealthCheckConfig(), own_port) == Address("10.0.0.11", 8009)
