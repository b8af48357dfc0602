"""The MLP's gate/up projection with SwiGLU in the GEMM's epilogue: a Triton kernel (CUDA, Hopper).

Unfused, the gate/up GEMM writes [tokens, 2 x intermediate] and a separate pass reads it back to
write silu(gate) * up: at case (a) sizes that pass moves 860 MB per block, 9.7 ms per forward at
memory bandwidth (bench/RESULTS.md). Here the weights' rows alternate gate j, up j (the folded
path stores them so, models/qwen2_5_vl/folded.py), so one 256-wide tile of the product holds 128
gate columns and their up columns side by side, and the program writes only the 128 products.

Measured at case (a) sizes on the H100 (bench/swiglu_gemm.py): 1.18 ms against 1.04 ms for the
cuBLAS GEMM plus 0.41 ms for the SwiGLU pass. The layout matters: two separate 128-wide
accumulators (gate tile, up tile) ran at 460 TFLOP/s, one 256-wide at 620; and TMA loads in a
persistent grid beat plain pointer loads (540).

The epilogue repeats the unfused path's roundings: the GEMM output plus its bias ``shift`` rounded
to the activation dtype, then ``scale * acc + bias`` (the folded RMSNorm's per-token rstd and the
projection's own bias) rounded, then silu and the product.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _tile(tile, m, n_inter, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M row blocks sweep the columns together, so their weight tiles stay in L2.
    num_m = tl.cdiv(m, BLOCK_M)
    num_n = tl.cdiv(n_inter, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m


@triton.jit
def _swiglu_pairs(acc, rows, col0, m, n_inter, shift_ptr, scale_ptr, bias_ptr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, dtype):
    """Columns 2j and 2j+1 of ``acc`` are gate j and up j; returns [BLOCK_M, BLOCK_N] products."""
    wcols = 2 * col0 + tl.arange(0, 2 * BLOCK_N)
    wcol_ok = wcols < 2 * n_inter
    scale = tl.load(scale_ptr + rows, mask=rows < m, other=0.0)[:, None]
    y = (acc + tl.load(shift_ptr + wcols, mask=wcol_ok, other=0.0).to(tl.float32)[None, :]).to(dtype)
    y = (scale * y.to(tl.float32) + tl.load(bias_ptr + wcols, mask=wcol_ok, other=0.0)[None, :]).to(dtype)
    # Each thread holds adjacent column pairs of the accumulator, so this split moves no data.
    g, u = tl.split(tl.reshape(y.to(tl.float32), (BLOCK_M, BLOCK_N, 2)))
    g = (g / (1.0 + tl.exp2(-1.4426950408889634 * g))).to(dtype)
    return (g.to(tl.float32) * u.to(tl.float32)).to(dtype)


@triton.jit
def _gate_up_swiglu(x_desc, w_desc, out_desc, shift_ptr, scale_ptr, bias_ptr, m, n_inter, k,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    dtype = shift_ptr.dtype.element_ty
    tiles = tl.cdiv(m, BLOCK_M) * tl.cdiv(n_inter, BLOCK_N)
    k_tiles = tl.cdiv(k, BLOCK_K)
    # Persistent: one program per SM walks the tiles; TMA zero-fills loads past the edges and
    # clips stores, so ragged m, k and n_inter need no masks in the main loop.
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile(tile, m, n_inter, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            acc = tl.dot(x_desc.load([off_m, kk * BLOCK_K]), w_desc.load([pid_n * 2 * BLOCK_N, kk * BLOCK_K]).T, acc)
        rows = off_m + tl.arange(0, BLOCK_M)
        h = _swiglu_pairs(acc, rows, pid_n * BLOCK_N, m, n_inter, shift_ptr, scale_ptr, bias_ptr, BLOCK_M, BLOCK_N,
                          dtype)
        out_desc.store([off_m, pid_n * BLOCK_N], h)


# Chosen on the H100 by bench/swiglu_gemm.py at case (a) sizes (41,472 x 1,280 -> 2 x 3,456).
DEFAULT = dict(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4)


def unavailable_reason(x: torch.Tensor, w: torch.Tensor, act: str) -> str | None:
    """Why the fused kernel cannot take this GEMM (None: it can)."""
    if not x.is_cuda:
        return "not on CUDA"
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return "TMA descriptors need a Hopper or newer GPU"
    if x.dtype not in (torch.float16, torch.bfloat16) or w.dtype != x.dtype:
        return f"dtype {x.dtype} (half precision only)"
    if act != "silu":
        return f"activation {act!r} (silu only)"
    # TMA: every row stride a multiple of 16 bytes, the innermost dimension contiguous.
    if x.stride(1) != 1 or w.stride(1) != 1 or (x.stride(0) * x.element_size()) % 16 or x.shape[1] % 8:
        return "operands not 16-byte aligned row-major"
    if (w.shape[0] // 2) % 8:
        return f"intermediate size {w.shape[0] // 2} not a multiple of 8"
    return None


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def gate_up_swiglu(x: torch.Tensor, w: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """silu(gate) * up of ``scale * (x @ w.T + shift) + bias``, where the rows of ``w`` (and the
    entries of ``shift`` and ``bias``) alternate gate j, up j.

    x [m, k] and w [2 * n_inter, k] in the activation dtype; shift (the GEMM bias) in the activation
    dtype, scale float32 [m], bias float32 [2 * n_inter]. Returns [m, n_inter]."""
    cfg = {**DEFAULT, **(config or {})}
    m, k = x.shape
    n_inter = w.shape[0] // 2
    out = torch.empty(m, n_inter, dtype=x.dtype, device=x.device)
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n_inter, bn)
    programs = min(tiles, _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device()))
    _gate_up_swiglu[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [2 * bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]), shift, scale, bias, m, n_inter, k,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["group_m"], NUM_PROGRAMS=programs,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


@triton.jit
def _gate_up_swiglu_fp8(x_desc, w_desc, out_desc, x_scale_ptr, w_scale_ptr, bias_ptr, m, n_inter, k,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """The same persistent walk on e4m3 operands (``--quantization fp8``): the accumulator scaled by
    the token's and the channel's scales, plus the bias, rounded to the bias's dtype, then SwiGLU."""
    dtype = bias_ptr.dtype.element_ty
    tiles = tl.cdiv(m, BLOCK_M) * tl.cdiv(n_inter, BLOCK_N)
    k_tiles = tl.cdiv(k, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile(tile, m, n_inter, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            acc = tl.dot(x_desc.load([off_m, kk * BLOCK_K]), w_desc.load([pid_n * 2 * BLOCK_N, kk * BLOCK_K]).T, acc)
        rows = off_m + tl.arange(0, BLOCK_M)
        wcols = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        wcol_ok = wcols < 2 * n_inter
        xs = tl.load(x_scale_ptr + rows, mask=rows < m, other=0.0)[:, None]
        ws = tl.load(w_scale_ptr + wcols, mask=wcol_ok, other=0.0)[None, :]
        y = (acc * xs * ws + tl.load(bias_ptr + wcols, mask=wcol_ok, other=0.0).to(tl.float32)[None, :]).to(dtype)
        g, u = tl.split(tl.reshape(y.to(tl.float32), (BLOCK_M, BLOCK_N, 2)))
        g = (g / (1.0 + tl.exp2(-1.4426950408889634 * g))).to(dtype)
        out_desc.store([off_m, pid_n * BLOCK_N], (g.to(tl.float32) * u.to(tl.float32)).to(dtype))


# e4m3 tiles are half the bytes of bf16 ones: twice the K per stage for the same shared memory.
DEFAULT_FP8 = dict(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3)


def gate_up_swiglu_fp8(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """silu(gate) * up of ``x_scale * w_scale * (xq @ wq.T) + bias`` (``torch_ops.swiglu_pairs`` of
    ``fp8.scaled_linear``), rows of ``wq`` alternating gate j, up j.

    xq [m, k] and wq [2 * n_inter, k] e4m3, x_scale float32 [m, 1], w_scale float32 [1, 2 * n_inter],
    bias [2 * n_inter] in the output dtype. Returns [m, n_inter]."""
    cfg = {**DEFAULT_FP8, **(config or {})}
    m, k = xq.shape
    n_inter = wq.shape[0] // 2
    out = torch.empty(m, n_inter, dtype=bias.dtype, device=xq.device)
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n_inter, bn)
    programs = min(tiles, _sm_count(xq.device.index if xq.device.index is not None else torch.cuda.current_device()))
    _gate_up_swiglu_fp8[(programs,)](
        TensorDescriptor.from_tensor(xq, [bm, bk]), TensorDescriptor.from_tensor(wq, [2 * bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]), x_scale, w_scale, bias, m, n_inter, k,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["group_m"], NUM_PROGRAMS=programs,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
