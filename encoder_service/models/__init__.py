"""Vision models: ``load_vision_model`` is the public entry point (README, "Python API").

One package per model family (``qwen2_5_vl/``, ``kimi_k25/``, ``qwen3_vl/``), each registered by one
line in ``registry.py`` and built through the contract in ``family.py``, each with its own image
processing and batch metadata; ``base.py`` is what every loaded model offers, ``served.py`` the part
of it the engine may call. Below this layer: the shared preprocessing, host metadata and attention
backends; above it, the engine. Nothing here knows a request, a cache or gRPC
(tests/test_architecture.py checks the imports).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InvalidInput
from ..torch_dtypes import MODEL_DTYPES as DTYPES
from .base import ModelSpec, VisionModel
from .family import load_checkpoint, load_preset
from .presets import PRESETS, make_checkpoint
from .registry import family_for

__all__ = ["PRESETS", "ModelSpec", "VisionModel", "load_vision_model", "make_checkpoint"]


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise InvalidInput(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}") from None


def load_vision_model(path_or_preset: str | Path, device: str | torch.device = "cpu",
                      dtype: torch.dtype | str = torch.float32, attn_backend: str = "auto",
                      seed: int = 0, preprocess: str = "auto", ops: str = "auto",
                      quantization: str | None = None) -> VisionModel:
    """Loads the vision tower of a transformers-format checkpoint directory, or a built-in preset
    (random weights from ``seed``; see ``PRESETS``). ``preprocess``: ``pil`` (bit-exact with
    transformers' PIL processor), ``torch`` (its default torchvision-backed processor, resize on the
    device) or ``auto`` (torch on an accelerator, pil on the CPU). ``ops``: the providers of the
    model's fused operations (``--ops``, encoder_service/ops/selection.py). ``quantization``: None or
    ``fp8`` (``--quantization``, ``VisionModel.quantize``)."""
    model = _load(path_or_preset, torch.device(device), parse_dtype(dtype), attn_backend, seed, ops)
    model.quantize(quantization)
    model.set_preprocess_mode(preprocess)
    return model


def _load(path_or_preset: str | Path, device: torch.device, dtype: torch.dtype, attn_backend: str,
          seed: int, ops: str) -> VisionModel:
    path = Path(path_or_preset)
    if path.is_dir():
        from .loader import read_checkpoint, read_config

        config = read_config(path)
        family = family_for(config.get("model_type"))  # before the weight files: the more useful error
        return load_checkpoint(family, read_checkpoint(path, config), model_id=str(path_or_preset),
                               device=device, dtype=dtype, attn_backend=attn_backend, ops=ops)
    name = str(path_or_preset)
    if name in PRESETS:
        preset = PRESETS[name]
        return load_preset(family_for(preset.model_type), preset, seed=seed, device=device, dtype=dtype,
                           attn_backend=attn_backend, ops=ops)
    raise InvalidInput(f"{str(path_or_preset)!r} is neither a checkpoint directory nor a preset; "
                       f"presets: {', '.join(PRESETS)}")
