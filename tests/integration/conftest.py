"""Fixtures for the integration tests: real servers that say their name, a proxy factory."""

from __future__ import annotations

import pytest

from tests.integration.harness import Lbproxies, NameServer


@pytest.fixture
def name_servers():
    started: list[NameServer] = []

    def make(*names: str, **options) -> list[NameServer]:
        servers = [NameServer(name, **options) for name in names]
        started.extend(servers)
        return servers

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def lbproxy(tmp_path):
    """lbproxy(yaml_text, ...) -> a started `lbproxy run` process (harness.Lbproxies says
    what else it takes); stopped after the test, which then fails if the process ended by
    itself, exited non-zero or logged a traceback (see harness.Lbproxy for how a test
    declares one it expects)."""
    proxies = Lbproxies(tmp_path)
    yield proxies
    proxies.stop_all()  # fails the test on an unexpected exit, status or traceback
