"""Configuration of outlier ejection and panic (SPEC §23): the defaults and what
`lbproxy check` shows."""

from __future__ import annotations

from pathlib import Path

from lbproxy.config.model import OutlierDetectionConfig
from lbproxy.config.reader import load
from lbproxy.config.summary import summary
from tests.unit.config.support import write

PROTECTED = """\
virtual_servers:
  - name: api
    listen: 127.0.0.1:8443
    panic_threshold: 30
    outlier_detection:
    real_servers:
      - {name: a, address: 127.0.0.1:9001}
  - name: web
    listen: 127.0.0.1:8080
    outlier_detection:
      {consecutive_failures: 2, base_ejection_time: 500ms, max_ejection_percent: 34}
    real_servers:
      - {name: c, address: 127.0.0.1:9003}
"""


def test_outlier_detection_and_panic_are_read_with_their_defaults(tmp_path: Path) -> None:
    config = load([write(tmp_path, "protected.yaml", PROTECTED)])
    api, web = config.virtual_servers
    assert api.outlier_detection == OutlierDetectionConfig()  # the block alone: defaults
    assert api.outlier_detection == OutlierDetectionConfig(5, 30.0, 300.0, 50)
    assert api.panic_threshold == 30 and web.panic_threshold == 0
    assert web.outlier_detection == OutlierDetectionConfig(2, 0.5, 300.0, 34)
    text = summary(config)
    assert (
        "outliers    ejected after 5 failed connects in a row for 30s x times in a row "
        "(at most 300s), up to 50% at once"
    ) in text
    assert "panic       under 30% of servers available" in text
    assert text.count("panic ") == 1  # web has none
