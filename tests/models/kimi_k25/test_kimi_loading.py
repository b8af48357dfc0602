"""Kimi-K2.5 loading (both weight layouts, vision + projector tensors only), presets, bad grids,
and the host metadata it adds (resize matrices, raster positions, temporal pooling plan)."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from encoder_service.errors import InvalidInput
from encoder_service.models import load_vision_model, make_checkpoint
from encoder_service.models.kimi_k25.loading import (
    original_to_split,
    rope_rows_to_interleaved,
    rope_rows_to_rotate_half,
    split_to_original,
)
from encoder_service.models.kimi_k25.metadata import bicubic_resample_matrix, raster_position_ids, temporal_pool_index
from encoder_service.models.kimi_k25.model import KimiK25VisionConfig
from encoder_service.models.presets import PRESETS, random_vision_state

GRIDS = [[1, 6, 8], [2, 4, 4]]


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    return make_checkpoint("tiny-kimi-k2.5", tmp_path_factory.mktemp("orig"), seed=5)


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    return make_checkpoint("tiny-kimi-k2.5", tmp_path_factory.mktemp("split"), seed=5, layout="transformers")


def _pixels(grids):
    n = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(n).standard_normal((n, 588), dtype=np.float32)


def test_checkpoint_layouts_hold_the_names_seen_in_the_wild(original, split):
    orig = set(load_file(str(original / "model.safetensors")))
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in orig
    assert "vision_tower.patch_embed.pos_emb.weight" in orig
    assert "mm_projector.proj.2.weight" in orig
    names = set(load_file(str(split / "model.safetensors")))
    assert "model.vision_tower.layers.0.attn.q_proj.weight" in names
    assert "model.vision_tower.patch_embed.pos_emb.position_embeddings" in names
    assert "model.mm_projector.out_proj.weight" in names
    assert not any("wqkv" in n for n in names)


def test_both_layouts_give_the_same_embeddings(original, split):
    a = load_vision_model(original).encode(_pixels(GRIDS), GRIDS)
    b = load_vision_model(split).encode(_pixels(GRIDS), GRIDS)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_preset_equals_its_checkpoint(original):
    a = load_vision_model("tiny-kimi-k2.5", seed=5).encode(_pixels(GRIDS), GRIDS)
    b = load_vision_model(original).encode(_pixels(GRIDS), GRIDS)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_rope_permutation_round_trips():
    t = torch.arange(2 * 72 * 3, dtype=torch.float32).view(144, 3)
    assert torch.equal(rope_rows_to_interleaved(rope_rows_to_rotate_half(t, 2), 2), t)
    # Row 1 (imaginary part of pair 0, head 0) moves to row 36 (second half of head 0).
    assert torch.equal(rope_rows_to_rotate_half(t, 2)[36], t[1])


def test_layout_conversion_round_trips():
    preset = PRESETS["tiny-kimi-k2.5"]
    cfg = KimiK25VisionConfig.from_config(json.loads(json.dumps({
        "vision_config": preset.vision_config, "text_config": {"hidden_size": preset.text_hidden_size}})))
    state = random_vision_state(preset, seed=1)
    converted = original_to_split(state, cfg, prefix="")
    vision = {k.removeprefix("vision_tower."): v for k, v in converted.items() if k.startswith("vision_tower.")}
    projector = {k.removeprefix("mm_projector."): v for k, v in converted.items() if k.startswith("mm_projector.")}
    back = split_to_original(vision, projector, cfg)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_only_vision_and_projector_tensors_are_read(original, tmp_path):
    ckpt = tmp_path / "with_llm"
    ckpt.mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        (ckpt / name).write_text((original / name).read_text())
    tensors = load_file(str(original / "model.safetensors"))
    save_file(tensors, str(ckpt / "model-00001-of-00002.safetensors"))
    save_file({"language_model.model.embed_tokens.weight": torch.ones(64, 64),
               "language_model.lm_head.weight": torch.ones(8, 64)}, str(ckpt / "model-00002-of-00002.safetensors"))
    model = load_vision_model(ckpt)
    assert sorted(model.tensors_read) == sorted(tensors)


def test_original_remote_code_config_schema(original, tmp_path):
    # moonshotai/Kimi-K2.5's own config.json spells the vision sizes vt_* / init_pos_emb_*.
    config = json.loads((original / "config.json").read_text())
    v = config["vision_config"]
    config["vision_config"] = {
        "vt_num_hidden_layers": v["num_hidden_layers"], "vt_hidden_size": v["hidden_size"],
        "vt_intermediate_size": v["intermediate_size"], "vt_num_attention_heads": v["num_attention_heads"],
        "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4,
        "merge_kernel_size": [2, 2], "mm_hidden_size": v["hidden_size"], "projector_ln_eps": 1e-5,
        "text_hidden_size": config["text_config"]["hidden_size"], "merge_type": "sd2_tpool",
    }
    del config["text_config"], config["projection_hidden_size"], config["projection_layer_norm_eps"]
    assert KimiK25VisionConfig.from_config(config) == KimiK25VisionConfig.from_config(
        json.loads((original / "config.json").read_text()))


def test_model_facts():
    m = load_vision_model("tiny-kimi-k2.5")
    assert m.spec.model_type == "kimi_k25"
    assert m.patch_dim == 3 * 14 * 14
    assert m.hidden_size == 64
    assert m.num_tokens((3, 4, 6)) == 6  # frames are pooled, not stacked
    # a clip: chunks of 4 and 1 frames, pooled each (tests/video/test_kimi_video.py)
    assert m.num_tokens((5, 4, 6)) == 12
    assert [o.shape[0] for o in m.encode(_pixels(GRIDS), GRIDS)] == [12, 4]


@pytest.mark.parametrize("grid, words", [
    ([1, 5, 8], "multiples of the spatial merge size 2"),
    ([1, 8, 3], "multiples of the spatial merge size 2"),
    ([1, 2, 514], "over 512 patches"),
    ([0, 4, 4], "t must be >= 1"),
])
def test_bad_grids_are_typed_errors(grid, words):
    m = load_vision_model("tiny-kimi-k2.5")
    good = [1, 2, 2]
    n = 4 + max(grid[0], 0) * grid[1] * grid[2]
    with pytest.raises(InvalidInput, match=words) as info:
        m.encode(np.zeros((n, 588), np.float32), [good, grid])
    assert info.value.image_index == 1


# --- metadata ---------------------------------------------------------------------------------


@pytest.mark.parametrize("out_size, in_size", [(5, 8), (8, 8), (13, 8), (64, 8), (2, 64), (512, 64), (1, 4)])
def test_bicubic_matrix_equals_torch_interpolate(out_size, in_size):
    table = torch.randn(1, 3, in_size, 7, dtype=torch.float64)
    ref = F.interpolate(table, size=(out_size, 7), mode="bicubic", align_corners=False)
    ours = torch.einsum("oi,bcik->bcok", torch.from_numpy(bicubic_resample_matrix(out_size, in_size).copy()).double(),
                        table)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_raster_positions_repeat_per_frame():
    pos = raster_position_ids([(2, 2, 4)])
    assert pos.tolist()[:5] == [[0, 0], [0, 1], [0, 2], [0, 3], [1, 0]]
    assert np.array_equal(pos[:8], pos[8:])


def test_temporal_pool_plan():
    plan = temporal_pool_index([(1, 2, 4), (2, 2, 2)], 2, 2)
    assert plan.max_frames == 2
    # Image 0 (raster 2x4): token 0 takes patches 0, 1, 4, 5; token 1 takes 2, 3, 6, 7; frame 2 is padding (8+8).
    assert plan.index[:8].tolist() == [[0, 16], [1, 16], [4, 16], [5, 16], [2, 16], [3, 16], [6, 16], [7, 16]]
    # Image 1 (2 frames of 2x2) starts at patch 8: slot k pools frame 0 and frame 1.
    assert plan.index[8:].tolist() == [[8, 12], [9, 13], [10, 14], [11, 15]]
    assert plan.frames.tolist() == [1.0] * 8 + [2.0] * 4
