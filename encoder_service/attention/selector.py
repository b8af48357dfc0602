"""Picks the attention backend once, at load time, with an error that says why when it can't."""

from __future__ import annotations

import torch

from ..errors import BackendUnavailable
from .base import AttentionBackend, RaggedOnly
from .registry import BACKENDS, backend_class

AUTO = "auto"


def valid_names() -> list[str]:
    return [AUTO, *BACKENDS]


def select_backend(name: str, device: torch.device | str, dtype: torch.dtype,
                   head_dim: int) -> type[AttentionBackend]:
    device = torch.device(device)
    if name == AUTO:
        candidates = sorted((backend_class(n) for n in BACKENDS), key=lambda c: -c.priority)
        reasons = []
        for cls in candidates:
            reason = cls.unsupported_reason(device, dtype, head_dim)
            if reason is None:
                return cls
            reasons.append(f"{cls.name}: {reason}")
        raise BackendUnavailable(f"no attention backend can run on {device} with {dtype}, head_dim "
                                 f"{head_dim}: " + "; ".join(reasons))
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown attention backend {name!r}; valid names: {', '.join(valid_names())}")
    cls = backend_class(name)
    reason = cls.unsupported_reason(device, dtype, head_dim)
    if reason is not None:
        raise BackendUnavailable(f"attention backend {name!r} cannot run here: {reason} "
                                 f"(device {device}, dtype {dtype}, head_dim {head_dim})")
    return cls


def graph_backend(backend: AttentionBackend) -> RaggedOnly | None:
    """What a forward captured in a CUDA graph attends with (models/cuda_graphs.py): the model's
    backend where its plans are static (``static_plans``), else ``varlen`` where it runs on this
    device (FlashInfer's ragged wrappers), else None (every forward stays eager)."""
    if backend.static_plans:
        return RaggedOnly(backend)
    varlen = backend_class("varlen")
    if varlen.unsupported_reason(backend.device, backend.dtype, backend.head_dim) is not None:
        return None
    return RaggedOnly(varlen(backend.num_heads, backend.head_dim, backend.device, backend.dtype))
