"""Which passed socket feeds which address (lbproxy/runtime/inherit.py), on real sockets."""

from __future__ import annotations

import socket

import pytest

from lbproxy.config.model import Address
from lbproxy.runtime.inherit import PREVIOUS, SYSTEMD, Inherited, InheritError, Passed


@pytest.fixture
def sockets():
    made: list[socket.socket] = []

    def make(kind=socket.SOCK_STREAM) -> tuple[socket.socket, Address]:
        sock = socket.socket(socket.AF_INET, kind)
        sock.bind(("127.0.0.1", 0))
        if kind == socket.SOCK_STREAM:
            sock.listen()
        made.append(sock)
        return sock, Address("127.0.0.1", sock.getsockname()[1])

    yield make
    for sock in made:
        sock.close()


def test_the_hand_over_name_wins_over_the_address(sockets):
    a, address = sockets()
    b, _ = sockets()
    pool = Inherited([Passed(a, "other", PREVIOUS), Passed(b, "127.0.0.1:0", PREVIOUS)])
    # A port-0 address matches the socket named after it, not one bound elsewhere.
    assert pool.take("127.0.0.1:0", Address("127.0.0.1", 0), udp=False) is b
    assert pool.take(str(address), address, udp=False) is a


def test_a_virtual_server_name_stands_for_its_one_address(sockets):
    a, _ = sockets()
    pool = Inherited([Passed(a, "web", SYSTEMD)])
    wanted = Address("0.0.0.0", 80)  # not the socket's own address: the name decides
    assert pool.take(str(wanted), wanted, udp=False, names=["api"]) is None
    assert pool.take(str(wanted), wanted, udp=False, names=["web"]) is a
    pool.check_all_used()


def test_by_address_and_of_the_right_kind(sockets):
    tcp, address = sockets()
    udp, udp_address = sockets(socket.SOCK_DGRAM)
    pool = Inherited([Passed(tcp, "unknown", SYSTEMD), Passed(udp, "unknown", SYSTEMD)])
    assert pool.take(str(udp_address), udp_address, udp=False) is None  # the TCP one is elsewhere
    assert pool.take(str(udp_address) + "/udp", udp_address, udp=True) is udp
    localhost = Address("localhost", address.port)
    assert pool.take("localhost", localhost, udp=False) is tcp


def test_a_systemd_socket_nothing_took_is_an_error_naming_it(sockets):
    a, address = sockets()
    pool = Inherited([Passed(a, "metrics", SYSTEMD)])
    with pytest.raises(InheritError) as error:
        pool.check_all_used()
    assert f"systemd's socket 'metrics' (TCP {address}) matches no virtual server" in str(
        error.value
    )
    assert pool.missing("127.0.0.1:80") == (
        f" (not among the sockets passed: metrics {address}; add it to lbproxy.socket)"
    )


def test_a_failed_bind_names_only_systemds_sockets(sockets):
    """The hint is about systemd's socket unit: sockets from a previous lbproxy (an
    upgrade) or from a supervisor (a worker) are not named, and there is no hint."""
    a, _ = sockets()
    b, address = sockets()
    assert Inherited([Passed(a, "127.0.0.1:81", PREVIOUS)]).missing("127.0.0.1:80") == ""
    mixed = Inherited([Passed(a, "127.0.0.1:81", PREVIOUS), Passed(b, "web", SYSTEMD)])
    assert mixed.missing("127.0.0.1:80") == (
        f" (not among the sockets passed: web {address}; add it to lbproxy.socket)"
    )


def test_a_previous_socket_the_new_configuration_dropped_is_closed(sockets):
    a, _ = sockets()
    pool = Inherited([Passed(a, "127.0.0.1:81", PREVIOUS)])
    pool.check_all_used()
    assert a.fileno() == -1


def test_no_listen_fds_takes_nothing_and_clears_the_environment():
    env = {"LISTEN_PID": "1", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "a:b", "OTHER": "x"}
    assert not Inherited.from_systemd(env)  # LISTEN_PID is another process's
    assert env == {"OTHER": "x"}
    assert not Inherited.from_systemd({})
