"""Capabilities and their providers, one line each: adding a provider is its file plus one line here.
Imported lazily (``provider_class``), so a provider whose kernel library is missing costs nothing
until it is asked whether it can run."""

from __future__ import annotations

import importlib

from .base import OpProvider

# capability -> provider name -> "module:class". Every capability has a "torch" provider.
PROVIDERS: dict[str, dict[str, str]] = {
    "window_attention": {
        "torch": "encoder_service.ops.torch_ops:RotaryAttention",
        "triton": "encoder_service.ops.triton_window:TritonWindowAttention",
    },
    "rms_scale": {
        "torch": "encoder_service.ops.torch_ops:TorchRmsScale",
        "triton": "encoder_service.ops.triton_rms:TritonRmsScale",
    },
    "gated_mlp": {
        "torch": "encoder_service.ops.torch_ops:TorchGatedMLP",
        "triton": "encoder_service.ops.triton_swiglu:TritonGatedMLP",
    },
    # --quantization fp8 only (FP8_CAPABILITIES): a model asks for these when it runs FP8 linears.
    "rms_quant": {
        "torch": "encoder_service.ops.torch_ops:TorchRmsQuant",
        "triton": "encoder_service.ops.triton_rms:TritonRmsQuant",
    },
    "fp8_gated_mlp": {
        "torch": "encoder_service.ops.torch_ops:TorchFp8GatedMLP",
        "triton": "encoder_service.ops.triton_swiglu:TritonFp8GatedMLP",
    },
    "act_quant": {
        "torch": "encoder_service.ops.torch_ops:TorchActQuant",
        "triton": "encoder_service.ops.triton_quant:TritonActQuant",
    },
}
FP8_CAPABILITIES: tuple[str, ...] = ("rms_quant", "fp8_gated_mlp", "act_quant")
CAPABILITIES: tuple[str, ...] = tuple(PROVIDERS)


def provider_class(capability: str, name: str) -> type[OpProvider]:
    module_name, _, attr = PROVIDERS[capability][name].partition(":")
    return getattr(importlib.import_module(module_name), attr)
