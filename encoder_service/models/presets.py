"""Built-in model presets with random weights (each family lists its own: tiny ones for tests and
demos, full-size ones for benchmarks); ``make_checkpoint`` writes one as a transformers-format
checkpoint directory."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch

from .family import Preset, preset_config, random_state, write_checkpoint
from .registry import family_for, get_preset, presets

__all__ = ["PRESETS", "Preset", "get_preset", "make_checkpoint", "random_vision_state"]


# Every family's presets by name. The family packages are light (their models import on first use).
PRESETS: Mapping[str, Preset] = MappingProxyType(presets())


def random_vision_state(preset: Preset, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random weights (float32, CPU) of a preset, in its family's runtime layout."""
    family = family_for(preset.model_type)
    return random_state(family, preset_config(family, preset), seed)


def make_checkpoint(preset: str, out_dir: str | Path, seed: int = 0, layout: str | None = None) -> Path:
    """Writes config.json, preprocessor_config.json and model.safetensors with random vision weights.

    ``layout``: how the checkpoint names its tensors, one of the family's ``layouts`` (Qwen2.5-VL:
    ``transformers`` = ``model.visual.``, ``original`` = ``visual.``; Kimi-K2.5: ``original`` fused
    ``wqkv`` or ``transformers`` split q/k/v); default: the family's first.
    """
    p = get_preset(preset)
    return write_checkpoint(family_for(p.model_type), p, Path(out_dir), seed=seed, layout=layout)
