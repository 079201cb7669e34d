"""The architecture as a contract: the import-linter contracts in pyproject.toml.

They replace the hand-kept module lists this test held: the layers (cli -> tools ->
runtime -> admin, locator, control, dataplane -> net -> config's reader and tables ->
core, wire -> config's model and values, imports pointing down only), no import cycle
inside a package, and the pure packages that never import trio. A new module is covered
by its package, except in config, whose two layers name their modules: a test here
checks that every one is named.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
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
        "import lbproxy.wire.client_hello, lbproxy.wire.snmp, lbproxy.locator.dns_answers\n"
        "import lbproxy.core.schedulers as s; s.available()\n"
        "print('trio' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _layered_modules() -> set[str]:
    """The modules and packages named in the layers contract of pyproject.toml."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [layers] = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return {
        name for layer in layers["layers"] for name in re.split(r"[:|]", layer.replace(" ", ""))
    }


def test_every_configuration_module_has_its_layer():
    # The configuration is two layers, named module by module: a new module must say which.
    named = _layered_modules()
    modules = sorted((ROOT / "lbproxy" / "config").glob("*.py"))
    missing = [
        f"lbproxy.config.{path.stem}"
        for path in modules
        if path.stem != "__init__" and f"lbproxy.config.{path.stem}" not in named
    ]
    assert missing == []


def test_the_default_scheduler_module_imports_nothing():
    # The layers contract lets the model import it (its one ignored import): safe only
    # while it leads nowhere else.
    tree = ast.parse((ROOT / "lbproxy" / "core" / "schedulers" / "default.py").read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    assert imports == []


def private_names_used(path: Path) -> list[str]:
    """`from X import _name`, and `obj._name` on anything but self or cls, in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
            found += [f"{path}:{node.lineno}: from {node.module} import {n}" for n in names]
        elif isinstance(node, ast.Attribute):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return [f for f in found if re.search(r"[ .]_(?!_)\w*$", f)]


def test_the_runtime_layer_uses_no_other_modules_private_names():
    # import-linter cannot see names; a private one is free to change under its module.
    used = [
        f
        for path in sorted((ROOT / "lbproxy/runtime").rglob("*.py"))
        for f in private_names_used(path)
    ]
    assert used == []


def test_no_test_module_imports_another():
    # Shared helpers live in harness.py, factories.py and the support modules: a test
    # module is free to change without breaking another.
    imports = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ImportFrom)
        and node.module
        and node.module.startswith("tests.")
        and node.module.rsplit(".", 1)[-1].startswith("test_")
    ]
    assert imports == []
