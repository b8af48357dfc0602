"""A checkpoint's own video processor settings are read where transformers' ``from_pretrained`` finds them
(models/loader.processor_configs): ``processor_config.json``'s ``video_processor``, else
``video_preprocessor_config.json``, else ``preprocessor_config.json``. Each case writes a tiny checkpoint
with such files, loads it, and compares our clip processing (patches and grid) with the family's
transformers video processor ``from_pretrained`` the same folder (tests/video_references.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from video_reference_driver import frames
from video_references import run_references

from encoder_service.errors import InvalidInput
from encoder_service.models import load_vision_model, make_checkpoint
from encoder_service.models.kimi_k25 import video as kimi
from encoder_service.models.qwen2_5_vl import video as qwen2
from encoder_service.models.qwen3_vl import video as qwen3

MODULES = {"qwen2_5_vl": qwen2, "qwen3_vl": qwen3, "kimi_k25": kimi}
PRESETS = {"qwen2_5_vl": "tiny-qwen2.5-vl", "qwen3_vl": "tiny-qwen3-vl", "kimi_k25": "tiny-kimi-k2.5"}
QWEN2_VIDEO = {"size": {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 6}}
QWEN3_VIDEO = {"size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 24}}
KIMI_VIDEO = {"max_patches": 256, "temporal_patch_size": 2}
# A file of None: the preset's file removed (the tiny Kimi preset writes a video_preprocessor_config.json).
NO_KIMI_VIDEO_FILE = {"video_preprocessor_config.json": None}

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
    ("kimi-video-file", "kimi_k25", {"video_preprocessor_config.json": KIMI_VIDEO}, (4, 300, 400)),
    ("kimi-nested-wins", "kimi_k25", {"processor_config.json": {"video_processor": {"max_patches": 512}},
                                      "video_preprocessor_config.json": KIMI_VIDEO}, (4, 300, 400)),
    # transformers' video processor then reads preprocessor_config.json: the image budget (1024
    # patches in the tiny preset) is the frames' budget too.
    ("kimi-image-file-only", "kimi_k25", NO_KIMI_VIDEO_FILE, (4, 600, 900)),
    ("kimi-preset-files", "kimi_k25", {}, (4, 600, 900)),
    # A nested image processor with another budget: the video processor still reads the legacy file.
    ("kimi-nested-image-only", "kimi_k25", {**NO_KIMI_VIDEO_FILE, "processor_config.json": {
        "image_processor": {"image_processor_type": "Kimi_K25ImageProcessor", "max_patches": 16384}}},
     (4, 600, 900)),
]


def checkpoint(root: Path, name: str, family: str, files: dict) -> Path:
    folder = make_checkpoint(PRESETS[family], root / name)
    for file, content in files.items():
        if content is None:
            (folder / file).unlink()
        else:
            (folder / file).write_text(json.dumps(content))
    return folder


def ours(family: str, clip: np.ndarray, config) -> tuple[np.ndarray, list[list[int]]]:
    """(patches, grids as transformers' video_grid_thw lists): Kimi-K2.5 gives one grid per chunk."""
    pixels, grid = MODULES[family].preprocess_video(clip, config)
    return pixels, [list(g) for g in grid] if family == "kimi_k25" else [list(grid)]


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
    pixels, grids = ours(family, frames(index, *shape), model.video_config)
    expected = arrays[f"pixels_{index}"].reshape(len(pixels), -1)
    assert grids == results["processing"][index]["grid"]
    assert np.array_equal(pixels, expected), float(np.abs(pixels - expected).max())


def test_the_cases_are_not_all_the_defaults(folders):
    # Each file changes what the clip becomes: otherwise the comparison above could not fail.
    grids = {name: ours(family, frames(0, *shape), load_vision_model(folders[name]).video_config)[1]
             for name, family, _, shape in CASES}
    defaults = {name: ours(family, frames(0, *shape), load_vision_model(PRESETS[family]).video_config)[1]
                for name, family, _, shape in CASES}
    assert grids["qwen2-video-file"] != grids["qwen2-image-file-only"]
    assert grids["qwen2-nested-wins"] == grids["qwen2-video-file"]
    assert grids["qwen3-video-file"] != defaults["qwen3-video-file"]
    assert grids["qwen3-image-file-only"] != defaults["qwen3-image-file-only"]
    assert grids["kimi-video-file"] != defaults["kimi-video-file"]
    assert grids["kimi-nested-wins"] not in (grids["kimi-video-file"], defaults["kimi-nested-wins"])
    assert grids["kimi-image-file-only"] != defaults["kimi-image-file-only"]
    assert grids["kimi-nested-image-only"] == grids["kimi-image-file-only"]
    # The preset in process and its checkpoint folder process clips alike.
    assert grids["kimi-preset-files"] == defaults["kimi-preset-files"]


def test_own_video_settings_change_the_cache_namespace_the_image_files_do_not(tmp_path):
    # The namespaces of checkpoints without video settings of their own (every published Qwen2.5-VL
    # one) stay what they were: their keys are still valid.
    for family in ("qwen2_5_vl", "qwen3_vl"):
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


def test_a_qwen2_image_config_with_other_patches_than_the_tower_is_refused(tmp_path):
    folder = checkpoint(tmp_path, "bad-image", "qwen2_5_vl", {})
    image = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps(image | {"merge_size": 4}))
    with pytest.raises(InvalidInput, match="image processor config's merge_size 4 differs from the "
                                           "vision_config's spatial_merge_size 2"):
        load_vision_model(folder)


def test_a_broken_processor_file_is_named(tmp_path):
    folder = checkpoint(tmp_path, "broken", "qwen2_5_vl", {})
    (folder / "video_preprocessor_config.json").write_text("{not json")
    with pytest.raises(InvalidInput, match=r"video_preprocessor_config\.json is not valid JSON"):
        load_vision_model(folder)


def test_kimi_video_settings_change_the_namespace_only_where_they_change_the_clips(tmp_path):
    preset = load_vision_model("tiny-kimi-k2.5").spec.fingerprint
    assert "video" not in preset
    assert load_vision_model(checkpoint(tmp_path, "same", "kimi_k25", {})).spec.fingerprint == preset
    own = load_vision_model(checkpoint(tmp_path, "own", "kimi_k25", {"video_preprocessor_config.json": KIMI_VIDEO}))
    assert own.spec.fingerprint["video"]["max_patches"] == 256 and own.spec.frames_per_chunk == 2
    image_file = load_vision_model(checkpoint(tmp_path, "image-file", "kimi_k25", NO_KIMI_VIDEO_FILE))
    assert image_file.spec.fingerprint["video"]["max_patches"] == 1024


@pytest.mark.parametrize("key, value", [("resample", 2), ("do_sample_frames", False), ("num_frames", 8),
                                        ("do_normalize", None), ("max_patches", "4096")])
def test_a_kimi_video_setting_the_service_would_not_follow_is_refused_at_load(tmp_path, key, value):
    folder = checkpoint(tmp_path, "unsupported", "kimi_k25", {"video_preprocessor_config.json": {key: value}})
    with pytest.raises(InvalidInput, match=f"video processor config: {key}"):
        load_vision_model(folder)


def test_a_kimi_image_config_with_other_patches_than_the_tower_is_refused(tmp_path):
    folder = checkpoint(tmp_path, "bad-image", "kimi_k25", {})
    image = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps(image | {"patch_size": 16}))
    with pytest.raises(InvalidInput, match="preprocessor config's patch_size 16 differs from the vision_config's 14"):
        load_vision_model(folder)


def test_a_kimi_video_config_with_other_patches_than_the_tower_is_refused(tmp_path):
    folder = checkpoint(tmp_path, "bad", "kimi_k25", {"video_preprocessor_config.json": {"merge_size": 4}})
    with pytest.raises(InvalidInput, match="video processor config's merge_size 4 differs from the "
                                           "vision_config's 2"):
        load_vision_model(folder)
