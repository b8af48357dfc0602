"""Micro-benchmarks of the GPU path's own kernels at case (a) sizes (41,472 tokens, 648 windows of 64):
the fused rotary + window attention kernel against the unfused path it replaces, the rstd kernel of
the folded norms, and the host cost of staging metadata. ``--sweep`` also tries launch configurations.

    python bench/kernels.py [--sweep]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from encoder_service.attention.base import _dense_uniform
from encoder_service.benchmarks.forward import time_it
from encoder_service.ops import apply_rotary
from encoder_service.ops import triton_window as fused_window


def unfused(qkv, cos, sin, heads):
    q, k, v = qkv.view(qkv.shape[0], 3, heads, -1).unbind(1)
    q, k = apply_rotary(q, k, cos, sin)
    return q, k, v.contiguous()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also try launch configurations of the fused kernel")
    args = parser.parse_args()
    tokens, heads, dim = 41472, 16, 80
    qkv = torch.randn(tokens, 3 * heads * dim, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(tokens, dim // 2, device="cuda") * 40
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    cu = np.arange(0, tokens + 1, 64)
    plan = fused_window.plan(cu, 64, torch.device("cuda"))
    rotary = torch.compile(unfused)
    moved = 4 * tokens * heads * dim * 2  # read q, k, v once, write the output once
    fused_s = time_it(lambda: fused_window.window_attention_rotary(qkv, cos, sin, plan, heads), 20, 3)
    rot_s = time_it(lambda: rotary(qkv, cos, sin, heads), 20, 3)
    q, k, v = rotary(qkv, cos, sin, heads)
    attn_s = time_it(lambda: _dense_uniform(q, k, v, 64, dim**-0.5), 20, 3)
    print(f"fused kernel: {fused_s * 1e3:.3f} ms ({moved / fused_s / 1e12:.2f} TB/s of its minimum traffic)")
    print(f"unfused: compiled rotary {rot_s * 1e3:.3f} ms + dense SDPA {attn_s * 1e3:.3f} ms")
    import math

    from encoder_service.ops._window_kernel import launch

    out = torch.empty(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    affine = (torch.rand(tokens, device="cuda") + 0.5, torch.randn(3 * heads * dim, device="cuda"))
    for hpp, warps, stages in ((8, 4, 2), (8, 4, 3), (8, 8, 2), (8, 8, 3), (16, 4, 2), (16, 8, 3), (4, 4, 2)):
        def run_affine(h=hpp, w=warps, st=stages):
            launch(qkv, cos, sin, plan.cu_seqlens, out, plan.num_windows, heads, dim, 64,
                   dim**-0.5 * math.log2(math.e), affine, heads_per_program=h, num_warps=w, stages=st)
        t = time_it(run_affine, 20, 2)
        print(f"fused kernel, affine input: heads/program {hpp} warps {warps} stages {stages}: {t * 1e3:.3f} ms "
              f"({moved / t / 1e12:.2f} TB/s)", flush=True)

    from encoder_service.ops import _rms_kernel
    from encoder_service.ops.torch_ops import rms_scale

    x = torch.randn(tokens, heads * dim, device="cuda", dtype=torch.bfloat16)
    pending = torch.randn(heads * dim, device="cuda")
    compiled = torch.compile(rms_scale)
    t = time_it(lambda: compiled(x, pending, 1e-6), 20, 3)
    print(f"rstd, inductor: {t * 1e3:.3f} ms ({x.numel() * 2 / t / 1e12:.2f} TB/s)")
    ref = compiled(x, pending, 1e-6)
    for rows in (1, 2, 4, 8, 16):
        for warps in (2, 4, 8):
            t = time_it(lambda r=rows, w=warps: _rms_kernel.rms_scale(x, pending, 1e-6, r, w), 20, 3)
            err = (_rms_kernel.rms_scale(x, pending, 1e-6, rows, warps) - ref).abs().max().item()
            print(f"rstd, triton rows {rows} warps {warps}: {t * 1e3:.3f} ms ({x.numel() * 2 / t / 1e12:.2f} TB/s)"
                  f" max diff {err:.1e}")

    import time

    from encoder_service.device import host_to_device

    pos = np.zeros((tokens, 2), dtype=np.int64)
    staging = torch.empty(pos.nbytes, dtype=torch.uint8, pin_memory=True)

    def reused_pinned():
        staging.numpy()[:] = pos.reshape(-1).view(np.uint8)
        return staging.to("cuda", non_blocking=True)

    for label, fn in (("host_to_device (pin_memory per call)", lambda: host_to_device(pos, torch.device("cuda"))),
                      ("one reused pinned buffer", reused_pinned)):
        host = []
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
        print(f"{label}, {pos.nbytes} bytes: host ms per call {[round(h * 1e3, 3) for h in host]}")
    if args.sweep:
        import math

        from encoder_service.ops._window_kernel import launch

        out = torch.empty(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
        for hpp in (1, 2, 4, 8):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3):
                    def run(h=hpp, w=warps, st=stages):
                        launch(qkv, cos, sin, plan.cu_seqlens, out, plan.num_windows, heads, dim, 64,
                               dim**-0.5 * math.log2(math.e), heads_per_program=h, num_warps=w, stages=st)
                    try:
                        t = time_it(run, 20, 2)
                        print(f"heads/program {hpp} warps {warps} stages {stages}: {t * 1e3:.3f} ms "
                              f"({moved / t / 1e12:.2f} TB/s)", flush=True)
                    except Exception as exc:
                        print(f"heads/program {hpp} warps {warps} stages {stages}: {type(exc).__name__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
