"""ViT throughput on one GPU: our backends against transformers' reference, same random weights.

    encoder-service bench forward --out results.json    (or: python -m encoder_service.benchmarks.forward)

Cases (Qwen2.5-VL-7B vision sizes, bf16): (a) 8 images of 1008x1008, (b) a mixed batch from
224x224 to 1344x1344, (c) 64 images of 448x448. Pixels are already on the GPU for every contender
(transformers' usual way), so the figure is the forward alone; each timing is the median of
``--iters`` runs measured with CUDA events after warm-up. Also measures the bf16 GEMM ceiling and
reports what share of it each run reaches, counting the model's FLOPs exactly from the grids.
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

from encoder_service.attention.registry import BACKENDS, backend_class
from encoder_service.metadata import SpatialConfig, build_metadata
from encoder_service.models.presets import PRESETS, random_vision_state
from encoder_service.models.qwen2_5_vl.loading import build
from encoder_service.models.qwen2_5_vl.model import Qwen2_5_VisionConfig

MIXED_SIZES = [(224, 224), (448, 672), (1344, 1344), (896, 896), (336, 1008), (1120, 784), (560, 560),
               (1344, 448)]
CASES = {
    "a": ("8 x 1008x1008", [(1008, 1008)] * 8),
    "b": ("mixed 224..1344 (8 images)", MIXED_SIZES),
    "c": ("64 x 448x448", [(448, 448)] * 64),
}


def grids_for(sizes, patch=14):
    # All case sizes are multiples of 28 and under max_pixels, so smart_resize keeps them.
    return [[1, h // patch, w // patch] for h, w in sizes]


def model_flops(cfg: Qwen2_5_VisionConfig, grids) -> float:
    """Exact FLOPs of one forward: GEMMs per patch plus attention per sequence pair."""
    meta = build_metadata(grids, SpatialConfig(cfg.spatial_merge_size, cfg.patch_size, cfg.window_size))
    n = meta.total_patches
    d, i, m = cfg.hidden_size, cfg.intermediate_size, cfg.spatial_merge_size**2
    patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    gemm = n * (2 * patch_dim * d + cfg.depth * 2 * (4 * d * d + 3 * d * i))
    gemm += (n // m) * 2 * (m * d * m * d + m * d * cfg.out_hidden_size)

    def attn(lengths):
        return sum(4 * s * s * d for s in lengths)

    full = attn(np.diff(meta.full.cu_seqlens).tolist())
    window = attn(np.diff(meta.window.cu_seqlens).tolist())
    n_full = len(cfg.fullatt_block_indexes)
    return gemm + n_full * full + (cfg.depth - n_full) * window


def time_it(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def time_back_to_back(fn, iters: int, warmup: int) -> float:
    """Seconds per call with ``iters`` calls enqueued back to back and one wait at the end: the
    steady state of a server fed faster than it computes, where the host work of call i+1 (metadata,
    launches) overlaps the device work of call i. The engine's worker runs batches this way."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def measure(fn, iters: int, warmup: int) -> tuple[float, float]:
    """(median seconds of one call timed alone, seconds per call back to back)."""
    return time_it(fn, iters, warmup), time_back_to_back(fn, iters, 1)


def gemm_ceiling(iters: int = 20) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = time_it(lambda: a @ b, iters, 5)
    return 2 * 8192**3 / t / 1e12


def transformers_reference(cfg_dict: dict, state: dict):
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg = Qwen2_5_VLVisionConfig(**cfg_dict)
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg, dtype=torch.bfloat16).eval()
    model.load_state_dict(state)
    return model


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="encoder-service bench forward", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-vl-7b")
    parser.add_argument("--backends", default="all",
                        help="comma list of our backends, or 'all' (every one that runs here); 'auto' times "
                             "what the server's --attn-backend auto serves")
    parser.add_argument("--cases", default="a,b,c")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", choices=["off", "on", "both"], default="on",
                        help="torch.compile of the non-attention parts of each block")
    parser.add_argument("--ops", nargs="+", default=["auto"], metavar="OPS",
                        help="one or more --ops values (the server's syntax), each timed with every backend, "
                             "e.g. --ops auto torch window_attention=triton window_attention=torch,gated_mlp=torch "
                             "(encoder_service/ops). Under auto a named backend runs the window layers too: "
                             "window_attention=triton times the fused window kernel with it")
    parser.add_argument("--cuda-graphs", choices=["off", "on", "both"], default="on",
                        help="replay each batch composition as a CUDA graph (models/cuda_graphs.py)")
    parser.add_argument("--try-compile-mode", default=None,
                        help="also time flashinfer-cudnn with this torch.compile mode, e.g. max-autotune-no-cudagraphs")
    parser.add_argument("--quantization", nargs="+", default=["none"], metavar="Q",
                        help="one or more --quantization values (none, fp8), each timed with every backend")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    preset = PRESETS[args.preset]
    cfg = Qwen2_5_VisionConfig.from_dict(preset.vision_config)
    state = {k: v.to(device=device, dtype=torch.bfloat16) for k, v in random_vision_state(preset).items()}
    if args.backends == "all":
        names = [n for n in BACKENDS if backend_class(n).unsupported_reason(device, torch.bfloat16, cfg.head_dim)
                 is None]
    else:
        names = args.backends.split(",")
    cases = {c: CASES[c] for c in args.cases.split(",")}
    rng = np.random.default_rng(0)
    inputs = {}
    for c, (_, sizes) in cases.items():
        grids = grids_for(sizes)
        n = sum(t * h * w for t, h, w in grids)
        pixels = torch.from_numpy(rng.standard_normal((n, 1176), dtype=np.float32)).to(device, torch.bfloat16)
        inputs[c] = (grids, pixels, model_flops(cfg, grids))

    ceiling = gemm_ceiling()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16 GEMM 8192^3: "
          f"{ceiling:.0f} TFLOP/s", flush=True)
    results = []

    def record(contender, c, timings, extra=None):
        grids, _, flops = inputs[c]
        seconds, b2b = timings
        row = {"contender": contender, "case": c, "case_name": cases[c][0], "images": len(grids),
               "patches": int(sum(t * h * w for t, h, w in grids)), "seconds": seconds,
               "images_per_s": len(grids) / seconds, "b2b_seconds": b2b, "b2b_images_per_s": len(grids) / b2b,
               "tflops": flops / seconds / 1e12, "share_of_gemm_ceiling": flops / seconds / 1e12 / ceiling,
               "b2b_share_of_gemm_ceiling": flops / b2b / 1e12 / ceiling, **(extra or {})}
        results.append(row)
        print(f"{contender:28s} case {c}: {row['images_per_s']:8.1f} images/s  {seconds * 1e3:8.1f} ms alone; "
              f"back to back {row['b2b_images_per_s']:8.1f} images/s {b2b * 1e3:8.1f} ms "
              f"({100 * row['b2b_share_of_gemm_ceiling']:.0f}% of GEMM ceiling)", flush=True)

    if not args.no_transformers:
        ref = transformers_reference({**preset.vision_config}, {k: v for k, v in state.items()})
        for c, (grids, pixels, _) in inputs.items():
            grid_t = torch.tensor(grids, device=device)
            with torch.inference_mode():
                timings = measure(lambda p=pixels, g=grid_t: ref(p, grid_thw=g), args.iters, args.warmup)
            record("transformers (sdpa)", c, timings)
        del ref
        torch.cuda.empty_cache()

    def time_model(label, make_model, extra=None):
        """Times one of our contenders on every case; a failure is reported and the run goes on."""
        model = None
        try:
            model = make_model()
            for c, (grids, pixels, _) in inputs.items():
                t0 = time.perf_counter()
                model.encode_packed(pixels, grids)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                timings = measure(lambda m=model, p=pixels, g=grids: m.encode_packed(p, g), args.iters, args.warmup)
                graphs = getattr(model, "graphs", None)
                record(label, c, timings, {"first_call_s": first, "backend": model.attn_backend,
                                           "kernel": type(model.backend).__name__, "ops": model.ops.describe(),
                                           "graph_replays": graphs.replays if graphs else 0, **(extra or {})})
        except Exception as exc:  # one failing contender must not lose the run
            print(f"{label}: FAILED {type(exc).__name__}: {exc}", flush=True)
            results.append({"contender": label, "error": f"{type(exc).__name__}: {exc}"})
        del model
        torch.cuda.empty_cache()

    modes = {"off": [False], "on": [True], "both": [False, True]}
    for name in names:
        for compiled in modes[args.compile]:
            for ops, cg, quant in [(o, g, q) for o in args.ops for g in modes[args.cuda_graphs]
                                   for q in args.quantization]:
                label = (f"{name}{' +compile' if compiled else ''}{'' if ops == 'auto' else f' (ops {ops})'}"
                         f"{'' if cg else ' (no CUDA graphs)'}{'' if quant == 'none' else f' {quant}'}")

                def make(n=name, c=compiled, o=ops, graphs=cg, q=quant):
                    model = build(cfg, dict(state), model_id=args.preset, preprocess_config=None, device=device,
                                  dtype=torch.bfloat16, attn_backend=n, ops=o, compile=c)
                    model.quantize(q)
                    if not graphs:
                        model.set_cuda_graphs(0)
                    return model

                time_model(label, make, {"compiled": compiled, "ops_asked": ops, "cuda_graphs": cg,
                                         "quantization": quant})

    if args.try_compile_mode:
        torch._dynamo.reset()

        def compiled_with_mode():
            model = build(cfg, dict(state), model_id=args.preset, preprocess_config=None, device=device,
                          dtype=torch.bfloat16, attn_backend="flashinfer-cudnn", compile=False)
            model.module.compile(mode=args.try_compile_mode)
            return model

        time_model(f"flashinfer-cudnn +compile({args.try_compile_mode})", compiled_with_mode)

    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
               "date": time.strftime("%Y-%m-%d"), "command": " ".join(["encoder-service bench forward", *argv]),
               "gemm_tflops": ceiling, "results": results}
    print("\n| contender | case | images/s back to back | ms | images/s alone | ms | share of GEMM ceiling |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        if "error" in r:
            print(f"| {r['contender']} | - | failed: {r['error'][:60]} | | | | |")
        else:
            print(f"| {r['contender']} | {r['case']} | {r['b2b_images_per_s']:.1f} | {r['b2b_seconds'] * 1e3:.1f} | "
                  f"{r['images_per_s']:.1f} | {r['seconds'] * 1e3:.1f} | {100 * r['b2b_share_of_gemm_ceiling']:.0f}% |")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
