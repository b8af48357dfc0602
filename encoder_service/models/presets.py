"""Built-in model presets with random weights: tiny ones for tests and demos, full-size ones for
benchmarks. ``make_checkpoint`` writes one as a transformers-format checkpoint directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

# Defaults of transformers' Qwen2VLImageProcessor (OpenAI CLIP mean/std).
QWEN2_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 1280,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 1 / 255,
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "resample": 3,
}


# Defaults of transformers' Kimi_K25ImageProcessor (size and max_patches count patches, not pixels).
KIMI_K25_PREPROCESSOR = {
    "image_processor_type": "Kimi_K25ImageProcessor",
    "size": {"max_height": 512, "max_width": 512},
    "max_patches": 16384,
    "patch_size": 14,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "rescale_factor": 1 / 255,
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "resample": 3,
}


@dataclass(frozen=True)
class Preset:
    name: str
    model_type: str
    vision_config: dict
    preprocessor_config: dict
    text_hidden_size: int


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
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
            preprocessor_config={**KIMI_K25_PREPROCESSOR, "max_patches": 1024},
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
            text_hidden_size=7168,
        ),
    ]
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        from ..errors import InvalidInput

        raise InvalidInput(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}") from None


def random_vision_state(preset: Preset, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random weights (float32, CPU) for the preset's vision tower, prefix-free."""
    if preset.model_type == "kimi_k25":
        from .kimi_k25 import KimiK25VisionConfig
        from .kimi_k25_loading import checkpoint_config, random_state

        config = checkpoint_config(preset.vision_config, preset.text_hidden_size)
        return random_state(KimiK25VisionConfig.from_config(config), seed)
    from .qwen2_5_vl import Qwen2_5_VisionConfig, Qwen2_5_VisionTower

    cfg = Qwen2_5_VisionConfig.from_dict(preset.vision_config)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen2_5_VisionTower(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name in sorted(shapes):
        shape = shapes[name]
        t = torch.randn(shape, generator=gen)
        if len(shape) >= 2:
            # 1/sqrt(fan_in) keeps attention scores O(1): with tiny weights attention would be
            # uniform and a wrong rotary or window order could not show in a parity test.
            t *= shape[1:].numel() ** -0.5
        elif name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")):
            t = 1.0 + 0.1 * t
        else:
            t *= 0.1
        state[name] = t
    return state


def make_checkpoint(preset: str, out_dir: str | Path, seed: int = 0, prefix: str = "model.visual.",
                    layout: str = "original") -> Path:
    """Writes config.json, preprocessor_config.json and model.safetensors with random vision weights.

    ``layout`` (Kimi-K2.5 only): "original" (fused ``wqkv``) or "transformers" (split q/k/v).
    """
    p = get_preset(preset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if p.model_type == "kimi_k25":
        from .kimi_k25_loading import write_checkpoint

        return write_checkpoint(p, out, seed, layout)
    config = {
        "model_type": p.model_type,
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "hidden_size": p.text_hidden_size,
        "vision_config": p.vision_config,
        "_preset": p.name,
        "_seed": seed,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(p.preprocessor_config, indent=2))
    state = {prefix + k: v.contiguous() for k, v in random_vision_state(p, seed).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
