"""The migration guide (docs/howto/migrating.md) is generated from the tables `lbproxy
import` translates with; the committed page must be what they write now (whether the
rows are what the importer does is held by tests/unit/tools/test_import_haproxy.py)."""

from __future__ import annotations

from lbproxy.tools.importer import guide, haproxy, nginx
from tests.docs.support import ROOT


def test_the_committed_guide_is_what_the_tables_write():
    page = (ROOT / "docs" / "howto" / "migrating.md").read_text()
    assert page == guide.markdown(), "run: python -m lbproxy.tools.importer.guide"


def test_every_row_of_both_tables_is_on_the_page():
    page = guide.markdown()
    for row in haproxy.DIRECTIVES + nginx.DIRECTIVES:
        assert f"| `{row.directive.replace('|', chr(92) + '|')}` |" in page, row


def test_the_page_is_in_the_sites_navigation():
    assert "howto/migrating.md" in (ROOT / "mkdocs.yml").read_text()


def test_each_source_gets_its_own_table_of_whatever_rows_it_holds(monkeypatch):
    from lbproxy.tools.importer.translation import Mapping

    row = Mapping("nginx", "least_conn", "virtual_servers[].scheduler", "`lc`")
    monkeypatch.setattr(nginx, "DIRECTIVES", (row,))
    page = guide.markdown()
    nginx_part = page.split("## nginx `stream`", 1)[1].split("\n## ", 1)[0]
    assert (
        "| `least_conn` | [`virtual_servers[].scheduler`]"
        "(../reference/configuration.md#virtual_servers) | `lc` |"
    ) in nginx_part
    haproxy_part = page.split("## HAProxy", 1)[1].split("\n## ", 1)[0]
    assert "least_conn" not in haproxy_part
    assert "| `balance leastconn` |" in haproxy_part


def test_every_key_links_to_a_heading_of_the_configuration_reference():
    reference = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    for row in haproxy.DIRECTIVES + nginx.DIRECTIVES:
        if row.lbproxy:
            anchor = guide.reference_link(row.lbproxy).split("#", 1)[1]
            assert f"{{#{anchor}}}" in reference, (row.directive, row.lbproxy, anchor)
