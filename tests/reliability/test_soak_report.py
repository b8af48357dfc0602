"""bench/soak.py's table: one row per scenario, its headline figures, pass or the failed checks."""

import json

import pytest
from repo_paths import import_script

from encoder_service.benchmarks.reliability.result import ScenarioResult

soak = import_script("bench/soak.py")

pytestmark = pytest.mark.reliability


def scenario(name: str, ok: bool) -> ScenarioResult:
    result = ScenarioResult(name)
    result.figure("lost", 0)
    result.latency("failover", [0.1, 0.2, 0.3])
    result.check("no request lost", ok, "" if ok else "2 lost")
    return result


def test_the_markdown_table_has_a_row_per_scenario_with_its_figures_and_verdict():
    header = {"date": "2026-01-01 00:00 UTC", "machine": "2 x CPU", "command": "python bench/soak.py", "minutes": 1,
              "seconds": 12.0}
    text = soak.markdown([scenario("failover", True), scenario("sigterm", False)], header)
    lines = text.splitlines()
    assert lines[0].startswith("Soak of 2026-01-01 00:00 UTC on 2 x CPU, `--minutes 1`")
    assert "| scenario | figures | result |" in lines
    assert "| failover | lost 0, failover_p50_ms 200, failover_p99_ms 300, failover_max_ms 300 | pass |" in lines
    assert "| sigterm |  | FAIL: no request lost |" in lines


def test_an_unknown_scenario_is_refused_before_anything_starts(capsys):
    with pytest.raises(SystemExit):
        soak.main(["--scenarios", "sustained,nonsense"])
    assert "unknown scenarios ['nonsense']" in capsys.readouterr().err


def test_a_result_serialises_with_its_figures_and_checks():
    data = json.loads(json.dumps(scenario("failover", False).to_json()))
    assert data["passed"] is False and data["figures"]["lost"] == 0
    assert data["checks"] == [{"name": "no request lost", "ok": False, "detail": "2 lost"}]
