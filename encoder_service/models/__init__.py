"""Vision models: ``load_vision_model`` is the public entry point (README, "Python API")."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InvalidInput
from .base import ModelSpec, VisionModel
from .presets import PRESETS, make_checkpoint

__all__ = ["PRESETS", "ModelSpec", "VisionModel", "load_vision_model", "make_checkpoint"]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise InvalidInput(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}") from None


def load_vision_model(path_or_preset: str | Path, device: str | torch.device = "cpu",
                      dtype: torch.dtype | str = torch.float32, attn_backend: str = "auto",
                      seed: int = 0, preprocess: str = "auto") -> VisionModel:
    """Loads the vision tower of a transformers-format checkpoint directory, or a built-in preset
    (random weights from ``seed``; see ``PRESETS``). ``preprocess``: ``pil`` (bit-exact with
    transformers' PIL processor), ``torch`` (its default torchvision-backed processor, resize on the
    device) or ``auto`` (torch on an accelerator, pil on the CPU)."""
    model = _load(path_or_preset, torch.device(device), parse_dtype(dtype), attn_backend, seed)
    model.set_preprocess_mode(preprocess)
    return model


def _load(path_or_preset: str | Path, device: torch.device, dtype: torch.dtype, attn_backend: str,
          seed: int) -> VisionModel:
    path = Path(path_or_preset)
    if path.is_dir():
        from .loader import read_checkpoint
        from .registry import loader_for

        ckpt = read_checkpoint(path)
        return loader_for(ckpt.config.get("model_type"))(ckpt, model_id=str(path_or_preset), device=device,
                                                         dtype=dtype, attn_backend=attn_backend)
    name = str(path_or_preset)
    if name in PRESETS:
        from .presets import random_vision_state

        preset = PRESETS[name]
        state = {k: v.to(dtype) for k, v in random_vision_state(preset, seed).items()}
        if preset.model_type == "kimi_k25":
            from .kimi_k25 import KimiK25VisionConfig
            from .kimi_k25_loading import build as build_kimi
            from .kimi_k25_loading import checkpoint_config

            cfg = KimiK25VisionConfig.from_config(checkpoint_config(preset.vision_config, preset.text_hidden_size))
            return build_kimi(cfg, state, model_id=f"{name}@seed{seed}",
                              preprocess_config=preset.preprocessor_config, device=device, dtype=dtype,
                              attn_backend=attn_backend)
        from .qwen2_5_vl import Qwen2_5_VisionConfig
        from .qwen2_5_vl_loading import build

        return build(Qwen2_5_VisionConfig.from_dict(preset.vision_config), state,
                     model_id=f"{name}@seed{seed}", preprocess_config=preset.preprocessor_config,
                     device=device, dtype=dtype, attn_backend=attn_backend)
    raise InvalidInput(f"{str(path_or_preset)!r} is neither a checkpoint directory nor a preset; "
                       f"presets: {', '.join(PRESETS)}")
