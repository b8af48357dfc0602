"""CI cannot pass by mistake: under CI=true a skip fails unless the test is marked
``allow_skip_on_cpu(reason)`` (tests/conftest.py), and pytest refuses to start without pytest-timeout."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
from repo_paths import REPO_ROOT
from strict_skips import ALLOW_SKIP_MARKER, StrictSkips, running_under_ci

pytest_plugins = ["pytester"]

SKIPPING_TESTS = '''
import pytest

@pytest.fixture
def missing_tool():
    pytest.skip("no such tool on PATH")

def test_passes():
    pass

def test_skips_in_the_call():
    pytest.skip("not here")

@pytest.mark.skipif(True, reason="a skipif mark")
def test_skipif_mark():
    pass

def test_skips_in_a_fixture(missing_tool):
    pass

def test_importorskip():
    pytest.importorskip("no_such_module_anywhere")

@pytest.mark.allow_skip_on_cpu("needs a CUDA GPU")
def test_allowed_to_skip():
    pytest.skip("no GPU")

@pytest.mark.allow_skip_on_cpu(reason="needs torchvision")
@pytest.mark.skipif(True, reason="no torchvision")
def test_allowed_to_skip_by_mark():
    pass

@pytest.mark.xfail(reason="a known bug")
def test_xfail():
    assert False
'''


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini(f"[pytest]\nmarkers =\n    {ALLOW_SKIP_MARKER}(reason): may skip under CI\n")
    pytester.makepyfile(test_skipping=SKIPPING_TESTS)
    return pytester


def test_under_ci_a_skip_fails_unless_the_test_is_allowed_to_skip(suite: pytest.Pytester) -> None:
    result = suite.runpytest("-rA", plugins=[StrictSkips(ci=True)])
    # The call-phase skip fails; a skip in setup (a skipif mark, a fixture) is an error of the test.
    result.assert_outcomes(passed=1, failed=2, errors=2, skipped=2, xfailed=1)
    result.stdout.fnmatch_lines(["*4 skip(s) refused under CI=true*"])
    for name in ("test_skips_in_the_call", "test_importorskip"):
        result.stdout.fnmatch_lines([f"FAILED test_skipping.py::{name}*"])
    for name in ("test_skipif_mark", "test_skips_in_a_fixture"):
        result.stdout.fnmatch_lines([f"ERROR test_skipping.py::{name}*"])
    result.stdout.fnmatch_lines(["*skipped under CI=true*no such tool on PATH*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_without_ci_skips_stay_skips(suite: pytest.Pytester) -> None:
    result = suite.runpytest(plugins=[StrictSkips(ci=False)])
    result.assert_outcomes(passed=1, skipped=6, xfailed=1)
    assert result.ret == pytest.ExitCode.OK


def test_under_ci_a_module_skipped_at_import_fails_the_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_whole_module='''
import pytest
pytest.importorskip("no_such_module_anywhere")

def test_never_collected():
    pass
''')
    result = pytester.runpytest(plugins=[StrictSkips(ci=True)])
    result.stdout.fnmatch_lines(["*ERROR collecting test_whole_module.py*", "*skipped under CI=true*"])
    assert result.ret != pytest.ExitCode.OK
    assert pytester.runpytest(plugins=[StrictSkips(ci=False)]).ret == pytest.ExitCode.NO_TESTS_COLLECTED


def test_the_allow_marker_needs_a_reason(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_no_reason=f'''
import pytest

@pytest.mark.{ALLOW_SKIP_MARKER}
def test_passes():
    pass
''')
    result = pytester.runpytest(plugins=[StrictSkips(ci=False)])
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*test_no_reason.py::test_passes: @pytest.mark.{ALLOW_SKIP_MARKER} needs a reason*"])


@pytest.mark.parametrize("value, ci", [("true", True), ("True", True), ("1", True), ("yes", True),
                                       ("", False), ("false", False), ("0", False), (None, False)])
def test_ci_is_read_from_the_environment(value, ci) -> None:
    assert running_under_ci({} if value is None else {"CI": value}) is ci


def test_this_session_runs_with_strict_skips_when_ci_is_set(pytestconfig) -> None:
    plugin = pytestconfig.pluginmanager.get_plugin("strict-skips")
    assert isinstance(plugin, StrictSkips)
    assert plugin.ci is running_under_ci()


def _module_level_calls(tree: ast.AST):
    """Calls run at import: in the module's body, outside any function or class."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            yield node
        yield from _module_level_calls(node)


def test_no_test_module_skips_itself_whole_at_import() -> None:
    # A module-level importorskip silently skips a whole file wherever the import fails; import the
    # dependency (a test extra) or skip per test with the allow marker.
    offenders = []
    for path in sorted((REPO_ROOT / "tests").rglob("*.py")):
        for call in _module_level_calls(ast.parse(path.read_text())):
            name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
            if name == "importorskip" or (name == "skip" and any(k.arg == "allow_module_level" for k in call.keywords)):
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{call.lineno}")
    assert offenders == []


def test_pytest_refuses_to_start_without_pytest_timeout(tmp_path) -> None:
    # -p no:timeout stands in for the plugin not being installed.
    env = {**os.environ, "CI": ""}
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:timeout", "-p", "no:cacheprovider",
                             "--noconftest", "--collect-only", "-q", "tests/test_bench.py"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0, result.stdout
    assert "Missing required plugins: pytest-timeout" in result.stdout + result.stderr
