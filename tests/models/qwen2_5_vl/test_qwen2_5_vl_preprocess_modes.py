"""The two preprocessing modes and the CPU/device split.

``pil`` is pinned bit for bit to transformers' PIL processors in test_qwen2_5_vl_preprocess.py and
test_kimi_preprocess.py. ``torch`` is pinned to transformers' torchvision-backed processors in the
``gpu`` tests (torchvision cannot be installed next to CI's CPU torch); here: what holds on any
machine.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from encoder_service.errors import InvalidInput
from encoder_service.models import load_vision_model
from encoder_service.models.qwen2_5_vl.preprocess import Qwen2VLPreprocessConfig, preprocess_qwen2_vl
from encoder_service.preprocess.staged import RawPatches, resize_uint8, torchvision_value_table


def _photo(height: int, width: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 / width, yy * 255 / height, (xx + yy) * 127 / (width + height)], axis=-1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def qwen_models():
    return {mode: load_vision_model("tiny-qwen2.5-vl", preprocess=mode) for mode in ("pil", "torch")}


def test_auto_mode_is_pil_on_the_cpu():
    assert load_vision_model("tiny-qwen2.5-vl").preprocess_mode == "pil"


def test_unknown_mode_is_refused_with_the_valid_ones():
    with pytest.raises(InvalidInput, match="auto, pil, torch"):
        load_vision_model("tiny-qwen2.5-vl", preprocess="opencv")


def test_modes_have_different_cache_namespaces(qwen_models):
    # Different pixels, different embeddings: a key computed under one mode must not hit the other.
    assert qwen_models["pil"].cache_namespace != qwen_models["torch"].cache_namespace


@pytest.mark.parametrize("size", [(61, 97), (224, 224), (300, 170)])
def test_torch_mode_has_the_same_grid_and_pixels_within_resize_rounding_of_pil(qwen_models, size):
    data = _photo(*size)
    pil, pil_grid = qwen_models["pil"].preprocess(data)
    tv, tv_grid = qwen_models["torch"].preprocess(data)
    assert pil_grid == tv_grid and pil.shape == tv.shape
    # Both are bicubic with antialias; they differ by the resize's rounding (a few levels of 255,
    # ~0.07 after normalisation by std ~0.27) and the order of the fused normalisation.
    diff = np.abs(pil - tv)
    assert diff.max() < 0.2 and diff.mean() < 0.02


def test_unchanged_size_makes_both_modes_equal_up_to_the_normalisation_order(qwen_models):
    data = _photo(56, 84)  # already a multiple of 28 within the pixel bounds: no resize
    pil, _ = qwen_models["pil"].preprocess(data)
    tv, _ = qwen_models["torch"].preprocess(data)
    np.testing.assert_allclose(pil, tv, rtol=0, atol=1e-5)


def test_torch_mode_resizes_uint8_with_torch_bicubic_antialias():
    rng = np.random.default_rng(3)
    chw = torch.from_numpy(rng.integers(0, 256, (3, 50, 70), dtype=np.uint8))
    out = resize_uint8(chw, (28, 56))
    expected = F.interpolate(chw[None], size=[28, 56], mode="bicubic", antialias=True, align_corners=False)[0]
    assert out.dtype == torch.uint8 and torch.equal(out, expected)


def test_value_table_follows_the_torchvision_fused_normalisation():
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    table = torchvision_value_table(mean, std, 1 / 255, True, True)
    x = torch.arange(256, dtype=torch.float32).expand(3, 256)[None, :, :, None]
    m = torch.tensor(mean) * (1.0 / (1 / 255))
    s = torch.tensor(std) * (1.0 / (1 / 255))
    expected = (x - m.view(1, 3, 1, 1)) / s.view(1, 3, 1, 1)
    assert torch.equal(table, expected[0, :, :, 0])


def test_batched_device_half_equals_each_image_alone(qwen_models):
    # One staging buffer, one copy, mixed decoded images and client patches: the same values as
    # each input preprocessed on its own.
    model = qwen_models["torch"]
    images = [model.decode(_photo(h, w, seed)) for seed, (h, w) in enumerate([(61, 97), (120, 90), (56, 56)])]
    alone = [model.pixel_values([item], dtype=torch.float32) for item in images]
    raw = alone[1].numpy().astype(np.float16)
    patches = RawPatches(raw.tobytes(), "float16", images[1].grid)
    batched = model.pixel_values([images[0], patches, images[1], images[2]], dtype=torch.float32)
    expected = torch.cat([alone[0], torch.from_numpy(raw.astype(np.float32)), alone[1], alone[2]])
    assert torch.equal(batched, expected)


def test_pil_mode_public_preprocess_equals_the_module_function(qwen_models):
    data = _photo(130, 77, seed=5)
    pixels, grid = qwen_models["pil"].preprocess(data)
    ref, ref_grid = preprocess_qwen2_vl(data, Qwen2VLPreprocessConfig())
    assert grid == ref_grid and np.array_equal(pixels, ref)


def test_kimi_torch_mode_on_the_cpu_equals_pil_mode():
    # Kimi's reference is torchvision-backed in both modes: both resize with PyTorch's uint8 kernel
    # on the CPU, so there the two modes give the same patches.
    data = _photo(500, 767, seed=2)  # over the tiny preset's 1024-patch budget: resized
    pil = load_vision_model("tiny-kimi-k2.5", preprocess="pil").preprocess(data)
    tv = load_vision_model("tiny-kimi-k2.5", preprocess="torch").preprocess(data)
    assert pil[1] == tv[1] and np.array_equal(pil[0], tv[0])
