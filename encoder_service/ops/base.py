"""What every op provider is: a class that says whether it can run for a model on a device (answered
at load time, from facts, without building anything) and, once chosen, computes its capability.

The capabilities and their call contracts (every provider of one capability is interchangeable):

``window_attention``
    ``prepare(meta, backend, device) -> plan`` once per batch for the window pattern, then per layer
    ``__call__(acc, affine, cos, sin, num_heads, plan, backend) -> [tokens, heads, d]``: the rotary
    (rotate-half) and attention within each window, from the raw output ``acc`` of a QKV GEMM whose
    RMSNorm was folded into its weight (``affine = (rstd [tokens], bias [3 * hidden])``, float32;
    the projection output is ``rstd * acc + bias`` rounded to the activation dtype). ``d`` is the
    model's head_dim, or the backend's ``padded_head_dim`` where the provider goes through the
    backend and it has one.
``rms_scale``
    ``__call__(x, pending, eps) -> float32 [tokens]``: the per-token rstd of the true residual
    ``x + pending`` (the half of an RMSNorm that is not folded into the next GEMM's weight).
``gated_mlp``
    ``__call__(x, w, shift, scale, bias, act) -> [tokens, intermediate]``: ``act(gate) * up`` of
    ``scale * (x @ w.T + shift) + bias``, whose rows alternate gate j, up j.
``rms_quant`` (``--quantization fp8``)
    ``__call__(x, pending, eps) -> (e4m3 [tokens, hidden], float32 [tokens, 1])``: the true residual
    ``x + pending`` per token in e4m3 and its scale times its rstd, the input of the next FP8 GEMM
    with the RMSNorm folded into its weight (ops/fp8.py).
``fp8_gated_mlp`` (``--quantization fp8``)
    ``__call__(xq, x_scale, wq, w_scale, bias, act) -> [tokens, intermediate]``: ``act(gate) * up`` of
    ``x_scale * w_scale * (xq @ wq.T) + bias`` (rows of ``wq`` alternating gate j, up j), in the
    dtype of ``bias``.
``act_quant`` (``--quantization fp8``)
    ``__call__(y, act) -> (e4m3 [tokens, dim], float32 [tokens, 1])``: ``act(y)``, rounded to y's dtype,
    in e4m3 per token with its scales: the input of an MLP's second FP8 GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class OpTarget:
    """The facts a provider's choice depends on, all known at load time."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    hidden_size: int
    intermediate_size: int  # the gated MLP's, as its weights hold it (padded)
    activation: str  # the gated MLP's
    window_tokens: int  # most tokens one attention window holds

    def __str__(self) -> str:
        return f"device {self.device}, dtype {self.dtype}"


class OpProvider:
    """One implementation of one capability. A new provider is one file with a subclass and one line
    in ``registry.PROVIDERS``."""

    capability: ClassVar[str]
    name: ClassVar[str]
    # ``auto`` takes the capable provider of the highest priority; the torch default has 0.
    priority: ClassVar[int] = 0
    # A provider that computes attention itself instead of calling the attention backend. ``auto``
    # picks it only when the attention backend is auto-selected too: a backend the user names runs
    # every attention layer unless ``--ops`` names this provider as well.
    runs_attention: ClassVar[bool] = False

    @classmethod
    def unavailable_reason(cls, target: OpTarget) -> str | None:
        """None when the provider can run for this model here, else a sentence saying why not."""
        return None

    def compile(self, mode: str | None = None) -> None:
        """torch.compile whatever plain-torch functions the provider runs (kernels stay as they are)."""
