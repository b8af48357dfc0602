"""Kimi-K2.5's ``pil``-mode resize is PyTorch's native uint8 kernel; pinned here against the numpy
re-implementation of that kernel that it replaced (kept below as the reference, integer for integer:
int16 weights, dynamic precision, horizontal pass then vertical, uint8 in between).

Odd sizes, down- and upscaling, noise and smooth content (rounding ties show differently), and the
(C, H, W) view of an (H, W, C) array that the service and torchvision both hand to the kernel.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from encoder_service.models.kimi_k25.preprocess import resize_bicubic_antialias


def _bicubic_aa(x: float) -> float:
    # Keys cubic with a = -0.5, as PIL and PyTorch's antialiased kernels use.
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    if x < 2.0:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return 0.0


def _aa_int16_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """PyTorch's ``_compute_index_ranges_weights`` (double) + ``_compute_index_ranges_int16_weights``."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = math.ceil(support) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    starts = np.zeros(out_size, dtype=np.int64)
    weights = np.zeros((out_size, taps), dtype=np.float64)
    wt_max = 0.0
    for i in range(out_size):
        center = scale * (i + 0.5)
        xmin = max(int(center - support + 0.5), 0)
        xsize = min(max(min(int(center + support + 0.5), in_size) - xmin, 0), taps)
        ws = [_bicubic_aa((j + xmin - center + 0.5) * invscale) for j in range(xsize)]
        total = sum(ws)  # left to right, as the C++ loop accumulates
        if total != 0.0:
            ws = [w / total for w in ws]
            wt_max = max(wt_max, *ws)
        starts[i] = xmin
        weights[i, :xsize] = ws
    precision = 0
    while precision < 22:
        if int(0.5 + wt_max * (1 << (precision + 1))) >= (1 << 15):
            break
        precision += 1
    scaled = weights * (1 << precision)
    ints = np.where(scaled < 0, np.trunc(-0.5 + scaled), np.trunc(0.5 + scaled)).astype(np.int64)
    return starts, ints, precision


def _resample_axis(image: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    in_size = image.shape[axis]
    starts, weights, precision = _aa_int16_weights(in_size, out_size)
    src = np.moveaxis(image, axis, 0).astype(np.int32)
    acc = np.full((out_size, *src.shape[1:]), 1 << (precision - 1), dtype=np.int32)
    weights = weights.astype(np.int32)
    for k in range(weights.shape[1]):
        idx = np.minimum(starts + k, in_size - 1)
        acc += weights[:, k].reshape(-1, 1, 1) * src[idx]
    out = np.clip(acc >> precision, 0, 255).astype(np.uint8)
    return np.moveaxis(out, 0, axis)


def numpy_resize_bicubic_antialias(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """The replaced numpy kernel: width first, then height, each pass skipped when its size does not change."""
    if image.shape[1] != width:
        image = _resample_axis(image, width, axis=1)
    if image.shape[0] != height:
        image = _resample_axis(image, height, axis=0)
    return image


CASES = [
    ((1001, 999), (449, 447)),  # ~1000x1000 down, as navit_resize does under a small patch budget
    ((333, 517), (211, 389)),  # down, non-integer factors
    ((97, 61), (131, 173)),  # up both ways
    ((259, 37), (101, 89)),  # down one axis, up the other
    ((75, 203), (75, 127)),  # one pass only (height unchanged)
    ((123, 45), (7, 45)),  # one pass only, a large factor
    ((13, 9), (3, 2)),  # tiny
    ((1, 301), (1, 47)),  # a single row
    ((300, 1), (29, 1)),  # a single column
]


@pytest.mark.parametrize("smooth", [False, True], ids=["noise", "smooth"])
@pytest.mark.parametrize("src, dst", CASES, ids=[f"{a[0]}x{a[1]}-{b[0]}x{b[1]}" for a, b in CASES])
def test_torch_uint8_kernel_equals_the_numpy_kernel_it_replaced(src, dst, smooth):
    rng = np.random.default_rng(src[0] * 7919 + src[1] + smooth)
    if smooth:
        img = np.cumsum(rng.integers(0, 3, (*src, 3)), axis=1).clip(0, 255).astype(np.uint8)
    else:
        img = rng.integers(0, 256, (*src, 3), dtype=np.uint8)
    img.flags.writeable = False  # as np.asarray(PIL image) hands it over
    ours = resize_bicubic_antialias(img, *dst)
    assert ours.shape == (*dst, 3) and ours.dtype == np.uint8
    assert np.array_equal(ours, numpy_resize_bicubic_antialias(img, *dst))


def test_same_size_is_returned_untouched():
    img = np.random.default_rng(0).integers(0, 256, (31, 17, 3), dtype=np.uint8)
    assert np.array_equal(resize_bicubic_antialias(img, 31, 17), img)
