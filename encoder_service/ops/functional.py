"""Plain-torch building blocks shared by the op providers and the models: activations and the
rotate-half rotary. They live here, below the models, because the torch providers compute with
them; models/layers.py re-exports them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {', '.join(ACTIVATIONS)}") from None


def linear_activation(x: torch.Tensor, w: torch.Tensor | tuple[torch.Tensor, torch.Tensor], b: torch.Tensor | None,
                      act: str) -> torch.Tensor:
    """``activation(act)(F.linear(x, w, b))``. On CUDA, GELU-tanh runs in the GEMM's epilogue
    (torch._addmm_activation: cuBLASLt's GELU_BIAS epilogue, the same tanh approximation) on the
    float32 accumulator, so no pre-activation is written and read back: for Qwen3-VL-8B at 8 x
    1024x1024 on an H200 that pass took 5.4 ms of a 125 ms forward (bench/RESULTS.md). It also skips
    one bf16 rounding. The CPU keeps transformers' order of operations."""
    from .fp8 import linear  # F.linear, or the FP8 linear where w is an (e4m3 weight, scales) pair

    if x.is_cuda and act == "gelu_pytorch_tanh" and b is not None and x.dim() == 2 and not isinstance(w, tuple):
        return torch._addmm_activation(b, x, w.t(), use_gelu=True)
    return activation(act)(linear(x, w, b))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary on [tokens, heads, head_dim]; cos/sin are float32 [tokens, head_dim]."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    q32, k32 = q.float(), k.float()
    q_out = q32 * cos + rotate_half(q32) * sin
    k_out = k32 * cos + rotate_half(k32) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)
