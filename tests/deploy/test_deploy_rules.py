"""Alert rules: promtool accepts them and their unit tests (deploy/prometheus/alerts_test.yaml) pass."""

from __future__ import annotations

import subprocess

import pytest
import yaml
from repo_paths import REPO_ROOT, find_tool

RULES_DIR = REPO_ROOT / "deploy" / "prometheus"
REQUIRED_ALERTS = {"EncoderServiceInstanceDown", "EncoderServiceHighErrorRatio", "EncoderServiceLatencySLOFastBurn",
                   "EncoderServiceLatencySLOSlowBurn", "EncoderServiceQueueSaturated", "EncoderServiceCacheThrash",
                   "EncoderServiceWorkerStalled"}


@pytest.fixture(scope="module")
def promtool() -> str:
    path = find_tool("promtool")
    if path is None:
        pytest.skip("no promtool on PATH (scripts/ci_tools.sh installs Debian's prometheus)")
    return path


def run(promtool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120)


def test_promtool_check_rules_accepts_the_alerts(promtool):
    result = run(promtool, "check", "rules", "alerts.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(REQUIRED_ALERTS)} rules found" in result.stdout


def test_promtool_unit_tests_of_the_alerts_pass(promtool):
    result = run(promtool, "test", "rules", "alerts_test.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_that_expects_it_to_fire():
    rules = yaml.safe_load((RULES_DIR / "alerts.yaml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert alerts == REQUIRED_ALERTS
    tests = yaml.safe_load((RULES_DIR / "alerts_test.yaml").read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t["alert_rule_test"] if case["exp_alerts"]}
    quiet = {case["alertname"] for t in tests for case in t["alert_rule_test"] if not case["exp_alerts"]}
    assert fired == alerts, f"alerts no unit test sees firing: {alerts - fired}"
    assert quiet == alerts, f"alerts no unit test sees quiet: {alerts - quiet}"


def test_every_alert_says_how_bad_and_what_happened():
    rules = yaml.safe_load((RULES_DIR / "alerts.yaml").read_text())
    for rule in (r for g in rules["groups"] for r in g["rules"] if "alert" in r):
        assert rule["labels"]["severity"] in ("page", "ticket"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        assert rule.get("for"), f"{rule['alert']} fires on a single evaluation"
