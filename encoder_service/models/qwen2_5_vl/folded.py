"""Qwen2.5-VL's blocks with each RMSNorm folded into the GEMM after it: the one block implementation,
on every device (the CPU parity tests hold it to transformers, so the production path is the tested one).

Between the GEMMs, a block written as the reference writes it is memory-bound, and its two residual
adds and two RMSNorms move the activations (tokens x hidden) 8 times: read the GEMM output and the
residual, write the new residual and the normed copy, twice. Here they move 4 times:

* ``RMSNorm(x) @ W.T == rstd(x) * (x @ (W * w).T)``: the norm's weight ``w`` is folded into the next
  projection once, at load time, and the per-token ``rstd`` (the ``rms_scale`` op) scales that GEMM's
  output wherever it is read next (the rotary, the window attention op, the gated MLP op). The GEMM
  reads the residual itself, so the normed copy is never written: a norm is one read of x.
* The residual adds happen inside the output projections: ``x.addmm_(out, W.T)`` has cuBLAS read x
  as its C operand. Their biases, which cuBLAS cannot add in the same call, are constants: their
  running sum ``pending`` (float32, per block) is added where x is read, ``x_true = x + pending``,
  and ``(x + pending) @ W'.T == x @ W'.T + shift`` with ``shift = W' @ pending`` precomputed and
  added by the GEMM's bias epilogue, so the consumer only computes ``rstd * acc + bias``.

Projection outputs are rounded to the activation dtype before use, as the reference rounds them; the
results match transformers up to float32 rounding on the CPU (tests/models/qwen2_5_vl/test_qwen2_5_vl_parity.py) and
the all-torch selection within bf16 rounding on a GPU (tests/gpu/test_gpu.py). Which provider computes
each fused step is the model's ``OpsSelection`` (encoder_service/ops): nothing here names a kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops import quantize_weight, scaled_linear


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


@torch.no_grad()
def fold_norms(tower) -> None:
    """Folds each block's RMSNorm weights into the projection after it, interleaves the gate and up
    rows, and precomputes the pending biases; once, at load time, after ``VisionBlock.fuse_mlp``.
    The checkpoint's own tensors are not modified, but the module's parameters now hold the folded
    weights (norm weights of one): nothing reads a loaded tower's state dict back as a checkpoint
    (checkpoints are written from the runtime layout, family.random_state)."""
    dim = tower.cfg.hidden_size
    device = tower.inv_freq.device
    pending = torch.zeros(dim, dtype=torch.float32, device=device)
    for block in tower.blocks:
        attn, n1, n2 = block.attn, block.norm1.weight, block.norm2.weight
        dtype = attn.qkv.weight.dtype
        qkv_w = (attn.qkv.weight.float() * n1.float()).to(dtype)
        attn.qkv.weight = torch.nn.Parameter(qkv_w, requires_grad=False)
        # The model's own fused buffers, rewritten in place with the rows alternating gate j, up j:
        # a fused gated-MLP kernel (ops/_swiglu_gemm.py) then finds both halves of a pair in one tile.
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


@torch.no_grad()
def quantize_blocks(tower) -> None:
    """``--quantization fp8``: the QKV and gate/up weights, as folded (norm weights in them, gate and
    up rows alternating), in e4m3 with one scale per output row, and their biases in the activation
    dtype for the FP8 GEMM's epilogue. The output and down projections stay in the activation dtype:
    their GEMMs add the residual as cuBLAS's C operand, which an FP8 GEMM cannot, and together they
    are a third of the blocks' FLOPs."""
    for block in tower.blocks:
        dtype = block.attn.qkv.weight.dtype
        block.qkv_fp8 = quantize_weight(block.attn.qkv.weight)
        block.qkv_bias_out = block.qkv_bias.to(dtype)
        block.gate_up_fp8 = quantize_weight(block.gate_up_w)
        block.gate_up_bias_out = block.gate_up_bias.to(dtype)
    tower.fp8 = True


def run_blocks(tower, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend, prepared) -> torch.Tensor:
    """All blocks on the folded weights; ``x`` (the permuted patch embeddings) is updated in place.
    Every fused step goes through ``tower.ops``; full-attention layers through the backend."""
    if getattr(tower, "fp8", False):
        return run_blocks_fp8(tower, x, cos, sin, backend, prepared)
    n = x.shape[0]
    cfg, ops = tower.cfg, tower.ops
    heads, eps, act = cfg.num_heads, cfg.rms_norm_eps, cfg.hidden_act
    for i, block in enumerate(tower.blocks):
        affine = (ops.rms_scale(x, block.pending_in, eps), block.qkv_bias)
        acc = F.linear(x, block.attn.qkv.weight, block.qkv_shift)
        if i in tower.full_blocks:
            out = ops.attention(acc, affine, cos, sin, heads, prepared.full_plan, backend)
        else:
            out = ops.window_attention(acc, affine, cos, sin, heads, prepared.window_plan, backend)
        # A provider that went through a backend with padded_head_dim hands back padded heads.
        padded = out.shape[-1]
        proj_w = block.attn.proj.weight if padded == cfg.head_dim else _padded_proj(block, padded)
        x.addmm_(out.view(n, -1), proj_w.t())
        scale = ops.rms_scale(x, block.pending_mid, eps)
        h = ops.gated_mlp(x, block.gate_up_w, block.gate_up_shift, scale, block.gate_up_bias, act)
        x.addmm_(h, block.down_w.t())
    return (x.float() + tower.pending_out).to(x.dtype)


def run_blocks_fp8(tower, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend, prepared) -> torch.Tensor:
    """``run_blocks`` with the QKV and gate/up GEMMs in FP8 (``quantize_blocks``). The op that reads the
    residual for its rstd (``rms_quant``) writes the true residual ``x + pending`` in e4m3 in the same
    pass, with a per-token scale that folds in the rstd, so the FP8 GEMM's output is the projection
    itself (bias from its epilogue): the attention op then takes an identity affine."""
    n = x.shape[0]
    cfg, ops = tower.cfg, tower.ops
    heads, eps, act = cfg.num_heads, cfg.rms_norm_eps, cfg.hidden_act
    identity = (torch.ones(n, dtype=torch.float32, device=x.device),
                torch.zeros(3 * cfg.hidden_size, dtype=torch.float32, device=x.device))
    for i, block in enumerate(tower.blocks):
        xq, x_scale = ops.rms_quant(x, block.pending_in, eps)
        proj = scaled_linear(xq, x_scale, *block.qkv_fp8, block.qkv_bias_out, x.dtype)
        if i in tower.full_blocks:
            out = ops.attention(proj, identity, cos, sin, heads, prepared.full_plan, backend)
        else:
            out = ops.window_attention(proj, identity, cos, sin, heads, prepared.window_plan, backend)
        padded = out.shape[-1]
        proj_w = block.attn.proj.weight if padded == cfg.head_dim else _padded_proj(block, padded)
        x.addmm_(out.view(n, -1), proj_w.t())
        xq, x_scale = ops.rms_quant(x, block.pending_mid, eps)
        h = ops.fp8_gated_mlp(xq, x_scale, *block.gate_up_fp8, block.gate_up_bias_out, act)
        x.addmm_(h, block.down_w.t())
    return (x.float() + tower.pending_out).to(x.dtype)
