"""contrib/prometheus/lbproxy-rules.yaml: promtool accepts the rules, its unit tests make
every alert fire, and the rules name only metrics lbproxy exports (SPEC §20)."""

from __future__ import annotations

import re
import shutil
import subprocess

import yaml

from tests import tools
from tests.docs.support import ROOT, metric_families

RULES = ROOT / "contrib" / "prometheus" / "lbproxy-rules.yaml"
TESTS = ROOT / "contrib" / "prometheus" / "tests" / "lbproxy-rules.test.yaml"
PROMTOOL = shutil.which("promtool")
needs_promtool = tools.requires("promtool", package="prometheus")

ALERTS = {
    rule["alert"]: rule
    for group in yaml.safe_load(RULES.read_text())["groups"]
    for rule in group["rules"]
}
# What the issue and SPEC §20 ask for, each by the alert that answers it.
REQUIRED = {
    "every real server of a virtual server down": "LbproxyAllRealServersDown",
    "a virtual server with no available server": "LbproxyNoAvailableRealServer",
    "a real server down": "LbproxyRealServerDown",
    "rejections by reason rising": "LbproxyRejectionsRising",
    "throttle in digg": "LbproxyThrottleDigg",
    "SNMP polls failing": "LbproxySnmpPollsFailing",
    "discovery failing": "LbproxyDiscoveryFailing",
    "workers restarting": "LbproxyWorkersRestarting",
    "config reload failed": "LbproxyConfigReloadFailed",
}


@needs_promtool
def test_promtool_accepts_the_rules():
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


@needs_promtool
def test_promtool_unit_tests_of_the_rules_pass():
    result = subprocess.run(
        [PROMTOOL, "test", "rules", TESTS.name],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_the_issue_names_exists_with_for_and_a_description():
    assert set(REQUIRED.values()) == set(ALERTS)
    for name, rule in ALERTS.items():
        assert rule.get("for"), f"{name} has no for:"
        assert len(rule["annotations"]["description"]) > 100, name
        assert rule["annotations"]["summary"], name


def test_the_unit_tests_make_every_alert_fire():
    fired = {
        case["alertname"]
        for test in yaml.safe_load(TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert fired == set(ALERTS)


def test_the_rules_name_only_metrics_lbproxy_exports():
    exported = metric_families()
    used = set()
    for rule in ALERTS.values():
        used |= set(re.findall(r"\blbproxy_\w+", rule["expr"]))
    assert used and used <= exported, used - exported
