"""The documentation's samples of the runtime commands (`status`, `drain`, `explain`,
`add-server`, ...; tests/docs/examples.py finds them) run as written against a real
`lbproxy run`, one per page, whose configuration has the virtual and real servers the
page's samples name: each exits 0 (the offline samples are run by
tests/docs/test_examples.py; `run` and `upgrade` start processes of their own and are
tested on their own)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.docs.examples import Sample, samples
from tests.integration.harness import ROOT, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RUNTIME = {
    "status",
    "drain",
    "enable",
    "disable",
    "set-weight",
    "explain",
    "shutdown-sessions",
    "add-server",
    "remove-server",
    "reload",
}
NAMED = {"drain", "enable", "disable", "set-weight", "shutdown-sessions", "remove-server"}


def _by_page() -> dict[str, list[Sample]]:
    pages: dict[str, list[Sample]] = defaultdict(list)
    for sample in samples():
        if sample.argv and sample.argv[0] in RUNTIME:
            pages[str(sample.block.page.relative_to(ROOT))].append(sample)
    return dict(pages)


PAGES = _by_page()


def _configuration(page_samples: list[Sample], admin_port: int) -> str:
    """Every virtual server the samples name, with every real server they name."""
    servers: dict[str, set[str]] = defaultdict(set)
    for sample in page_samples:
        command, *words = [word for word in sample.argv if not word.startswith("-")]
        if command in NAMED | {"explain", "add-server"}:
            servers.setdefault(words[0], set())
        if command in NAMED:
            servers[words[0]].add(words[1])
    servers.setdefault("web", {"a"})
    lines = [
        "global:",
        f"  admin: {{listen: 127.0.0.1:{admin_port}}}",
        "virtual_servers:",
    ]
    for vs, names in servers.items():
        lines += [
            f"  - name: {vs}",
            f"    listen: 127.0.0.1:{free_port()}",
            "    health_check: {type: none}",
            "    real_servers:",
        ]
        for name in sorted(names or {"a"}):
            lines.append(f"      - {{name: {name}, address: 127.0.0.1:{free_port()}}}")
    return "\n".join(lines) + "\n"


def _argv(sample: Sample, admin: str) -> list[str]:
    argv = list(sample.argv)
    if "--admin" in argv:  # the page's address stands for this proxy's
        argv[argv.index("--admin") + 1] = admin
    return argv


@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_runtime_samples_of_a_page_run_against_a_real_proxy(page, lbproxy):
    admin_port = free_port()
    page_samples = PAGES[page]
    proxy = lbproxy(_configuration(page_samples, admin_port))
    admin = f"http://127.0.0.1:{admin_port}"
    for sample in page_samples:
        result = subprocess.run(
            [sys.executable, "-m", "lbproxy", *_argv(sample, admin)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "LBPROXY_ADMIN": admin, "COLUMNS": "120"},
            timeout=60,
        )
        where = f"{page}:{sample.line}: lbproxy {' '.join(sample.argv)}"
        assert result.returncode == 0, f"{where}\n{result.stdout}{result.stderr}\n{proxy.log()}"
        assert result.stdout.strip(), where


def test_the_runtime_samples_are_found():
    found = {sample.argv[0] for page in PAGES.values() for sample in page}
    assert {"status", "drain", "explain", "add-server", "remove-server"} <= found
