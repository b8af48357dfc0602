"""The plain-torch provider of every capability: runs anywhere, always available, and the one the
CPU parity tests hold to transformers. Attention goes through the attention backend, so with these
providers ``--attn-backend`` runs every attention layer.

The functions are what the kernels of the other providers fuse, with the same roundings: projection
outputs rounded to the activation dtype before use, statistics and rotary in float32. ``compile``
wraps them in torch.compile (one graph each; the attention call stays outside, with the backend).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .base import OpProvider
from .compiling import compiled
from .fp8 import quantize_rows, scaled_linear
from .functional import activation, apply_rotary


def rms_scale(x: torch.Tensor, pending: torch.Tensor, eps: float) -> torch.Tensor:
    """rstd of the true residual (x + pending) per token, float32 [tokens]."""
    xt = x.float() + pending
    return torch.rsqrt(xt.pow(2).mean(-1) + eps)


def rms_quant(x: torch.Tensor, pending: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The true residual (x + pending) of each token in e4m3, scaled to its largest magnitude, and
    float32 [tokens, 1] scales that fold in its rstd: ``scale * q == rstd * (x + pending)`` up to
    e4m3 rounding, the folded RMSNorm's input to the next GEMM (``--quantization fp8``)."""
    xt = x.float() + pending
    q, scale = quantize_rows(xt)
    return q, scale * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + eps)


def act_quant(y: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation of ``y`` (rounded to its dtype) in e4m3 per token, with float32 [tokens, 1] scales."""
    return quantize_rows(activation(act)(y))


def swiglu_pairs(y: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up of a projection whose columns alternate gate j, up j."""
    gate, up = y.view(y.shape[0], -1, 2).unbind(-1)
    return activation(act)(gate) * up


def _affine(acc: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return (scale[:, None] * acc.float() + bias).to(acc.dtype)


def qkv_rotary(acc, scale, bias, cos, sin, num_heads: int, padded: int = 0):
    """q, k, v packed [tokens, heads, head_dim] from the raw output of the folded QKV GEMM; with
    ``padded``, zero-padded to that head_dim in the same pass (the backend's padded_head_dim)."""
    q, k, v = _affine(acc, scale, bias).view(acc.shape[0], 3, num_heads, -1).unbind(1)
    q, k = apply_rotary(q, k, cos, sin)
    if padded:
        return tuple(F.pad(t, (0, padded - t.shape[-1])) for t in (q, k, v))
    # Contiguous here, inside the compiled graph, where the copy fuses with the rotary kernel;
    # kernels that want [T, H, D] packed (cuDNN) would otherwise copy it on their own.
    return q, k, v.contiguous()


def swiglu(acc, scale, bias, act: str):
    """SwiGLU of the folded gate/up GEMM's raw output, whose columns alternate gate j, up j."""
    gate, up = _affine(acc, scale, bias).view(acc.shape[0], -1, 2).unbind(-1)
    return activation(act)(gate) * up


class RotaryAttention(OpProvider):
    """Rotary in torch, then the attention backend with the window pattern's plan. The model's
    full-attention layers run this too (``OpsSelection.attention``), with the full pattern's plan."""

    capability = "window_attention"
    name = "torch"

    def __init__(self) -> None:
        self._rotary = qkv_rotary

    def compile(self, mode: str | None = None) -> None:
        self._rotary = compiled(qkv_rotary, mode)

    def prepare(self, meta, backend, device: torch.device) -> Any:
        return backend.prepare(meta)

    def __call__(self, acc, affine, cos, sin, num_heads: int, plan, backend) -> torch.Tensor:
        return backend.forward(*self._rotary(acc, *affine, cos, sin, num_heads, backend.padded_head_dim or 0), plan)


class TorchRmsScale(OpProvider):
    capability = "rms_scale"
    name = "torch"

    def __init__(self) -> None:
        self._fn = rms_scale

    def compile(self, mode: str | None = None) -> None:
        self._fn = compiled(rms_scale, mode)

    def __call__(self, x: torch.Tensor, pending: torch.Tensor, eps: float) -> torch.Tensor:
        return self._fn(x, pending, eps)


class TorchGatedMLP(OpProvider):
    """cuBLAS (or the CPU's) GEMM with the bias ``shift`` in its epilogue, then SwiGLU as one pass."""

    capability = "gated_mlp"
    name = "torch"

    def __init__(self) -> None:
        self._swiglu = swiglu

    def compile(self, mode: str | None = None) -> None:
        self._swiglu = compiled(swiglu, mode)

    def __call__(self, x, w, shift, scale, bias, act: str) -> torch.Tensor:
        return self._swiglu(F.linear(x, w, shift), scale, bias, act)


class TorchRmsQuant(OpProvider):
    capability = "rms_quant"
    name = "torch"

    def __init__(self) -> None:
        self._fn = rms_quant

    def compile(self, mode: str | None = None) -> None:
        self._fn = compiled(rms_quant, mode)

    def __call__(self, x: torch.Tensor, pending: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._fn(x, pending, eps)


class TorchFp8GatedMLP(OpProvider):
    """The FP8 GEMM (``torch._scaled_mm``) with the bias in its epilogue, then SwiGLU as one pass."""

    capability = "fp8_gated_mlp"
    name = "torch"

    def __init__(self) -> None:
        self._swiglu = swiglu_pairs

    def compile(self, mode: str | None = None) -> None:
        self._swiglu = compiled(swiglu_pairs, mode)

    def __call__(self, xq, x_scale, wq, w_scale, bias, act: str) -> torch.Tensor:
        return self._swiglu(scaled_linear(xq, x_scale, wq, w_scale, bias, bias.dtype), act)


class TorchActQuant(OpProvider):
    capability = "act_quant"
    name = "torch"

    def __init__(self) -> None:
        self._fn = act_quant

    def compile(self, mode: str | None = None) -> None:
        self._fn = compiled(act_quant, mode)

    def __call__(self, y: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._fn(y, act)
