"""Kimi-K2.5 video: frame sampling, the chunks of ``temporal_patch_size`` frames the merger pools
(``spec.frames_per_chunk``), their timestamps, and frames -> patches equal to transformers'
``Kimi_K25VideoProcessor``; ``video_front`` serves them as one clip grid (below).

Sampling (``sample_frame_indices``), by reference:
- ``transformers``: ``Kimi_K25VideoProcessor`` samples with ``BaseVideoProcessor.sample_frames``
  (``default_sample_indices_fn``): by fps (default the processor's, 2) ``max(1, int(total / fps_src *
  fps))`` frames, by count that many; more than the clip's frames is an error (so is fps above the
  source's where it asks for more frames than there are); indices ``arange(n) * total // n``. Asking for a
  count means fps=None in the call (with the class default fps=2 filled in, transformers rejects the pair).
  It has no min/max frame settings: asking for them is an ``InvalidInput``.
- ``vllm``: vLLM 0.33.0 has no Kimi-K2.5 video path of its own: its chat front end splits a video with
  ``split_video_chunks`` where the multimodal processor has one, and ``KimiK25MultiModalProcessor``
  (vllm/model_executor/models/kimi_k25.py) no longer does; earlier vLLM releases delegated it to the
  checkpoint's remote code (``KimiK25VisionProcessor.split_video_chunks``, kimi_k25_vision_processing.py).
  This reference is a transcription of that remote code, not run here (it needs the ``mecord`` decoder):
  ``sample_fps = min(fps, fps_src)``, ``max(round(total * sample_fps / fps_src), 1)`` frames over
  ``linspace(0, total - 1, n)`` rounded. It reads no frame count or bounds: asking for them is an
  ``InvalidInput``. Its pixels (Pillow resize in the remote processor) are not reproduced: processing here
  is transformers' only.

Processing (``preprocess_video``): frames cut into chunks of ``temporal_patch_size`` (4; the last may be
shorter and is not padded), each chunk's frames resized with ``navit_resize`` (the video processor's patch
budget, ``max_patches`` 4096, not the image processor's 16384) by PyTorch's uint8 bicubic antialiased
kernel (torchvision's CPU path), zero-padded bottom/right to a multiple of ``merge_size * patch_size``,
normalized through the torchvision value table and patchified in raster order, each patch (C, P, P). One
grid per chunk: ``(frames in the chunk, h, w)``.

Served (``video_front``, the service-wide convention of ``ModelSpec.frames_per_chunk``): a clip of ``T``
sampled frames is ONE item of grid ``(T, h, w)``, its patches the frames' patches in order (which are the
chunks' patches in order: ``pixel_values_videos`` unchanged), no frame padded. The model cuts that grid
into the chunk grids above (``metadata.clip_chunks``), encodes each chunk as transformers encodes one
chunk grid, and returns the chunks' embeddings concatenated in order: ``ceil(T / temporal_patch_size) * h
* w / merge_unit`` rows, chunk ``c`` at rows ``c * h*w/merge_unit`` onward. The response carries every
used frame's source index (``frame_indices``) and, where the container states its fps, time
(``frame_timestamps_s``). An LLM server gets what ``Kimi_K25Processor`` puts in the prompt from those:
chunk ``c``'s grid is ``(min(tp, T - c*tp), h, w)`` (``tp``: 4, ``temporal_patch_size``) with ``h*w /
merge_unit`` placeholders, and its timestamp is its first frame's, ``frame_timestamps_s[c*tp]``
(``chunk_timestamps``; where the fps is unknown the response has no times and transformers takes
``frame_indices[c*tp] / 24``).

Settings (``checkpoint_video_config``), as ``Kimi_K25VideoProcessor.from_pretrained`` reads them: the
class defaults and the keys of the checkpoint's video file (``processor_config.json``'s
``video_processor``, else ``video_preprocessor_config.json``, else ``preprocessor_config.json``, whose
``max_patches`` then budgets every frame); keys that would make transformers process clips otherwise
(another resample, no sampling, a default frame count, a null step flag) are refused at load. A
``preprocessor_config.json`` of the original remote code is read as that code reads it
(``video_config_for``): its ``media_proc_cfg``'s patch layout, side limit and normalisation, and its
``temporal_merge_kernel_size`` (the chunk length), ``in_patch_limit_each_frame`` (the per-frame patch
budget) and ``sample_fps`` (the default fps).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

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
    PROCESSOR_SAMPLES,
    ClipFacts,
    VideoSampling,
    check_fps_xor_num_frames,
    check_indices,
    describe,
    linspace_indices,
    refuse_all_frames,
)
from ..loader import FromImageFile
from ..video_hooks import FamilyVideo, VideoFront
from .metadata import clip_chunks
from .preprocess import KimiK25PreprocessConfig, geometry

ASSUMED_FPS = 24.0  # transformers' fps for the chunk timestamps of a clip whose fps is unknown


@dataclasses.dataclass(frozen=True)
class KimiK25VideoConfig:
    """``Kimi_K25VideoProcessor``'s settings; defaults are its class defaults."""

    max_patches: int = 4096
    max_side_patches: int = 512  # size.max_height == size.max_width, counted in patches
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 4  # frames per chunk
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    fps: float = 2.0

    def __post_init__(self) -> None:
        settings.check_positive_ints(self, ("max_patches", "max_side_patches", "patch_size", "merge_size",
                                            "temporal_patch_size"))
        settings.check_video_fps(self)
        settings.check_normalization(self)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> KimiK25VideoConfig:
        """From transformers' video processor keys (``size.max_height``, ``max_patches``, ...) over the
        class defaults, as ``Kimi_K25VideoProcessor.from_pretrained`` reads its file."""
        return cls(**_video_kwargs(config))

    def fingerprint(self) -> dict[str, Any]:
        return settings.fingerprint(self)

    def transformers_keys(self) -> dict[str, Any]:
        """These settings in the keys of transformers' ``video_preprocessor_config.json`` (``from_dict``
        reads them back)."""
        fields = self.fingerprint()
        side = fields.pop("max_side_patches")
        return {"video_processor_type": "Kimi_K25VideoProcessor", "size": {"max_height": side, "max_width": side},
                **fields}


def _video_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings that transformers' video processor keys in ``config`` give (keys that do not change
    the pixels ignored, as ``from_pretrained`` ignores unknown ones); an ``InvalidInput`` naming a key
    that would make transformers process clips otherwise than this service does."""
    unsupported = [f"{key}={config[key]!r}" for key, ok in (
        ("resample", lambda v: v == 3),  # PIL's BICUBIC: the only kernel reproduced here
        ("do_sample_frames", lambda v: v is not False),  # every clip is sampled (fps or a frame count)
        ("num_frames", lambda v: v is None),  # a default count: asked per request here
        *((flag, lambda v: v is not None) for flag in ("do_resize", "do_rescale", "do_normalize")),
    ) if key in config and not ok(config[key])]
    if unsupported:
        raise InvalidInput(f"video processor config: {', '.join(unsupported)} is not supported for Kimi-K2.5 "
                           "(transformers would then process clips otherwise than this service)")
    kwargs: dict[str, Any] = {}
    size = config.get("size")
    if size is not None:
        if not isinstance(size, Mapping) or size.get("max_height") is None or \
                size.get("max_height") != size.get("max_width"):
            raise InvalidInput(f"video processor config: size must have equal max_height and max_width, "
                               f"got {size!r}")
        kwargs["max_side_patches"] = int(size["max_height"])
    for field in ("max_patches", "patch_size", "merge_size", "temporal_patch_size"):
        value = config.get(field)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidInput(f"video processor config: {field} must be an integer, got {value!r}")
            kwargs[field] = value
    if config.get("fps") is not None:
        kwargs["fps"] = float(config["fps"])  # 2 and 2.0 alike in the cache namespace
    kwargs |= settings.flag_and_normalization_kwargs(config, ("do_resize", "do_rescale", "do_normalize"))
    return kwargs


# The original remote code's media_proc_cfg keys for video -> the fields they set here.
_MEDIA_PROC_VIDEO_KEYS = (("temporal_merge_kernel_size", "temporal_patch_size"),
                          ("in_patch_limit_each_frame", "max_patches"), ("sample_fps", "fps"))


def video_config_for(preprocessor_config: Mapping[str, Any] | None, image: KimiK25PreprocessConfig
                     ) -> KimiK25VideoConfig:
    """The video settings as the original remote code reads them from ``preprocessor_config.json``'s
    ``media_proc_cfg`` (also the settings of a checkpoint with no processor file at all, and the
    baseline of the cache namespace): ``Kimi_K25VideoProcessor``'s class defaults with the image
    processor's patch layout, side limit and normalisation (``image``), and the video keys of the
    ``media_proc_cfg`` (``temporal_merge_kernel_size``, ``in_patch_limit_each_frame``, ``sample_fps``)."""
    media = (preprocessor_config or {}).get("media_proc_cfg") or {}
    kwargs: dict[str, Any] = {name: getattr(image, name) for name in (
        "max_side_patches", "patch_size", "merge_size", "image_mean", "image_std", "rescale_factor",
        "do_resize", "do_rescale", "do_normalize")}
    for key, field in _MEDIA_PROC_VIDEO_KEYS:
        if media.get(key) is not None:
            kwargs[field] = float(media[key]) if field == "fps" else int(media[key])
    return KimiK25VideoConfig(**kwargs)


def checkpoint_video_config(file: Mapping[str, Any] | None, *, image_file: bool,
                            image: KimiK25PreprocessConfig) -> KimiK25VideoConfig:
    """A checkpoint's video settings from the file ``loader.processor_configs`` found (``image_file``:
    it is ``preprocessor_config.json``, the checkpoint having no video file of its own):
    - a video file, or a ``preprocessor_config.json`` of transformers' keys: the class defaults and that
      file's keys, as ``Kimi_K25VideoProcessor.from_pretrained`` reads it (an image file's
      ``max_patches`` then budgets every frame);
    - a ``preprocessor_config.json`` of the original remote code (a ``media_proc_cfg``): as that code
      reads it (``video_config_for``, from that file's own image settings);
    - no file at all (transformers would not load a video processor): ``video_config_for(None, image)``."""
    if file is None:
        return video_config_for(None, image)
    if image_file and file.get("media_proc_cfg"):
        return video_config_for(file, KimiK25PreprocessConfig.from_dict(file))
    return KimiK25VideoConfig.from_dict(file)


def sample_frame_indices(clip: ClipFacts, sampling: VideoSampling,
                         config: KimiK25VideoConfig | None = None) -> list[int]:
    """The clip's frame indices the reference ``sampling.reference`` feeds Kimi-K2.5, in order; an
    ``InvalidInput`` naming the setting where that reference fails or has no such setting."""
    cfg = config or KimiK25VideoConfig()
    what = describe(sampling, clip)
    refuse_all_frames(sampling, clip, "Kimi-K2.5's video processor always samples (fps or a frame count)")
    total, source_fps = clip.total_frames, clip.known_fps
    # PROCESSOR_SAMPLES: vLLM has no Kimi-K2.5 video path, so no processor call to give them to.
    unsupported = ["min_frames", "max_frames", "min_pixels", "max_pixels", "cap_pixels_per_frame",
                   *PROCESSOR_SAMPLES] + (["num_frames"] if sampling.reference == "vllm" else [])
    asked = [name for name in unsupported if getattr(sampling, name) is not None]
    if asked:
        raise InvalidInput(f"{what}: Kimi-K2.5's {sampling.reference} reference has no {', '.join(asked)} setting")
    if sampling.reference == "vllm":
        if source_fps is None:
            raise InvalidInput(f"{what}: sampling by fps needs the clip's fps, which the container does not give")
        sample_fps = min(sampling.fps if sampling.fps is not None else cfg.fps, source_fps)
        return check_indices(linspace_indices(total, max(round(total * sample_fps / source_fps), 1)), clip, what)
    check_fps_xor_num_frames(sampling.fps, sampling.num_frames, what)  # Kimi_K25VideoProcessor refuses both
    count = sampling.num_frames
    if count is None:
        if source_fps is None:
            raise InvalidInput(f"{what}: sampling by fps needs the clip's fps, which the container does not give; "
                               "ask for num_frames")
        count = max(1, int(total / source_fps * (sampling.fps if sampling.fps is not None else cfg.fps)))
    if count > total:
        raise InvalidInput(f"{what}: asks for {count} frames, more than the clip's {total} (the reference "
                           "refuses); lower fps or num_frames")
    return check_indices((np.arange(count, dtype=int) * total // count).tolist(), clip, what)  # host: numpy indices


def chunk_timestamps(clip: ClipFacts, indices: list[int], config: KimiK25VideoConfig | None = None) -> list[float]:
    """Each chunk's time in seconds, as transformers' ``Kimi_K25Processor`` prints it before the chunk:
    its first frame's index over the source fps (24 where unknown)."""
    tp = (config or KimiK25VideoConfig()).temporal_patch_size
    fps = clip.known_fps or ASSUMED_FPS
    return [indices[i] / fps for i in range(0, len(indices), tp)]


def timestamp_text(seconds: float) -> str:
    """``HH:MM:SS.mmm`` as ``Kimi_K25Processor`` writes a chunk's time into the prompt."""
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}"


def video_geometry(height: int, width: int, cfg: KimiK25VideoConfig
                   ) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """A frame of ``height`` x ``width`` -> (its resized size, its padded size, (h, w) in patches): the
    image geometry with the video processor's settings."""
    resize_to, pad_to, (_, gh, gw) = geometry(height, width, cfg, what="video frame")
    return resize_to, pad_to, (gh, gw)


def chunk_grids(num_frames: int, height: int, width: int, config: KimiK25VideoConfig | None = None
                ) -> list[tuple[int, int, int]]:
    """One (frames, h, w) grid per chunk of ``temporal_patch_size`` frames (the last may be shorter)."""
    cfg = config or KimiK25VideoConfig()
    _, _, (gh, gw) = video_geometry(height, width, cfg)
    return clip_chunks((num_frames, gh, gw), cfg.temporal_patch_size)


def value_table(cfg: KimiK25VideoConfig) -> torch.Tensor:
    """float32 [3, 256]: rescale and normalize of each byte as the torchvision-backed processor computes it."""
    return torchvision_value_table(cfg.image_mean, cfg.image_std, cfg.rescale_factor, cfg.do_rescale,
                                   cfg.do_normalize)


def preprocess_video(frames: np.ndarray, config: KimiK25VideoConfig | None = None
                     ) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Sampled uint8 frames [T, H, W, 3] -> (float32 [sum of t*h*w, 3*P*P], one grid per chunk):
    transformers' ``pixel_values_videos`` (flattened per patch) and ``video_grid_thw``."""
    cfg = config or KimiK25VideoConfig()
    check_frames(frames)
    resize_to, (pad_h, pad_w), (gh, gw) = video_geometry(frames.shape[1], frames.shape[2], cfg)
    table = value_table(cfg)
    p = cfg.patch_size
    patches = []
    for frame in host_tensor(frames).permute(0, 3, 1, 2):
        chw = resize_uint8(frame.contiguous(), resize_to) if cfg.do_resize else frame
        chw = F.pad(chw, (0, pad_w - chw.shape[2], 0, pad_h - chw.shape[1]))
        values = apply_table(chw, table)
        patches.append(values.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3 * p * p))
    return torch.cat(patches).numpy(), chunk_grids(*frames.shape[:3], cfg)  # host: CPU preprocessing, a CPU tensor


def video_front(config: KimiK25VideoConfig) -> VideoFront:
    """This family's video path bound to ``config`` (the engine's ``ModelFront.video_front``): the
    sampling above, ``resize_clip`` and ``process_clip``; the response's timestamps are each used
    frame's source time (a chunk's timestamp is its first frame's, see the module docstring)."""
    return VideoFront(sample=functools.partial(sample_frame_indices, config=config),
                      resize=functools.partial(resize_clip, config=config),
                      process=functools.partial(process_clip, config=config), pixel_bounds=False,
                      processor_level=False)


def resize_clip(frames: np.ndarray, indices: list[int], sampling: VideoSampling, mode: str, *,
                config: KimiK25VideoConfig) -> tuple[DecodedClip, list[int]]:
    """Sampled frames -> (the clip's CPU half for the device, the indices as given): the frames as uint8
    with their size after the resize, the padded size and ONE grid ``(T, h, w)`` as ``process_clip``
    gives; resized here only in pil mode (the reference's CPU kernel: bit for bit ``preprocess_video``),
    padded, normalized and patchified on the device (the model's ``_patchify_clip``)."""
    check_frames(frames)
    resize_to, pad_to, (gh, gw) = video_geometry(frames.shape[1], frames.shape[2], config)
    if not config.do_resize:
        resize_to = tuple(frames.shape[1:3])
    check_clip_fits(frames.shape[0], tuple(resize_to), (int(frames.shape[0]), gh, gw))  # before the resize
    if mode != "torch" and tuple(frames.shape[1:3]) != tuple(resize_to):
        frames = resize_frames_on_host(frames, resize_to)
    clip = DecodedClip(np.ascontiguousarray(frames), tuple(resize_to), (int(frames.shape[0]), gh, gw), tuple(pad_to))
    return clip, [int(i) for i in indices]


def patchify_clip(frames: torch.Tensor, config: KimiK25VideoConfig) -> torch.Tensor:
    """[T, C, H, W] normalized, padded frames -> [T*gh*gw, C*P*P]: each frame's patches in raster order,
    frame after frame (``pixel_values_videos`` flattened per patch)."""
    count, channels, height, width = frames.shape
    p = config.patch_size
    gh, gw = height // p, width // p
    patches = frames.reshape(count, channels, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(count * gh * gw, channels * p * p)


def process_clip(frames: np.ndarray, indices: list[int], sampling: VideoSampling, *, config: KimiK25VideoConfig
                 ) -> tuple[np.ndarray, tuple[int, int, int], list[int]]:
    """Sampled frames -> (pixel values: ``pixel_values_videos`` of the whole clip, ONE grid ``(T, h, w)``
    for it, the indices as given: nothing padded). The grid stands for ``chunk_grids``' chunk grids
    (``ModelSpec.frames_per_chunk``); ``sampling`` has nothing more for processing (its pixel bounds,
    which this processor lacks, are refused when sampling)."""
    pixels, grids = preprocess_video(frames, config)
    _, gh, gw = grids[0]
    return pixels, (int(frames.shape[0]), gh, gw), [int(i) for i in indices]


def baseline_settings(tower, image_file: Mapping[str, Any] | None, image: KimiK25PreprocessConfig
                      ) -> KimiK25VideoConfig:
    """The video processor's defaults with the image layout (``video_config_for(None, image)``): a
    checkpoint with these keeps its namespace, other video settings add theirs."""
    return video_config_for(None, image)


def read_settings(file: Mapping[str, Any], image: KimiK25PreprocessConfig) -> KimiK25VideoConfig:
    """``checkpoint_video_config`` of the file found (the image processor's where the checkpoint has no
    video file: ``loader.FromImageFile``)."""
    return checkpoint_video_config(file, image_file=isinstance(file, FromImageFile), image=image)


def check_layouts(tower, image: KimiK25PreprocessConfig, video: KimiK25VideoConfig, model_id: str) -> None:
    """Patches other than the tower's would fail every request later: refused at load, naming the file;
    so are chunks longer than the tower's temporal position embedding."""
    for what, processor in (("preprocessor", image), ("video processor", video)):
        for name, size in (("patch_size", tower.patch_size), ("merge_size", tower.merge_kernel_size[0])):
            if getattr(processor, name) != size:
                raise InvalidInput(f"{model_id!r}: the {what} config's {name} {getattr(processor, name)} "
                                   f"differs from the vision_config's {size}")
    chunk = video.temporal_patch_size
    if chunk > tower.pos_emb_time:
        raise InvalidInput(f"kimi_k25: the video processor's chunks of {chunk} frames (temporal_patch_size) "
                           f"exceed the {tower.pos_emb_time} frames of the tower's temporal position embedding "
                           "(pos_emb_time)")


VIDEO = FamilyVideo(baseline=baseline_settings, read=read_settings, check=check_layouts, front=video_front,
                    value_table=value_table, patchify=patchify_clip)
