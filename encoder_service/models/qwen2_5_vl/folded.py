"""Qwen2.5-VL's blocks with each RMSNorm folded into the GEMM after it: the GPU path.

Between the GEMMs, a block of the reference path is memory-bound, and its two residual adds and two
RMSNorms move the activations (tokens x hidden) 8 times: read the GEMM output and the residual,
write the new residual and the normed copy, twice. Here they move 4 times:

* ``RMSNorm(x) @ W.T == rstd(x) * (x @ (W * w).T)``: the norm's weight ``w`` is folded into the next
  projection once, at load time, and the per-token ``rstd`` scales that GEMM's output wherever it is
  read next (the rotary, the fused window kernel, SwiGLU). The GEMM reads the residual itself, so
  the normed copy is never written: a norm is one read of x to get ``rstd``.
* The residual adds happen inside the output projections: ``x.addmm_(out, W.T)`` has cuBLAS read x
  as its C operand. Their biases, which cuBLAS cannot add in the same call, are constants: their
  running sum ``pending`` (float32, per block) is added where x is read, ``x_true = x + pending``,
  and ``(x + pending) @ W'.T == x @ W'.T + shift`` with ``shift = W' @ pending`` precomputed and
  added by the GEMM's bias epilogue, so the consumer only computes ``rstd * acc + bias``.

Projection outputs are rounded to the activation dtype before use, as the reference rounds them;
the results match the reference path within bf16 rounding (tests/test_gpu.py, and exactly up to
float32 rounding on the CPU: tests/test_qwen2_5_vl_parity.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...attention import fused_window
from ..layers import activation, apply_rotary


def rms_scale(x: torch.Tensor, pending: torch.Tensor, eps: float) -> torch.Tensor:
    """rstd of the true residual (x + pending) per token, float32 [tokens]."""
    xt = x.float() + pending
    return torch.rsqrt(xt.pow(2).mean(-1) + eps)


def _affine(acc: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return (scale[:, None] * acc.float() + bias).to(acc.dtype)


def qkv_rotary(acc, scale, bias, cos, sin, num_heads: int, padded: int = 0):
    """q, k, v packed [tokens, heads, head_dim] from the raw output of the folded QKV GEMM; with
    ``padded``, zero-padded to that head_dim in the same pass (the backend's padded_head_dim)."""
    q, k, v = _affine(acc, scale, bias).view(acc.shape[0], 3, num_heads, -1).unbind(1)
    q, k = apply_rotary(q, k, cos, sin)
    if padded:
        return tuple(F.pad(t, (0, padded - t.shape[-1])) for t in (q, k, v))
    return q, k, v.contiguous()


def _padded_proj(block, padded: int) -> torch.Tensor:
    """The output projection's weight with zero columns for the padded head dims, made once."""
    cache = block.__dict__.setdefault("_padded_proj", {})
    if padded not in cache:
        w = block.attn.proj.weight
        heads = block.num_heads
        cache[padded] = F.pad(w.view(w.shape[0], heads, -1), (0, padded - w.shape[1] // heads)).reshape(
            w.shape[0], heads * padded)
    return cache[padded]


def interleave(t: torch.Tensor) -> torch.Tensor:
    """[gate; up] stacked along dim 0 -> alternating rows (or entries) gate 0, up 0, gate 1, ..."""
    half = t.shape[0] // 2
    return torch.stack((t[:half], t[half:]), dim=1).reshape(t.shape)


def swiglu(acc, scale, bias, act: str):
    """SwiGLU of the folded gate/up GEMM's raw output, whose columns alternate gate j, up j."""
    gate, up = _affine(acc, scale, bias).view(acc.shape[0], -1, 2).unbind(-1)
    return activation(act)(gate) * up


@torch.no_grad()
def fold_norms(tower) -> None:
    """Folds each block's RMSNorm weights into the projection after it, interleaves the gate and up
    rows, and precomputes the pending biases. The tower runs only the folded path afterwards
    (``tower.folded``); the checkpoint's own tensors are not modified."""
    dim = tower.cfg.hidden_size
    device = tower.inv_freq.device
    pending = torch.zeros(dim, dtype=torch.float32, device=device)
    for block in tower.blocks:
        attn, n1, n2 = block.attn, block.norm1.weight, block.norm2.weight
        dtype = attn.qkv.weight.dtype
        qkv_w = (attn.qkv.weight.float() * n1.float()).to(dtype)
        attn.qkv.weight = torch.nn.Parameter(qkv_w, requires_grad=False)
        # The model's own fused buffers, rewritten in place with the rows alternating gate j, up j:
        # the fused SwiGLU GEMM (_swiglu_gemm.py) then finds both halves of a pair in one tile.
        # gate_proj and up_proj become strided views of it, so they still hold their (folded) rows.
        block.gate_up_w.copy_(interleave(block.gate_up_w.float() * n2.float()))
        block.gate_up_b.copy_(interleave(block.gate_up_b))
        mlp, inter = block.mlp, block.mlp.gate_proj.weight.shape[0]
        for name, first in (("gate_proj", 0), ("up_proj", 1)):
            layer = getattr(mlp, name)
            layer.weight = torch.nn.Parameter(block.gate_up_w[first::2][:inter], requires_grad=False)
            layer.bias = torch.nn.Parameter(block.gate_up_b[first::2][:inter], requires_grad=False)
        block.norm1.weight = torch.nn.Parameter(torch.ones_like(n1), requires_grad=False)
        block.norm2.weight = torch.nn.Parameter(torch.ones_like(n2), requires_grad=False)

        # GEMM bias epilogue (shift, activation dtype), then the consumer's bias (float32).
        block.pending_in = pending
        block.qkv_shift, block.qkv_bias = (qkv_w.float() @ pending).to(dtype), attn.qkv.bias.float()
        pending = pending + attn.proj.bias.float()
        block.pending_mid = pending
        block.gate_up_shift = (block.gate_up_w.float() @ pending).to(dtype)
        block.gate_up_bias = block.gate_up_b.float()
        pending = pending + block.mlp.down_proj.bias.float()
    tower.pending_out = pending
    tower.folded = True


def run_blocks(tower, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend, plans: dict,
               windows) -> torch.Tensor:
    """All blocks on the folded weights; ``x`` (the permuted patch embeddings) is updated in place."""
    n = x.shape[0]
    cfg = tower.cfg
    heads, eps, act = cfg.num_heads, cfg.rms_norm_eps, cfg.hidden_act
    rms, qkv_fn, swiglu_fn = tower._folded_fns
    padded = backend.padded_head_dim or 0
    fused_mlp = False
    if x.is_cuda and fused_window.unavailable_reason(x.device, x.dtype) is None:
        from .._rms_kernel import rms_scale as rms  # Triton: twice inductor's speed for this reduction
        from .._swiglu_gemm import gate_up_swiglu, unavailable_reason

        fused_mlp = tower.fused_swiglu and unavailable_reason(x, tower.blocks[0].gate_up_w, act) is None
    for i, block in enumerate(tower.blocks):
        full = i in tower.full_blocks
        affine = (rms(x, block.pending_in, eps), block.qkv_bias)
        acc = F.linear(x, block.attn.qkv.weight, block.qkv_shift)
        if windows is not None and not full:
            out = fused_window.window_attention_rotary(acc, cos, sin, windows, heads, affine)
            proj_w = block.attn.proj.weight
        else:
            out = backend.forward(*qkv_fn(acc, *affine, cos, sin, heads, padded), plans[full])
            proj_w = _padded_proj(block, padded) if padded else block.attn.proj.weight
        x.addmm_(out.view(n, -1), proj_w.t())
        scale = rms(x, block.pending_mid, eps)
        if fused_mlp:
            h = gate_up_swiglu(x, block.gate_up_w, block.gate_up_shift, scale, block.gate_up_bias)
        else:
            h = swiglu_fn(F.linear(x, block.gate_up_w, block.gate_up_shift), scale, block.gate_up_bias, act)
        x.addmm_(h, block.down_w.t())
    return (x.float() + tower.pending_out).to(x.dtype)
