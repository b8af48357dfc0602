"""The toy family's video: Qwen2-VL's sampling, processing and patch order (models/qwen2_5_vl/video.py) with
settings of its own, whose baseline is its preset's (the page: "a new family's is its presets' settings")."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..qwen2_5_vl import video as qwen2_video
from ..video_hooks import FamilyVideo


@dataclasses.dataclass(frozen=True)
class ToyVideoConfig(qwen2_video.Qwen2VLVideoConfig):
    """Qwen2-VL's video processor settings with smaller per-frame pixel bounds and mean/std 0.5."""

    min_pixels: int = 28 * 28
    max_pixels: int = 112 * 112
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)


def baseline_settings(tower, image_file: Mapping[str, Any] | None, image) -> ToyVideoConfig:
    return ToyVideoConfig(patch_size=tower.patch_size, temporal_patch_size=tower.temporal_patch_size,
                          merge_size=tower.spatial_merge_size)


def read_settings(file: Mapping[str, Any], image) -> ToyVideoConfig:
    return ToyVideoConfig.from_dict(file)


VIDEO = FamilyVideo(baseline=baseline_settings, read=read_settings, front=qwen2_video.video_front,
                    value_table=qwen2_video.value_table, patchify=qwen2_video.patchify_clip)
