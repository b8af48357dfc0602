"""The ``triton`` provider of ``gated_mlp``: the gate/up GEMM with SwiGLU in its epilogue, one Triton
kernel (``_swiglu_gemm.py``: TMA descriptors, so Hopper or newer)."""

from __future__ import annotations

import torch

from .base import OpProvider, OpTarget
from .triton_window import unavailable_reason


class TritonGatedMLP(OpProvider):
    capability = "gated_mlp"
    name = "triton"
    priority = 10

    @classmethod
    def unavailable_reason(cls, target: OpTarget) -> str | None:
        """The kernel's own check (``_swiglu_gemm.unavailable_reason``, per call on tensors), answered
        from the model's sizes at load time: activations [tokens, hidden] and weights
        [2 * intermediate, hidden] are contiguous."""
        if (reason := unavailable_reason(target.device, target.dtype)) is not None:
            return reason
        if torch.cuda.get_device_capability(target.device) < (9, 0):
            return "TMA descriptors need a Hopper or newer GPU"
        if target.activation != "silu":
            return f"activation {target.activation!r} (silu only)"
        if target.hidden_size % 8:
            return f"hidden size {target.hidden_size} not a multiple of 8 (16-byte aligned rows)"
        if target.intermediate_size % 8:
            return f"intermediate size {target.intermediate_size} not a multiple of 8"
        return None

    def __init__(self) -> None:
        from ._swiglu_gemm import gate_up_swiglu  # imports triton: only once this provider is chosen

        self._fn = gate_up_swiglu

    def __call__(self, x, w, shift, scale, bias, act: str) -> torch.Tensor:
        return self._fn(x, w, shift, scale, bias)


class TritonFp8GatedMLP(OpProvider):
    """``fp8_gated_mlp`` in one Triton kernel: the e4m3 gate/up GEMM with its scales, bias and SwiGLU
    in the epilogue (``_swiglu_gemm.gate_up_swiglu_fp8``), so the [tokens, 2 x intermediate]
    projection is never written."""

    capability = "fp8_gated_mlp"
    name = "triton"
    priority = 10

    @classmethod
    def unavailable_reason(cls, target: OpTarget) -> str | None:
        if (reason := TritonGatedMLP.unavailable_reason(target)) is not None:
            return reason
        # e4m3 rows: TMA wants 16-byte aligned rows, 16 one-byte elements.
        if target.hidden_size % 16:
            return f"hidden size {target.hidden_size} not a multiple of 16 (16-byte aligned e4m3 rows)"
        return None

    def __init__(self) -> None:
        from ._swiglu_gemm import gate_up_swiglu_fp8

        self._fn = gate_up_swiglu_fp8

    def __call__(self, xq, x_scale, wq, w_scale, bias, act: str) -> torch.Tensor:
        return self._fn(xq, x_scale, wq, w_scale, bias)
