"""AMD Aiter varlen flash attention (package ``amd-aiter``; PyPI's ``aiter`` is unrelated).

Unverified on hardware: no ROCm machine is available to this project. Kept as small as the call.
"""

from __future__ import annotations

import importlib.util

import torch

from ..device import host_to_device, is_rocm
from ..metadata import AttentionMetadata
from .base import GpuHalfPrecisionBackend


class AiterBackend(GpuHalfPrecisionBackend):
    name = "aiter"
    priority = 20
    static_plans = False  # never captured on hardware here: kept eager

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not is_rocm():
            return f"aiter needs a ROCm build of torch; this torch ({torch.__version__}) is not one"
        if importlib.util.find_spec("aiter") is None:
            return "the amd-aiter package is not installed"
        import aiter

        if not hasattr(aiter, "flash_attn_varlen_func"):
            return "the installed 'aiter' package has no flash_attn_varlen_func (install amd-aiter, not PyPI's aiter)"
        return None

    def prepare_ragged(self, meta: AttentionMetadata):
        return host_to_device(meta.cu_seqlens, self.device), meta.max_seqlen

    def forward_ragged(self, q, k, v, prepared) -> torch.Tensor:
        import aiter

        cu, n = prepared
        return aiter.flash_attn_varlen_func(q, k, v, cu, cu, n, n, softmax_scale=self.scale, causal=False)
