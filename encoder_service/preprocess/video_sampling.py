"""PLACEHOLDER (replaced by the sampling branch): the shared video sampling types."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClipFacts:
    total_frames: int
    fps: float | None
    duration_s: float | None


@dataclass(frozen=True)
class VideoSampling:
    reference: str = "transformers"
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
