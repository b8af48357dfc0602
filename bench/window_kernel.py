"""Times the fused rotary + window attention kernel against the unfused path it replaces.

    python bench/window_kernel.py        (case (a) sizes: 41,472 tokens in 648 windows of 64)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from encoder_service.attention import fused_window
from encoder_service.attention.base import _dense_uniform
from encoder_service.bench import time_it
from encoder_service.models.layers import apply_rotary


def unfused(qkv, cos, sin, heads):
    q, k, v = qkv.view(qkv.shape[0], 3, heads, -1).unbind(1)
    q, k = apply_rotary(q, k, cos, sin)
    return q, k, v.contiguous()


def main() -> int:
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
    attn_s = time_it(lambda: _dense_uniform(q, k, v, 64), 20, 3)
    print(f"fused kernel: {fused_s * 1e3:.3f} ms ({moved / fused_s / 1e12:.2f} TB/s of its minimum traffic)")
    print(f"unfused: compiled rotary {rot_s * 1e3:.3f} ms + dense SDPA {attn_s * 1e3:.3f} ms")
    if "--sweep" in sys.argv:
        import math

        from encoder_service.attention._window_kernel import launch

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
