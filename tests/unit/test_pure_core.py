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
