"""Decoder names -> what each one is, as attention backends (attention/registry.py) and fused operations'
providers (ops/registry.py) are: the one place that knows what ``--decode`` and ``--video-decode`` may
name and what choosing each means. Adding a decoder is its module plus one entry here; the model
(models/base.py, models/video_hooks.py), the loader, the video pool and the config ask this table
instead of comparing names.

Nothing heavy is imported here: the config imports this module for its choices, and every video
decoder process imports it. A decoder's own libraries (torchvision for nvJPEG, PyNvVideoCodec for
NVDEC) are imported only when it is asked whether it can run, or when it decodes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import BackendUnavailable, InvalidInput


@dataclass(frozen=True)
class ImageDecoder:
    """An image decoder (``--decode``)."""

    name: str
    # The first entry is the default, whose pixels the cache namespace was made for: only another one
    # adds itself to the namespace (models/base.py), so the default's namespaces stay what they were.
    default: bool
    # The preprocess mode it needs (None: any), refused at load otherwise.
    needs_preprocess: str | None
    # Whether the CPU half reads only a JPEG's header and the device decodes it (preprocess/nvjpeg.py):
    # the front end's decoder is wrapped, and the warm-up's second image is a JPEG.
    on_device: bool
    # "module:function" (device) -> None, raising ``BackendUnavailable`` where it cannot run; None: it
    # runs anywhere. A name, looked up when asked, so that a test's stand-in put there is the one asked.
    check: str | None = None

    def unavailable_reason(self, device) -> str | None:
        """Why it cannot run with a model on ``device``; None where it can."""
        if self.check is None:
            return None
        try:
            _resolve(self.check)(device)
        except BackendUnavailable as exc:
            return exc.message
        return None

    def require(self, device, preprocess_mode: str) -> None:
        """Raises, saying why, where a model on ``device`` preprocessing in ``preprocess_mode`` cannot use it:
        InvalidInput for the mode (checked first), BackendUnavailable for the device or a missing library."""
        if self.needs_preprocess is not None and preprocess_mode != self.needs_preprocess:
            raise InvalidInput(f"decode {self.name} needs preprocess {self.needs_preprocess} (the resize runs on the "
                               f"device, after the decode); this model preprocesses in {preprocess_mode} mode")
        if (reason := self.unavailable_reason(device)) is not None:
            raise BackendUnavailable(reason)

    def front(self, decoder):
        """The front end's CPU half around the family's ``decoder`` (models/base.py ``Decoder``)."""
        if not self.on_device:
            return decoder
        from . import nvjpeg  # torch, not torchvision: the device decode imports that when it runs

        return nvjpeg.NvjpegDecoder(decoder, decoder.geometry, decoder.config)


@dataclass(frozen=True)
class VideoDecoder:
    """A clip decoder (``--video-decode``): it decodes the sampled frames in the video decoder processes
    (video_pool.py), after PyAV has probed, checked and counted the clip."""

    name: str
    default: bool  # as ``ImageDecoder.default``: only another one adds itself to the cache namespace
    # Whether its decoder processes each run on a GPU (their index: ``gpu``), spread over the node's.
    needs_gpu: bool
    # "module:function" (data, indices, facts, header, limits, deadline, gpu) -> uint8 [N, H, W, 3]
    frames: str
    # "module:function" () -> bool: whether its library loads here; None: always.
    available: str | None = None
    # What it needs, for the error where ``available`` says no.
    library: str = ""

    @property
    def bounds_child_memory(self) -> bool:
        """Whether its decoder processes may hold an RLIMIT_DATA: not on a GPU, where the CUDA driver's own
        allocations are not ours to bound."""
        return not self.needs_gpu

    def unavailable_reason(self, device) -> str | None:
        """Why it cannot run with a model on ``device``; None where it can."""
        if self.needs_gpu and device.type != "cuda":
            return f"video decode {self.name} needs a CUDA device; this model runs on {device}"
        if self.available is not None and not _resolve(self.available)():
            return f"video decode {self.name} needs {self.library}"
        return None

    def require(self, device) -> None:
        """Raises InvalidInput, saying why, where a model on ``device`` cannot use it."""
        if (reason := self.unavailable_reason(device)) is not None:
            raise InvalidInput(reason)

    def decode(self, data: bytes, indices: list[int], facts, header: dict, limits, deadline: float,
               gpu: int | None):
        return _resolve(self.frames)(data, indices, facts, header, limits, deadline, gpu)


IMAGE_DECODERS: dict[str, ImageDecoder] = {d.name: d for d in (
    ImageDecoder("pillow", default=True, needs_preprocess=None, on_device=False),
    ImageDecoder("nvjpeg", default=False, needs_preprocess="torch", on_device=True,
                 check="encoder_service.preprocess.nvjpeg:check_available"),
)}
VIDEO_DECODERS: dict[str, VideoDecoder] = {d.name: d for d in (
    VideoDecoder("pyav", default=True, needs_gpu=False,
                 frames="encoder_service.preprocess.video_decode:pyav_frames"),
    VideoDecoder("nvdec", default=False, needs_gpu=True,
                 frames="encoder_service.preprocess.video_decode:nvdec_frames",
                 available="encoder_service.preprocess.video_nvdec:available",
                 library="NVIDIA's PyNvVideoCodec (pip install PyNvVideoCodec)"),
)}
IMAGE_DEFAULT = next(name for name, d in IMAGE_DECODERS.items() if d.default)
VIDEO_DEFAULT = next(name for name, d in VIDEO_DECODERS.items() if d.default)


def image_decoder(name: str) -> ImageDecoder:
    """InvalidInput for a name not in the table, listing the valid ones."""
    return _lookup(IMAGE_DECODERS, name, "decode")


def video_decoder(name: str) -> VideoDecoder:
    """InvalidInput for a name not in the table, listing the valid ones."""
    return _lookup(VIDEO_DECODERS, name, "video decode")


def clip_decoder(gpu: int | None) -> VideoDecoder:
    """The decoder a video decoder process runs: the one on a GPU where it was given one (video_pool.py
    hands a process only its GPU index, so that what crosses to it stays a plain int), else the default."""
    return next(d for d in VIDEO_DECODERS.values() if d.needs_gpu) if gpu is not None else VIDEO_DECODERS[VIDEO_DEFAULT]


def _lookup(table: dict, name: str, what: str):
    if name not in table:
        raise InvalidInput(f"unknown {what} {name!r}; valid: {', '.join(table)}")
    return table[name]


def _resolve(target: str) -> Callable:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)
