"""torch.nn.attention.varlen.varlen_attn: FlashAttention over packed sequences, CUDA only.

Takes ``cu_seqlens`` on the device and ``max_seqlen`` as a host int, so no sync.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ..device import host_to_device
from ..metadata import AttentionMetadata
from .base import GpuHalfPrecisionBackend


@dataclass(frozen=True)
class _Prepared:
    cu_seqlens: torch.Tensor
    max_seqlen: int


class VarlenBackend(GpuHalfPrecisionBackend):
    name = "varlen"
    priority = 10
    static_plans = True  # cu_seqlens on the device, max_seqlen a host int fixed by the padded shape

    @classmethod
    def unavailable_reason(cls) -> str | None:
        # Found, not imported: importing it imports torch._dynamo (1.7 s), which a server whose device
        # cannot run this backend (every CPU server asks) would pay at each start.
        if importlib.util.find_spec("torch.nn.attention.varlen") is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen (needs torch >= 2.9)"
        return None

    @classmethod
    def supports_head_size(cls, head_dim: int) -> bool:
        return head_dim % 8 == 0 and head_dim <= 256

    def prepare_ragged(self, meta: AttentionMetadata) -> _Prepared:
        return _Prepared(host_to_device(meta.cu_seqlens, self.device), meta.max_seqlen)

    def forward_ragged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prepared: _Prepared) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        # Positional only: keyword names moved between torch releases; the default scale is
        # head_dim ** -0.5 of the unpadded head_dim, which is what we need.
        cu, n = prepared.cu_seqlens, prepared.max_seqlen
        return varlen_attn(q, k, v, cu, cu, n, n)
