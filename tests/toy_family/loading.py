"""Builds the toy model from runtime-layout weights (the checkpoint's names under ``model.visual.``)."""

from __future__ import annotations

import torch

from ..loader import check_state
from .model import ToyConfig, ToyTower, ToyVisionModel


def build(cfg: ToyConfig, state: dict[str, torch.Tensor], *, model_id: str, preprocess_config: dict | None,
          device: torch.device, dtype: torch.dtype, attn_backend: str, ops: str = "auto",
          video_config: dict | None = None) -> ToyVisionModel:
    with torch.device("meta"):
        module = ToyTower(cfg)
    check_state(module, state, model_id)
    module.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    module = module.to(device=device).eval().requires_grad_(False)
    return ToyVisionModel(cfg, module, model_id=model_id, preprocess_config=preprocess_config, device=device,
                          dtype=dtype, attn_backend=attn_backend, ops=ops, video_config=video_config)
