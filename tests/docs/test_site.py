"""The documentation site: it builds strictly, the front page is the README, and it names
every metric family and admin route the code serves (SPEC §20).

The names are read from the code itself (the metric families' constructors, the admin
apps' routes), so a family or route someone adds without documenting it fails here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

from lbproxy.admin.metric_families import FAMILIES
from lbproxy.admin.routes import ROUTES
from lbproxy.core.histogram import DURATION_BUCKETS, POLL_BUCKETS, QUEUE_BUCKETS
from tests.docs.support import ROOT, metric_families

DOCS = ROOT / "docs"


def _site_text() -> str:
    return "\n".join(page.read_text() for page in sorted(DOCS.rglob("*.md")))


def test_site_builds_with_no_broken_link_or_anchor(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        mkdocs = shutil.which("mkdocs")
    assert mkdocs, "mkdocs is in the test extra (docs/requirements.txt)"
    result = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").exists()


def test_every_page_is_in_the_nav():
    """Every page is in the nav, or named by `not_in_nav` (pages linked to, not browsed:
    the development journals)."""
    config = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    listed = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", config, re.MULTILINE))
    block = re.search(r"^not_in_nav: \|\n((?:  .*\n)+)", config, re.MULTILINE)
    patterns = block.group(1).split() if block else []
    kept_out = {page for page in pages if any(fnmatch("/" + page, p) for p in patterns)}
    assert pages == listed | kept_out
    assert not listed & kept_out


def test_the_front_page_is_the_readme():
    """docs/index.md is README.md with its links made relative to docs/."""
    readme = (ROOT / "README.md").read_text()
    expected = readme.replace("](docs/", "](").replace("[`docs/`](index.md)", "`docs/`")
    assert (DOCS / "index.md").read_text() == expected


def test_every_metric_family_is_in_the_metrics_reference():
    families = metric_families()
    assert "lbproxy_connections_total" in families and "lbproxy_throttle_mode" in families
    reference = (DOCS / "reference" / "metrics.md").read_text()
    documented = set(re.findall(r"`(lbproxy_\w+)`", reference))
    assert families - documented == set(), "undocumented metric families"
    assert documented - families == set(), "documented families the code does not serve"


def _routes() -> set[str]:
    """Every path the admin apps answer, with {} for a path parameter: the one route
    table (admin/routes.py) that both apps dispatch on."""
    return {route.template for route in ROUTES}


def test_every_admin_route_is_in_the_admin_api_reference():
    routes = _routes()
    assert "/api/v1/reload" in routes and "/api/v1/virtual-servers/{}/locate" in routes
    reference = (DOCS / "reference" / "admin-api.md").read_text()
    documented = {
        re.sub(r"\{[^}]*\}", "{}", path).split("[")[0]
        for path in re.findall(r"^\| `(?:GET|PUT|POST|PATCH|DELETE) (/[^` ]*)`", reference, re.M)
    }
    assert routes - documented == set()


def test_every_histograms_buckets_are_in_the_metrics_reference():
    """The "Histogram buckets" table lists each histogram family's bounds as the code has
    them (core/histogram.py), and no histogram is missing from it."""
    buckets = {
        "lbproxy_connection_duration_seconds": DURATION_BUCKETS,
        "lbproxy_snmp_poll_duration_seconds": POLL_BUCKETS,
        "lbproxy_queue_wait_seconds": QUEUE_BUCKETS,
    }
    assert {f.name for f in FAMILIES.values() if f.kind == "histogram"} == set(buckets)
    reference = (DOCS / "reference" / "metrics.md").read_text()
    section = reference.split("### Histogram buckets", 1)[1]
    for name, bounds in buckets.items():
        row = re.search(rf"^\| `{name}` \| ([^|]*) \|$", section, re.M)
        assert row, name
        listed = [float(n) for n in re.sub(r"\([^)]*\)", "", row.group(1)).split(",")]
        assert tuple(listed) == bounds, name
