"""Building blocks shared by the vision towers."""

from __future__ import annotations

import torch
from torch import nn

# Re-exported: the op providers compute with them too, so they live below the models (ops/functional.py).
from ..ops import ACTIVATIONS, activation, apply_rotary, rotate_half  # noqa: F401


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
