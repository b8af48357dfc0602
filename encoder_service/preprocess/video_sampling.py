"""PLACEHOLDER (replaced by the sampling branch): the shared video sampling types."""

from __future__ import annotations

from dataclasses import dataclass

from .video_decode import ClipFacts  # noqa: F401


@dataclass(frozen=True)
class VideoSampling:
    reference: str = "transformers"
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
