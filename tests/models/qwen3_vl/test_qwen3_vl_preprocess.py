"""Qwen3-VL / Qwen3.5 preprocessing (transformers' Qwen2VLImageProcessor with patch 16, mean/std 0.5,
a 65536 .. 16777216 pixel budget): our ``pil`` mode equals ``Qwen2VLImageProcessorPil`` bit for bit,
and an image's embeddings through our model equal transformers' processor + vision model.

The ``torch`` mode is pinned to the torchvision-backed processor in test_qwen3_vl_gpu.py
(torchvision cannot be installed next to CI's CPU torch).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from qwen3_vl_tiny import OUT_HIDDEN, PREPROCESSOR, ours, reference, reference_levels, rel_err
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

# Odd sizes: most under the 65536-pixel floor (upscaled), one over 16 * 32 per side, one long and thin.
IMAGES = [((61, 97), "JPEG", "RGB"), ((300, 170), "PNG", "RGB"), ((517, 389), "JPEG", "RGB"),
          ((37, 1000), "PNG", "RGB"), ((211, 143), "PNG", "L"), ((129, 255), "PNG", "RGBA")]


def _image_bytes(size: tuple[int, int], fmt: str, mode: str, seed: int = 0) -> bytes:
    height, width = size
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 / width, yy * 255 / height, (xx * yy) % 255, (xx + yy) % 255], axis=-1)
    pixels = np.clip(base + rng.normal(0, 16, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels[..., :4] if mode == "RGBA" else pixels[..., :3]).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def _transformers(data: bytes) -> tuple[np.ndarray, list[int]]:
    config = {k: v for k, v in PREPROCESSOR.items() if k != "image_processor_type"}
    out = Qwen2VLImageProcessorPil(**config)(images=Image.open(io.BytesIO(data)))
    return np.asarray(out["pixel_values"]), [int(v) for v in np.asarray(out["image_grid_thw"])[0]]


@pytest.fixture(scope="module")
def model():
    model = ours("qwen3_vl")
    model.set_preprocess_mode("pil")
    return model


@pytest.mark.parametrize(("size", "fmt", "mode"), IMAGES, ids=[f"{s[0]}x{s[1]}-{f}-{m}" for s, f, m in IMAGES])
def test_pil_mode_equals_transformers_pil_processor_bit_for_bit(model, size, fmt, mode):
    data = _image_bytes(size, fmt, mode, seed=size[0])
    ours_pixels, grid = model.preprocess(data)
    ref_pixels, ref_grid = _transformers(data)
    assert list(grid) == ref_grid
    assert ours_pixels.shape == ref_pixels.shape == (grid[0] * grid[1] * grid[2], model.patch_dim)
    assert np.array_equal(ours_pixels, ref_pixels)


def test_small_images_are_upscaled_to_the_pixel_floor(model):
    _, (t, h, w) = model.preprocess(_image_bytes((61, 97), "JPEG", "RGB"))
    assert t == 1 and h * w * 16 * 16 >= 65536


def test_an_image_encodes_as_transformers_processor_and_model_do(model):
    data = _image_bytes((300, 170), "PNG", "RGB", seed=2)
    ref_pixels, grid = _transformers(data)
    pixels, our_grid = model.preprocess(data)
    assert list(our_grid) == grid
    embeddings = model.encode(pixels, [our_grid])[0]
    levels = reference_levels(reference("qwen3_vl"), torch.from_numpy(ref_pixels), [grid])
    assert embeddings.shape == (grid[1] * grid[2] // 4, 3 * OUT_HIDDEN)
    for level, (a, b) in enumerate(zip(embeddings.split(OUT_HIDDEN, dim=-1), levels)):
        assert rel_err(a, b) <= 1e-5, f"level {level}: relative error {rel_err(a, b):.2e}"
