"""A checkpoint's own video processor settings are read where transformers' ``from_pretrained`` finds them
(models/loader.processor_configs): ``processor_config.json``'s ``video_processor``, else
``video_preprocessor_config.json``, else ``preprocessor_config.json``. Each case writes a tiny checkpoint
with such files, loads it, and compares our clip processing (patches and grid) with the family's
transformers video processor ``from_pretrained`` the same folder (tests/video_references.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from video_reference_driver import frames
from video_references import run_references

from encoder_service.errors import InvalidInput
from encoder_service.models import load_vision_model, make_checkpoint
from encoder_service.models.qwen2_5_vl import video as qwen2
from encoder_service.models.qwen3_vl import video as qwen3

MODULES = {"qwen2_5_vl": qwen2, "qwen3_vl": qwen3}
PRESETS = {"qwen2_5_vl": "tiny-qwen2.5-vl", "qwen3_vl": "tiny-qwen3-vl"}
QWEN2_VIDEO = {"size": {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 6}}
QWEN3_VIDEO = {"size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 24}}

# (name, family, extra files, frames [T, H, W])
CASES = [
    ("qwen2-video-file", "qwen2_5_vl", {"video_preprocessor_config.json": QWEN2_VIDEO}, (4, 120, 200)),
    ("qwen2-nested-wins", "qwen2_5_vl", {"processor_config.json": {"video_processor": QWEN2_VIDEO},
                                         "video_preprocessor_config.json": {"size": {"shortest_edge": 3136,
                                                                                     "longest_edge": 3136 * 40}}},
     (4, 120, 200)),
    ("qwen2-image-file-only", "qwen2_5_vl", {}, (4, 120, 200)),
    ("qwen3-video-file", "qwen3_vl", {"video_preprocessor_config.json": QWEN3_VIDEO}, (4, 120, 200)),
    ("qwen3-nested", "qwen3_vl", {"processor_config.json": {"video_processor": QWEN3_VIDEO}}, (4, 120, 200)),
    ("qwen3-image-file-only", "qwen3_vl", {}, (4, 120, 200)),
]


def checkpoint(root: Path, name: str, family: str, files: dict) -> Path:
    folder = make_checkpoint(PRESETS[family], root / name)
    for file, content in files.items():
        (folder / file).write_text(json.dumps(content))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("video-processor-files")
    return {name: checkpoint(root, name, family, files) for name, family, files, _ in CASES}


@pytest.fixture(scope="module")
def references(folders, tmp_path_factory):
    cases = [{"family": family, "pretrained": str(folders[name]), "shape": shape, "seed": i}
             for i, (name, family, _, shape) in enumerate(CASES)]
    return run_references({"processing": cases}, tmp_path_factory.mktemp("video-processor-references"))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_a_checkpoints_video_settings_are_read_as_transformers_reads_them(folders, references, index):
    results, arrays = references
    name, family, _, shape = CASES[index]
    model = load_vision_model(folders[name])
    pixels, grid = MODULES[family].preprocess_video(frames(index, *shape), model.video_config)
    expected = arrays[f"pixels_{index}"].reshape(len(pixels), -1)
    assert [list(grid)] == results["processing"][index]["grid"]
    assert np.array_equal(pixels, expected), float(np.abs(pixels - expected).max())


def test_the_cases_are_not_all_the_defaults(folders):
    # Each file changes what the clip becomes: otherwise the comparison above could not fail.
    grids = {name: MODULES[family].preprocess_video(frames(0, *shape), load_vision_model(folders[name]).video_config)[1]
             for name, family, _, shape in CASES}
    defaults = {family: MODULES[family].preprocess_video(frames(0, *shape), load_vision_model(PRESETS[family])
                                                         .video_config)[1] for _, family, _, shape in CASES}
    assert grids["qwen2-video-file"] != grids["qwen2-image-file-only"]
    assert grids["qwen2-nested-wins"] == grids["qwen2-video-file"]
    assert grids["qwen3-video-file"] != defaults["qwen3_vl"]
    assert grids["qwen3-image-file-only"] != defaults["qwen3_vl"]


def test_own_video_settings_change_the_cache_namespace_the_image_files_do_not(tmp_path):
    # The namespaces of checkpoints without video settings of their own (every published Qwen2.5-VL
    # one) stay what they were: their keys are still valid.
    for family in PRESETS:
        folder = checkpoint(tmp_path, family, family, {})
        without = load_vision_model(folder)
        assert "video" not in without.spec.fingerprint or family == "qwen3_vl"
        (folder / "video_preprocessor_config.json").write_text(json.dumps(QWEN2_VIDEO if family == "qwen2_5_vl"
                                                                          else QWEN3_VIDEO))
        own = load_vision_model(folder)
        assert "video" in own.spec.fingerprint and own.cache_namespace != without.cache_namespace
    # A Qwen3-VL checkpoint whose video file is the published one (the class defaults) keeps its namespace.
    folder = checkpoint(tmp_path, "published", "qwen3_vl", {"video_preprocessor_config.json": {}})
    assert "video" not in load_vision_model(folder).spec.fingerprint


def test_a_video_config_with_other_patches_than_the_tower_is_refused(tmp_path):
    folder = checkpoint(tmp_path, "bad", "qwen3_vl", {"video_preprocessor_config.json": {"patch_size": 14}})
    with pytest.raises(InvalidInput, match="video processor config's patch_size 14 differs from the "
                                           "vision_config's patch_size 16"):
        load_vision_model(folder)


def test_a_broken_processor_file_is_named(tmp_path):
    folder = checkpoint(tmp_path, "broken", "qwen2_5_vl", {})
    (folder / "video_preprocessor_config.json").write_text("{not json")
    with pytest.raises(InvalidInput, match=r"video_preprocessor_config\.json is not valid JSON"):
        load_vision_model(folder)


def test_kimi_says_it_does_not_read_a_video_processor_file(tmp_path, caplog):
    folder = make_checkpoint("tiny-kimi-k2.5", tmp_path / "kimi")
    (folder / "video_preprocessor_config.json").write_text(json.dumps({"fps": 1.0}))
    with caplog.at_level(logging.WARNING):
        load_vision_model(folder)
    assert "video processor config (processor_config.json or video_preprocessor_config.json) is not read" in \
        caplog.text


def test_kimi_says_nothing_when_the_checkpoint_has_no_video_file(tmp_path, caplog):
    folder = make_checkpoint("tiny-kimi-k2.5", tmp_path / "kimi")
    # transformers 5 saves the image processor nested; the video processor then falls back to the legacy file
    legacy = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "processor_config.json").write_text(json.dumps({"image_processor": {**legacy, "note": "nested"}}))
    with caplog.at_level(logging.WARNING):
        load_vision_model(folder)
    assert "is not read" not in caplog.text
