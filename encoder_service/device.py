"""Small device helpers shared by the models and the attention backends."""

from __future__ import annotations

import numpy as np
import torch


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Copy a host array to ``device`` without making the host wait for it.

    On CUDA the source is pinned so the copy is a true async DMA on the current stream (a pageable
    source would make the copy synchronous); the caching host allocator keeps the pinned buffer
    alive until the copy has run.
    """
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def is_rocm() -> bool:
    return torch.version.hip is not None
