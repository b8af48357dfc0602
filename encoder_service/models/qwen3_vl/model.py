"""A loaded Qwen3-VL / Qwen3.5 vision tower with its preprocessing: the public ``VisionModel`` API.

Preprocessing is transformers' ``Qwen2VLImageProcessor`` (models/qwen2_5_vl/preprocess.py), the class both
families' processors use, with the checkpoint's settings. Each output row carries the main
embedding, then (Qwen3-VL) one deepstack level per deepstack merger, each ``out_hidden_size``
wide (``ModelSpec.feature_levels``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from ...errors import InvalidInput
from ...metadata import pad_attention
from ...ops import OpTarget, select_ops
from ..base import Grid, ModelSpec, VisionModel, validate_batch
from ..cuda_graphs import GraphForward, Slots
from ..qwen2_5_vl.processor import Qwen2VLProcessorHooks
from . import video
from .config import Qwen3VLVisionConfig
from .metadata import Qwen3VLBatchMetadata, build_qwen3_vl_metadata
from .tower import Qwen3VLVisionTower

# The fused operations the FP8 blocks ask for (tower.run), never a kernel by name.
FP8_OPS = ("act_quant",)


class Qwen3VLVisionModel(Qwen2VLProcessorHooks, VisionModel):
    FP8_OPS = FP8_OPS
    VIDEO = video.VIDEO

    def __init__(self, cfg: Qwen3VLVisionConfig, module: Qwen3VLVisionTower, *, model_id: str,
                 preprocess_config: dict | None, device: torch.device, dtype: torch.dtype,
                 attn_backend: str, ops: str = "auto", video_config: dict | None = None) -> None:
        from ..qwen2_5_vl.preprocess import Qwen2VLPreprocessConfig

        self.preprocess_config = Qwen2VLPreprocessConfig.from_dict(
            _published_preprocessor() if preprocess_config is None else preprocess_config)
        # The processors' patches must be the tower's: otherwise every request would fail later.
        self._bind_video(video_config, cfg, model_id, image_file=preprocess_config)
        if cfg.in_channels != 3:
            raise InvalidInput(f"{model_id!r}: vision_config in_channels {cfg.in_channels}; the image processor "
                               "makes RGB patches (3 channels)")
        super().__init__(cfg, module, device=device, dtype=dtype, attn_backend=attn_backend, ops=ops)
        self.spec = ModelSpec(
            model_id=model_id, model_type=cfg.model_type, hidden_size=cfg.out_hidden_size,
            patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
            spatial_merge_size=cfg.spatial_merge_size, in_channels=cfg.in_channels,
            feature_levels=cfg.feature_levels,
            fingerprint={"vision_config": cfg.to_dict(), "preprocess": self.preprocess_config.fingerprint(),
                         **self._video_fingerprint()},
        )

    def validate(self, pixel_values: torch.Tensor | np.ndarray, grids: Sequence[Sequence[int]]) -> list[Grid]:
        # Any grid the merge rules allow: the position table is resampled to any size.
        return validate_batch(pixel_values, grids, self.spec)

    def metadata(self, grids: Sequence[Grid]) -> Qwen3VLBatchMetadata:
        cfg = self.cfg
        return build_qwen3_vl_metadata(grids, cfg.spatial_merge_size, cfg.patch_size, cfg.num_grid_per_side)

    def _ops_target(self) -> OpTarget:
        cfg = self.cfg
        return OpTarget(self.device, self.dtype, head_dim=cfg.head_dim, hidden_size=cfg.hidden_size,
                        intermediate_size=cfg.intermediate_size, activation=cfg.hidden_act, window_tokens=0)

    def _quantize_fp8(self) -> None:
        self.ops = select_ops(self._ops_spec, self._ops_target(), FP8_OPS, attention_named=self._attention_named)
        self.module.ops = self.ops
        self.module.quantize_fp8()
        if self.module.compiled is not None:  # the providers' torch functions, compiled as the tower's
            self.ops.compile(*self.module.compiled)

    def graph_forward(self, backend) -> GraphForward:
        """Token budgets' graphs: one pattern, ``slots.full`` frames of up to the budget."""
        module = self.module

        def pad(meta: Qwen3VLBatchMetadata, budget: int, slots: Slots) -> Qwen3VLBatchMetadata:
            return dataclasses.replace(meta, attention=pad_attention(meta.attention, slots.full(budget), budget))

        return GraphForward(metadata=self.metadata, pad=pad,
                            prepare=lambda meta: module.prepare(meta, backend, self.device),
                            run=lambda pixels, prepared: module.run(pixels, prepared, backend),
                            merge=self.cfg.spatial_merge_size)

    @torch.inference_mode()
    def encode_packed(self, pixel_values: torch.Tensor | np.ndarray, grids: Sequence[Sequence[int]]
                      ) -> tuple[torch.Tensor, tuple[int, ...]]:
        return self._encode_grids(pixel_values, grids, self.metadata)


def _published_preprocessor() -> dict:
    """The preprocessor_config.json published with Qwen3-VL and Qwen3.5 checkpoints. Used only where a
    checkpoint has none; a file that omits a key gets transformers' class default for it, as there."""
    from .preprocess import QWEN3_VL_PREPROCESSOR

    return QWEN3_VL_PREPROCESSOR
