"""Qwen3-VL / Qwen3.5 vision tower (``model_type`` qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe).

One tower serves the four: the MoE variants differ only in their LLM, and Qwen3.5 is Qwen3-VL's
tower without the deepstack mergers. Files: ``config.py`` (settings from config.json),
``metadata.py`` (per-batch host arrays), ``tower.py`` (the module), ``model.py`` (the served model
with its preprocessing: Qwen2-VL's, from the qwen2_5_vl package), ``preprocess.py`` (the published
preprocessor settings), ``loading.py`` (build, preset configs); ``FAMILY`` is its registry entry.
"""

from __future__ import annotations

import torch

from ..family import ModelFamily, Preset, prefixed
from .preprocess import QWEN3_VL_PREPROCESSOR

# The vision sizes every released Qwen3-VL and Qwen3.5 tower shares (transformers' defaults).
_REAL_TOWER = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
    "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 2304,
    "hidden_act": "gelu_pytorch_tanh",
}
# transformers' save_pretrained of the *ForConditionalGeneration classes and the hub's files use
# model.visual.; save_pretrained of the bare *Model classes and older exports visual.
_LAYOUT_PREFIXES = {"transformers": "model.visual.", "original": "visual."}


class Qwen3VLFamily(ModelFamily):
    model_types = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
    layouts = tuple(_LAYOUT_PREFIXES)
    presets = (
        Preset(
            name="tiny-qwen3-vl",
            model_type="qwen3_vl",
            # head_dim 72 as in the real tower; an 8 x 8 position table, so test grids are both
            # smaller and larger than it; deepstack after the first and the last block.
            vision_config={
                "depth": 3, "hidden_size": 144, "intermediate_size": 96, "num_heads": 2, "in_channels": 3,
                "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
                "num_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh",
                "deepstack_visual_indexes": [0, 2],
            },
            # A small pixel budget keeps CPU tests and demos quick.
            preprocessor_config={**QWEN3_VL_PREPROCESSOR, "size": {"shortest_edge": 65536,
                                                                   "longest_edge": 448 * 448}},
            text_hidden_size=48,
        ),
        Preset(
            name="qwen3-vl-8b",
            model_type="qwen3_vl",
            vision_config={**_REAL_TOWER, "deepstack_visual_indexes": [8, 16, 24]},
            preprocessor_config=QWEN3_VL_PREPROCESSOR,
            text_hidden_size=4096,
        ),
        Preset(
            name="qwen3.5",  # the tower of Qwen3.5-27B (LLM hidden size 5120); no deepstack
            model_type="qwen3_5",
            vision_config=_REAL_TOWER,
            preprocessor_config=QWEN3_VL_PREPROCESSOR,
            text_hidden_size=5120,
        ),
    )

    @property
    def vision_prefixes(self) -> tuple[str, ...]:
        return tuple(_LAYOUT_PREFIXES.values())

    def parse_config(self, config: dict):
        from .config import Qwen3VLVisionConfig

        return Qwen3VLVisionConfig.from_config(config)

    def checkpoint_config(self, preset: Preset) -> dict:
        from .loading import checkpoint_config

        return checkpoint_config(preset.model_type, preset.vision_config, preset.text_hidden_size)

    def new_tower(self, cfg) -> torch.nn.Module:
        from .tower import Qwen3VLVisionTower

        return Qwen3VLVisionTower(cfg)

    def build(self, cfg, state, **kwargs):
        from .loading import build

        return build(cfg, state, **kwargs)

    def to_checkpoint(self, state, cfg, layout):
        return prefixed(state, _LAYOUT_PREFIXES[layout])

    def init_weight(self, name, shape, gen):
        if name == "pos_embed.weight":
            # Unit scale, as large as the patch embedding: a wrong resampling must show.
            return torch.randn(shape, generator=gen)
        return super().init_weight(name, shape, gen)


FAMILY = Qwen3VLFamily()
