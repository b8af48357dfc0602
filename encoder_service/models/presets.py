"""Built-in model presets with random weights (each family lists its own: tiny ones for tests and
demos, full-size ones for benchmarks); ``make_checkpoint`` writes one as a transformers-format
checkpoint directory."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch

from .family import Preset, preset_config, random_state, write_checkpoint
from .registry import family_for, get_preset, presets

__all__ = ["PRESETS", "Preset", "get_preset", "make_checkpoint", "random_vision_state", "write_shallow_checkpoint"]


# Every family's presets by name. The family packages are light (their models import on first use).
PRESETS: Mapping[str, Preset] = MappingProxyType(presets())


def random_vision_state(preset: Preset, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random weights (float32, CPU) of a preset, in its family's runtime layout."""
    family = family_for(preset.model_type)
    return random_state(family, preset_config(family, preset), seed)


def make_checkpoint(preset: str, out_dir: str | Path, seed: int = 0, layout: str | None = None) -> Path:
    """Writes config.json, preprocessor_config.json (and the video processor's file where the preset has
    one) and model.safetensors with random vision weights.

    ``layout``: how the checkpoint names its tensors, one of the family's ``layouts`` (Qwen2.5-VL:
    ``transformers`` = ``model.visual.``, ``original`` = ``visual.``; Kimi-K2.5: ``original`` fused
    ``wqkv`` or ``transformers`` split q/k/v); default: the family's first.
    """
    p = get_preset(preset)
    return write_checkpoint(family_for(p.model_type), p, Path(out_dir), seed=seed, layout=layout)


def write_shallow_checkpoint(preset: str, depth: int, out_dir: str | Path, seed: int = 0, *,
                             narrow: bool = False) -> Path:
    """A preset cut to its first ``depth`` blocks (same widths, preprocessing and output size), as a
    checkpoint directory: the service benchmark's way to measure the front end without the forward.
    Layer-index lists (Qwen2.5-VL's full-attention blocks, Qwen3-VL's deepstack levels) keep the
    indexes below ``depth``; a model whose output levels that would change is refused. ``narrow``:
    the blocks 64 wide as well, one head (Qwen2.5-VL: its output width, ``out_hidden_size``, stays),
    so that CPU workers' forward costs little too and the front end's share shows on a CPU host."""
    p = get_preset(preset)
    vision = dict(p.vision_config)
    if narrow:
        if not {"hidden_size", "intermediate_size", "num_heads", "out_hidden_size"} <= vision.keys():
            raise ValueError(f"{preset}: narrowing is for configs with a separate out_hidden_size (Qwen2.5-VL)")
        vision.update(hidden_size=64, intermediate_size=64, num_heads=1)
    key = next((k for k in ("depth", "num_hidden_layers") if k in vision), None)
    if key is None or depth < 1:
        raise ValueError(f"{preset}: cannot cut to {depth} blocks")
    vision[key] = depth
    if "fullatt_block_indexes" in vision:
        vision["fullatt_block_indexes"] = [i for i in vision["fullatt_block_indexes"] if i < depth] or [depth - 1]
    if any(i >= depth for i in vision.get("deepstack_visual_indexes", [])):
        raise ValueError(f"{preset}: a deepstack level comes from block {max(vision['deepstack_visual_indexes'])}; "
                         f"{depth} blocks would change the output")
    shallow = dataclasses.replace(p, name=f"{p.name}-depth{depth}{'-narrow' if narrow else ''}", vision_config=vision)
    return write_checkpoint(family_for(p.model_type), shallow, Path(out_dir), seed=seed, layout=None)
