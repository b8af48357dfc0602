"""An activation and the per-token e4m3 quantisation of its output in one pass: a Triton kernel (CUDA
only) for ``--quantization fp8``'s MLP input of the second GEMM.

Inductor's kernel for the same function (a reduction over 4,304 columns, Qwen3-VL-8B's MLP) reads the
row twice and took 0.68 ms a block at 8 x 1024x1024 on an H200, 16% of the FP8 forward; here one
program holds a whole row in registers, reads it once and writes its e4m3 row and scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The activations the kernel computes, by ``hidden_act`` name (ops/functional.py's formulas).
ACTS = {"gelu_pytorch_tanh": 1, "gelu": 2, "silu": 3}


@triton.jit
def _act_quant(y_ptr, q_ptr, scale_ptr, stride, DIM: tl.constexpr, BLOCK_D: tl.constexpr, ACT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < DIM
    y = tl.load(y_ptr + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
    if ACT == 1:  # tanh approximation; tanh(u) = 1 - 2 / (exp(2u) + 1), exp through exp2
        u = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        g = 0.5 * y * (2.0 - 2.0 / (tl.exp2(2.8853900817779268 * u) + 1.0))
    elif ACT == 2:
        g = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    else:
        g = y / (1.0 + tl.exp2(-1.4426950408889634 * y))
    # The activation's output in the activation dtype, as the unfused path rounds it before quantising.
    g = tl.where(ok, g.to(y_ptr.dtype.element_ty).to(tl.float32), 0.0)
    amax = tl.maximum(tl.max(tl.abs(g), axis=0), 1e-12)
    q = tl.clamp(g * (448.0 / amax), -448.0, 448.0)
    tl.store(q_ptr + row * DIM + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row, amax / 448.0)


def act_quant(y: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8.quantize_rows(activation(act)(y))``: e4m3 rows [n, dim] and float32 scales [n, 1]."""
    n, dim = y.shape
    q = torch.empty(n, dim, dtype=torch.float8_e4m3fn, device=y.device)
    scale = torch.empty(n, 1, dtype=torch.float32, device=y.device)
    block = triton.next_power_of_2(dim)
    _act_quant[(n,)](y, q, scale, y.stride(0), DIM=dim, BLOCK_D=block, ACT=ACTS[act],
                     num_warps=8 if block >= 4096 else 4)
    return q, scale
