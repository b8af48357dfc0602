"""Qwen3-VL / Qwen3.5 vision tower throughput: our backends against transformers' vision model.

    python bench/qwen3_vl_throughput.py --preset qwen3-vl-8b --out qwen3.json

Same method as encoder-service bench (random bf16 weights of the full-size preset, the same tensors in
both, pixels already on the GPU, median of CUDA-event timings after warm-up, and back to back) and
the same cases, at Qwen3-VL's patch 16: (a) 8 x 1024x1024, (b) a mixed batch from 224x224 to
1344x1344, (c) 64 x 448x448. The share of the bf16 GEMM ceiling counts the tower's FLOPs exactly
from the grids, deepstack mergers included.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import time_backends
from encoder_service.attention.registry import BACKENDS, backend_class
from encoder_service.benchmarks.forward import MIXED_SIZES, gemm_ceiling, grids_for, measure
from encoder_service.models import load_vision_model
from encoder_service.models.family import preset_config, random_state
from encoder_service.models.presets import get_preset
from encoder_service.models.registry import family_for

PATCH = 16
CASES = {
    "a": ("8 x 1024x1024", [(1024, 1024)] * 8),
    # Qwen2.5-VL's mixed sizes rounded to Qwen3-VL's 32-pixel merge unit.
    "b": ("mixed 224..1344 (8 images)", [(h // 32 * 32, w // 32 * 32) for h, w in MIXED_SIZES]),
    "c": ("64 x 448x448", [(448, 448)] * 64),
}


def tower_flops(cfg, grids) -> float:
    """FLOPs of one forward: the GEMMs of every patch and merged token, attention per frame."""
    d, i, m = cfg.hidden_size, cfg.intermediate_size, cfg.spatial_merge_size ** 2
    n = sum(t * h * w for t, h, w in grids)
    patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    gemm = n * (2 * patch_dim * d + cfg.depth * 2 * (4 * d * d + 2 * d * i))
    mergers = 1 + len(cfg.deepstack_visual_indexes)
    gemm += mergers * (n // m) * 2 * (m * d * m * d + m * d * cfg.out_hidden_size)
    return gemm + attention_flops(cfg, grids)


def attention_flops(cfg, grids) -> float:
    """QK^T and PV of every block, one sequence per frame."""
    return sum(t * 4 * (h * w) ** 2 * cfg.hidden_size for t, h, w in grids) * cfg.depth


def reference(preset, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' vision model of the preset's model_type with our weights, in bf16 on the GPU."""
    from transformers import AutoConfig, AutoModel

    family = family_for(preset.model_type)
    vision = AutoConfig.for_model(**family.checkpoint_config(preset)).vision_config
    vision._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = AutoModel.from_config(vision, dtype=torch.bfloat16).eval()
    model.load_state_dict(state, strict=True)
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-vl-8b")
    parser.add_argument("--backends", default="all", help="comma list of our backends, or 'all' (every one that runs)")
    parser.add_argument("--cases", default="a,b,c")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quantization", default="none", help="comma list of --quantization values, each timed")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2

    device = torch.device("cuda")
    preset = get_preset(args.preset)
    cfg = preset_config(family_for(preset.model_type), preset)
    state = {k: v.to(device, torch.bfloat16) for k, v in random_state(family_for(preset.model_type), cfg).items()}
    names = (args.backends.split(",") if args.backends != "all" else
             [n for n in BACKENDS if backend_class(n).unsupported_reason(device, torch.bfloat16, cfg.head_dim) is None])
    rng = np.random.default_rng(0)
    patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    inputs = {}
    for c in args.cases.split(","):
        grids = grids_for(CASES[c][1], patch=PATCH)
        n = sum(t * h * w for t, h, w in grids)
        pixels = torch.from_numpy(rng.standard_normal((n, patch_dim), dtype=np.float32)).to(device, torch.bfloat16)
        inputs[c] = (grids, pixels, tower_flops(cfg, grids))

    ceiling = gemm_ceiling()
    print(f"device: {torch.cuda.get_device_name()}  bf16 GEMM 8192^3: {ceiling:.0f} TFLOP/s", flush=True)
    results = []

    def record(contender, c, timings):
        grids, _, flops = inputs[c]
        alone, b2b = timings
        row = {"contender": contender, "case": c, "case_name": CASES[c][0], "images": len(grids),
               "images_per_s": len(grids) / alone, "b2b_images_per_s": len(grids) / b2b, "seconds": alone,
               "b2b_seconds": b2b, "b2b_share_of_gemm_ceiling": flops / b2b / 1e12 / ceiling}
        results.append(row)
        print(f"{contender:24s} case {c}: {row['images_per_s']:7.1f} images/s alone, back to back "
              f"{row['b2b_images_per_s']:7.1f} ({100 * row['b2b_share_of_gemm_ceiling']:.0f}% of GEMM ceiling)",
              flush=True)

    if not args.no_transformers:
        ref = reference(preset, state)
        for c, (grids, pixels, _) in inputs.items():
            grid_t = torch.tensor(grids, device=device)
            with torch.inference_mode():
                record("transformers (sdpa)", c, measure(lambda p=pixels, g=grid_t: ref(p, grid_thw=g),
                                                         args.iters, args.warmup))
        del ref
        torch.cuda.empty_cache()

    # The preset's seed-0 weights: the same tensors as the reference's. A contender is BACKEND or
    # BACKEND fp8 (the name time_backends records).
    contenders = [f"{n} {q}" if q != "none" else n for q in args.quantization.split(",") for n in names]

    def load(contender: str):
        name, _, quant = contender.partition(" ")
        return load_vision_model(args.preset, device="cuda", dtype=torch.bfloat16, attn_backend=name,
                                 quantization=quant or None)

    time_backends(contenders, load, inputs, lambda fn: measure(fn, args.iters, args.warmup), record, results)

    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
                                        "command": " ".join(sys.argv), "preset": args.preset,
                                        "gemm_tflops": ceiling, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
