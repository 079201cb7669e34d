"""lbproxy.net.descriptors: `max_clients: auto` leaves the reserve free whatever the
open-file limit, and `apply_max_clients` sets the count the accept batch compares."""

from __future__ import annotations

import logging

import pytest

from lbproxy.net import descriptors
from lbproxy.net.descriptors import (
    MIN_RESERVE,
    apply_max_clients,
    default_max_clients,
    descriptors_per_client,
)
from lbproxy.net.pump import MAX_IDLE_PIPES


@pytest.mark.parametrize("splice", [True, False])
def test_auto_keeps_ten_percent_or_64_descriptors_free_with_every_client_at_its_most(splice):
    pooled = 2 * MAX_IDLE_PIPES if splice else 0
    for nofile in [*range(64, 5000, 7), 65536, 524288, 1048576]:
        limit = default_max_clients(nofile, splice)
        held = limit * descriptors_per_client(splice) + pooled
        reserve = max(MIN_RESERVE, nofile // 10)
        if limit > 1:
            assert nofile - held >= reserve, nofile
            # and not much more: one client more would eat into it
            assert nofile - held - descriptors_per_client(splice) < reserve, nofile


def test_the_figures_an_operator_reads():
    assert descriptors_per_client(True) == 6  # client, server, a pipe per direction
    assert descriptors_per_client(False) == 2
    assert default_max_clients(1024, True) == (1024 - 102 - 256) // 6 == 111
    assert default_max_clients(1048576, True) == 157243  # a container's usual limit
    assert default_max_clients(64, True) == 1  # no room: one client, and a warning


def test_apply_sets_the_limit_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(descriptors, "clients", type(descriptors.clients)())
    monkeypatch.setattr(descriptors, "_nofile", lambda: 1024)
    monkeypatch.setattr(descriptors, "splice_available", lambda: True)
    with caplog.at_level(logging.INFO, logger="lbproxy.descriptors"):
        assert apply_max_clients(None) == 111
        assert apply_max_clients(None) == 111  # a reload that changes nothing: quiet
        assert apply_max_clients(5000) == 5000  # more than 1024 descriptors allow
    assert descriptors.clients.limit == 5000
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "max_clients 111 (open-file limit 1024, up to 6 descriptors a client)"
    assert messages[1] == "max_clients 5000"
    assert messages[2].startswith("max_clients 5000: with up to 6 descriptors a client, the")
    assert len(messages) == 3
