"""Tiny Qwen3-VL / Qwen3.5 towers for the tests: ours and transformers' with the same random weights.

head_dim 72 as in the real models (1152 / 16), an 8 x 8 position table (real: 48 x 48) so that
test grids are both smaller and larger than the table, and two deepstack levels on the Qwen3-VL
types, one after the first block and one after the last.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel

from encoder_service.models.family import random_state
from encoder_service.models.qwen3_vl import FAMILY
from encoder_service.models.qwen3_vl.config import Qwen3VLVisionConfig
from encoder_service.models.qwen3_vl.loading import build, checkpoint_config

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
OUT_HIDDEN = 48
TINY_VISION = {
    "depth": 3, "hidden_size": 144, "intermediate_size": 96, "num_heads": 2, "patch_size": 16,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 64,
    "hidden_act": "gelu_pytorch_tanh",
}
# The MoE variant gets other levels than the dense one: nothing may assume (0, last).
DEEPSTACK = {"qwen3_vl": [0, 2], "qwen3_vl_moe": [1, 2]}
# Qwen3-VL's preprocessor_config.json as published (Qwen3.5's is the same).
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}


def tiny_config(model_type: str) -> dict:
    """A whole transformers-format config.json of the tiny tower."""
    vision = {**TINY_VISION, "deepstack_visual_indexes": DEEPSTACK.get(model_type, [])}
    return checkpoint_config(model_type, vision, OUT_HIDDEN)


def tiny_state(model_type: str, seed: int = 0) -> dict[str, torch.Tensor]:
    return random_state(FAMILY, Qwen3VLVisionConfig.from_config(tiny_config(model_type)), seed)


def ours(model_type: str, seed: int = 0, attn_backend: str = "sdpa", preprocess_config: dict | None = None):
    cfg = Qwen3VLVisionConfig.from_config(tiny_config(model_type))
    return build(cfg, tiny_state(model_type, seed), model_id=f"tiny-{model_type}", device=torch.device("cpu"),
                 preprocess_config=PREPROCESSOR if preprocess_config is None else preprocess_config,
                 dtype=torch.float32, attn_backend=attn_backend)


def reference(model_type: str, seed: int = 0) -> torch.nn.Module:
    """transformers' vision model of the type (``AutoModel`` on its vision config), our weights loaded
    strictly: the same tensor names, nothing missing, nothing left over."""
    vision_cfg = AutoConfig.for_model(**tiny_config(model_type)).vision_config
    vision_cfg._attn_implementation = "sdpa"
    model = AutoModel.from_config(vision_cfg).eval()
    model.load_state_dict(tiny_state(model_type, seed), strict=True)
    return model


def reference_levels(model: torch.nn.Module, pixels: torch.Tensor, grids: list[list[int]]) -> list[torch.Tensor]:
    """[main, *deepstack levels] of transformers' forward, each [tokens, out_hidden]."""
    with torch.no_grad():
        out = model(pixels, grid_thw=torch.tensor(grids))
    return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]


def pixels(grids: list[list[int]], patch_dim: int) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    rng = np.random.default_rng(n + len(grids))
    return torch.from_numpy(rng.standard_normal((n, patch_dim), dtype=np.float32))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def write_checkpoint(out: Path, config: dict, preprocessor_config: dict | None, state: dict[str, torch.Tensor],
                     prefix: str = "model.visual.", extra: dict[str, torch.Tensor] | None = None) -> Path:
    """config.json, preprocessor_config.json (if given) and model.safetensors holding ``state`` under
    ``prefix`` plus ``extra`` tensors under their own full names (an LLM's, say)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if preprocessor_config is not None:
        (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config, indent=2))
    tensors = {prefix + k: v.contiguous() for k, v in state.items()}
    tensors.update({k: v.contiguous() for k, v in (extra or {}).items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
