"""What a new user reads first: a short README, the LICENSE pyproject.toml names, a
changelog for this version (also on the site), the Debian packages scripts/test installs
all listed, and no reference to the SPEC, which users do not have."""

from __future__ import annotations

import re
import tomllib

from lbproxy import __version__
from tests.docs.support import ROOT

DOCS = ROOT / "docs"


def test_the_license_is_the_apache_2_text_pyproject_names():
    license_text = (ROOT / "LICENSE").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    assert "Apache License\n                           Version 2.0, January 2004" in license_text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text  # the whole text, not a notice


def test_the_changelog_starts_with_this_version_in_keep_a_changelog_form():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## \[([^\]]+)\]", changelog, re.M)
    assert versions and versions[0] in (__version__, "Unreleased"), versions
    assert __version__ in versions
    assert "keepachangelog.com" in changelog
    first = changelog[changelog.index("## [") :]
    sections = re.findall(r"^### (\w+)", first.split("\n## [")[0], re.M)
    assert sections and set(sections) <= {
        "Added",
        "Changed",
        "Deprecated",
        "Removed",
        "Fixed",
        "Security",
    }


def test_the_site_shows_the_changelog():
    """docs/changelog.md is CHANGELOG.md with its links made relative to docs/."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert (DOCS / "changelog.md").read_text() == changelog.replace("](docs/", "](")
    assert "changelog.md" in (ROOT / "mkdocs.yml").read_text()


def test_the_readme_is_short_and_points_to_the_site():
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert 40 <= len(lines) <= 80, len(lines)
    assert "lbproxy run " in readme and "lbproxy check " in readme
    assert "Behaviour changes" not in readme  # the changelog has them
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).exists(), link
    assert "docs/changelog.md" in readme


def test_no_user_page_cites_the_spec():
    """The SPEC is the developers' contract; a user has the site. The pages about the
    code (architecture, development) may name it."""
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md"] + [
        page
        for page in DOCS.rglob("*.md")
        if page.name not in ("architecture.md", "development.md")
        and page.parent.name != "development"
    ]
    citing = [
        f"{page.relative_to(ROOT)}:{number}"
        for page in pages
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if re.search(r"\bSPEC\b", line)
    ]
    assert citing == []


def test_getting_started_lists_every_debian_package_scripts_test_installs():
    script = (ROOT / "scripts" / "test").read_text()
    packages = set(re.findall(r"\|\| need ([\w.+-]+) \"", script))
    assert {"snmpd", "redis-server", "mariadb-server", "python3-venv"} <= packages
    guide = (DOCS / "getting-started.md").read_text()
    section = guide[: guide.index("## A five-minute tour")]
    listed = set(re.findall(r"`([\w.+-]+)`", section))
    assert packages - listed == set()
