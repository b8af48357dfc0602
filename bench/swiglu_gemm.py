"""The MLP's gate/up GEMM with SwiGLU fused into its epilogue (Triton) against cuBLAS followed by the
compiled SwiGLU pass, at case (a) sizes of Qwen2.5-VL-7B (41,472 tokens, hidden 1,280, intermediate
3,420 padded to 3,456). Sweeps launch configurations; prints ms, TFLOP/s and the error against the
unfused path.

    python bench/swiglu_gemm.py [--tokens N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from encoder_service.benchmarks.forward import time_it
from encoder_service.ops.torch_ops import swiglu

# Departures from _swiglu_gemm.DEFAULT.
CONFIGS = [
    dict(),
    dict(num_stages=3),
    dict(num_stages=5),
    dict(group_m=4),
    dict(group_m=16),
    dict(group_m=1),
    dict(block_k=128, num_stages=2),
    dict(block_n=64, num_warps=4),
    dict(block_n=64, num_warps=8),
    dict(block_m=64, num_warps=4),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=41472)
    parser.add_argument("--hidden", type=int, default=1280)
    parser.add_argument("--inter", type=int, default=3456)
    args = parser.parse_args()
    from encoder_service.ops import _swiglu_gemm  # imports triton: after --help, which needs no GPU

    m, k, n = args.tokens, args.hidden, args.inter
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=dt)
    # Rows alternating gate j, up j, as the folded path stores them.
    w = torch.randn(2 * n, k, device=dev, dtype=dt) * k**-0.5
    shift = (torch.randn(2 * n, device=dev) * 0.1).to(dt)
    scale = torch.rand(m, device=dev) + 0.5
    bias = torch.randn(2 * n, device=dev) * 0.1
    flops = 2 * m * k * 2 * n
    compiled = torch.compile(swiglu, fullgraph=True)

    def unfused():
        return compiled(F.linear(x, w, shift), scale, bias, "silu")

    gemm_s = time_it(lambda: F.linear(x, w, shift), 20, 3)
    half_s = time_it(lambda: F.linear(x, w[:n], shift[:n]), 20, 3)
    print(f"cuBLAS GEMM of the gate half alone: {half_s * 1e3:.3f} ms ({flops / 2 / half_s / 1e12:.0f} TFLOP/s)")
    gu = F.linear(x, w, shift)
    act_s = time_it(lambda: compiled(gu, scale, bias, "silu"), 20, 3)
    ref = unfused()
    total = gemm_s + act_s
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {_swiglu_gemm.triton.__version__}")
    print(f"cuBLAS gate/up GEMM {gemm_s * 1e3:.3f} ms ({flops / gemm_s / 1e12:.0f} TFLOP/s) + compiled SwiGLU "
          f"{act_s * 1e3:.3f} ms = {total * 1e3:.3f} ms", flush=True)
    for cfg in CONFIGS:
        try:
            out = _swiglu_gemm.gate_up_swiglu(x, w, shift, scale, bias, cfg)
            t = time_it(lambda c=cfg: _swiglu_gemm.gate_up_swiglu(x, w, shift, scale, bias, c), 20, 3)
        except Exception as exc:  # a config the compiler rejects is a result too
            print(f"{cfg}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
            continue
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        full = {**_swiglu_gemm.DEFAULT, **cfg}
        print(f"{full}: {t * 1e3:.3f} ms ({flops / t / 1e12:.0f} TFLOP/s, {t / gemm_s:.0%} of cuBLAS GEMM alone, "
              f"{t / total:.0%} of unfused) rel err {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
