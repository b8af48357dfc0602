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
  and ``(x + pending) @ W'.T == x @ W'.T + shift`` with ``shift = W' @ pending`` precomputed.

Projection outputs are rounded to the activation dtype before use, as the reference rounds them;
the results match the reference path within bf16 rounding (tests/test_gpu.py, and exactly up to
float32 rounding on the CPU: tests/test_qwen2_5_vl_parity.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import fused_window
from .layers import activation, apply_rotary


def rms_scale(x: torch.Tensor, pending: torch.Tensor, eps: float) -> torch.Tensor:
    """rstd of the true residual (x + pending) per token, float32 [tokens]."""
    xt = x.float() + pending
    return torch.rsqrt(xt.pow(2).mean(-1) + eps)


def _affine(acc: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return (scale[:, None] * (acc.float() + shift) + bias).to(acc.dtype)


def qkv_rotary(acc, scale, shift, bias, cos, sin, num_heads: int):
    """q, k, v packed [tokens, heads, head_dim] from the raw output of the folded QKV GEMM."""
    q, k, v = _affine(acc, scale, shift, bias).view(acc.shape[0], 3, num_heads, -1).unbind(1)
    q, k = apply_rotary(q, k, cos, sin)
    return q, k, v.contiguous()


def swiglu(acc, scale, shift, bias, act: str):
    gate, up = _affine(acc, scale, shift, bias).chunk(2, dim=-1)
    return activation(act)(gate) * up


@torch.no_grad()
def fold_norms(tower) -> None:
    """Folds each block's RMSNorm weights into the projection after it and precomputes the pending
    biases. The norms' weights become ones, so the module still computes the same function on the
    reference path; the checkpoint's own tensors are not modified."""
    dim = tower.cfg.hidden_size
    device = tower.inv_freq.device
    pending = torch.zeros(dim, dtype=torch.float32, device=device)
    for block in tower.blocks:
        attn, n1, n2 = block.attn, block.norm1.weight, block.norm2.weight
        dtype = attn.qkv.weight.dtype
        qkv_w = (attn.qkv.weight.float() * n1.float()).to(dtype)
        attn.qkv.weight = torch.nn.Parameter(qkv_w, requires_grad=False)
        block.gate_up_w.copy_(block.gate_up_w.float() * n2.float())  # the model's own fused buffer
        block.norm1.weight = torch.nn.Parameter(torch.ones_like(n1), requires_grad=False)
        block.norm2.weight = torch.nn.Parameter(torch.ones_like(n2), requires_grad=False)

        block.pending_in = pending
        block.qkv_affine = (qkv_w.float() @ pending, attn.qkv.bias.float())
        pending = pending + attn.proj.bias.float()
        block.pending_mid = pending
        block.gate_up_affine = (block.gate_up_w.float() @ pending, block.gate_up_b.float())
        pending = pending + block.mlp.down_proj.bias.float()
    tower.pending_out = pending
    tower.folded = True


def run_blocks(tower, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend, plans: dict,
               windows) -> torch.Tensor:
    """All blocks on the folded weights; ``x`` (the permuted patch embeddings) is updated in place."""
    n, dim = x.shape
    cfg = tower.cfg
    heads, eps, act = cfg.num_heads, cfg.rms_norm_eps, cfg.hidden_act
    rms, qkv_fn, swiglu_fn = tower._folded_fns
    for i, block in enumerate(tower.blocks):
        full = i in tower.full_blocks
        affine = (rms(x, block.pending_in, eps), *block.qkv_affine)
        acc = F.linear(x, block.attn.qkv.weight)
        if windows is not None and not full:
            out = fused_window.window_attention_rotary(acc, cos, sin, windows, heads, affine)
        else:
            out = backend.forward(*qkv_fn(acc, *affine, cos, sin, heads), plans[full])
        x.addmm_(out.view(n, dim), block.attn.proj.weight.t())
        scale = rms(x, block.pending_mid, eps)
        x.addmm_(swiglu_fn(F.linear(x, block.gate_up_w), scale, *block.gate_up_affine, act), block.down_w.t())
    return (x.float() + tower.pending_out).to(x.dtype)
