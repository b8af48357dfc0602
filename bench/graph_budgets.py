"""Eager forwards against CUDA-graph replays at token budgets, batch by batch, on one GPU.

    python bench/graph_budgets.py --presets qwen2.5-vl-7b,qwen3-vl-8b,kimi-k2.5 --out graphs.json

Each preset loads as the server loads it in bf16 and no other flag (random weights of the full-size preset,
``engine.loading.load_model`` with a default ``ServiceConfig`` on cuda: its attention backend, its
fused operations, its default ladder), runs the server's warm-up and captures the ladder (seconds
and GPU memory reported). Then for each case (images of one size, the grids the processor makes of
them), with the pixels already on the device: the wall time of ``encode_packed`` to its result on
the device (a lone request's forward: host work, launches, device work), median of ``--iters``
after warm-up, eager (graphs set aside) against replayed, and the replay's error against eager for
every image (relative, and how many are bit-exact). What it chooses: the ladder's top, where a
replayed budget stops beating the eager forward of the batch it pads.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from encoder_service.config import ServiceConfig
from encoder_service.engine.loading import load_model
from encoder_service.engine.worker import warm_up

# (label, image side in pixels, images): lone images, then batches up to and past the default top.
CASES = [("224 x1", 224, 1), ("448 x1", 448, 1), ("672 x1", 672, 1), ("1008 x1", 1008, 1), ("448 x4", 448, 4),
         ("1008 x2", 1008, 2), ("448 x8", 448, 8), ("1008 x3", 1008, 3), ("448 x16", 448, 16),
         ("1008 x4 (above the top)", 1008, 4)]


def wall_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_preset(preset: str, iters: int, attn_backend: str = "auto") -> dict:
    config = ServiceConfig(model=preset, device="cuda", dtype="bfloat16", attn_backend=attn_backend)
    t0 = time.perf_counter()
    model = load_model(config.loading)
    load_s = time.perf_counter() - t0
    warmup_s = warm_up(model)  # the server's warm-up, then the capture of its ladder
    graphs = model.graphs
    report = graphs.report if graphs is not None else None
    out = {"preset": preset, "backend": model.attn_backend, "graph_backend": None, "load_s": load_s,
           "warmup_and_capture_s": warmup_s, "cases": []}
    if report is not None:
        out.update(budgets=list(report.budgets), capture_s=report.seconds, capture_mib=report.memory_bytes / 2**20,
                   capture_failed=list(report.failed))
    print(json.dumps({k: v for k, v in out.items() if k != "cases"}), flush=True)
    unit = model.spec.patch_size * model.spec.spatial_merge_size
    rng = np.random.default_rng(0)
    for label, side, count in CASES:
        blocks = round(side / unit) * model.spec.spatial_merge_size
        grids = [[1, blocks, blocks]] * count
        patches = sum(t * h * w for t, h, w in grids)
        pixels = torch.from_numpy(rng.standard_normal((patches, model.spec.patch_dim), dtype=np.float32)).to(
            model.device, model.dtype)
        tokens = [model.num_tokens(g) for g in grids]
        model.graphs = None
        eager_ms = wall_ms(lambda p=pixels, g=grids, m=model: m.encode_packed(p, g), iters)
        eager = model.encode_packed(pixels, grids)[0].float()
        model.graphs = graphs
        row = {"case": label, "images": count, "patches": patches, "eager_ms": eager_ms}
        if graphs is not None:
            replays = graphs.replays
            replay_ms = wall_ms(lambda p=pixels, g=grids, m=model: m.encode_packed(p, g), iters)
            replayed = model.encode_packed(pixels, grids)[0].float()
            budget = next((b for b in graphs.captured if b >= patches), None)
            errors = [rel_err(a, b) for a, b in zip(replayed.split(tokens), eager.split(tokens))]
            exact = sum(bool(torch.equal(a, b)) for a, b in zip(replayed.split(tokens), eager.split(tokens)))
            row.update(budget=budget, replayed=graphs.replays > replays, graph_ms=replay_ms,
                       speedup=eager_ms / replay_ms, max_rel_err=max(errors), bit_exact_images=exact)
        out["cases"].append(row)
        print(json.dumps(row), flush=True)
    del model, graphs
    torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="qwen2.5-vl-7b")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--attn-backend", default="auto", help="the server's --attn-backend")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "presets": []}
    for preset in args.presets.split(","):
        try:
            result["presets"].append(run_preset(preset.strip(), args.iters, args.attn_backend))
        except Exception as exc:  # one failing preset must not lose the others
            print(f"{preset}: FAILED {type(exc).__name__}: {exc}", flush=True)
            result["presets"].append({"preset": preset, "error": f"{type(exc).__name__}: {exc}"})
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
