"""Builds a Qwen2.5-VL vision model from runtime-layout weights (a checkpoint's, under either prefix,
or random ones: family.py does the reading)."""

from __future__ import annotations

import torch

from ..loader import check_state
from .folded import fold_norms
from .model import Qwen2_5_VisionConfig, Qwen2_5_VisionTower, Qwen2_5_VLVisionModel

VISION_PREFIXES = ("model.visual.", "visual.")


def build(cfg: Qwen2_5_VisionConfig, state: dict[str, torch.Tensor], *, model_id: str,
          preprocess_config: dict | None, device: torch.device, dtype: torch.dtype,
          attn_backend: str, ops: str = "auto", video_config: dict | None = None,
          compile: bool | None = None) -> Qwen2_5_VLVisionModel:
    """The tower on ``device`` with its MLP padded (``VisionBlock.fuse_mlp``) and its norms folded
    (folded.py), on every device: the one block implementation. ``ops``: ``--ops``, the providers of
    its fused operations (encoder_service/ops). ``compile``: torch.compile the torch providers;
    None = on CUDA only (2.2x faster on an H100, bench/RESULTS.md; on the CPU the compile time
    outweighs the gain for tests)."""
    with torch.device("meta"):
        module = Qwen2_5_VisionTower(cfg)
    check_state(module, state, model_id)
    module.load_state_dict(state, assign=True)
    # Non-persistent buffers (inv_freq) are not in the state dict: rebuild them for real.
    half = cfg.head_dim // 2
    module.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
    module = module.to(device=device).eval().requires_grad_(False)
    for block in module.blocks:
        block.fuse_mlp()
    module.inv_freq = module.inv_freq.float()
    fold_norms(module)
    model = Qwen2_5_VLVisionModel(cfg, module, model_id=model_id, preprocess_config=preprocess_config,
                                  device=device, dtype=dtype, attn_backend=attn_backend, ops=ops,
                                  video_config=video_config)
    if compile if compile is not None else device.type == "cuda":
        module.compile()  # after the model chose the providers: compiles theirs
    return model
