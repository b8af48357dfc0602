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

``--slots`` compares how many sequences the padded attention patterns hold (``Slots`` of
models/cuda_graphs.py, e.g. ``--slots full_max=2,window_factor=2 --slots window_factor=none``): after
the default ladder, each variant's graphs are captured at ``--budgets`` (default: the default
ladder's) and every case replayed again, against the same eager times.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from encoder_service.models.cuda_graphs import Slots

# (label, image side in pixels, images): lone images, then batches up to and past the default top.
CASES = [("224 x1", 224, 1), ("448 x1", 448, 1), ("672 x1", 672, 1),
         ("1008 x1 as resized (980)", 980, 1), ("1008 x1", 1008, 1), ("448 x4", 448, 4),
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


def parse_slots(spec: str) -> Slots:
    """``full_max=2,window_factor=2`` -> Slots(full_max=2, window_factor=2.0); ``none`` is None."""
    fields = {f.name: f.type for f in dataclasses.fields(Slots)}
    values = {}
    for item in filter(None, spec.split(",")):
        key, value = item.split("=")
        values[key] = None if value.lower() == "none" else (float(value) if "float" in str(fields[key]) else int(value))
    return Slots(**values)


def run_preset(preset: str, iters: int, attn_backend: str = "auto", slots: list[str] = (),
               budgets: list[int] | None = None) -> dict:
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
                   capture_failed=list(report.failed), slots=dataclasses.asdict(graphs.slots))
    print(json.dumps({k: v for k, v in out.items() if k != "cases"}), flush=True)
    unit = model.spec.patch_size * model.spec.spatial_merge_size
    rng = np.random.default_rng(0)
    batches = []
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
        batches.append((label, count, grids, patches, pixels, tokens, eager_ms, eager))
    _replay_cases(model, graphs, "default ladder", batches, iters, out)
    for spec in slots:
        model.graphs = graphs = None  # the previous graphs' memory pool goes before the next capture
        torch.cuda.empty_cache()
        model.set_cuda_graphs(budgets or out.get("budgets") or (), parse_slots(spec))
        rep = model.capture_cuda_graphs()
        variant = {"slots": spec, "budgets": rep and list(rep.budgets), "capture_s": rep and rep.seconds,
                   "capture_mib": rep and rep.memory_bytes / 2**20, "failed": rep and list(rep.failed)}
        print(json.dumps(variant), flush=True)
        out.setdefault("variants", []).append(variant)
        graphs = model.graphs
        _replay_cases(model, graphs, spec, batches, iters, out)
    del model, graphs, batches
    torch.cuda.empty_cache()
    return out


def _replay_cases(model, graphs, variant: str, batches, iters: int, out: dict) -> None:
    for label, count, grids, patches, pixels, tokens, eager_ms, eager in batches:
        row = {"case": label, "variant": variant, "images": count, "patches": patches, "eager_ms": eager_ms}
        if graphs is not None:
            model.graphs = graphs
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="qwen2.5-vl-7b")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--attn-backend", default="auto", help="the server's --attn-backend")
    p.add_argument("--slots", action="append", default=[],
                   help="a Slots variant to compare (k=v,...; repeat the flag for more)")
    p.add_argument("--budgets", default=None, help="comma-separated budgets the --slots variants capture")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "presets": []}
    for preset in args.presets.split(","):
        try:
            budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else None
            result["presets"].append(run_preset(preset.strip(), args.iters, args.attn_backend, args.slots, budgets))
        except Exception as exc:  # one failing preset must not lose the others
            print(f"{preset}: FAILED {type(exc).__name__}: {exc}", flush=True)
            result["presets"].append({"preset": preset, "error": f"{type(exc).__name__}: {exc}"})
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
