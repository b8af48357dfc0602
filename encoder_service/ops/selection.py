"""Chooses a provider for every capability a model uses, once, at load time (``--ops``), with an error
that names the capability, the provider and the reason when it can't; ``OpsSelection`` is what the
model then calls.

``--ops`` syntax: comma-separated entries, each either ``CAPABILITY=PROVIDER`` or one bare provider
name that applies to every capability not named (``auto`` where none is given):

- ``auto`` (the default): per capability, the capable provider of the highest priority, except that
  a provider computing attention itself (the Triton window kernel) is a candidate only when
  ``--attn-backend`` is ``auto`` too: a backend the user names runs every attention layer;
- ``torch``: every capability in plain torch (attention through the backend);
- ``window_attention=triton,gated_mlp=torch``: those two as named, the rest ``auto``;
- ``torch,rms_scale=triton``: ``rms_scale`` as named, the rest ``torch``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import BackendUnavailable
from .base import OpProvider, OpTarget
from .registry import CAPABILITIES, PROVIDERS, provider_class
from .torch_ops import RotaryAttention

AUTO = "auto"


def parse_ops(spec: str) -> tuple[str, dict[str, str]]:
    """``--ops`` -> (the provider for capabilities not named, {capability: provider}); checks the
    names against the registry (not whether they can run here: ``select_ops`` does that)."""
    default, named = AUTO, {}
    bare = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        capability, sep, provider = (s.strip() for s in entry.partition("="))
        if not sep:
            bare.append(entry)
            known = {AUTO, *(n for providers in PROVIDERS.values() for n in providers)}
            if entry not in known:
                raise BackendUnavailable(f"--ops {spec!r}: unknown provider {entry!r}; providers: "
                                         f"{', '.join(sorted(known))} (or CAPABILITY=PROVIDER)")
            default = entry
            continue
        if capability not in PROVIDERS:
            raise BackendUnavailable(f"--ops {spec!r}: unknown capability {capability!r}; capabilities: "
                                     f"{', '.join(CAPABILITIES)}")
        if provider != AUTO and provider not in PROVIDERS[capability]:
            raise BackendUnavailable(f"--ops {spec!r}: unknown provider {provider!r} for {capability}; "
                                     f"providers: {', '.join([AUTO, *PROVIDERS[capability]])}")
        if capability in named:
            raise BackendUnavailable(f"--ops {spec!r}: {capability} is named twice")
        named[capability] = provider
    if len(bare) > 1:
        raise BackendUnavailable(f"--ops {spec!r}: at most one provider without a capability (the default "
                                 f"for the rest), got {', '.join(bare)}")
    return default, named


def _auto(capability: str, target: OpTarget, attention_named: bool) -> type[OpProvider]:
    candidates = sorted((provider_class(capability, n) for n in PROVIDERS[capability]), key=lambda c: -c.priority)
    for cls in candidates:
        if cls.runs_attention and attention_named:
            continue
        if cls.unavailable_reason(target) is None:
            return cls
    return provider_class(capability, "torch")  # always capable: a torch provider declines nothing


def select_ops(spec: str, target: OpTarget | None, capabilities: tuple[str, ...], *,
               attention_named: bool, later: tuple[str, ...] = ()) -> OpsSelection:
    """A provider for each of ``capabilities`` (what the model uses; ``target`` None when it uses
    none). ``attention_named``: whether ``--attn-backend`` named a backend rather than ``auto``.
    ``later``: capabilities the model asks for only once quantised (``VisionModel.quantize`` checks
    a name among them), which ``spec`` may name now."""
    default, named = parse_ops(spec)
    unused = [c for c in named if c not in capabilities and c not in later]
    if unused:
        uses = f"uses only {', '.join(capabilities)}" if capabilities else "uses no fused operations"
        raise BackendUnavailable(f"--ops {spec!r} names {', '.join(unused)}, but this model {uses}")
    chosen: dict[str, OpProvider] = {}
    for capability in capabilities:
        name = named.get(capability, default)
        if name == AUTO:
            cls = _auto(capability, target, attention_named)
        else:
            if name not in PROVIDERS[capability]:
                raise BackendUnavailable(f"--ops {spec!r}: {capability} has no provider {name!r}; providers: "
                                         f"{', '.join([AUTO, *PROVIDERS[capability]])}")
            cls = provider_class(capability, name)
            if (reason := cls.unavailable_reason(target)) is not None:
                raise BackendUnavailable(f"--ops: {capability}={name} cannot run here: {reason} ({target})")
        chosen[capability] = cls()
    return OpsSelection(chosen)


class OpsSelection:
    """The providers chosen for one model; the model calls these methods and names no kernel."""

    def __init__(self, providers: dict[str, OpProvider]) -> None:
        self.providers = providers
        window = providers.get("window_attention")
        # Full-attention layers: rotary in torch, then the backend, whatever the window provider (the
        # same object where that is exactly the torch one, so it is compiled once; not a subclass,
        # which may compute attention its own way).
        self._attention = window if type(window) is RotaryAttention else RotaryAttention()

    def describe(self) -> str:
        """``window_attention=triton,rms_scale=triton,gated_mlp=torch``; ``none`` for a model that
        uses no fused operations (every layer in its own torch code and the attention backend)."""
        return ",".join(f"{c}={p.name}" for c, p in self.providers.items()) or "none"

    def __repr__(self) -> str:
        return f"OpsSelection({self.describe()})"

    def compile(self, mode: str | None = None) -> None:
        """torch.compile every plain-torch function the model's providers run."""
        for provider in {id(p): p for p in (*self.providers.values(), self._attention)}.values():
            provider.compile(mode)

    def prepare_windows(self, meta, backend, device: torch.device) -> Any:
        return self.providers["window_attention"].prepare(meta, backend, device)

    def window_attention(self, acc, affine, cos, sin, num_heads: int, plan, backend) -> torch.Tensor:
        return self.providers["window_attention"](acc, affine, cos, sin, num_heads, plan, backend)

    def attention(self, acc, affine, cos, sin, num_heads: int, plan, backend) -> torch.Tensor:
        """Full attention (no windows): rotary in torch, then the backend whatever the selection."""
        return self._attention(acc, affine, cos, sin, num_heads, plan, backend)

    def rms_scale(self, x: torch.Tensor, pending: torch.Tensor, eps: float) -> torch.Tensor:
        return self.providers["rms_scale"](x, pending, eps)

    def gated_mlp(self, x, w, shift, scale, bias, act: str) -> torch.Tensor:
        return self.providers["gated_mlp"](x, w, shift, scale, bias, act)

    def rms_quant(self, x: torch.Tensor, pending: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.providers["rms_quant"](x, pending, eps)

    def fp8_gated_mlp(self, xq, x_scale, wq, w_scale, bias, act: str) -> torch.Tensor:
        return self.providers["fp8_gated_mlp"](xq, x_scale, wq, w_scale, bias, act)

    def act_quant(self, y: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.providers["act_quant"](y, act)


def no_ops() -> OpsSelection:
    """The selection of a model that uses no fused operations."""
    return OpsSelection({})
