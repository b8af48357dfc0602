"""The one interface every attention backend implements.

ViT attention is multi-head attention with no KV cache over packed tokens: ``q, k, v`` are
``[tokens, heads, head_dim]`` and the metadata says which contiguous token ranges attend to each
other. A backend is chosen once at load time; per batch, ``prepare`` turns the host metadata of one
attention pattern into whatever the kernel needs (device index tensors, a plan), and every layer
with that pattern reuses it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

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
    def __init__(self, num_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.device = device
        self.dtype = dtype
        self.scale = head_dim**-0.5

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> Any:
        """Once per batch and attention pattern, from host metadata. Must not sync the device."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prepared: Any) -> torch.Tensor:
        """Non-causal attention within each sequence; returns ``[tokens, heads, head_dim]``."""
