"""Under CI, a skip is a failure unless the test may skip: the plugin tests/conftest.py registers
(tests/test_ci_strict.py tests it)."""

from __future__ import annotations

import os

import pytest

ALLOW_SKIP_MARKER = "allow_skip_on_cpu"


def running_under_ci(environ=os.environ) -> bool:
    """CI=true (GitHub Actions, GitLab, .ci/run) or CI=1."""
    return environ.get("CI", "").strip().lower() in ("1", "true", "yes")


class StrictSkips:
    """Under CI a skipped test fails, unless it is marked ``@pytest.mark.allow_skip_on_cpu(reason)``.

    A skip on the CI machine means something CI was meant to provide is missing (a tool
    scripts/ci_tools.sh installs, a test extra, a fixture's server): left a skip, it is a green run
    that tested nothing. Only what cannot exist on the CPU-only CI machine (a GPU, torchvision) is
    marked as allowed, with its reason. Deselected tests (``-m "not gpu"``) never run, so never
    skip; xfail is not a skip. A whole module skipped at import (``pytest.importorskip`` at module
    level, ``pytest.skip(allow_module_level=True)``) cannot be marked: under CI it is an error.
    """

    def __init__(self, ci: bool | None = None) -> None:
        self.ci = running_under_ci() if ci is None else ci
        self.refused: list[str] = []

    @staticmethod
    def allowed_reason(item: pytest.Item) -> str | None:
        marker = item.get_closest_marker(ALLOW_SKIP_MARKER)
        if marker is None:
            return None
        reason = marker.kwargs.get("reason", marker.args[0] if marker.args else None)
        if not isinstance(reason, str) or not reason.strip():
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{ALLOW_SKIP_MARKER} needs a reason, "
                                    f"e.g. @pytest.mark.{ALLOW_SKIP_MARKER}(\"needs a CUDA GPU\")")
        return reason

    def pytest_report_header(self, config) -> str | None:
        if self.ci:
            return f"CI: a skipped test fails unless marked @pytest.mark.{ALLOW_SKIP_MARKER}(reason)"
        return None

    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:  # a marker without a reason is refused whether or not the test skips
            self.allowed_reason(item)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if self.ci and report.skipped and not hasattr(report, "wasxfail") and self.allowed_reason(item) is None:
            self._refuse(report, _skip_message(report))
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector):
        report = yield
        if self.ci and report.skipped:
            self._refuse(report, _skip_message(report) + " (a whole module skipped at import)")
        return report

    def _refuse(self, report, why: str) -> None:
        report.outcome = "failed"
        report.longrepr = (f"skipped under CI=true, which is a failure here: {why}\n"
                           f"Provide what the test needs in CI (scripts/ci_tools.sh, the test extras), or, if it "
                           f"cannot exist on the CPU-only CI machine, mark the test "
                           f"@pytest.mark.{ALLOW_SKIP_MARKER}(reason).")
        self.refused.append(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.refused:
            terminalreporter.write_sep("=", f"{len(self.refused)} skip(s) refused under CI=true", red=True)
            for nodeid in self.refused:
                terminalreporter.write_line(nodeid)


def _skip_message(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2])
    return str(longrepr)
