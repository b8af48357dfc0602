"""Qwen2-VL preprocessing settings: transformers' defaults and keys, checks, fingerprint."""

from __future__ import annotations

import json

import pytest
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as qwen2_vl_pil

from encoder_service.errors import InvalidInput
from encoder_service.models.qwen2_5_vl.preprocess import (
    Qwen2VLPreprocessConfig,
)

# ---------------------------------------------------------------------------------------------
# config


def test_config_defaults_are_transformers_defaults():
    processor = qwen2_vl_pil.Qwen2VLImageProcessorPil()
    cfg = Qwen2VLPreprocessConfig.from_dict({})
    assert cfg == Qwen2VLPreprocessConfig()
    assert cfg.min_pixels == processor.size["shortest_edge"]
    assert cfg.max_pixels == processor.size["longest_edge"]
    assert (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) == (
        processor.patch_size,
        processor.temporal_patch_size,
        processor.merge_size,
    )
    assert cfg.image_mean == tuple(processor.image_mean)
    assert cfg.image_std == tuple(processor.image_std)
    assert cfg.rescale_factor == processor.rescale_factor
    assert cfg.resample == int(processor.resample)
    assert (cfg.do_resize, cfg.do_rescale, cfg.do_normalize, cfg.do_convert_rgb) == (
        processor.do_resize,
        processor.do_rescale,
        processor.do_normalize,
        processor.do_convert_rgb,
    )


def test_old_and_new_pixel_keys_give_the_same_config():
    old = Qwen2VLPreprocessConfig.from_dict({"min_pixels": 1000, "max_pixels": 99999})
    new = Qwen2VLPreprocessConfig.from_dict({"size": {"shortest_edge": 1000, "longest_edge": 99999}})
    assert old == new and (old.min_pixels, old.max_pixels) == (1000, 99999)


def test_top_level_pixel_keys_override_size_like_transformers():
    config = {"min_pixels": 2000, "size": {"shortest_edge": 1000, "longest_edge": 99999}}
    cfg = Qwen2VLPreprocessConfig.from_dict(config)
    processor = qwen2_vl_pil.Qwen2VLImageProcessorPil(**config)
    assert (cfg.min_pixels, cfg.max_pixels) == (processor.size["shortest_edge"], processor.size["longest_edge"])


def test_real_qwen25_vl_preprocessor_config_is_accepted():
    config = {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
    }
    cfg = Qwen2VLPreprocessConfig.from_dict(config)
    assert cfg.max_pixels == 12845056 and cfg.patch_dim == 1176


@pytest.mark.parametrize(
    "config",
    [
        {"size": {"longest_edge": 1000}},
        {"patch_size": 0},
        {"min_pixels": 5000, "max_pixels": 100},
        {"image_mean": [0.5, 0.5]},
        {"resample": 42},
    ],
)
def test_bad_config_is_rejected(config: dict):
    with pytest.raises(InvalidInput, match="preprocessor config"):
        Qwen2VLPreprocessConfig.from_dict(config)


def test_fingerprint_has_every_field_is_json_ready_and_changes_with_any_field():
    cfg = Qwen2VLPreprocessConfig()
    fingerprint = cfg.fingerprint()
    assert json.loads(json.dumps(fingerprint)) == fingerprint
    assert set(fingerprint) == {
        "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "image_mean",
        "image_std", "rescale_factor", "do_resize", "do_rescale", "do_normalize", "do_convert_rgb",
        "resample",
    }  # fmt: skip
    changed = {
        "min_pixels": 4000,
        "max_pixels": 10**6,
        "patch_size": 16,
        "temporal_patch_size": 1,
        "merge_size": 1,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 0.5,
        "do_resize": False,
        "do_rescale": False,
        "do_normalize": False,
        "do_convert_rgb": False,
        "resample": 2,
    }
    assert set(changed) == set(fingerprint)
    for key, value in changed.items():
        assert Qwen2VLPreprocessConfig.from_dict({key: value}).fingerprint() != fingerprint, key


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        Qwen2VLPreprocessConfig().patch_size = 16  # type: ignore[misc]
