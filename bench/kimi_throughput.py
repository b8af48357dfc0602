"""Kimi-K2.5 vision tower + projector throughput: our backends against transformers' reference.

    python bench/kimi_throughput.py --out kimi.json

Same method as encoder-service bench (random bf16 weights of the full-size preset, pixels already on the
GPU, median of CUDA-event timings after warm-up). Cases: (a) 8 images of 1008x1008, (c) 64 of 448x448.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import time_backends
from encoder_service.attention.registry import BACKENDS, backend_class
from encoder_service.benchmarks.forward import gemm_ceiling, time_it
from encoder_service.models import load_vision_model
from encoder_service.models.kimi_k25.loading import checkpoint_config, original_to_split
from encoder_service.models.kimi_k25.model import KimiK25VisionConfig
from encoder_service.models.kimi_k25.reference import transformers_reference
from encoder_service.models.presets import PRESETS, random_vision_state

CASES = {"a": ("8 x 1008x1008", [[1, 72, 72]] * 8), "c": ("64 x 448x448", [[1, 32, 32]] * 64)}


def reference(preset, state):
    config = checkpoint_config(preset.vision_config, preset.text_hidden_size)
    split = original_to_split(state, KimiK25VisionConfig.from_config(config), prefix="")
    tower, projector = transformers_reference(config, split)
    tower.to("cuda", torch.bfloat16)
    projector.to("cuda", torch.bfloat16)

    def run(pixels, grid_t):
        return projector(tower(pixels.view(-1, 3, 14, 14), grid_thw=grid_t).pooler_output)

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    preset = PRESETS["kimi-k2.5"]
    state = random_vision_state(preset)
    rng = np.random.default_rng(0)
    inputs = {}
    for c, (_, grids) in CASES.items():
        n = sum(t * h * w for t, h, w in grids)
        pixels = torch.from_numpy(rng.standard_normal((n, 588), dtype=np.float32))
        inputs[c] = (grids, pixels.to("cuda", torch.bfloat16))
    ceiling = gemm_ceiling()
    print(f"device: {torch.cuda.get_device_name()}  bf16 GEMM {ceiling:.0f} TFLOP/s", flush=True)
    results = []

    def record(label, c, seconds):
        row = {"contender": label, "case": c, "case_name": CASES[c][0], "seconds": seconds,
               "images_per_s": len(CASES[c][1]) / seconds}
        results.append(row)
        print(f"{label:24s} case {c}: {row['images_per_s']:8.1f} images/s {seconds * 1e3:8.1f} ms", flush=True)

    ref = reference(preset, state)
    for c, (grids, px) in inputs.items():
        g = torch.tensor(grids, device="cuda")
        with torch.inference_mode():
            record("transformers (sdpa)", c, time_it(lambda p=px, g=g, f=ref: f(p, g), args.iters, args.warmup))
    del ref
    torch.cuda.empty_cache()
    names = [n for n in BACKENDS if backend_class(n).unsupported_reason(torch.device("cuda"), torch.bfloat16, 72)
             is None]
    time_backends(names, lambda name: load_vision_model("kimi-k2.5", device="cuda", dtype="bfloat16",
                                                         attn_backend=name),
                  inputs, lambda fn: time_it(fn, args.iters, args.warmup), record, results)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                                        "gemm_tflops": ceiling, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
