"""The cookbook (docs/howto/databases.md): every recipe of configs/cookbook/ is valid as
shipped (`lbproxy check`, alone and all together), shown on the page, says what it is
in HAProxy's words, and is run against its real server by tests/integration/
test_cookbook.py; so a recipe added without a page section or a test fails here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lbproxy.config.reader import load
from tests.docs.support import ROOT

COOKBOOK = ROOT / "configs" / "cookbook"
RECIPES = sorted(COOKBOOK.glob("*.yaml"))
PAGE = ROOT / "docs" / "howto" / "databases.md"
TESTS = ROOT / "tests" / "integration" / "test_cookbook.py"


def test_there_are_recipes():
    assert {p.name for p in RECIPES} >= {
        "postgres-patroni.yaml",
        "postgres.yaml",
        "mariadb.yaml",
        "redis-primary.yaml",
        "smtp.yaml",
        "tls-service.yaml",
    }


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_each_recipe_loads_alone_is_on_the_page_and_is_run_by_a_test(path):
    [vs] = load([path]).virtual_servers
    assert vs.health_check.type not in ("tcp", "none"), "a recipe shows a protocol check"
    assert "# HAProxy:" in path.read_text()
    assert f'--8<-- "configs/cookbook/{path.name}"' in PAGE.read_text()
    assert f'"{path.name}"' in TESTS.read_text()


def test_lbproxy_check_accepts_the_cookbook_folder():
    done = subprocess.run(
        [sys.executable, "-m", "lbproxy", "check", str(COOKBOOK)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "pgsql as user lbproxy every 1s" in done.stdout
    assert "redis PING after AUTH, role master every 1s" in done.stdout
    assert done.stdout.strip().endswith("configuration ok")
