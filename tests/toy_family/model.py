"""The toy tower (a patch embedding, one pre-LayerNorm block with full attention within each frame, a 2x2
merger) and its ``VisionModel``, fed by Qwen2-VL's processors."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...attention import AttentionBackend
from ...errors import InvalidInput
from ...metadata import BatchMetadata, SpatialConfig, build_metadata
from ..base import Grid, ModelSpec, VisionModel
from ..layers import patch_conv_as_linear
from ..qwen2_5_vl.preprocess import Qwen2VLPreprocessConfig
from ..qwen2_5_vl.processor import Qwen2VLProcessorHooks
from . import video
from .preprocess import TOY_PREPROCESSOR

_INTS = ("hidden_size", "num_heads", "intermediate_size", "in_channels", "patch_size", "temporal_patch_size",
         "spatial_merge_size", "out_hidden_size")


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    model_type: str = "toy_vl"
    hidden_size: int = 32
    num_heads: int = 2
    intermediate_size: int = 64
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 24

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_config(cls, config: dict) -> ToyConfig:
        if config.get("model_type") != "toy_vl":
            raise InvalidInput(f"model_type {config.get('model_type')!r} is not toy_vl")
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise InvalidInput("config.json has no vision_config mapping")
        kwargs = {}
        for key in _INTS:
            if vision.get(key) is not None:
                value = vision[key]
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise InvalidInput(f"vision_config: {key} must be a positive integer, got {value!r}")
                kwargs[key] = value
        cfg = cls(**kwargs)
        if cfg.hidden_size % cfg.num_heads:
            raise InvalidInput(f"vision_config: hidden_size {cfg.hidden_size} is not divisible by num_heads "
                               f"{cfg.num_heads}")
        return cfg

    def to_dict(self) -> dict:
        return {key: getattr(self, key) for key in _INTS}


class ToyTower(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel, bias=True)
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.merger_norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.merger_fc1 = nn.Linear(merged, merged)
        self.merger_fc2 = nn.Linear(merged, cfg.out_hidden_size)

    def forward(self, pixel_values: torch.Tensor, meta: BatchMetadata, backend: AttentionBackend) -> torch.Tensor:
        """[patches, patch_dim] in merge-block order -> [tokens, out_hidden_size]."""
        x = patch_conv_as_linear(pixel_values, self.patch_embed)
        n, heads = x.shape[0], self.cfg.num_heads
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, heads, -1).unbind(1)
        attn = backend.forward(q, k, v.contiguous(), backend.prepare(meta.full))
        x = x + self.proj(attn.reshape(n, -1))
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        merged = self.merger_norm(x).reshape(-1, self.merger_fc1.in_features)
        return self.merger_fc2(F.gelu(self.merger_fc1(merged)))


class ToyVisionModel(Qwen2VLProcessorHooks, VisionModel):
    VIDEO = video.VIDEO

    def __init__(self, cfg: ToyConfig, module: ToyTower, *, model_id: str, preprocess_config: dict | None,
                 device: torch.device, dtype: torch.dtype, attn_backend: str, ops: str = "auto",
                 video_config: dict | None = None) -> None:
        self.preprocess_config = Qwen2VLPreprocessConfig.from_dict(
            TOY_PREPROCESSOR if preprocess_config is None else preprocess_config)
        self._bind_video(video_config, cfg, model_id, image_file=preprocess_config)
        super().__init__(cfg, module, device=device, dtype=dtype, attn_backend=attn_backend, ops=ops)
        self.spec = ModelSpec(
            model_id=model_id, model_type=cfg.model_type, hidden_size=cfg.out_hidden_size,
            patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
            spatial_merge_size=cfg.spatial_merge_size, in_channels=cfg.in_channels,
            fingerprint={"vision_config": cfg.to_dict(), "preprocess": self.preprocess_config.fingerprint(),
                         **self._video_fingerprint()},
        )

    @torch.inference_mode()
    def encode_packed(self, pixel_values: torch.Tensor | np.ndarray, grids: Sequence[Sequence[int]]
                      ) -> tuple[torch.Tensor, tuple[int, ...]]:
        checked: list[Grid] = self.validate(pixel_values, grids)
        meta = build_metadata(checked, SpatialConfig(self.cfg.spatial_merge_size, self.cfg.patch_size))
        x = self._pixels_to_device(pixel_values).to(self.dtype)
        return self.module(x, meta, self.backend), meta.tokens_per_image
