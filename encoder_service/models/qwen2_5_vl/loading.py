"""Builds a Qwen2.5-VL vision model from runtime-layout weights (a checkpoint's, under either prefix,
or random ones: family.py does the reading)."""

from __future__ import annotations

import torch

from ..loader import check_state
from .model import Qwen2_5_VisionConfig, Qwen2_5_VisionTower, Qwen2_5_VLVisionModel

VISION_PREFIXES = ("model.visual.", "visual.")


def build(cfg: Qwen2_5_VisionConfig, state: dict[str, torch.Tensor], *, model_id: str,
          preprocess_config: dict | None, device: torch.device, dtype: torch.dtype,
          attn_backend: str, compile: bool | None = None, fuse_mlp: bool = True,
          fused_windows: bool = True, fold_norms: bool | None = None,
          fused_swiglu: bool = True) -> Qwen2_5_VLVisionModel:
    """``fuse_mlp``: see ``VisionBlock.fuse_mlp``; ``fused_windows`` and ``fused_swiglu``: see
    ``Qwen2_5_VisionTower`` (all three off only to measure what they buy). ``fold_norms``: run the
    blocks with the RMSNorms folded into the GEMMs (qwen2_5_vl_folded.py); None = on CUDA only, where
    it is faster, while the CPU keeps the reference's exact order of operations.
    ``compile``: torch.compile the blocks' non-attention halves; None = on CUDA only (2.2x faster
    on an H100, bench/RESULTS.md; on the CPU the compile time outweighs the gain for tests)."""
    with torch.device("meta"):
        module = Qwen2_5_VisionTower(cfg)
    check_state(module, state, model_id)
    module.load_state_dict(state, assign=True)
    # Non-persistent buffers (inv_freq) are not in the state dict: rebuild them for real.
    half = cfg.head_dim // 2
    module.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
    module = module.to(device=device).eval().requires_grad_(False)
    for block in module.blocks:
        block.fuse_mlp(multiple=64 if fuse_mlp else 1)
    module.inv_freq = module.inv_freq.float()
    module.fused_windows = fused_windows
    module.fused_swiglu = fused_swiglu
    if fold_norms if fold_norms is not None else device.type == "cuda":
        module.fold_norms()
    if compile if compile is not None else device.type == "cuda":
        module.compile()
    return Qwen2_5_VLVisionModel(cfg, module, model_id=model_id, preprocess_config=preprocess_config,
                                 device=device, dtype=dtype, attn_backend=attn_backend)
