"""Building blocks shared by the vision towers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in float32 whatever the activation dtype, as the reference does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


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


def patch_conv_as_linear(x: torch.Tensor, conv: nn.Conv2d | nn.Conv3d) -> torch.Tensor:
    """A patch-embedding conv whose kernel equals its stride, on flattened patches: one GEMM.
    x: [patches, C * prod(kernel)], each patch flattened in the weight's (C, ...kernel) order."""
    w = conv.weight
    return F.linear(x.to(w.dtype), w.view(w.shape[0], -1), conv.bias)
