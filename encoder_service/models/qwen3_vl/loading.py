"""Builds a Qwen3-VL / Qwen3.5 vision model from a checkpoint, or from random weights.

Checkpoints store the tower under ``model.visual.`` (the hub's Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and
Qwen3.5-MoE files, and transformers' ``save_pretrained`` of the ``*ForConditionalGeneration``
classes) or ``visual.`` (``save_pretrained`` of the bare ``*Model`` classes and older exports),
with transformers' module names below it: reading the tower is a prefix strip.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ...errors import InvalidInput
from ..loader import CheckpointFiles, check_state, load_tensors
from .config import MODEL_TYPES, Qwen3VLVisionConfig
from .model import Qwen3VLVisionModel
from .tower import Qwen3VLVisionTower, rope_inv_freq

VISION_PREFIXES = ("model.visual.", "visual.")

_ARCHITECTURES = {
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}


def load(ckpt: CheckpointFiles, *, model_id: str, device: torch.device, dtype: torch.dtype,
         attn_backend: str) -> Qwen3VLVisionModel:
    cfg = Qwen3VLVisionConfig.from_config(ckpt.config)
    state, read = load_tensors(ckpt, VISION_PREFIXES, dtype)
    model = build(cfg, state, model_id=model_id, preprocess_config=ckpt.preprocessor_config,
                  device=device, dtype=dtype, attn_backend=attn_backend)
    model.tensors_read = read
    return model


def build(cfg: Qwen3VLVisionConfig, state: dict[str, torch.Tensor], *, model_id: str,
          preprocess_config: dict | None, device: torch.device, dtype: torch.dtype,
          attn_backend: str) -> Qwen3VLVisionModel:
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
    return Qwen3VLVisionModel(cfg, module, model_id=model_id, preprocess_config=preprocess_config,
                              device=device, dtype=dtype, attn_backend=attn_backend)


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


def random_state(cfg: Qwen3VLVisionConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random weights (float32, CPU), prefix-free names."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen3VLVisionTower(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name in sorted(shapes):
        shape = shapes[name]
        t = torch.randn(shape, generator=gen)
        if name == "pos_embed.weight":
            pass  # unit scale, as large as the patch embedding: a wrong resampling must show
        elif len(shape) >= 2:
            # 1/sqrt(fan_in) keeps attention scores O(1): with tiny weights attention would be
            # uniform and a wrong rotary or patch order could not show in a parity test.
            t *= shape[1:].numel() ** -0.5
        elif "norm" in name and name.endswith(".weight"):
            t = 1.0 + 0.1 * t
        else:
            t *= 0.1
        state[name] = t
    return state


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
