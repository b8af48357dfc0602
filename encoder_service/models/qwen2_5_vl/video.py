"""Qwen2-VL / Qwen2.5-VL video: frame sampling equal to the named reference, and frames -> patches equal
to transformers' ``Qwen2VLVideoProcessor`` (the video processor ``Qwen2_5_VLProcessor`` loads; Qwen2.5-VL
has none of its own). Qwen3-VL's video (models/qwen3_vl/video.py) reuses the patch layout here.

Sampling (``sample_frame_indices``), by reference:
- ``transformers``: what ``Qwen2VLVideoProcessor`` does with the request's settings. With none of fps,
  num_frames, min_frames, max_frames, its default: ``do_sample_frames`` is off (the class default, and
  the checkpoint's unless it sets it), so every frame is taken. ``all_frames`` asks for that explicitly.
  With fps or num_frames (or a checkpoint that samples), ``sample_frames`` as called with
  ``do_sample_frames=True``; min_frames / max_frames alone sample nothing, as in the processor: a frame count (the
  request's, else the checkpoint's ``num_frames``) is rounded to a multiple of ``temporal_patch_size``
  (Python's half-to-even ``round``: 1 -> 0, which the reference divides by, 3 -> 4, 5 -> 4); by fps (the
  request's, else the checkpoint's ``fps``), ``total / fps_src * fps`` is clamped to ``[min_frames,
  max_frames]`` and the clip, then floored to that multiple; with neither, every frame. The indices are
  the float32 ``torch.arange(0, total, total / n)``, which can end one past the clip (41 frames at 8 fps,
  fps=3: index 41; the reference raises IndexError, here ``InvalidInput``). A long clip taken whole is
  bounded by the server's video limits (``--max-video-frames``), which refuse it by name.
- ``vllm``: vLLM 0.33.0's ``Qwen2VLVideoBackend`` (what its ``Qwen2VLVideoProcessor`` maps to), then the
  HF processor, which does not sample again (``do_sample_frames`` stays False for Qwen2.5-VL). The loader
  ignores a requested frame count, caps fps at 30, uses its own ``temporal_patch_size`` default 2 and
  ``max_frames`` <= 768, rejects an unknown source fps, and clamps the index past the end. The request's
  processor-level settings (vLLM's ``mm_processor_kwargs``: ``processor_fps``, ``processor_num_frames``,
  ``processor_do_sample_frames``) are that call's: the processor samples only with
  ``processor_do_sample_frames`` on (or a checkpoint that samples), then as transformers does with that
  fps or count over the whole clip, its picks indexing the frames the loader kept (past them: vLLM's
  IndexError, here ``InvalidInput``); a processor fps alone samples nothing, as in vLLM.

Processing (``preprocess_video``): transformers has no PIL video processor, so there is one path: the
torchvision one. Each frame is resized with ``F.interpolate(uint8, bicubic, antialias=True)``, PyTorch's
uint8 kernel on the CPU (what ``tvF.resize`` runs there, as the image ``torch`` mode does:
preprocess/staged.py), rescaled and normalized through the torchvision value table, padded to a multiple
of ``temporal_patch_size`` by repeating the last frame, and patchified as the processor does.
``cap_pixels_per_frame`` (qwen-vl-utils' per-frame budget) is the request's where it sets it, else the
checkpoint's, else False: what transformers 5.24 does when it is unset (with a warning that the default
will change) and what vLLM 0.33.0 gets; the per-frame pixel bounds alone apply then.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ...errors import InvalidInput
from ...preprocess import settings
from ...preprocess.staged import (
    DecodedClip,
    apply_table,
    check_clip_fits,
    check_frames,
    host_tensor,
    resize_frames_on_host,
    resize_uint8,
    torchvision_value_table,
)
from ...preprocess.video_sampling import (
    ClipFacts,
    VideoSampling,
    arange_indices,
    check_fps_xor_num_frames,
    check_indices,
    describe,
    every_frame,
    pad_to_multiple,
    pick_loaded,
    processor_samples,
    refuse_all_frames,
)
from ..video_hooks import FamilyVideo, VideoFront
from .preprocess import _CLIP_MEAN, _CLIP_STD, PatchLayout, smart_resize

ASSUMED_FPS = 24.0  # what the references assume for a clip of unknown fps (VideoMetadata.sampled_fps)
# vLLM 0.33.0's Qwen2VLVideoBackend: its fps cap, max_frames cap, and its defaults (load_bytes' fps=2,
# the sampling kwargs' temporal_patch_size=2, min_frames=4).
VLLM_MAX_FPS = 30
VLLM_MAX_FRAMES = 768
VLLM_DEFAULT_FPS = 2.0
VLLM_TEMPORAL_PATCH_SIZE = 2
VLLM_MIN_FRAMES = 4


@dataclasses.dataclass(frozen=True)
class Qwen2VLVideoConfig(PatchLayout):
    """``Qwen2VLVideoProcessor``'s settings; defaults are its class defaults. ``min_pixels`` /
    ``max_pixels`` bound each frame (``size.shortest_edge`` / ``size.longest_edge``)."""

    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 28 * 28 * 768
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False  # transformers 5.24's unset default: see the module docstring
    max_video_tokens: int = 128000
    # transformers 5.24's class defaults: no sampling unless asked (backward compatibility, its comment
    # says), and no default fps or frame count when it samples: every frame.
    do_sample_frames: bool = False
    fps: float | None = None
    num_frames: int | None = None

    def __post_init__(self) -> None:
        check_video_config(self)
        settings.check_normalization(self)
        if self.fps is not None:
            settings.check_video_fps(self)
        if self.num_frames is not None:
            settings.check_positive_ints(self, ("num_frames",))

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Qwen2VLVideoConfig:
        """As ``Qwen2VLVideoProcessor(**config)`` reads it (``video_preprocessor_config.json``, or
        ``preprocessor_config.json`` where a checkpoint has no video file, as transformers falls back):
        ``size.shortest_edge`` / ``longest_edge``, overridden by top-level ``min_pixels`` / ``max_pixels``."""
        kwargs = video_config_kwargs(config, ("min_frames", "max_frames", "max_video_tokens", "fps", "num_frames"),
                                     top_level_pixels=True)
        if config.get("do_sample_frames") is not None:
            kwargs["do_sample_frames"] = bool(config["do_sample_frames"])
        return cls(**kwargs)

    def for_request(self, sampling: VideoSampling) -> Qwen2VLVideoConfig:
        """With the request's per-frame pixel bounds (a call's ``size``) and per-frame cap, where it gives them."""
        bounds = {k: v for k, v in (("min_pixels", sampling.min_pixels), ("max_pixels", sampling.max_pixels),
                                    ("cap_pixels_per_frame", sampling.cap_pixels_per_frame)) if v is not None}
        return dataclasses.replace(self, **bounds) if bounds else self


def check_video_config(cfg: Any) -> None:
    """The checks the Qwen video processors' settings share (Qwen3-VL's ``Qwen3VLVideoConfig`` too): counts
    and bounds positive. Not their order: transformers' processors take ``min_pixels`` above
    ``max_pixels`` (a request giving only a ``max_pixels`` under the config's ``min_pixels``: its
    ``smart_resize`` shrinks to ``max_pixels``), so the service does too (``for_request``)."""
    settings.check_positive_ints(cfg, ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
                                       "min_frames", "max_frames", "max_video_tokens"))


def video_config_kwargs(config: Mapping[str, Any], fields: tuple[str, ...], *, top_level_pixels: bool
                        ) -> dict[str, Any]:
    """A Qwen video processor config's keys as its settings' fields: ``size.shortest_edge`` /
    ``longest_edge`` as ``min_pixels`` / ``max_pixels`` (overridden by top-level keys where the
    processor reads those: ``top_level_pixels``), the patch layout and ``fields`` as given,
    ``cap_pixels_per_frame``, and the flags and normalisation."""
    kwargs: dict[str, Any] = {}
    size = config.get("size") or {}
    if not isinstance(size, Mapping):
        raise InvalidInput(f"video processor config: size must be a mapping, got {size!r}")
    for key, field in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
        if size.get(key) is not None:
            kwargs[field] = size[key]
        if top_level_pixels and config.get(field) is not None:
            kwargs[field] = config[field]
    for field in ("patch_size", "temporal_patch_size", "merge_size", *fields):
        if config.get(field) is not None:
            kwargs[field] = config[field]
    if config.get("cap_pixels_per_frame") is not None:
        kwargs["cap_pixels_per_frame"] = bool(config["cap_pixels_per_frame"])
    return kwargs | settings.flag_and_normalization_kwargs(config, ("do_resize", "do_rescale", "do_normalize"))


def sample_frame_indices(clip: ClipFacts, sampling: VideoSampling, config: Qwen2VLVideoConfig | None = None,
                         frames_given: bool = False) -> list[int]:
    """The clip's frame indices the reference ``sampling.reference`` feeds Qwen2.5-VL, in order (they may
    repeat); an ``InvalidInput`` naming the setting where that reference fails. ``frames_given``: the
    clip came as its frames, which vLLM loads as they are (no loader sampling)."""
    cfg = config or Qwen2VLVideoConfig()
    what = describe(sampling, clip)
    if sampling.reference == "vllm":
        refuse_all_frames(sampling, clip, "vLLM's Qwen2-VL video loader always samples by fps")
        loaded = every_frame(clip) if frames_given else _vllm_indices(clip, sampling, what)
        # Then its HF-processor call, which samples again only where its do_sample_frames is on: the
        # request's (mm_processor_kwargs), else the processor's own (vLLM drops the loader's metadata flag
        # for Qwen2.5-VL), with the request's processor fps or count, over the whole clip.
        if not processor_samples(sampling, cfg.do_sample_frames):
            return loaded
        asked = VideoSampling(fps=sampling.processor_fps, num_frames=sampling.processor_num_frames)
        if asked.fps is None and asked.num_frames is None and cfg.fps is None and cfg.num_frames is None:
            # Qwen2VLVideoProcessor.sample_frames then compares num_frames None with the clip (TypeError)
            raise InvalidInput(f"{what}: vLLM's processor samples with neither an fps nor a frame count (the "
                               "reference fails there); give processor_fps or processor_num_frames")
        picks = _transformers_indices(clip, asked, dataclasses.replace(cfg, do_sample_frames=True), what)
        return pick_loaded(loaded, picks, what)
    return _transformers_indices(clip, sampling, cfg, what)


def _transformers_indices(clip: ClipFacts, sampling: VideoSampling, cfg: Qwen2VLVideoConfig, what: str) -> list[int]:
    check_fps_xor_num_frames(sampling.fps, sampling.num_frames, what)  # Qwen2VLVideoProcessor refuses both
    # The processor samples where the checkpoint says so or the request names a rate or a count; frame
    # bounds alone sample nothing (with do_sample_frames off the processor does not read them).
    sample = not sampling.all_frames and (cfg.do_sample_frames or sampling.fps is not None
                                          or sampling.num_frames is not None)
    num_frames = sampling.num_frames if sampling.num_frames is not None else cfg.num_frames
    fps = sampling.fps if sampling.fps is not None else cfg.fps
    if not sample or (num_frames is None and fps is None):
        return every_frame(clip)
    total, tp = clip.total_frames, cfg.temporal_patch_size
    if num_frames is not None:
        count = round(num_frames / tp) * tp
        if count == 0:
            raise InvalidInput(f"{what}: num_frames={num_frames} rounds to 0 at temporal_patch_size {tp} "
                               "(the reference divides by zero); ask for at least "
                               f"{tp // 2 + 1 if tp > 1 else 1} frames")
    else:
        min_frames = sampling.min_frames if sampling.min_frames is not None else cfg.min_frames
        max_frames = sampling.max_frames if sampling.max_frames is not None else cfg.max_frames
        count = _fps_count(clip, fps, tp, min_frames, max_frames, what)
    if count > total:
        raise InvalidInput(f"{what}: num_frames {count} exceeds the clip's {total} frames")
    return check_indices(arange_indices(total, count), clip, what)


def _fps_count(clip: ClipFacts, fps: float, tp: int, min_frames: int, max_frames: int, what: str) -> int:
    """The frame count of fps sampling, as both references compute it (a multiple of ``tp``)."""
    source_fps = clip.known_fps
    if source_fps is None:
        raise InvalidInput(f"{what}: sampling by fps needs the clip's fps, which the container does not give "
                           "(the reference cannot sample it)")
    total = clip.total_frames
    max_frames = math.floor(min(max_frames, total) / tp) * tp
    count = total / source_fps * fps
    count = min(max(count, min_frames), max_frames, total)
    count = math.floor(count / tp) * tp
    if count == 0:
        raise InvalidInput(f"{what}: the clip has fewer frames than temporal_patch_size {tp} or max_frames is "
                           f"under it, so fps sampling picks 0 frames (the reference divides by zero)")
    return count


def _vllm_indices(clip: ClipFacts, sampling: VideoSampling, what: str) -> list[int]:
    # Qwen2VLVideoBackend.compute_frames_index_to_sample: num_frames is not read.
    fps = min(sampling.fps if sampling.fps is not None else VLLM_DEFAULT_FPS, VLLM_MAX_FPS)
    min_frames = sampling.min_frames if sampling.min_frames is not None else VLLM_MIN_FRAMES
    max_frames = min(sampling.max_frames if sampling.max_frames is not None else VLLM_MAX_FRAMES, VLLM_MAX_FRAMES)
    count = _fps_count(clip, fps, VLLM_TEMPORAL_PATCH_SIZE, min_frames, max_frames, what)
    return [min(i, clip.total_frames - 1) for i in arange_indices(clip.total_frames, count)]


def second_per_grid_t(clip: ClipFacts, indices: list[int], config: Qwen2VLVideoConfig | None = None) -> float:
    """``second_per_grid_ts`` of ``Qwen2_5_VLProcessor`` for this sampling: ``temporal_patch_size`` over the
    sampled fps (``len(indices) / total * fps``; 24 where the clip's fps is unknown)."""
    tp = (config or Qwen2VLVideoConfig()).temporal_patch_size
    fps = clip.known_fps
    sampled_fps = ASSUMED_FPS if fps is None else len(indices) / clip.total_frames * fps
    return tp / sampled_fps


def video_geometry(num_frames: int, height: int, width: int, cfg: Qwen2VLVideoConfig
                   ) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """``num_frames`` frames of ``height`` x ``width`` -> (each frame's resized size, the grid in patches)."""
    if num_frames < 1:
        raise InvalidInput("video has no frames to process")
    if cfg.do_resize:
        max_pixels = cfg.max_pixels
        if cfg.cap_pixels_per_frame:
            total_pixels = int(cfg.max_video_tokens * cfg.factor * cfg.factor * 0.9)
            max_pixels = max(min(max_pixels, total_pixels * cfg.temporal_patch_size // num_frames),
                             int(cfg.min_pixels * 1.05))
        height, width = smart_resize(height, width, cfg.factor, cfg.min_pixels, max_pixels)
    return (height, width), frames_grid(num_frames, height, width, cfg)


def frames_grid(num_frames: int, height: int, width: int, cfg: PatchLayout) -> tuple[int, int, int]:
    """The grid in patches of ``num_frames`` frames of their resized ``height`` x ``width`` (the frames padded
    to whole temporal patches); Qwen3-VL's geometry ends with it too."""
    if height % cfg.factor or width % cfg.factor:
        raise InvalidInput(f"video frames of {width}x{height} are not a multiple of {cfg.factor} pixels per side "
                           "(do_resize is off)")
    tp = cfg.temporal_patch_size
    return (num_frames + -num_frames % tp) // tp, height // cfg.patch_size, width // cfg.patch_size


def frames_to_values(frames: np.ndarray, size: tuple[int, int], table: torch.Tensor) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> float32 [T, 3, h, w]: each frame resized (PyTorch's uint8 bicubic antialiased
    kernel, as torchvision on the CPU) to ``size``, then through the per-channel value table."""
    check_frames(frames)
    video = host_tensor(frames).permute(0, 3, 1, 2)
    return torch.stack([apply_table(resize_uint8(frame.contiguous(), size), table) for frame in video])


def patchify_clip(frames: torch.Tensor, config: Qwen2VLVideoConfig) -> torch.Tensor:
    """``patchify_video`` with ``config``'s patch layout (Qwen3-VL's settings have the same fields)."""
    return patchify_video(frames, config.patch_size, config.merge_size, config.temporal_patch_size)


def patchify_video(x: torch.Tensor, patch: int, merge: int, tp: int) -> torch.Tensor:
    """[T, C, H, W] -> [t*h*w, C*tp*P*P] in ``Qwen2VLVideoProcessor.patchify``'s order, the frame count
    first padded to a multiple of ``tp`` with copies of the last frame. Rows: temporal patch, then merge
    window (row-major), then the window's patches row-major; columns: channel, frame, patch row, column."""
    if pad := -x.shape[0] % tp:
        x = torch.cat((x, x[-1:].expand(pad, -1, -1, -1)))
    frames, channels, height, width = x.shape
    gt, gh, gw = frames // tp, height // patch, width // patch
    windows = x.reshape(gt, tp, channels, gh // merge, merge, patch, gw // merge, merge, patch)
    return windows.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gt * gh * gw, channels * tp * patch * patch)


def value_table(cfg: Qwen2VLVideoConfig) -> torch.Tensor:
    """float32 [3, 256]: rescale and normalize of each byte as the torchvision-backed processor computes it."""
    return torchvision_value_table(cfg.image_mean, cfg.image_std, cfg.rescale_factor, cfg.do_rescale,
                                   cfg.do_normalize)


def preprocess_video(frames: np.ndarray, config: Qwen2VLVideoConfig | None = None, geometry=None
                     ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Sampled uint8 frames [T, H, W, 3] -> (float32 [t*h*w, patch_dim], (t, h, w)): transformers'
    ``pixel_values_videos`` and ``video_grid_thw`` for them (``Qwen2VLVideoProcessor`` on the CPU).
    ``geometry``: the family's ``video_geometry`` (Qwen3-VL's bounds the whole video; this one's, each frame)."""
    cfg = config or Qwen2VLVideoConfig()
    check_frames(frames)
    size, grid = (geometry or video_geometry)(frames.shape[0], frames.shape[1], frames.shape[2], cfg)
    values = frames_to_values(frames, size, value_table(cfg))
    patches = patchify_video(values, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    return patches.numpy(), grid  # host: CPU preprocessing, a CPU tensor


def video_front(config: Qwen2VLVideoConfig, sample=sample_frame_indices, geometry=video_geometry) -> VideoFront:
    """This family's video path bound to ``config`` (the engine's ``ModelFront.video_front``); Qwen3-VL's
    with its own ``sample`` and ``geometry``, the patch layout being this one."""
    return VideoFront(sample=functools.partial(sample, config=config),
                      resize=functools.partial(resize_clip, config=config, geometry=geometry),
                      process=functools.partial(process_clip, config=config, geometry=geometry))


def resize_clip(frames: np.ndarray, indices: list[int], sampling: VideoSampling, mode: str, *, config, geometry
                ) -> tuple[DecodedClip, list[int]]:
    """Sampled frames -> (the clip's CPU half for the device, the indices used), with the request's pixel
    bounds: the frames as uint8 with their target size and grid, resized here only in pil mode (with the
    reference's CPU kernel: bit-exact with ``preprocess_video``); the device does the rest (the model's
    ``_patchify_clip``). ``geometry`` is the family's ``video_geometry``."""
    cfg = config.for_request(sampling)
    check_frames(frames)
    size, grid = geometry(frames.shape[0], frames.shape[1], frames.shape[2], cfg)
    check_clip_fits(frames.shape[0], size, grid)  # before the resize takes the memory
    if mode != "torch" and tuple(frames.shape[1:3]) != tuple(size):
        frames = resize_frames_on_host(frames, size)
    return DecodedClip(np.ascontiguousarray(frames), tuple(size), grid), pad_to_multiple(list(indices),
                                                                                       cfg.temporal_patch_size)


def process_clip(frames: np.ndarray, indices: list[int], sampling: VideoSampling, *, config: Qwen2VLVideoConfig,
                 geometry=video_geometry) -> tuple[np.ndarray, tuple[int, int, int], list[int]]:
    """Sampled frames -> (pixel values, grid, the indices used: padded to the temporal patch size with
    the last, as ``preprocess_video`` pads the frames), with the request's pixel bounds."""
    cfg = config.for_request(sampling)
    pixels, grid = preprocess_video(frames, cfg, geometry)
    return pixels, grid, pad_to_multiple(list(indices), cfg.temporal_patch_size)


def baseline_settings(tower, image_file: Mapping[str, Any] | None, image) -> Qwen2VLVideoConfig:
    """Qwen2.5-VL checkpoints publish no video processor config: transformers' ``Qwen2VLVideoProcessor``
    then reads ``preprocessor_config.json``, so its pixel bounds bound each frame. Those settings are the
    baseline: a checkpoint without video settings of its own keeps its namespace."""
    return Qwen2VLVideoConfig.from_dict(image_file or {})


def read_settings(file: Mapping[str, Any], image) -> Qwen2VLVideoConfig:
    """A checkpoint's own video settings (``processor_config.json``'s ``video_processor`` or
    ``video_preprocessor_config.json``), or its image file's where it has none."""
    return Qwen2VLVideoConfig.from_dict(file)


VIDEO = FamilyVideo(baseline=baseline_settings, read=read_settings, front=video_front, value_table=value_table,
                    patchify=patchify_clip)
