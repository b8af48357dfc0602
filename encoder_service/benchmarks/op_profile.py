"""Where a tower's forward goes, by op class: torch.profiler's kernels (the ops' own time on the CPU),
each sorted into a class by its name, with each class's time, share, count and, where the profiler
counts FLOPs (matrix products, convolutions), its achieved TFLOP/s against the card's ceiling. The
profiler counts the FLOPs of aten's own matrix products only: a class that also holds Triton GEMMs
(the fused gate/up + SwiGLU) or FP8 ones (``_scaled_mm``) shows a rate below its true one, so its
rate is printed with a ``*`` where kernels of that kind ran (bench/RESULTS.md counts those by hand).

    encoder-service bench profile --presets qwen2.5-vl-7b,qwen3-vl-8b --out profile.json

Why by name: on a GPU the kernels are what the device runs (cuBLAS/nvjet GEMMs, FlashAttention or
cuDNN attention, Triton kernels that torch.compile fused and named after what they fuse, PyTorch's
elementwise and index kernels), and their names say which class of work each is; the split tells
where the time outside the matrix products goes (attention, the window reordering, norms, rotary,
activations, residual adds, copies). On the CPU the same is done with the aten ops' self time, which
is what the tests check the parsing with (tiny towers, no GPU).

The cases are the towers' throughput cases of bench/RESULTS.md: Qwen2.5-VL-7B 8 x 1008x1008, Qwen3-VL-8B
8 x 1024x1024 (``CASES``), random weights of the full-size presets, pixels already on the device, the
model as the server loads it (its default attention backend and fused ops; CUDA graphs only up to
6144 patches, so these batches run eagerly as they do in the server).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

# Classes, in the order they are tried: the first whose pattern matches a kernel's (or an aten op's)
# name takes it. Patterns are matched against the lower-cased name.
CLASSES: tuple[tuple[str, str], ...] = (
    ("memcpy", r"memcpy|memset"),
    ("attention", r"attention|attn|flash|fmha|sdpa|mha_|cudnn_generated_fort_native_sdpa|flashinfer"),
    ("conv", r"conv|implicit_gemm|cudnn_convolution"),
    # _gate_up_swiglu: the fused gate/up GEMM (ops/_swiglu_gemm.py), a GEMM with SwiGLU in its epilogue
    ("gemm", r"gemm|gate_up|nvjet|cutlass|xmma|cublas|splitk"
             r"|aten::(addmm|mm|bmm|matmul|linear|baddbmm|_scaled_mm)_?\b"),
    # torch.compile names a fused kernel after what it fuses: rsqrt/mean/var is a norm's
    ("norm", r"rms|layer_?norm|norm|rsqrt|aten::(pow|mean|var)\b"),
    ("rotary", r"rotary|rope|\bcos\b|\bsin\b|_cos_|_sin_|aten::(cos|sin)\b"),
    ("activation", r"gelu|silu|swiglu|sigmoid|erf|tanh|aten::(relu|gelu|silu)\b"),
    ("reorder", r"index|gather|scatter|cat|_take|aten::(select|narrow|flip)\b|reorder|permute"),
    ("copy", r"copy|_to_copy|contiguous|clone|fill"),
    ("elementwise", r"elementwise|vectorized|add|mul|div|sub|neg|triton_poi|triton_per|triton_red|reduce"),
)
# GEMM kernels whose FLOPs the profiler does not count: Triton's (ours) and cuBLAS's FP8 ones.
_UNCOUNTED = re.compile(r"gate_up|qqtst|e4m3|_scaled_mm")
CLASS_NAMES = (*(name for name, _ in CLASSES), "other")
_COMPILED = tuple((name, re.compile(pattern)) for name, pattern in CLASSES)


def is_annotation(name: str) -> bool:
    """A range the profiler records around other kernels (torch.compile's ``## Call CompiledFxGraph ...
    ##``), with device time that is theirs: counting it would count them twice."""
    return name.startswith("## ")


def classify(name: str) -> str:
    """The op class of a kernel or aten op ``name`` (``other`` where no pattern matches)."""
    lowered = name.lower()
    for cls, pattern in _COMPILED:
        if pattern.search(lowered):
            return cls
    return "other"


@dataclass
class OpTime:
    """One kernel (or aten op, on the CPU) summed over a profile: its time in microseconds, how many
    times it ran, and the FLOPs the profiler counted for it (0 where it counts none)."""

    name: str
    us: float
    count: int
    flops: float = 0.0


@dataclass
class ClassTime:
    name: str
    us: float
    share: float
    count: int
    flops: float
    tflops: float | None  # achieved, where FLOPs were counted
    share_of_ceiling: float | None


def summarize(ops: Iterable[OpTime], ceiling_tflops: float | None = None, forwards: int = 1) -> list[ClassTime]:
    """Per class, per forward (``forwards``: how many the profile held), largest first."""
    totals: dict[str, list[float]] = {name: [0.0, 0, 0.0] for name in CLASS_NAMES}
    for op in ops:
        row = totals[classify(op.name)]
        row[0] += op.us
        row[1] += op.count
        row[2] += op.flops
    whole = sum(us for us, _, _ in totals.values()) or 1.0
    out = []
    for name, (us, count, flops) in totals.items():
        if not count:
            continue
        tflops = flops / (us * 1e-6) / 1e12 if flops and us else None
        out.append(ClassTime(name, us / forwards, us / whole, int(count // forwards), flops / forwards, tflops,
                             tflops / ceiling_tflops if tflops and ceiling_tflops else None))
    return sorted(out, key=lambda c: -c.us)


def profile_ops(fn: Callable[[], object], device: str, iters: int = 3) -> list[OpTime]:
    """``fn`` run ``iters`` times under torch.profiler: on CUDA its kernels' device time (FLOPs from the aten
    ops that launched them, summed per class by the aten op's name), on the CPU its aten ops' self time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.inference_mode(), profile(activities=activities, with_flops=True, record_shapes=True) as prof:
        for _ in range(iters):
            fn()
        if cuda:
            torch.cuda.synchronize()
    ops = []
    for event in prof.key_averages():
        if cuda:
            # A kernel has device time of its own and no CPU time of its own (device_type CUDA).
            if is_annotation(event.key):
                continue
            if str(getattr(event, "device_type", "")).endswith("CUDA") and event.self_device_time_total > 0:
                ops.append(OpTime(event.key, float(event.self_device_time_total), int(event.count)))
            elif event.flops:  # the aten op that launched GEMMs: its FLOPs go to its class
                ops.append(OpTime(event.key, 0.0, 0, float(event.flops)))
        elif event.self_cpu_time_total > 0 and event.key.startswith("aten::"):
            ops.append(OpTime(event.key, float(event.self_cpu_time_total), int(event.count), float(event.flops or 0)))
    return ops


# name -> (preset, images, side)
CASES: dict[str, tuple[str, int, int]] = {
    "qwen2.5-vl-7b": ("qwen2.5-vl-7b", 8, 1008),
    "qwen3-vl-8b": ("qwen3-vl-8b", 8, 1024),
}


def tower_case(preset: str, images: int, side: int, device: str, dtype: str, attn_backend: str = "auto",
               quantization: str | None = None):
    """(the loaded tower, a function running one forward of ``images`` ``side`` x ``side`` images)."""
    import numpy as np
    import torch

    from ..models import load_vision_model
    from ..torch_dtypes import torch_dtype

    model = load_vision_model(preset, device=device, dtype=torch_dtype(dtype), attn_backend=attn_backend,
                              quantization=quantization)
    factor = model.spec.patch_size * model.spec.spatial_merge_size
    cells = side // factor * model.spec.spatial_merge_size
    grids = [(1, cells, cells)] * images
    patches = images * cells * cells
    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.standard_normal((patches, model.spec.patch_dim), dtype=np.float32))
    pixels = pixels.to(device, torch_dtype(dtype))
    return model, (lambda: model.encode_packed(pixels, grids))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="encoder-service bench profile", description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(CASES), help="comma list of " + ", ".join(CASES))
    parser.add_argument("--images", type=int, default=None, help="images per forward (default: the case's)")
    parser.add_argument("--side", type=int, default=None, help="image side in pixels (default: the case's)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--attn-backend", default="auto", help="the server's --attn-backend")
    parser.add_argument("--quantization", default="none", help="the server's --quantization (none, fp8)")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per tower")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    ceiling = None
    if args.device.startswith("cuda"):
        from .forward import gemm_ceiling

        ceiling = gemm_ceiling()
        print(f"device: {torch.cuda.get_device_name()}  bf16 GEMM 8192^3: {ceiling:.0f} TFLOP/s", flush=True)
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "gemm_ceiling_tflops": ceiling, "towers": []}
    for name in args.presets.split(","):
        preset, images, side = CASES.get(name, (name, 8, 448))
        images, side = args.images or images, args.side or side
        model, forward = tower_case(preset, images, side, args.device, args.dtype, args.attn_backend,
                                    args.quantization)
        for _ in range(2):  # warm-up: compiled graphs, plans, autotuning
            forward()
        wall = None
        if args.device.startswith("cuda"):
            from .forward import measure

            # Outside the profiler: what a forward takes alone and back to back; what the kernels do
            # not account for is launch gaps and host work (the profile's own overhead excluded).
            alone, b2b = measure(forward, max(args.iters, 5), 1)
            wall = {"alone_ms": alone * 1e3, "back_to_back_ms": b2b * 1e3}
        ops = profile_ops(forward, args.device, args.iters)
        classes = summarize(ops, ceiling, args.iters)
        top = sorted((op for op in ops if op.us), key=lambda op: -op.us)[:args.top]
        total_ms = sum(c.us for c in classes) / 1e3
        print(f"\n=== {preset}: {images} x {side}x{side}, backend {model.attn_backend}, quantization "
              f"{args.quantization}: "
              f"{total_ms:.1f} ms of {'kernels' if ceiling else 'ops'} a forward", flush=True)
        if wall:
            print(f"  wall: {wall['alone_ms']:.1f} ms alone, {wall['back_to_back_ms']:.1f} ms back to back; "
                  f"gaps back to back {wall['back_to_back_ms'] - total_ms:.1f} ms", flush=True)
        for c in classes:
            uncounted = c.name == "gemm" and any(classify(op.name) == "gemm" and _UNCOUNTED.search(op.name.lower())
                                                 for op in ops if op.us)
            achieved = f"  {c.tflops:6.0f} TFLOP/s{'*' if uncounted else ''} ({100 * c.share_of_ceiling:.0f}% of " \
                f"ceiling)" if c.tflops \
                and c.share_of_ceiling else ""
            print(f"  {c.name:12s} {c.us / 1e3:8.2f} ms  {100 * c.share:5.1f}%  x{c.count}{achieved}")
        for op in top:
            print(f"    {op.us / args.iters / 1e3:8.2f} ms  x{op.count // args.iters:<4d} [{classify(op.name)}] "
                  f"{op.name[:110]}")
        report["towers"].append({"preset": preset, "images": images, "side": side, "backend": model.attn_backend,
                                 "quantization": args.quantization,
                                 "ms_per_forward": total_ms, "wall": wall, "classes": [asdict(c) for c in classes],
                                 "top": [asdict(op) for op in top]})
        del model, forward
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
