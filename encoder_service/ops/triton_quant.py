"""The ``triton`` provider of ``act_quant``: the activation and the per-token e4m3 quantisation of its
output in one Triton kernel (``_quant_kernel.py``), one read of the MLP's hidden row instead of
inductor's two."""

from __future__ import annotations

import torch

from .base import OpProvider, OpTarget
from .triton_window import unavailable_reason

_ACTS = ("gelu_pytorch_tanh", "gelu", "silu")  # _quant_kernel.ACTS, without importing triton


class TritonActQuant(OpProvider):
    capability = "act_quant"
    name = "triton"
    priority = 10

    @classmethod
    def unavailable_reason(cls, target: OpTarget) -> str | None:
        if (reason := unavailable_reason(target.device, target.dtype)) is not None:
            return reason
        if target.activation not in _ACTS:
            return f"activation {target.activation!r} ({', '.join(_ACTS)} only)"
        return None

    def __init__(self) -> None:
        from ._quant_kernel import act_quant

        self._fn = act_quant

    def __call__(self, y: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._fn(y, act)
