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
