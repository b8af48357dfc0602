"""Building blocks shared by the vision towers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Re-exported: the op providers compute with them too, so they live below the models (ops/functional.py).
from ..ops import (  # noqa: F401
    ACTIVATIONS,
    activation,
    apply_rotary,
    compiled,
    linear,
    linear_activation,
    quantize_weight,
    rotate_half,
    scaled_linear,
)


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


def patch_conv_as_linear(x: torch.Tensor, conv: nn.Conv2d | nn.Conv3d) -> torch.Tensor:
    """A patch-embedding conv whose kernel equals its stride, on flattened patches: one GEMM.
    x: [patches, C * prod(kernel)], each patch flattened in the weight's (C, ...kernel) order."""
    w = conv.weight
    return F.linear(x.to(w.dtype), w.view(w.shape[0], -1), conv.bias)


class ConvPatchEmbed3d(nn.Module):
    """The Qwen towers' patch embedding: a Conv3d whose kernel equals its stride over each flattened
    (C, T, P, P) patch, kept Conv3d-shaped (``proj``) so checkpoints load unchanged, applied as one GEMM."""

    def __init__(self, in_channels: int, hidden_size: int, temporal_patch_size: int, patch_size: int, *,
                 bias: bool) -> None:
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, hidden_size, kernel, stride=kernel, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return patch_conv_as_linear(x, self.proj)


class QkvProjections(nn.Module):
    """An attention's parameters as the Qwen towers' checkpoints name them: the fused ``qkv`` and the
    output ``proj``, both with a bias. The attention itself runs in the family's block, through the
    attention backend."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=True)
