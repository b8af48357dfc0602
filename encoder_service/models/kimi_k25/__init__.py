"""Kimi-K2.5's vision tower and projector: the model (``model.py``), its per-batch host arrays
(``metadata.py``), its image processing (``preprocess.py``) and loading of both checkpoint layouts
(``loading.py``); ``FAMILY`` is its entry in the model registry."""

from __future__ import annotations

import torch

from ..family import ModelFamily, Preset, prefixed
from .preprocess import KIMI_K25_PREPROCESSOR, KimiK25PreprocessConfig
from .video import video_config_for

TINY_PREPROCESSOR = {**KIMI_K25_PREPROCESSOR, "max_patches": 1024}


def _video_file(preprocessor: dict) -> dict:
    """A preset's video_preprocessor_config.json: the video processor's defaults with the image layout.
    Without it, transformers' video processor would read preprocessor_config.json, image budget and all."""
    return video_config_for(None, KimiK25PreprocessConfig.from_dict(preprocessor)).transformers_keys()


class KimiK25Family(ModelFamily):
    model_types = ("kimi_k25",)
    # original: the remote-code names (fused wqkv); transformers: split q/k/v (loading.py).
    layouts = ("original", "transformers")
    presets = (
        Preset(
            name="tiny-kimi-k2.5",
            model_type="kimi_k25",
            # head_dim 72 as in the real model, so GPU backends see the real head size.
            vision_config={
                "num_hidden_layers": 3, "hidden_size": 144, "intermediate_size": 96, "num_attention_heads": 2,
                "patch_size": 14, "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 4,
                "merge_kernel_size": [2, 2], "hidden_act": "gelu_pytorch_tanh",
                "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
            },
            # A small patch budget keeps CPU tests and demos quick.
            preprocessor_config=TINY_PREPROCESSOR,
            video_processor_config=_video_file(TINY_PREPROCESSOR),
            text_hidden_size=64,
        ),
        Preset(
            name="kimi-k2.5",
            model_type="kimi_k25",
            vision_config={
                "num_hidden_layers": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_attention_heads": 16,
                "patch_size": 14, "pos_emb_height": 64, "pos_emb_width": 64, "pos_emb_time": 4,
                "merge_kernel_size": [2, 2], "hidden_act": "gelu_pytorch_tanh",
                "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
            },
            preprocessor_config=KIMI_K25_PREPROCESSOR,
            video_processor_config=_video_file(KIMI_K25_PREPROCESSOR),
            text_hidden_size=7168,
        ),
    )

    def parse_config(self, config: dict):
        from .model import KimiK25VisionConfig

        return KimiK25VisionConfig.from_config(config)

    def checkpoint_config(self, preset: Preset) -> dict:
        from .loading import checkpoint_config

        return checkpoint_config(preset.vision_config, preset.text_hidden_size)

    def new_tower(self, cfg) -> torch.nn.Module:
        from .model import KimiK25VisionTower

        return KimiK25VisionTower(cfg)

    def build(self, cfg, state, **kwargs):
        from .loading import build

        return build(cfg, state, **kwargs)

    def read_weights(self, ckpt, cfg, dtype):
        from .loading import read_weights

        return read_weights(ckpt, cfg, dtype)

    def to_checkpoint(self, state, cfg, layout):
        if layout == "transformers":
            from .loading import original_to_split

            return original_to_split(state, cfg)
        return prefixed(state, "")

    def init_weight(self, name, shape, gen):
        if name.endswith("pos_emb.weight"):
            return torch.randn(shape, generator=gen)  # unit scale, as the original: a wrong resize must show
        return super().init_weight(name, shape, gen)


FAMILY = KimiK25Family()
