"""The Triton kernel behind triton_window.py (imported only once that provider is chosen: CUDA, where
triton ships with torch)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_tile(ptr, col, mask, col_ok, row_scale, bias_ptr, AFFINE: tl.constexpr, dtype):
    """A [rows, half-head] tile of the projection's output in float32. With AFFINE, ``ptr`` holds the
    GEMM output of a projection whose RMSNorm was folded into its weight (models/qwen2_5_vl/folded.py):
    the value is row_scale * x + bias, rounded to the activation dtype as the reference rounds its
    projection output."""
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    if AFFINE:
        bias = tl.load(bias_ptr + col, mask=col_ok, other=0.0)
        x = (row_scale * x + bias[None, :]).to(dtype).to(tl.float32)
    return x


@triton.jit
def _window_attention_rotary(
    qkv_ptr, cos_ptr, sin_ptr, cu_ptr, out_ptr, row_scale_ptr, bias_ptr,
    qkv_stride, cs_stride, out_stride, qk_scale,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, AFFINE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, STAGES: tl.constexpr,
):
    window = tl.program_id(0)
    start = tl.load(cu_ptr + window)
    n = tl.load(cu_ptr + window + 1) - start
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < n
    col_ok = cols < HALF
    mask = row_ok[:, None] & col_ok[None, :]
    tok = (start + rows).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    qkv_ptr += tok[:, None] * qkv_stride
    width: tl.constexpr = HEADS * HEAD_DIM

    # The two halves of each head are separate tiles, so rotate-half is plain arithmetic on them. The
    # tables are the same for every head: loaded once per program.
    table = tok[:, None] * cs_stride + cols[None, :]
    cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
    row_scale = 1.0
    if AFFINE:
        row_scale = tl.load(row_scale_ptr + tok, mask=row_ok, other=0.0)[:, None]
    for i in tl.range(HEADS_PER_PROGRAM, num_stages=STAGES):
        head = tl.program_id(1) * HEADS_PER_PROGRAM + i
        c1 = head * HEAD_DIM + cols
        c2 = c1 + HALF
        q1 = _load_tile(qkv_ptr + c1[None, :], c1, mask, col_ok, row_scale, bias_ptr, AFFINE, dtype)
        q2 = _load_tile(qkv_ptr + c2[None, :], c2, mask, col_ok, row_scale, bias_ptr, AFFINE, dtype)
        k1 = _load_tile(qkv_ptr + width + c1[None, :], width + c1, mask, col_ok, row_scale, bias_ptr,
                        AFFINE, dtype)
        k2 = _load_tile(qkv_ptr + width + c2[None, :], width + c2, mask, col_ok, row_scale, bias_ptr,
                        AFFINE, dtype)
        q1, q2 = (q1 * cos - q2 * sin).to(dtype), (q2 * cos + q1 * sin).to(dtype)
        k1, k2 = (k1 * cos - k2 * sin).to(dtype), (k2 * cos + k1 * sin).to(dtype)

        s = tl.dot(q1, tl.trans(k1))
        s = tl.dot(q2, tl.trans(k2), s)
        s = tl.where(row_ok[None, :], s * qk_scale, float("-inf"))  # keys past the window's end
        m = tl.max(s, axis=1)
        p = tl.exp2(s - m[:, None])
        inv = 1.0 / tl.sum(p, axis=1)
        p = p.to(dtype)

        v1 = _load_tile(qkv_ptr + 2 * width + c1[None, :], 2 * width + c1, mask, col_ok, row_scale, bias_ptr,
                        AFFINE, dtype).to(dtype)
        v2 = _load_tile(qkv_ptr + 2 * width + c2[None, :], 2 * width + c2, mask, col_ok, row_scale, bias_ptr,
                        AFFINE, dtype).to(dtype)
        o1 = tl.dot(p, v1) * inv[:, None]
        o2 = tl.dot(p, v2) * inv[:, None]
        dst = out_ptr + tok[:, None] * out_stride + c1[None, :]
        tl.store(dst, o1.to(dtype), mask=mask)
        tl.store(dst + HALF, o2.to(dtype), mask=mask)


def _heads_per_program(num_heads: int) -> int:
    # Measured on the H100 (bench/kernels.py --sweep): 8 heads per program, 4 warps, 2 stages
    # ran at 1.9 TB/s against 1.0 for one head per program; more heads share one load of cos/sin.
    return next(h for h in (8, 4, 2, 1) if num_heads % h == 0)


def launch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor, out: torch.Tensor,
           num_windows: int, num_heads: int, head_dim: int, block_m: int, qk_scale: float,
           affine: tuple[torch.Tensor, torch.Tensor] | None = None,
           heads_per_program: int | None = None, num_warps: int = 4, stages: int = 2) -> None:
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride() or not out.is_contiguous():
        raise ValueError("fused window attention needs row-major qkv, cos/sin and output")
    row_scale, bias = affine if affine is not None else (cos, cos)  # unread without AFFINE
    hpp = heads_per_program or _heads_per_program(num_heads)
    half = head_dim // 2
    _window_attention_rotary[(num_windows, num_heads // hpp)](
        qkv, cos, sin, cu_seqlens, out, row_scale, bias,
        qkv.stride(0), cos.stride(0), out.stride(0), qk_scale,
        HEADS=num_heads, HEAD_DIM=head_dim, HALF=half, AFFINE=affine is not None, BLOCK_M=block_m,
        BLOCK_H=max(16, triton.next_power_of_2(half)), HEADS_PER_PROGRAM=hpp, STAGES=stages, num_warps=num_warps,
    )
