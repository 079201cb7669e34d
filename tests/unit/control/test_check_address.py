"""Where a real server's checks go: its own `health_check: {port, address}` over the
virtual server's `health_check` `port` and `address`, over where it is served; and
whether they begin with a PROXY header."""

from __future__ import annotations

from lbproxy.config.model import Address, HealthCheckConfig, RealServerCheckConfig
from lbproxy.control.checks import check_address, check_proxy_header

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


# -- the PROXY header a check begins with (HAProxy's check-send-proxy) -------------------


def test_the_header_follows_the_traffic_to_the_servers_own_port_only():
    tcp = HealthCheckConfig()
    assert check_proxy_header(SERVED, tcp, None, "v2") == "v2"
    assert check_proxy_header(SERVED, tcp, RealServerCheckConfig(), "v1") == "v1"
    assert check_proxy_header(SERVED, tcp, None, "none") == "none"
    # a check port or address elsewhere: none, as HAProxy with `port` or `addr`
    assert check_proxy_header(SERVED, HealthCheckConfig(port=8008), None, "v2") == "none"
    assert check_proxy_header(SERVED, tcp, RealServerCheckConfig(address="10.0.0.99"), "v1") == (
        "none"
    )
    # the same address written out is still the traffic port
    assert check_proxy_header(SERVED, HealthCheckConfig(port=5432), None, "v1") == "v1"


def test_send_proxy_forces_it_on_or_off_the_servers_own_key_first():
    forced = HealthCheckConfig(port=8008, send_proxy=True)
    assert check_proxy_header(SERVED, forced, None, "v2") == "v2"
    assert check_proxy_header(SERVED, forced, None, "none") == "v1"  # HAProxy's default line
    assert check_proxy_header(SERVED, HealthCheckConfig(send_proxy=False), None, "v2") == "none"
    own_off = RealServerCheckConfig(send_proxy=False)
    assert check_proxy_header(SERVED, forced, own_off, "v2") == "none"
    own_on = RealServerCheckConfig(port=8008, send_proxy=True)
    assert check_proxy_header(SERVED, HealthCheckConfig(), own_on, "v1") == "v1"
    # UDP checks have no PROXY header to send
    udp = HealthCheckConfig(type="udp", send_proxy=True)
    assert check_proxy_header(SERVED, udp, None, "v1") == "none"
