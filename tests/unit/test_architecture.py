"""The architecture as a contract: the import-linter contracts in pyproject.toml.

They replace the hand-kept module lists this test held: the layers (runtime -> admin,
locator, control, dataplane -> net -> core, wire, config, imports pointing down only)
and the pure packages that never import trio. A new module is covered by its package.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept():
    lint_imports = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    out = subprocess.run(
        [lint_imports, "--no-cache"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BROKEN" not in out.stdout


def test_pure_modules_do_not_import_trio_at_run_time():
    # The contracts read the source; this also catches an import made at run time.
    code = (
        "import sys\n"
        "import lbproxy.config.reader, lbproxy.core.pool, lbproxy.wire.proxy_protocol\n"
        "import lbproxy.wire.client_hello, lbproxy.locator.dns_answers\n"
        "import lbproxy.core.schedulers as s; s.available()\n"
        "print('trio' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
