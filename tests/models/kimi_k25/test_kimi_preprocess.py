"""Kimi-K2.5 preprocessing pinned on the CPU; compared with transformers' processor where torchvision exists.

transformers' ``Kimi_K25ImageProcessor`` needs torchvision, which this machine's torch build lacks.
Its steps are pinned here against their torch equivalents: ``tvF.resize`` of a uint8 CPU image with
bicubic + antialias is ``F.interpolate(uint8, mode="bicubic", antialias=True)``, padding is zeros at
the bottom/right, normalisation is ``(x - 127.5) / 127.5`` in float32, patchify is the processor's
reshape/permute. The ``gpu``-marked test runs the real processor on the GPU machine.
"""

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from encoder_service.models import load_vision_model
from encoder_service.models.kimi_k25.preprocess import (
    KimiK25PreprocessConfig,
    navit_resize,
    preprocess_kimi_k25,
    resize_bicubic_antialias,
)


@pytest.mark.parametrize("size, expected", [
    ((3000, 4000), ((1554, 2073), (1568, 2100))),  # the patch budget (16384) binds
    ((100, 50), ((100, 50), (112, 56))),  # never upscaled, only padded to multiples of 28
    ((13, 9), ((13, 9), (28, 28))),
    ((20000, 300), ((7168, 107), (7168, 112))),  # the 512-patch side limit binds
    ((1000, 1000), ((1000, 1000), (1008, 1008))),
    ((7, 7000), ((7, 7000), (28, 7000))),  # under one patch high counts as one patch
])
def test_navit_resize(size, expected):
    assert navit_resize(*size, patch_size=14, merge_size=2, max_patches=16384, max_side_patches=512) == expected


def _torch_resize(img: np.ndarray, h: int, w: int) -> np.ndarray:
    t = torch.from_numpy(img).permute(2, 0, 1)[None]
    return F.interpolate(t, size=(h, w), mode="bicubic", antialias=True)[0].permute(1, 2, 0).numpy()


@pytest.mark.parametrize("seed", range(12))
def test_resize_equals_torch_uint8_bicubic_antialias(seed):
    rng = np.random.default_rng(seed)
    H, W = (int(v) for v in rng.integers(4, 200, 2))
    h, w = (int(v) for v in rng.integers(2, 260, 2))
    img = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    if seed % 2:  # smooth content too: rounding ties show differently than in noise
        img = np.cumsum(rng.integers(0, 3, (H, W, 3)), axis=1).clip(0, 255).astype(np.uint8)
    assert np.array_equal(resize_bicubic_antialias(img, h, w), _torch_resize(img, h, w))


def _png(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def _reference_pipeline(img: np.ndarray, cfg: KimiK25PreprocessConfig):
    """transformers' steps written with torch (what the torchvision backend does on a CPU tensor)."""
    (h, w), (ph, pw) = navit_resize(*img.shape[:2], cfg.patch_size, cfg.merge_size, cfg.max_patches,
                                    cfg.max_side_patches)
    t = torch.from_numpy(img).permute(2, 0, 1)[None]
    t = F.interpolate(t, size=(h, w), mode="bicubic", antialias=True) if (h, w) != img.shape[:2] else t
    t = F.pad(t, (0, pw - w, 0, ph - h), value=0)
    mean = torch.tensor([0.5, 0.5, 0.5]) * (1.0 / (1 / 255))
    std = torch.tensor([0.5, 0.5, 0.5]) * (1.0 / (1 / 255))
    t = (t.float() - mean[:, None, None]) / std[:, None, None]
    p = cfg.patch_size
    gh, gw = ph // p, pw // p
    patches = t.reshape(1, 3, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(gh * gw, 3, p, p)
    return patches, (1, gh, gw)


@pytest.mark.parametrize("shape", [(90, 130), (300, 41), (28, 28), (500, 700)])
def test_pipeline_equals_reference_steps(shape):
    rng = np.random.default_rng(shape[0])
    img = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    cfg = KimiK25PreprocessConfig(max_patches=1024)
    patches, grid = preprocess_kimi_k25(_png(img), cfg)
    ref, ref_grid = _reference_pipeline(img, cfg)
    assert grid == ref_grid and all(isinstance(v, int) for v in grid)
    assert grid[1] % 2 == 0 and grid[2] % 2 == 0
    assert np.array_equal(patches, ref.reshape(len(ref), -1).numpy())


def test_padding_is_minus_one_and_mean_std_half():
    img = np.full((20, 30, 3), 255, dtype=np.uint8)
    patches, grid = preprocess_kimi_k25(_png(img), KimiK25PreprocessConfig())
    assert grid == (1, 2, 4)  # 28 x 56 pixels
    image = patches.reshape(2, 4, 3, 14, 14).transpose(0, 3, 1, 4, 2).reshape(28, 56, 3)
    assert np.all(image[:20, :30] == 1.0) and np.all(image[20:] == -1.0) and np.all(image[:, 30:] == -1.0)


def test_config_from_transformers_and_original_files():
    ours = KimiK25PreprocessConfig.from_dict({"max_patches": 4096, "size": {"max_height": 256, "max_width": 256},
                                              "merge_size": 2, "patch_size": 14})
    original = KimiK25PreprocessConfig.from_dict({"media_proc_cfg": {
        "in_patch_limit": 4096, "patch_limit_on_one_side": 256, "merge_kernel_size": 2, "patch_size": 14,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}})
    assert ours == original
    with pytest.raises(Exception, match="resample"):
        KimiK25PreprocessConfig.from_dict({"resample": 2})


def test_model_preprocess_feeds_encode():
    m = load_vision_model("tiny-kimi-k2.5")
    patches, grid = m.preprocess(_png(np.random.default_rng(0).integers(0, 256, (60, 90, 3), dtype=np.uint8)))
    assert patches.shape == (grid[1] * grid[2], m.patch_dim)
    assert m.encode(patches, [grid])[0].shape == (m.num_tokens(grid), m.hidden_size)


@pytest.mark.gpu
@pytest.mark.allow_skip_on_cpu("transformers' Kimi processor needs torchvision, which the CPU CI machine lacks")
@pytest.mark.parametrize("shape", [(90, 130), (300, 41), (1200, 1700), (33, 2000)])
def test_equals_transformers_processor(shape):
    pytest.importorskip("torchvision")
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor

    rng = np.random.default_rng(shape[1])
    img = np.cumsum(rng.integers(0, 5, (*shape, 3)), axis=0).clip(0, 255).astype(np.uint8)
    data = _png(img)
    out = Kimi_K25ImageProcessor()(Image.open(io.BytesIO(data)), return_tensors="pt")
    patches, grid = preprocess_kimi_k25(data, KimiK25PreprocessConfig())
    assert [list(grid)] == out["image_grid_thw"].tolist()
    ref = out["pixel_values"].reshape(len(patches), -1).numpy()
    assert np.linalg.norm(patches - ref) / np.linalg.norm(ref) <= 1e-5
    assert np.array_equal(patches, ref)
