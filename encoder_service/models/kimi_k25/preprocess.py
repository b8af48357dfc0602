"""Kimi-K2.5 image preprocessing: bytes -> raster-order patches + grid, equal to transformers'
``Kimi_K25ImageProcessor``.

That processor (torchvision backend, CPU) does: ``navit_resize`` (scale down, never up, to fit the
patch budget and the per-side patch limit), a bicubic antialiased resize of the uint8 image
(``tvF.resize`` -> ``F.interpolate(uint8, mode="bicubic", antialias=True)``: PyTorch's fixed-point
uint8 kernel), zero padding at the bottom/right to a multiple of ``merge_size * patch_size`` (28),
``(x - 127.5) / 127.5`` in float32 (mean and std 0.5, fused with the 1/255 rescale), and patches in
raster order, each flattened as (C, P, P). In ``pil`` mode (the CPU default) the resize runs on the
CPU with that same uint8 kernel, so the pixels are the processor's bit for bit; in ``torch`` mode it
runs on the model's device (``preprocess/staged.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ...errors import InvalidInput
from ...preprocess import settings
from ...preprocess.decode import decode_rgb
from ...preprocess.staged import (
    DecodedImage,
    apply_table,
    host_tensor,
    image_tensor,
    resize_uint8,
    torchvision_value_table,
)

_BICUBIC = 3  # PILImageResampling.BICUBIC: the only filter the Kimi processor is used with


@dataclasses.dataclass(frozen=True)
class KimiK25PreprocessConfig:
    """Preprocessing settings; defaults are transformers' ``Kimi_K25ImageProcessor`` class defaults."""

    max_patches: int = 16384  # patch budget of the resized image (before padding)
    max_side_patches: int = 512  # size.max_height == size.max_width, counted in patches
    patch_size: int = 14
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = _BICUBIC

    def __post_init__(self) -> None:
        settings.check_positive_ints(self, ("max_patches", "max_side_patches", "patch_size", "merge_size"))
        settings.check_normalization(self)
        if self.resample != _BICUBIC:
            raise InvalidInput(f"preprocessor config: resample {self.resample!r} is not supported for Kimi-K2.5 "
                               "(only 3, bicubic)")

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> KimiK25PreprocessConfig:
        """From ``preprocessor_config.json``: transformers' keys (``max_patches``, ``size.max_height``,
        ``merge_size``) or the original remote-code ones under ``media_proc_cfg``
        (``in_patch_limit``, ``patch_limit_on_one_side``, ``merge_kernel_size``)."""
        config = dict(config.get("media_proc_cfg") or {}) | {k: v for k, v in config.items()
                                                              if k != "media_proc_cfg"}
        kwargs: dict[str, Any] = {}
        size = config.get("size")
        if size is not None:
            if not isinstance(size, Mapping) or size.get("max_height") != size.get("max_width"):
                raise InvalidInput(f"preprocessor config: size must have equal max_height and max_width, got {size!r}")
            if size.get("max_height") is not None:
                kwargs["max_side_patches"] = int(size["max_height"])
        for field, names in (("max_patches", ("max_patches", "in_patch_limit")),
                             ("max_side_patches", ("patch_limit_on_one_side",)),
                             ("patch_size", ("patch_size",)),
                             ("merge_size", ("merge_size", "merge_kernel_size")),
                             ("resample", ("resample",))):
            for name in names:
                if config.get(name) is not None:
                    value = config[name]
                    kwargs[field] = int(value[0] if isinstance(value, (list, tuple)) else value)
                    break
        kwargs |= settings.flag_and_normalization_kwargs(config, ("do_resize", "do_rescale", "do_normalize"))
        return cls(**kwargs)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def max_pixels(self) -> int:
        """The pixels of the patch budget: what an image is resized down to (the default pixel limit
        is derived from it)."""
        return self.max_patches * self.patch_size * self.patch_size

    def fingerprint(self) -> dict[str, Any]:
        return settings.fingerprint(self)


def _transformers_config(cfg: KimiK25PreprocessConfig) -> dict[str, Any]:
    """``cfg`` in the keys of transformers' ``preprocessor_config.json`` (``from_dict`` reads it back):
    the per-side limit as ``size``; the processor always converts to RGB."""
    fields = cfg.fingerprint()
    side = fields.pop("max_side_patches")
    resample = fields.pop("resample")
    return {"image_processor_type": "Kimi_K25ImageProcessor", "size": {"max_height": side, "max_width": side},
            **fields, "do_convert_rgb": True, "resample": resample}


# Defaults of transformers' Kimi_K25ImageProcessor (size and max_patches count patches, not pixels):
# the class defaults above; what the presets start from.
KIMI_K25_PREPROCESSOR = _transformers_config(KimiK25PreprocessConfig())


def navit_resize(height: int, width: int, patch_size: int, merge_size: int, max_patches: int,
                 max_side_patches: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized_h, resized_w), (padded_h, padded_w)) in pixels; transformers' ``navit_resize``.

    The scale is the tightest of: the patch budget (counted with floor-divided sides), the per-side
    patch limit, and 1 (never upscale); sides are truncated, then padded up to a multiple of
    ``merge_size * patch_size``. Float expressions in the reference's order: one ulp can move a side.
    """
    patches_h = max(1.0, height // patch_size)
    patches_w = max(1.0, width // patch_size)
    scale = min(1.0, math.sqrt(max_patches / (patches_h * patches_w)),
                (max_side_patches * patch_size) / height, (max_side_patches * patch_size) / width)
    new_h = min(max(1, int(height * scale)), max_side_patches * patch_size)
    new_w = min(max(1, int(width * scale)), max_side_patches * patch_size)
    factor = merge_size * patch_size
    return (new_h, new_w), ((factor - new_h % factor) % factor + new_h, (factor - new_w % factor) % factor + new_w)


def resize_bicubic_antialias(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, C] -> uint8 [height, width, C]: PyTorch's native uint8 kernel,
    ``F.interpolate(uint8, size, mode="bicubic", antialias=True)`` on the CPU, what ``tvF.resize``
    calls; it releases the GIL. Run on the (C, H, W) view of the array, as torchvision's
    ``pil_to_tensor`` hands it over.
    """
    if image.shape[:2] == (height, width):
        return image
    chw = resize_uint8(host_tensor(image).permute(2, 0, 1), (height, width))
    return chw.permute(1, 2, 0).numpy()  # host: CPU preprocessing, a CPU tensor


def value_table(cfg: KimiK25PreprocessConfig) -> torch.Tensor:
    """float32 [3, 256]: rescale + normalize of each byte, as the (torchvision-backed) processor
    computes them (mean and std fused with the 1/255 rescale, in float32)."""
    return torchvision_value_table(cfg.image_mean, cfg.image_std, cfg.rescale_factor, cfg.do_rescale,
                                   cfg.do_normalize)


def decode_kimi_k25_pixels(pixels: np.ndarray, cfg: KimiK25PreprocessConfig, mode: str) -> DecodedImage:
    """The CPU half: RGB uint8 pixels, resized here in ``pil`` mode (PyTorch's uint8 kernel, above)
    or on the device in ``torch`` mode, with the padded size and the grid."""
    resize_to, pad_to, grid = geometry(*pixels.shape[:2], cfg)
    if mode == "pil":
        pixels = resize_bicubic_antialias(pixels, *resize_to)
    return DecodedImage(np.ascontiguousarray(pixels), resize_to, pad_to, grid)


def geometry(height: int, width: int, cfg: KimiK25PreprocessConfig, what: str = "image"
             ) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int, int]]:
    """An image (``what``: a video frame, with the video settings) of ``height`` x ``width`` pixels ->
    (its resized size, its padded size, its grid)."""
    pad_h, pad_w = height, width
    if cfg.do_resize:
        (height, width), (pad_h, pad_w) = navit_resize(height, width, cfg.patch_size, cfg.merge_size,
                                                       cfg.max_patches, cfg.max_side_patches)
    p = cfg.patch_size
    if pad_h % p or pad_w % p:
        raise InvalidInput(f"{what} of {pad_w}x{pad_h} pixels is not a multiple of the patch size {p} "
                           "(do_resize is off)")
    return (height, width), (pad_h, pad_w), (1, pad_h // p, pad_w // p)


def decode_kimi_k25(data: bytes, cfg: KimiK25PreprocessConfig, mode: str = "pil",
                    max_image_pixels: int | None = None) -> DecodedImage:
    return decode_kimi_k25_pixels(decode_rgb(data, max_image_pixels), cfg, mode)


def patchify(x: torch.Tensor, cfg: KimiK25PreprocessConfig) -> torch.Tensor:
    """[C, H, W] -> [gh*gw, C*P*P]: patches in raster order, each flattened as (C, P, P)."""
    channels, height, width = x.shape
    p = cfg.patch_size
    gh, gw = height // p, width // p
    return x.view(channels, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, channels * p * p)


def preprocess_kimi_k25(data: bytes, cfg: KimiK25PreprocessConfig, max_image_pixels: int | None = None,
                        mode: str = "pil") -> tuple[np.ndarray, tuple[int, int, int]]:
    """Encoded image bytes -> (float32 [h*w, 3*P*P], (1, h, w) in patches, Python ints), both halves
    on the CPU."""
    item = decode_kimi_k25(data, cfg, mode, max_image_pixels)
    chw = image_tensor(host_tensor(item.pixels).view(-1), item, mode)
    return patchify(apply_table(chw, value_table(cfg)), cfg).numpy(), item.grid  # host: CPU preprocessing, a CPU tensor
