"""FP8 against bf16 at the towers' own GEMM shapes: time, TFLOP/s and error against float32.

    python bench/fp8_gemm.py --out fp8.json

For each linear of Qwen2.5-VL-7B (8 x 1008x1008: 41,472 patches) and Qwen3-VL-8B (8 x 1024x1024:
32,768 patches), every contender computes ``x @ W.T + b`` from the same bf16 x and W:

* ``bf16``: ``F.linear`` (cuBLAS), what the towers run today;
* ``fp8 tensor``: ``torch._scaled_mm`` with one scale for x and one for W (e4m3);
* ``fp8 row``: ``torch._scaled_mm`` with one scale per token of x and one per output channel of W;
* ``quant row``: the pass that makes x's e4m3 rows and scales (torch.compile'd), timed alone: what
  FP8 costs when the quantisation is not fused into the op before the GEMM.

The error is the relative Frobenius error of each output against the float32 product of the same
bf16 inputs. Median of CUDA-event timings after warm-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from encoder_service.benchmarks.forward import gemm_ceiling, time_it

E4M3_MAX = 448.0
# (tower, layer, M, K, N): every distinct linear of a block, and the mergers, at the towers' batches.
SHAPES = [
    ("qwen2.5-vl-7b", "qkv", 41472, 1280, 3840),
    ("qwen2.5-vl-7b", "proj", 41472, 1280, 1280),
    ("qwen2.5-vl-7b", "gate_up", 41472, 1280, 6912),
    ("qwen2.5-vl-7b", "down", 41472, 3456, 1280),
    ("qwen2.5-vl-7b", "merger fc1", 10368, 5120, 5120),
    ("qwen2.5-vl-7b", "merger fc2", 10368, 5120, 3584),
    ("qwen3-vl-8b", "qkv", 32768, 1152, 3456),
    ("qwen3-vl-8b", "proj", 32768, 1152, 1152),
    ("qwen3-vl-8b", "fc1", 32768, 1152, 4304),
    ("qwen3-vl-8b", "fc2", 32768, 4304, 1152),
    ("qwen3-vl-8b", "merger fc1", 8192, 4608, 4608),
    ("qwen3-vl-8b", "merger fc2", 8192, 4608, 4096),
]


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 rows of x and their float32 scales [rows, 1] (amax / 448 per row)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def quant_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax().float().clamp(min=1e-12) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def measure_shape(m: int, k: int, n: int, quant, iters: int) -> dict:
    """Each contender's time, TFLOP/s and error at one shape, and the row quantisation's time."""
    dev = "cuda"
    # Activations of a residual stream: mostly unit scale, a few outlier channels (as ViTs have).
    x = torch.randn(m, k, device=dev)
    x[:, :: max(1, k // 16)] *= 8
    x = x.to(torch.bfloat16)
    w = (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)
    b = (torch.randn(n, device=dev) * 0.02).to(torch.bfloat16)
    ref = F.linear(x.float(), w.float(), b.float())
    flops = 2 * m * k * n
    xr, sxr = quant_rows(x)
    wr, swr = quant_rows(w)
    swr = swr.t().contiguous()  # [1, N]: one scale per output channel
    xt, sxt = quant_tensor(x)
    wt, swt = quant_tensor(w)
    contenders = {
        "bf16": lambda: F.linear(x, w, b),
        "fp8 tensor": lambda: torch._scaled_mm(xt, wt.t(), scale_a=sxt, scale_b=swt, bias=b,
                                               out_dtype=torch.bfloat16, use_fast_accum=True),
        "fp8 row": lambda: torch._scaled_mm(xr, wr.t(), scale_a=sxr, scale_b=swr, bias=b,
                                            out_dtype=torch.bfloat16, use_fast_accum=True),
        "fp8 row (slow accum)": lambda: torch._scaled_mm(xr, wr.t(), scale_a=sxr, scale_b=swr, bias=b,
                                                         out_dtype=torch.bfloat16),
    }
    line: dict = {}
    for label, fn in contenders.items():
        try:
            out = fn()
            t = time_it(fn, iters, 3)
            line[label] = {"ms": t * 1e3, "tflops": flops / t / 1e12, "rel_err": rel_err(out, ref)}
        except Exception as exc:  # one failing contender must not lose the run
            line[label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    quant(x)
    line["quant row"] = {"ms": time_it(lambda: quant(x), iters, 3) * 1e3}
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    ceiling = gemm_ceiling()
    name = torch.cuda.get_device_name()
    print(f"device: {name}  torch {torch.__version__}  bf16 GEMM 8192^3: {ceiling:.0f} TFLOP/s", flush=True)
    quant = torch.compile(quant_rows)
    rows = []
    torch.manual_seed(0)
    for tower, layer, m, k, n in SHAPES:
        line = {"tower": tower, "layer": layer, "m": m, "k": k, "n": n, **measure_shape(m, k, n, quant, args.iters)}
        rows.append(line)
        cells = "  ".join(f"{lab}: {v['ms']:.3f} ms {v.get('tflops', 0):.0f} TF err {v.get('rel_err', 0):.2e}"
                          if "ms" in v else f"{lab}: {v['error'][:80]}" for lab, v in line.items()
                          if isinstance(v, dict))
        print(f"{tower:14s} {layer:11s} {m}x{k}x{n}  {cells}", flush=True)
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                                        "gemm_ceiling_tflops": ceiling, "command": " ".join(sys.argv),
                                        "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
