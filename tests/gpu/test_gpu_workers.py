"""``--devices`` on two GPUs of one host (the two-H200 machine): throughput scaling through the
service, one CUDA context per GPU and none in the front end, and a worker killed under load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT
from worker_helpers import kill_one_worker_under_load

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900), pytest.mark.allow_skip_on_cpu("needs two GPUs of one host")]


def _gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


needs_two_gpus = pytest.mark.skipif(_gpu_count() < 2, reason="needs two GPUs of one host")


@needs_two_gpus
def test_two_gpus_serve_at_least_1_9x_one_with_one_process_per_gpu_and_none_in_the_front_end(tmp_path):
    # BENCH_OUT_DIR keeps the figures and server logs (bench/RESULTS.md quotes them). The node's fast
    # path: JPEGs decoded by nvJPEG in each worker, embeddings written into the clients' shared
    # memory (clients on the node). With embeddings on the gRPC stream one front-end process tops
    # out near 100-115 images/s on this machine (bench/RESULTS.md), short of two GPUs.
    out = Path(os.environ.get("BENCH_OUT_DIR") or tmp_path) / "scaling.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "bench/multi_gpu_scaling.py", "--setups", "0;0,1", "--concurrency", "64",
           "--seconds", "15", "--images", "2400", "--transport", "shared-memory", "--out", str(out),
           "--profile", os.environ.get("BENCH_PROFILE", ""), "--", "--max-batch-tokens", "65536",
           "--decode", "nvjpeg"]
    subprocess.run(cmd, cwd=REPO_ROOT, check=True, timeout=840)
    one, two = json.loads(out.read_text())["setups"]
    assert two["ratio_to_first"] >= 1.9, (one["images_per_s"], two["images_per_s"])
    for setup, gpus in ((one, [0]), (two, [0, 1])):
        seen = setup["gpu_processes"]
        assert seen["front_end_gpus"] == [], seen  # the front end never opened a CUDA context
        assert sorted(seen["workers"]) == [f"cuda:{g}" for g in gpus], seen
        for label, worker in seen["workers"].items():
            assert worker["gpus"] == [int(label.split(":")[1])], seen  # exactly its own GPU
        server_pids = {seen["front_end_pid"], *(w["pid"] for w in seen["workers"].values())}
        per_gpu = {g: [a["pid"] for a in seen["compute_apps"] if a["gpu"] == g and a["pid"] in server_pids]
                   for g in gpus}
        assert all(len(pids) == 1 for pids in per_gpu.values()), seen


@needs_two_gpus
def test_a_gpu_worker_killed_under_load_comes_back_and_no_request_is_lost(start_encoder_server):
    server = start_encoder_server("--devices", "0,1", "--model", "tiny-qwen2.5-vl", "--max-batch-tokens", "65536",
                                  "--batch-wait-ms", "0", timeout_s=300)
    kill_one_worker_under_load(server, "cuda:1", image_side=1344, count=48)
