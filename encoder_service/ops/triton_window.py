"""Short-window attention with the rotary embedding fused in: one Triton kernel, CUDA only (the
``triton`` provider of ``window_attention``; the kernel itself is ``_window_kernel.py``).

Qwen2.5-VL attends within 8x8-patch windows (at most 64 tokens) in 28 of its 32 blocks. There the
work is memory-bound, and the unfused path moves the activations ten times per layer: the rotary
pass reads q, k, v out of the QKV projection and writes them back as three packed tensors (6
passes of tokens x hidden), attention reads those (3) and writes its output (1). This kernel reads
the projection's output once, rotates q and k in registers and writes only the output: 4 passes.
One program owns one (window, head): the whole window fits in registers, so there is no online
softmax and no loop. Windows may have any length up to ``MAX_SEQLEN`` (edge windows of images whose
size is not a multiple of the window are shorter).

Numerics follow the reference: rotary in float32 rounded to the activation dtype before q.k, scores
and softmax in float32, probabilities rounded to the activation dtype for p.v as flash kernels do.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass

import numpy as np
import torch

from .base import OpProvider, OpTarget

MAX_SEQLEN = 64


@functools.cache
def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cuda" or torch.version.hip is not None:
        return "needs an NVIDIA GPU"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"runs float16/bfloat16 only, not {dtype}"
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    return None


@dataclass(frozen=True)
class WindowPlan:
    cu_seqlens: torch.Tensor  # int32 [windows + 1] on the device
    num_windows: int
    block_m: int


def plan(cu_seqlens: np.ndarray, max_seqlen: int, device: torch.device) -> WindowPlan | None:
    """Device metadata for one batch's windows, or None when a window is too long for the kernel."""
    from ..device import host_to_device

    if max_seqlen > MAX_SEQLEN or len(cu_seqlens) < 2:
        return None
    cu = host_to_device(np.ascontiguousarray(cu_seqlens, dtype=np.int32), device)
    return WindowPlan(cu, len(cu_seqlens) - 1, max(16, 1 << (max_seqlen - 1).bit_length()))


def window_attention_rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: WindowPlan,
                            num_heads: int, affine: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """``qkv``: [tokens, 3 * heads * head_dim], the QKV projection's output (q, k, v blocks, each
    head-major). ``cos``/``sin``: float32 [tokens, head_dim] rotate-half tables (both halves equal;
    only the first is read). ``affine``: (row_scale [tokens], bias [3 * hidden]), both float32, when
    ``qkv`` is a GEMM output still to be mapped to row_scale * qkv + bias (a folded RMSNorm,
    models/qwen2_5_vl/folded.py). Returns [tokens, heads, head_dim]."""
    from ._window_kernel import launch

    tokens, width = qkv.shape
    head_dim = width // (3 * num_heads)
    out = qkv.new_empty(tokens, num_heads, head_dim)
    launch(qkv, cos, sin, plan.cu_seqlens, out, plan.num_windows, num_heads, head_dim, plan.block_m,
           head_dim**-0.5 * math.log2(math.e), affine)
    return out


class TritonWindowAttention(OpProvider):
    """Computes window attention itself (``runs_attention``): the attention backend prepares and
    runs only the full-attention layers next to it."""

    capability = "window_attention"
    name = "triton"
    priority = 10
    runs_attention = True

    @classmethod
    def unavailable_reason(cls, target: OpTarget) -> str | None:
        if (reason := unavailable_reason(target.device, target.dtype)) is not None:
            return reason
        if target.window_tokens > MAX_SEQLEN:
            return f"windows of up to {target.window_tokens} tokens; the kernel holds at most {MAX_SEQLEN}"
        return None

    def prepare(self, meta, backend, device: torch.device) -> WindowPlan:
        windows = plan(meta.cu_seqlens, meta.max_seqlen, device)
        if windows is None:  # the load-time check (window_tokens) rules this out
            raise RuntimeError(f"a window of {meta.max_seqlen} tokens: the fused kernel holds at most {MAX_SEQLEN}")
        return windows

    def __call__(self, acc, affine, cos, sin, num_heads: int, plan, backend) -> torch.Tensor:
        return window_attention_rotary(acc, cos, sin, plan, num_heads, affine)
