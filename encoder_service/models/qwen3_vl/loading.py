"""Builds a Qwen3-VL / Qwen3.5 vision model from runtime-layout weights (a checkpoint's or random
ones: family.py reads and writes them).

Checkpoints store the tower under ``model.visual.`` (the hub's Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and
Qwen3.5-MoE files, and transformers' ``save_pretrained`` of the ``*ForConditionalGeneration``
classes) or ``visual.`` (``save_pretrained`` of the bare ``*Model`` classes and older exports),
with transformers' module names below it: reading the tower is a prefix strip.
"""

from __future__ import annotations

import torch

from ...errors import InvalidInput
from ..loader import check_state
from .config import MODEL_TYPES, Qwen3VLVisionConfig
from .model import Qwen3VLVisionModel
from .tower import Qwen3VLVisionTower, rope_inv_freq

_ARCHITECTURES = {
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}


def build(cfg: Qwen3VLVisionConfig, state: dict[str, torch.Tensor], *, model_id: str,
          preprocess_config: dict | None, device: torch.device, dtype: torch.dtype,
          attn_backend: str, ops: str = "auto", video_config: dict | None = None) -> Qwen3VLVisionModel:
    """A model from a prefix-free state dict (transformers' vision-model names), checked strictly:
    a missing, unknown or misshapen tensor is an ``InvalidInput`` naming it."""
    with torch.device("meta"):
        module = Qwen3VLVisionTower(cfg)
    check_state(module, state, model_id)
    module.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    # inv_freq is a non-persistent buffer, not in the state dict: rebuild it for real, in float32
    # (the rotary angles are computed at full precision whatever the weights' dtype).
    module.inv_freq = rope_inv_freq(cfg)
    module = module.to(device=device).eval().requires_grad_(False)
    if device.type == "cuda":  # the CPU keeps transformers' exact operations, uncompiled
        module.compile()
    return Qwen3VLVisionModel(cfg, module, model_id=model_id, preprocess_config=preprocess_config,
                              device=device, dtype=dtype, attn_backend=attn_backend, ops=ops, video_config=video_config)


def checkpoint_config(model_type: str, vision_config: dict, text_hidden_size: int) -> dict:
    """A transformers-format config.json (``AutoConfig`` loads it) for a preset: the vision part in
    full, the LLM part only as wide as the tower's output (the LLM's other fields keep
    transformers' defaults; no LLM weights are written)."""
    cfg = Qwen3VLVisionConfig.from_config(
        {"model_type": model_type, "vision_config": {"out_hidden_size": text_hidden_size, **vision_config}})
    if cfg.out_hidden_size != text_hidden_size:
        raise InvalidInput(f"vision_config out_hidden_size {cfg.out_hidden_size} differs from the LLM's hidden "
                           f"size {text_hidden_size}: the LLM adds the tower's rows to its hidden states")
    vision = cfg.to_dict()
    vision_type, has_deepstack = MODEL_TYPES[model_type]
    if not has_deepstack:
        del vision["deepstack_visual_indexes"]  # not a field of Qwen3.5's vision config
    return {
        "model_type": model_type,
        "architectures": [_ARCHITECTURES[model_type]],
        "vision_config": {**vision, "model_type": vision_type},
        "text_config": {"model_type": f"{model_type}_text", "hidden_size": text_hidden_size},
    }
