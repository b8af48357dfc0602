"""Every script in bench/ and examples/ imports and answers ``--help`` (exit 0, a usage line) with no
GPU, from the repository root with the repository and client/ on PYTHONPATH: a script that no longer
imports (a moved helper, a GPU-only module imported at the top) fails here, not on the GPU machine.
bench/__init__.py is not a script (the scenarios bench/soak.py drives are encoder_service/benchmarks/reliability,
and so is the soak itself: bench/soak.py runs encoder_service/benchmarks/reliability/soak.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from repo_paths import REPO_ROOT

SCRIPTS = sorted(p.relative_to(REPO_ROOT).as_posix() for folder in ("bench", "examples")
                 for p in (REPO_ROOT / folder).glob("*.py") if p.name != "__init__.py")


@pytest.fixture(scope="module")
def answers() -> dict[str, subprocess.CompletedProcess]:
    """Each script's ``--help``, all started at once (each imports torch: a few seconds apiece)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",  # no GPU, also on the GPU machine
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "client"),
                                          *filter(None, [os.environ.get("PYTHONPATH")])])}
    running = {script: subprocess.Popen([sys.executable, script, "--help"], cwd=REPO_ROOT, env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for script in SCRIPTS}
    done = {}
    for script, proc in running.items():
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        done[script] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def test_the_scripts_are_found():
    assert {"bench/soak.py", "bench/kimi_throughput.py", "bench/kernels.py", "examples/epd_decode_server.py"} <= set(
        SCRIPTS)
    assert not any(s.startswith("bench/reliability/") or s.endswith("__init__.py") for s in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_answers_help(answers, script):
    result = answers[script]
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage:"), result.stdout[:500] + result.stderr[-2000:]
    assert "--help" in result.stdout


@pytest.mark.parametrize("benchmark", ["", "forward", "service", "video", "reliability", "profile"])
def test_the_bench_subcommands_answer_help_and_only_forward_imports_torch(benchmark):
    # `encoder-service bench BENCHMARK --help`; forward imports torch at the top, the others must not wait for it.
    words = ["bench", *filter(None, [benchmark]), "--help"]
    code = ("import sys\nfrom encoder_service.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    assert not e.code, e.code\nprint('torch imported:', 'torch' in sys.modules)")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", code, *words], cwd=REPO_ROOT, env=env, text=True,
                            capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"usage: encoder-service {' '.join(words[:-1])} "), result.stdout[:500]
    assert result.stdout.rstrip().endswith(f"torch imported: {benchmark == 'forward'}")
    assert result.stderr == ""
    if not benchmark:
        assert all(name in result.stdout for name in ("forward", "service", "video", "reliability", "profile"))
