"""Fused operations as capabilities: the layer between the models and the kernels.

A model never names a kernel. It asks for a capability (``window_attention``: windowed attention
with the rotary applied inside; ``rms_scale``: the per-token half of an RMSNorm folded into the next
GEMM; ``gated_mlp``: the gate/up GEMM with its activation), and ``select_ops`` chooses a provider for
each, once, at load time (``--ops``; ``selection.py`` documents the syntax and the ``auto`` rule).
Every capability has a plain-torch provider (``torch_ops.py``) that runs anywhere and goes through
the attention backend for attention; faster providers (``triton_*.py``, their kernels in
``_*_kernel.py`` / ``_swiglu_gemm.py``) say at load time why they cannot run where they can't. A new
provider is one file and one line in ``registry.py``. What was chosen is reported by
``OpsSelection.describe()``: the start-up log and ``ModelInfo.ops``.

Models import this package only (never a module under it); it imports neither the models nor
triton at import time (tests/test_architecture.py).
"""

from .base import OpProvider, OpTarget
from .compiling import compiled
from .fp8 import fp8_linear, linear, quantize_weight, scaled_linear
from .functional import ACTIVATIONS, activation, apply_rotary, linear_activation, rotate_half
from .registry import CAPABILITIES, FP8_CAPABILITIES, PROVIDERS
from .selection import AUTO, OpsSelection, no_ops, parse_ops, select_ops

__all__ = ["ACTIVATIONS", "AUTO", "CAPABILITIES", "FP8_CAPABILITIES", "PROVIDERS", "OpProvider", "OpTarget",
           "OpsSelection", "activation", "apply_rotary", "compiled", "fp8_linear", "linear", "linear_activation",
           "no_ops", "parse_ops",
           "quantize_weight", "rotate_half", "scaled_linear", "select_ops"]
