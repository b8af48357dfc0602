"""The ``triton`` provider of ``rms_scale``: the per-token rstd in one Triton kernel (``_rms_kernel.py``),
twice the speed of inductor's kernel for the same reduction on the H100 (bench/kernels.py)."""

from __future__ import annotations

import torch

from .base import OpProvider, OpTarget
from .triton_window import unavailable_reason


class TritonRmsScale(OpProvider):
    capability = "rms_scale"
    name = "triton"
    priority = 10

    @classmethod
    def unavailable_reason(cls, target: OpTarget) -> str | None:
        # The conditions of the other Triton kernels (NVIDIA, half precision, triton installed): the
        # kernel was measured and tested there only.
        return unavailable_reason(target.device, target.dtype)

    def __init__(self) -> None:
        from ._rms_kernel import rms_scale  # imports triton: only once this provider is chosen

        self._fn = rms_scale

    def __call__(self, x: torch.Tensor, pending: torch.Tensor, eps: float) -> torch.Tensor:
        return self._fn(x, pending, eps)


class TritonRmsQuant(OpProvider):
    """``rms_quant`` in one Triton kernel (``_rms_kernel.py``): the rstd kernel's single read of x, with
    the e4m3 row and its scale written in the same pass."""

    capability = "rms_quant"
    name = "triton"
    priority = 10

    @classmethod
    def unavailable_reason(cls, target: OpTarget) -> str | None:
        return unavailable_reason(target.device, target.dtype)

    def __init__(self) -> None:
        from ._rms_kernel import rms_quant

        self._fn = rms_quant

    def __call__(self, x: torch.Tensor, pending: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._fn(x, pending, eps)
