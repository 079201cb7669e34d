"""The line in the middle of the architecture: the pure core never imports trio."""

from __future__ import annotations

import subprocess
import sys

PURE = [
    "lbproxy.config",
    "lbproxy.pool",
    "lbproxy.health",
    "lbproxy.simulate",
    "lbproxy.proxy_protocol",
    "lbproxy.schedulers",
    "lbproxy.schedulers.maglev",
    "lbproxy.persistence",
    "lbproxy.discovery_model",
    "lbproxy.client_hello",
    "lbproxy.balance",
    "lbproxy.dns_query",
]


def test_pure_modules_do_not_import_trio():
    code = (
        "import sys\n"
        f"for name in {PURE!r}: __import__(name)\n"
        "import lbproxy.schedulers as s; s.available()\n"
        "print('trio' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# Arrows point down only (ARCHITECTURE.md): a module on the left never imports, even
# indirectly, the modules on the right.
IMPORTS_NEVER = {
    "lbproxy.virtual_server": ["lbproxy.proxy", "lbproxy.listener", "lbproxy.server"],
    "lbproxy.waiting": ["lbproxy.proxy", "lbproxy.listener", "lbproxy.server"],
    "lbproxy.checks": ["lbproxy.proxy", "lbproxy.listener", "lbproxy.server"],
    "lbproxy.throttle_monitor": ["lbproxy.proxy", "lbproxy.listener", "lbproxy.server"],
    "lbproxy.proxy": ["lbproxy.listener", "lbproxy.server", "lbproxy.admin"],
    "lbproxy.listener": ["lbproxy.server", "lbproxy.admin"],
    "lbproxy.admin": ["lbproxy.server", "lbproxy.listener", "lbproxy.proxy"],
    "lbproxy.http_server": ["lbproxy.server", "lbproxy.listener", "lbproxy.proxy", "lbproxy.admin"],
    "lbproxy.conditioning": ["lbproxy.proxy", "lbproxy.listener", "lbproxy.server"],
    "lbproxy.locator": ["lbproxy.proxy", "lbproxy.listener", "lbproxy.server", "lbproxy.admin"],
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
