"""Qwen2.5-VL's vision tower: the model (``model.py``), its blocks with the norms folded into the
GEMMs (``folded.py``, the one block implementation, whose fused steps the ops layer provides),
loading (``loading.py``), and transformers' Qwen2-VL image processing (``preprocess.py``, its hooks
on the model in ``processor.py``; Qwen3-VL uses them too); ``FAMILY`` is its entry in the model
registry."""

from __future__ import annotations

import torch

from ...errors import InvalidInput
from ..family import ModelFamily, Preset, prefixed
from .preprocess import QWEN2_VL_PREPROCESSOR

# transformers' save_pretrained writes the tower under model.visual.; the hub's original files
# under visual. (both are read: loading.VISION_PREFIXES).
_LAYOUT_PREFIXES = {"transformers": "model.visual.", "original": "visual."}


class Qwen2_5_VLFamily(ModelFamily):
    model_types = ("qwen2_5_vl",)
    layouts = tuple(_LAYOUT_PREFIXES)
    presets = (
        Preset(
            name="tiny-qwen2.5-vl",
            model_type="qwen2_5_vl",
            vision_config={
                "depth": 4, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "in_channels": 3,
                "out_hidden_size": 48, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
                "window_size": 112, "fullatt_block_indexes": [1, 3], "hidden_act": "silu",
            },
            # Smaller max_pixels than the real model keeps CPU tests and demos quick.
            preprocessor_config={**QWEN2_VL_PREPROCESSOR, "max_pixels": 448 * 448},
            text_hidden_size=48,
        ),
        Preset(
            name="qwen2.5-vl-7b",
            model_type="qwen2_5_vl",
            vision_config={
                "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
                "out_hidden_size": 3584, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
                "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu",
            },
            preprocessor_config=QWEN2_VL_PREPROCESSOR,
            text_hidden_size=3584,
        ),
    )

    @property
    def vision_prefixes(self) -> tuple[str, ...]:
        from .loading import VISION_PREFIXES

        return VISION_PREFIXES

    def parse_config(self, config: dict):
        from .model import Qwen2_5_VisionConfig

        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise InvalidInput("config.json has no vision_config")
        return Qwen2_5_VisionConfig.from_dict(vision)

    def checkpoint_config(self, preset: Preset) -> dict:
        return {
            "model_type": preset.model_type,
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "hidden_size": preset.text_hidden_size,
            "vision_config": preset.vision_config,
        }

    def new_tower(self, cfg) -> torch.nn.Module:
        from .model import Qwen2_5_VisionTower

        return Qwen2_5_VisionTower(cfg)

    def build(self, cfg, state, **kwargs):
        from .loading import build

        return build(cfg, state, **kwargs)

    def to_checkpoint(self, state, cfg, layout):
        return prefixed(state, _LAYOUT_PREFIXES[layout])

    def is_norm_weight(self, name: str) -> bool:
        return name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight"))


FAMILY = Qwen2_5_VLFamily()
