"""Qwen2-VL / Qwen2.5-VL image preprocessing: bytes -> flat patches + grid (Qwen3-VL and Qwen3.5 use it
too, at patch 16).

Split in two halves (``preprocess/staged.py``): ``decode_qwen2_vl`` on the CPU, ``patchify`` (after the value
table) on the model's device. Mode ``pil`` matches transformers' ``Qwen2VLImageProcessorPil`` bit for
bit (same Pillow resize, same float rounding); mode ``torch`` matches its default, torchvision-backed
``Qwen2VLImageProcessor``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image

from ...errors import InvalidInput
from ...preprocess import settings
from ...preprocess.decode import MAX_ASPECT_RATIO, decode_rgb, open_image, to_rgb
from ...preprocess.staged import (
    DecodedImage,
    apply_table,
    host_tensor,
    image_tensor,
    torchvision_value_table,
)

# transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD, the Qwen2-VL processor defaults.
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class PatchLayout:
    """What the Qwen2-VL processors' settings dataclasses (image and video, Qwen3-VL's video too)
    derive from their ``patch_size``, ``temporal_patch_size`` and ``merge_size`` fields, and their
    fingerprint. A mixin without fields of its own."""

    @property
    def factor(self) -> int:
        """Side of one merged token in pixels: resized sides are multiples of it."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return settings.NUM_CHANNELS * self.temporal_patch_size * self.patch_size * self.patch_size

    def fingerprint(self) -> dict[str, Any]:
        """Every field, JSON-ready; part of the cache key (any change changes the patches)."""
        return settings.fingerprint(self)


@dataclasses.dataclass(frozen=True)
class Qwen2VLPreprocessConfig(PatchLayout):
    """Preprocessing settings, read from a checkpoint's ``preprocessor_config.json``.

    Defaults are transformers' ``Qwen2VLImageProcessor`` class defaults, so a config file that
    omits a key means what it means to transformers.
    """

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    resample: int = int(Image.Resampling.BICUBIC)

    def __post_init__(self) -> None:
        settings.check_positive_ints(
            self, ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"))
        if self.min_pixels > self.max_pixels:
            raise InvalidInput(f"preprocessor config: min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")
        settings.check_normalization(self)
        if self.resample not in {int(r) for r in Image.Resampling}:
            raise InvalidInput(f"preprocessor config: resample {self.resample!r} is not a Pillow filter")

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Qwen2VLPreprocessConfig:
        """Build from a ``preprocessor_config.json`` dict; unknown keys are ignored.

        Pixel bounds come, in transformers' order of precedence, from top-level ``min_pixels`` /
        ``max_pixels`` (old Qwen2-VL files), else ``size.shortest_edge`` / ``size.longest_edge``
        (new files; the names are historical: they are pixel counts, not edges).
        """
        kwargs: dict[str, Any] = {}
        size = config.get("size")
        if size is not None:
            if not isinstance(size, Mapping):
                raise InvalidInput(f"preprocessor config: size must be a mapping, got {size!r}")
            # Some Qwen2-VL files spell the size keys min_pixels/max_pixels; accept them as aliases.
            for key, alias, field in (
                ("shortest_edge", "min_pixels", "min_pixels"),
                ("longest_edge", "max_pixels", "max_pixels"),
            ):
                value = size.get(key, size.get(alias))
                if value is not None:
                    kwargs[field] = value
            # transformers replaces its default size wholesale with the given one, so a size with
            # one bound and no top-level override would fail there at call time; fail here instead.
            for field in ("min_pixels", "max_pixels"):
                if field not in kwargs and config.get(field) is None:
                    raise InvalidInput(
                        f"preprocessor config: size needs both shortest_edge and longest_edge, got {dict(size)}"
                    )
        for field in ("min_pixels", "max_pixels"):
            if config.get(field) is not None:
                kwargs[field] = config[field]

        for field in ("patch_size", "temporal_patch_size", "merge_size", "resample"):
            if config.get(field) is not None:
                kwargs[field] = config[field]
        flags = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
        kwargs |= settings.flag_and_normalization_kwargs(config, flags)
        return cls(**kwargs)



# The preprocessor_config.json of transformers' Qwen2VLImageProcessor defaults (OpenAI CLIP mean/std):
# the class defaults above, with the processor's name; what the presets start from.
QWEN2_VL_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", **Qwen2VLPreprocessConfig().fingerprint()}


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): multiples of ``factor``, area within [min, max] pixels, aspect kept.

    The float expressions are written in the same order as Qwen's reference (divide by beta, then by
    factor; Python's round-half-to-even) because a one-ulp difference can move a side by a whole
    ``factor``, i.e. change the token count.
    """
    if height <= 0 or width <= 0:
        raise InvalidInput(f"image size must be positive, got {height}x{width}")
    aspect = max(height, width) / min(height, width)
    if aspect > MAX_ASPECT_RATIO:
        raise InvalidInput(f"image aspect ratio {aspect:.1f} is over the limit of {MAX_ASPECT_RATIO}")
    new_h = round(height / factor) * factor
    new_w = round(width / factor) * factor
    if new_h * new_w > max_pixels:
        shrink = math.sqrt((height * width) / max_pixels)
        # Floor so the area ends at or under the bound; never below one factor per side.
        new_h = max(factor, math.floor(height / shrink / factor) * factor)
        new_w = max(factor, math.floor(width / shrink / factor) * factor)
    elif new_h * new_w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        new_h = math.ceil(height * grow / factor) * factor
        new_w = math.ceil(width * grow / factor) * factor
    return new_h, new_w


def _value_table(cfg: Qwen2VLPreprocessConfig) -> np.ndarray:
    """float32 [channel, uint8 value] -> the value after rescale and normalize.

    transformers computes ``float32(u8 * rescale_factor in float64)`` then ``(x - mean) / std`` in
    float32, elementwise. Each output depends only on (channel, byte), so evaluating those exact
    operations on the 256 possible bytes and indexing gives bit-identical results without the
    image-sized float64 temporary.
    """
    values = np.arange(256, dtype=np.uint8)
    if cfg.do_rescale:
        scaled = (values.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    else:
        scaled = values.astype(np.float32)
    table = np.broadcast_to(scaled, (settings.NUM_CHANNELS, 256))
    if cfg.do_normalize:
        mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None]
        std = np.asarray(cfg.image_std, dtype=np.float32)[:, None]
        table = (table - mean) / std
    return np.ascontiguousarray(table, dtype=np.float32)


def value_table(cfg: Qwen2VLPreprocessConfig, mode: str) -> torch.Tensor:
    """float32 [3, 256]: rescale + normalize of each byte, in the order of the mode's reference."""
    if mode == "torch":
        return torchvision_value_table(cfg.image_mean, cfg.image_std, cfg.rescale_factor, cfg.do_rescale,
                                       cfg.do_normalize)
    return torch.from_numpy(_value_table(cfg))


def check_mode(cfg: Qwen2VLPreprocessConfig, mode: str) -> None:
    """Fails at load time for a config the mode cannot reproduce."""
    if mode == "torch" and cfg.do_resize and cfg.resample != int(Image.Resampling.BICUBIC):
        raise InvalidInput(f"preprocess mode torch resizes bicubic only; the config asks for resample "
                           f"{cfg.resample}: use --preprocess pil")


def decode_qwen2_vl_image(image: Image.Image, cfg: Qwen2VLPreprocessConfig, mode: str) -> DecodedImage:
    """The CPU half: a decoded image -> uint8 RGB pixels, the target size and the grid.

    ``pil`` resizes here with Pillow, as transformers' PIL processor does (resizing floats would
    differ); ``torch`` leaves the resize to the device.
    """
    if cfg.do_convert_rgb:
        image = to_rgb(image)
    elif image.mode != "RGB":
        # transformers would hand the model 1 or 4 channels here and fail later; say why now.
        raise InvalidInput(f"image mode {image.mode} is not RGB and do_convert_rgb is off")
    resize_to, pad_to, grid = geometry(image.height, image.width, cfg)
    if mode == "pil" and resize_to != (image.height, image.width):
        # reducing_gap=None and the configured filter (BICUBIC by default), as transformers does.
        image = image.resize((resize_to[1], resize_to[0]), resample=cfg.resample)
    return DecodedImage(np.asarray(image, dtype=np.uint8), resize_to, pad_to, grid)


def geometry(height: int, width: int, cfg: Qwen2VLPreprocessConfig
             ) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int, int]]:
    """An image of ``height`` x ``width`` pixels -> (its resized size, its padded size: the same
    here, its grid in patches)."""
    if cfg.do_resize:
        height, width = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    f = cfg.factor
    if height % f or width % f:
        raise InvalidInput(f"image {width}x{height} is not a multiple of {f} pixels per side (do_resize is off)")
    p = cfg.patch_size
    return (height, width), (height, width), (1, height // p, width // p)


def decode_qwen2_vl(data: bytes, cfg: Qwen2VLPreprocessConfig, mode: str = "pil",
                    max_image_pixels: int | None = None) -> DecodedImage:
    """Encoded image bytes -> the CPU half's output (see ``decode_qwen2_vl_image``). Where the pixels are
    all the CPU hands over (``torch`` mode: the resize on the device), they decode straight into their
    array (``decode_rgb``: a plain JPEG without Pillow's image in between); ``pil`` mode resizes Pillow's
    image."""
    if cfg.do_convert_rgb and mode != "pil":
        pixels = decode_rgb(data, max_image_pixels)
        return DecodedImage(pixels, *geometry(*pixels.shape[:2], cfg))
    return decode_qwen2_vl_image(open_image(data, max_image_pixels), cfg, mode)


def patchify(x: torch.Tensor, cfg: Qwen2VLPreprocessConfig) -> torch.Tensor:
    """[C, H, W] (sides multiples of ``cfg.factor``) -> [gh*gw, patch_dim], on x's device and dtype.

    Row order: merge-window by merge-window (row-major over windows), and within a window the
    ``merge_size**2`` patches row-major, so the ViT's patch merger sees each window's patches
    adjacent. Column order: channel, temporal, patch row, patch column. A still image fills the
    temporal patch with copies of itself, hence one temporal step in the grid.
    """
    channels, height, width = x.shape
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = height // p, width // p
    # (c, win_row, row_in_win, y, win_col, col_in_win, x) -> (win_row, win_col, row_in_win,
    # col_in_win, c, y, x)
    windows = x.view(channels, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    return windows.unsqueeze(5).expand(-1, -1, -1, -1, -1, tp, -1, -1).reshape(gh * gw, channels * tp * p * p)


def preprocess_qwen2_vl(
    data: bytes, cfg: Qwen2VLPreprocessConfig, max_image_pixels: int | None = None, mode: str = "pil"
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Encoded image bytes -> (float32 [t*h*w, patch_dim], (t, h, w) in patches, Python ints), both
    halves on the CPU.

    ``pil``: equal to ``Qwen2VLImageProcessorPil(**config)(PIL.Image.open(io.BytesIO(data)))``
    except that EXIF orientation is applied first (see ``decode``). ``torch``: equal to the default
    (torchvision-backed) ``Qwen2VLImageProcessor`` on the CPU.
    """
    item = decode_qwen2_vl(data, cfg, mode, max_image_pixels)
    chw = image_tensor(host_tensor(item.pixels).view(-1), item, mode)
    patches = patchify(apply_table(chw, value_table(cfg, mode)), cfg)
    return patches.numpy(), item.grid  # host: CPU preprocessing, a CPU tensor
