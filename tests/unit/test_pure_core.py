"""The line in the middle of the architecture: the pure core never imports trio."""

from __future__ import annotations

import subprocess
import sys

PURE = [
    "lbproxy.config.model",
    "lbproxy.config.values",
    "lbproxy.config.tables",
    "lbproxy.config.reader",
    "lbproxy.config.summary",
    "lbproxy.core.pool",
    "lbproxy.core.health",
    "lbproxy.tools.simulate",
    "lbproxy.wire.proxy_protocol",
    "lbproxy.core.schedulers",
    "lbproxy.core.schedulers.maglev",
    "lbproxy.core.persistence",
    "lbproxy.core.discovery_model",
    "lbproxy.wire.client_hello",
    "lbproxy.core.balance",
    "lbproxy.locator.dns_answers",
]


def test_pure_modules_do_not_import_trio():
    code = (
        "import sys\n"
        f"for name in {PURE!r}: __import__(name)\n"
        "import lbproxy.core.schedulers as s; s.available()\n"
        "print('trio' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# Arrows point down only (ARCHITECTURE.md): a module on the left never imports, even
# indirectly, the modules on the right.
IMPORTS_NEVER = {
    "lbproxy.dataplane.virtual_server": [
        "lbproxy.dataplane.connection",
        "lbproxy.dataplane.listener",
        "lbproxy.runtime.server",
    ],
    "lbproxy.dataplane.queue": [
        "lbproxy.dataplane.connection",
        "lbproxy.dataplane.listener",
        "lbproxy.runtime.server",
    ],
    "lbproxy.control.checks": [
        "lbproxy.dataplane.connection",
        "lbproxy.dataplane.listener",
        "lbproxy.runtime.server",
    ],
    "lbproxy.control.throttle_monitor": [
        "lbproxy.dataplane.connection",
        "lbproxy.dataplane.listener",
        "lbproxy.runtime.server",
    ],
    "lbproxy.dataplane.connection": [
        "lbproxy.dataplane.listener",
        "lbproxy.runtime.server",
        "lbproxy.admin.api",
    ],
    "lbproxy.dataplane.listener": ["lbproxy.runtime.server", "lbproxy.admin.api"],
    "lbproxy.admin.api": [
        "lbproxy.runtime.server",
        "lbproxy.dataplane.listener",
        "lbproxy.dataplane.connection",
    ],
    "lbproxy.admin.http_server": [
        "lbproxy.runtime.server",
        "lbproxy.dataplane.listener",
        "lbproxy.dataplane.connection",
        "lbproxy.admin.api",
    ],
    "lbproxy.control.conditioning": [
        "lbproxy.dataplane.connection",
        "lbproxy.dataplane.listener",
        "lbproxy.runtime.server",
    ],
    "lbproxy.locator.dns_server": [
        "lbproxy.dataplane.connection",
        "lbproxy.dataplane.listener",
        "lbproxy.runtime.server",
        "lbproxy.admin.api",
    ],
}


def test_imports_point_one_way():
    code = (
        "import sys\n"
        "name, never = sys.argv[1], sys.argv[2:]\n"
        "__import__(name)\n"
        "print(sorted(set(never) & set(sys.modules)))\n"
    )
    for name, never in IMPORTS_NEVER.items():
        out = subprocess.run(
            [sys.executable, "-c", code, name, *never], capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == "[]", f"{name} imports {out.stdout.strip()}"
