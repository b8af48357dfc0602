"""The one interface every attention backend implements.

ViT attention is multi-head attention with no KV cache over packed tokens: ``q, k, v`` are
``[tokens, heads, head_dim]`` and the metadata says which contiguous token ranges attend to each
other. A backend is chosen once at load time; per batch, ``prepare`` turns the host metadata of one
attention pattern into whatever the kernel needs (device index tensors, a plan), and every layer
with that pattern reuses it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ..metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: ClassVar[str]
    # "auto" tries capable backends from the highest priority down.
    priority: ClassVar[int] = 0

    # --- capabilities: plain class methods, answered without building anything ----------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why the backend's library cannot be used in this process, or None."""
        return None

    @classmethod
    def supports_device(cls, device: torch.device) -> bool:
        return True

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return True

    @classmethod
    def supports_head_size(cls, head_dim: int) -> bool:
        return True

    @classmethod
    def unsupported_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """None when the backend can run here, else a sentence saying why not."""
        if (reason := cls.unavailable_reason()) is not None:
            return reason
        if not cls.supports_device(device):
            return f"device {device} is not supported"
        if not cls.supports_dtype(dtype):
            return f"dtype {dtype} is not supported"
        if not cls.supports_head_size(head_dim):
            return f"head_dim {head_dim} is not supported"
        return None

    # --- per model, per batch, per layer -------------------------------------------------------
    # A head_dim the kernel runs at, zero-padded from the model's, when it also takes q, k, v already
    # padded (and then returns the output padded): a model that can write them padded for free
    # (inside a compiled graph) skips the backend's own pad and slice copies.
    padded_head_dim: int | None = None
    # Whether prepare_ragged() of a pattern at a fixed shape (metadata.pad_attention) gives only
    # device tensors and host values fixed by that shape, so that a forward captured in a CUDA graph
    # replays any batch once its plans' tensors are refreshed in place (models/cuda_graphs.py).
    # Not: a plan of host ints per sequence (sdpa), or one in a reused wrapper (FlashInfer's ragged).
    static_plans: ClassVar[bool] = False

    def __init__(self, num_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.device = device
        self.dtype = dtype
        self.scale = head_dim**-0.5

    # Sequences all of one length up to this many tokens run as one dense batched SDPA call, a view of
    # the packed tensors with no copy: 28 of Qwen2.5-VL-7B's 32 layers attend within full 64-token
    # windows, where ragged kernels spend most of their time on per-sequence overhead.
    dense_uniform_max_seqlen: ClassVar[int] = 512

    def prepare(self, meta: AttentionMetadata) -> Any:
        """Once per batch and attention pattern, from host metadata. Never syncs the device."""
        lengths = meta.cu_seqlens[1:] - meta.cu_seqlens[:-1]
        if meta.num_sequences > 1 and meta.max_seqlen <= self.dense_uniform_max_seqlen \
                and (lengths == lengths[0]).all():
            return _Uniform(int(lengths[0]))
        return self.prepare_ragged(meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prepared: Any) -> torch.Tensor:
        """Non-causal attention within each sequence; returns ``[tokens, heads, head_dim]``."""
        if isinstance(prepared, _Uniform):
            return _dense_uniform(q, k, v, prepared.seqlen, self.scale)
        return self.forward_ragged(q, k, v, prepared)

    @abstractmethod
    def prepare_ragged(self, meta: AttentionMetadata) -> Any:
        """What the kernel needs for sequences of any lengths (device index tensors, a plan)."""

    @abstractmethod
    def forward_ragged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prepared: Any) -> torch.Tensor:
        """The backend's own kernel over packed sequences."""


class RaggedOnly:
    """A backend whose every pattern takes its ragged kernel: a padded pattern (zero-length
    sequences) must not switch paths with the batch, and a graph must see the plan it captured."""

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.padded_head_dim = backend.padded_head_dim
        self.name = backend.name

    def prepare(self, meta: AttentionMetadata) -> Any:
        return self.backend.prepare_ragged(meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prepared: Any) -> torch.Tensor:
        return self.backend.forward_ragged(q, k, v, prepared)


@dataclass(frozen=True)
class _Uniform:
    seqlen: int


def _dense_uniform(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlen: int, scale: float) -> torch.Tensor:
    tokens, heads, dim = q.shape
    # [T, H, D] -> [B, L, H, D] -> [B, H, L, D]: views; SDPA takes the strides as they are. The scale is
    # the model's head_dim's: q, k, v may come zero-padded (padded_head_dim).
    qb, kb, vb = (x.view(tokens // seqlen, seqlen, heads, dim).transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(qb, kb, vb, scale=scale).transpose(1, 2).reshape(tokens, heads, dim)


class GpuHalfPrecisionBackend(AttentionBackend):
    """A backend whose kernels run on a GPU (CUDA or ROCm: both are "cuda" devices in torch) in
    float16 / bfloat16 only: the kernel libraries' own limits."""

    @classmethod
    def supports_device(cls, device: torch.device) -> bool:
        return device.type == "cuda"

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in (torch.float16, torch.bfloat16)
