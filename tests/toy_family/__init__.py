"""A toy vision family, written from docs/adding-a-model-family.md alone: ``tests/models/test_toy_family.py``
copies the ``encoder_service`` package, puts these files in it as ``models/toy_vl/``, adds the one registry
line and serves it. Not importable from here: the relative imports resolve only inside that copy.

Files, as the page lists them: ``preprocess.py`` (the image processor's settings), ``model.py`` (the tower
and its ``VisionModel``), ``loading.py`` (``build``), ``video.py`` (the video processor's settings and
``VIDEO``). Image and video processing are Qwen2-VL's (``qwen2_5_vl/preprocess.py``, ``processor.py``,
``video.py``), as Qwen3-VL builds on them; the tower is its own: a patch embedding, one pre-LayerNorm block
(no positions) and a 2x2 merger.
"""

from __future__ import annotations

import torch

from ..family import ModelFamily, Preset, prefixed
from .preprocess import TOY_PREPROCESSOR

_PREFIX = "model.visual."


class ToyFamily(ModelFamily):
    model_types = ("toy_vl",)
    layouts = ("transformers",)
    vision_prefixes = (_PREFIX,)
    presets = (
        Preset(
            name="tiny-toy",
            model_type="toy_vl",
            vision_config={"hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "in_channels": 3,
                           "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2},
            preprocessor_config={**TOY_PREPROCESSOR, "size": {"shortest_edge": 56 * 56,
                                                              "longest_edge": 224 * 224}},
            text_hidden_size=24,
        ),
    )

    def parse_config(self, config: dict):
        from .model import ToyConfig

        return ToyConfig.from_config(config)

    def checkpoint_config(self, preset: Preset) -> dict:
        return {"model_type": preset.model_type,
                "vision_config": {**preset.vision_config, "out_hidden_size": preset.text_hidden_size}}

    def new_tower(self, cfg) -> torch.nn.Module:
        from .model import ToyTower

        return ToyTower(cfg)

    def build(self, cfg, state, **kwargs):
        from .loading import build

        return build(cfg, state, **kwargs)

    def to_checkpoint(self, state, cfg, layout):
        return prefixed(state, _PREFIX)


FAMILY = ToyFamily()
