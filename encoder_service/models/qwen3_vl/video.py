"""Qwen3-VL / Qwen3.5 video: frame sampling equal to the named reference, the ``<t seconds>`` timestamps,
and frames -> patches equal to transformers' ``Qwen3VLVideoProcessor`` (the patch layout is Qwen2-VL's:
models/qwen2_5_vl/video.py).

Sampling (``sample_frame_indices``), by reference:
- ``transformers``: ``Qwen3VLVideoProcessor.sample_frames``. By fps (default the processor's, 2):
  ``int(total / fps_src * fps)`` (24 fps assumed where the clip's is unknown), clamped to the processor's
  ``[min_frames, max_frames]`` and the clip, not rounded to even; by count: that many frames, even above
  the clip's length (frames then repeat). The indices are ``linspace(0, total - 1, n)`` rounded. Asking
  for a count means fps=None in the call (as vLLM passes it): with the class default fps=2 filled in,
  transformers rejects num_frames as conflicting. ``min_frames`` / ``max_frames`` here are the
  processor's settings (transformers reads them from the processor, not from the call).
- ``vllm``: vLLM 0.33.0's ``Qwen3VLVideoBackend`` (fps capped at 30, a requested count ignored, unknown
  source fps taken as 24, ``max_frames`` <= 768), then its HF-processor call: where the loader kept every
  frame of the clip, vLLM marks the video ``do_sample_frames`` and the processor samples again at its
  own fps (a 30-frame 10 fps clip at fps=30: the loader keeps 30, the processor 6). The request's
  processor-level settings (vLLM's ``mm_processor_kwargs``: ``processor_fps``, ``processor_num_frames``,
  ``processor_do_sample_frames``) are that call's: with ``processor_fps=30`` too, the processor keeps all
  30. Its picks are over the whole clip and index the loaded frames (vLLM hands it those with the clip's
  metadata): ``processor_do_sample_frames`` forced on after a loader that sampled picks past them, which
  fails there as in vLLM. A clip given as frames is loaded whole, and sampled only where the request's
  ``processor_do_sample_frames`` says so (vLLM's metadata for frames says False).
Both fail, and so does this module (``InvalidInput``), for a sampling of fewer frames than
``temporal_patch_size``: the processor's ``smart_resize`` rejects it.

Processing (``preprocess_video``): the torchvision path, as for Qwen2-VL, with Qwen3-VL's
``smart_resize``, whose pixel bounds are per video (frames x height x width, the frame count rounded to
``temporal_patch_size``). ``cap_pixels_per_frame`` is the request's where it sets it, else the
checkpoint's, else False: what transformers 5.24 does when it is unset (it warns that the default will
become True; the published ``video_preprocessor_config.json`` does not set it) and what vLLM 0.33.0 gets;
True (qwen-vl-utils' per-frame cap) is computed as transformers does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import InvalidInput
from ...preprocess import settings
from ...preprocess.decode import MAX_ASPECT_RATIO
from ...preprocess.video_sampling import (
    SAMPLES,
    ClipFacts,
    VideoSampling,
    check_fps_xor_num_frames,
    check_indices,
    describe,
    every_frame,
    linspace_indices,
    pad_to_multiple,
    pick_loaded,
    processor_samples,
    refuse_all_frames,
)
from ..qwen2_5_vl import video as qwen2_video
from ..qwen2_5_vl.preprocess import PatchLayout
from ..qwen2_5_vl.video import check_video_config, video_config_kwargs
from ..video_hooks import FamilyVideo, VideoFront

ASSUMED_FPS = 24.0  # the references' fps for a clip whose container does not give one
# vLLM 0.33.0's Qwen3VLVideoBackend: its caps and defaults (load_bytes' fps=2, the sampling kwargs'
# min_frames=4).
VLLM_MAX_FPS = 30
VLLM_MAX_FRAMES = 768
VLLM_DEFAULT_FPS = 2.0
VLLM_MIN_FRAMES = 4


@dataclasses.dataclass(frozen=True)
class Qwen3VLVideoConfig(PatchLayout):
    """``Qwen3VLVideoProcessor``'s settings; defaults are its class defaults. ``min_pixels`` /
    ``max_pixels`` (``size.shortest_edge`` / ``longest_edge``) bound the whole video's pixels."""

    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False  # transformers 5.24's unset default: see the module docstring
    max_video_tokens: int = 768
    do_sample_frames: bool = True  # transformers 5.24's class default: sample at ``fps``

    def __post_init__(self) -> None:
        check_video_config(self)
        settings.check_video_fps(self)
        settings.check_normalization(self)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Qwen3VLVideoConfig:
        """From ``video_preprocessor_config.json`` (transformers' keys; ``size`` holds the pixel bounds)."""
        kwargs = video_config_kwargs(config, ("min_frames", "max_frames", "max_video_tokens", "fps"),
                                     top_level_pixels=False)
        if config.get("do_sample_frames") is not None:
            kwargs["do_sample_frames"] = bool(config["do_sample_frames"])
        return cls(**kwargs)

    def for_request(self, sampling: VideoSampling) -> Qwen3VLVideoConfig:
        """With the request's pixel bounds and per-frame cap, and its min/max frames as the processor's settings."""
        changes = {k: v for k, v in (("min_pixels", sampling.min_pixels), ("max_pixels", sampling.max_pixels),
                                     ("min_frames", sampling.min_frames), ("max_frames", sampling.max_frames),
                                     ("cap_pixels_per_frame", sampling.cap_pixels_per_frame))
                   if v is not None}
        return dataclasses.replace(self, **changes) if changes else self

def sample_frame_indices(clip: ClipFacts, sampling: VideoSampling, config: Qwen3VLVideoConfig | None = None,
                         frames_given: bool = False) -> list[int]:
    """The clip's frame indices the reference ``sampling.reference`` feeds Qwen3-VL, in order (they may
    repeat); an ``InvalidInput`` naming the setting where that reference fails. ``frames_given``: the
    clip came as its frames, which vLLM loads as they are (no loader sampling; its metadata says
    do_sample_frames False)."""
    cfg = config or Qwen3VLVideoConfig()
    what = describe(sampling, clip)
    source_fps = clip.known_fps or ASSUMED_FPS
    if sampling.reference == "vllm":
        refuse_all_frames(sampling, clip, "vLLM's Qwen3-VL video loader always samples by fps")
        indices = every_frame(clip) if frames_given else _vllm_loaded(clip, sampling, source_fps)
        # ... then its HF-processor call: where the loader kept every frame of the clip vLLM marks the video
        # do_sample_frames (unless the request's mm_processor_kwargs say), and the processor samples the
        # loaded frames again, at the request's processor fps or count, else its own fps.
        if processor_samples(sampling, not frames_given and len(indices) == clip.total_frames):
            indices = pick_loaded(indices, _processor_picks(clip, sampling, cfg, source_fps, what), what)
    else:
        check_fps_xor_num_frames(sampling.fps, sampling.num_frames, what)  # Qwen3VLVideoProcessor refuses both
        cfg = cfg.for_request(sampling)
        sample = not sampling.all_frames and (cfg.do_sample_frames
                                              or any(getattr(sampling, name) is not None for name in SAMPLES))
        if not sample:  # do_sample_frames off: every frame
            indices = every_frame(clip)
        elif sampling.num_frames is not None:
            indices = linspace_indices(clip.total_frames, sampling.num_frames)
        else:
            fps = sampling.fps if sampling.fps is not None else cfg.fps
            indices = _by_fps(clip.total_frames, source_fps, fps, cfg.min_frames, cfg.max_frames)
    if len(indices) < cfg.temporal_patch_size:
        raise InvalidInput(f"{what}: samples {len(indices)} frame(s), fewer than temporal_patch_size "
                           f"{cfg.temporal_patch_size}, which the reference's Qwen3VLVideoProcessor rejects")
    return check_indices(indices, clip, what)


def _vllm_loaded(clip: ClipFacts, sampling: VideoSampling, source_fps: float) -> list[int]:
    """Qwen3VLVideoBackend.compute_frames_index_to_sample (num_frames is not read)."""
    fps = min(sampling.fps if sampling.fps is not None else VLLM_DEFAULT_FPS, VLLM_MAX_FPS)
    min_frames = sampling.min_frames if sampling.min_frames is not None else VLLM_MIN_FRAMES
    max_frames = min(sampling.max_frames if sampling.max_frames is not None else VLLM_MAX_FRAMES, VLLM_MAX_FRAMES)
    return _by_fps(clip.total_frames, source_fps, fps, min_frames, max_frames)


def _processor_picks(clip: ClipFacts, sampling: VideoSampling, cfg: Qwen3VLVideoConfig, source_fps: float,
                     what: str) -> list[int]:
    """``Qwen3VLVideoProcessor.sample_frames`` as vLLM calls it: over the whole clip (its metadata), with
    the request's processor fps or count (a count with fps None, as vLLM passes it), else the processor's
    fps, within the processor's own frame bounds."""
    check_fps_xor_num_frames(sampling.processor_fps, sampling.processor_num_frames, what)
    if sampling.processor_num_frames is not None:
        return linspace_indices(clip.total_frames, sampling.processor_num_frames)
    fps = sampling.processor_fps if sampling.processor_fps is not None else cfg.fps
    return _by_fps(clip.total_frames, source_fps, fps, cfg.min_frames, cfg.max_frames)


def _by_fps(total: int, source_fps: float, fps: float, min_frames: int, max_frames: int) -> list[int]:
    count = int(total / source_fps * fps)
    return linspace_indices(total, min(max(count, min_frames), max_frames, total))


def frame_timestamps(clip: ClipFacts, indices: list[int], config: Qwen3VLVideoConfig | None = None) -> list[float]:
    """The seconds of each temporal patch, as the ``<t seconds>`` markers say them (``Qwen3VLProcessor`` and
    vLLM alike): the indices padded to ``temporal_patch_size`` with the last, each over the source fps (24
    where unknown), the mean of each patch's first and last."""
    tp = (config or Qwen3VLVideoConfig()).temporal_patch_size
    fps = clip.known_fps or ASSUMED_FPS
    times = [i / fps for i in pad_to_multiple(list(indices), tp)]
    return [(times[i] + times[i + tp - 1]) / 2 for i in range(0, len(times), tp)]


def smart_resize(num_frames: int, height: int, width: int, cfg: Qwen3VLVideoConfig, max_pixels: int
                 ) -> tuple[int, int]:
    """Qwen3-VL's video ``smart_resize``: sides multiples of ``factor``, the video's pixels (frames rounded
    to ``temporal_patch_size``) within [min_pixels, max_pixels]; float expressions in the reference's order."""
    tp, factor = cfg.temporal_patch_size, cfg.factor
    if num_frames < tp:
        raise InvalidInput(f"video of {num_frames} frame(s) has fewer than temporal_patch_size {tp}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidInput(f"video aspect ratio {max(height, width) / min(height, width):.1f} is over the limit "
                           f"of {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / tp) * tp
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_geometry(num_frames: int, height: int, width: int, cfg: Qwen3VLVideoConfig
                   ) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """``num_frames`` frames of ``height`` x ``width`` -> (each frame's resized size, the grid in patches)."""
    if num_frames < 1:
        raise InvalidInput("video has no frames to process")
    if cfg.do_resize:
        max_pixels = cfg.max_pixels
        if cfg.cap_pixels_per_frame:
            frame_cap = cfg.max_video_tokens * cfg.factor * cfg.factor
            per_frame = max(min(frame_cap, cfg.max_pixels // num_frames), int(cfg.min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        height, width = smart_resize(num_frames, height, width, cfg, max_pixels)
    return (height, width), qwen2_video.frames_grid(num_frames, height, width, cfg)


def preprocess_video(frames: np.ndarray, config: Qwen3VLVideoConfig | None = None
                     ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Sampled uint8 frames [T, H, W, 3] -> (float32 [t*h*w, patch_dim], (t, h, w)): transformers'
    ``pixel_values_videos`` and ``video_grid_thw`` for them (``Qwen3VLVideoProcessor`` on the CPU)."""
    return qwen2_video.preprocess_video(frames, config or Qwen3VLVideoConfig(), video_geometry)


def video_front(config: Qwen3VLVideoConfig) -> VideoFront:
    """This family's video path bound to ``config`` (the engine's ``ModelFront.video_front``): Qwen2-VL's
    processing with this family's sampling and geometry."""
    return qwen2_video.video_front(config, sample=sample_frame_indices, geometry=video_geometry)


def baseline_settings(tower, image_file: Mapping[str, Any] | None, image) -> Qwen3VLVideoConfig:
    """Without video settings (a preset), ``Qwen3VLVideoProcessor``'s class defaults, which the published
    ``video_preprocessor_config.json`` equals, with the tower's patch geometry: the baseline, the settings
    that keep the namespace. A checkpoint's are read as transformers finds them (``loader.processor_configs``:
    its ``preprocessor_config.json`` where it has no video file)."""
    return Qwen3VLVideoConfig(patch_size=tower.patch_size, temporal_patch_size=tower.temporal_patch_size,
                              merge_size=tower.spatial_merge_size)


def read_settings(file: Mapping[str, Any], image) -> Qwen3VLVideoConfig:
    return Qwen3VLVideoConfig.from_dict(file)


# Qwen2-VL's value table and patch order (models/qwen2_5_vl/video.py) with this family's settings.
VIDEO = FamilyVideo(baseline=baseline_settings, read=read_settings, front=video_front,
                    value_table=qwen2_video.value_table, patchify=qwen2_video.patchify_clip)
