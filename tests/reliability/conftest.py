"""The reliability suite: each test runs one scenario of encoder_service/benchmarks/reliability (short, for CI) against
real server processes and asserts every one of its checks. ``bench/soak.py`` runs the same scenarios
for long. Figures are printed (``pytest -s``), attached to the JUnit XML as properties, and appended
as JSON lines to $RELIABILITY_FIGURES when it is set."""

from __future__ import annotations

import json
import os

import pytest

from encoder_service.benchmarks.reliability.result import ScenarioResult


@pytest.fixture
def check_scenario(record_property):
    """Prints and records a ScenarioResult, then fails the test with every failed check."""
    def check(result: ScenarioResult) -> ScenarioResult:
        print("\n" + result.report())
        for key, value in result.figures.items():
            record_property(f"{result.name}.{key}", value)
        path = os.environ.get("RELIABILITY_FIGURES")
        if path:
            with open(path, "a") as out:
                out.write(json.dumps(result.to_json()) + "\n")
        failed = result.failures()
        assert not failed, "\n".join(f"{c.name}: {c.detail}" for c in failed) + "\n\n" + result.report()
        return result
    return check
