"""Reading a Qwen3-VL / Qwen3.5 config.json: transformers' defaults and spellings, a clear error
naming the bad key and value, and preset configs that transformers' AutoConfig loads."""

import json
from dataclasses import fields

import pytest
from transformers import AutoConfig

from encoder_service.errors import InvalidInput
from encoder_service.models.qwen3_vl.config import MODEL_TYPES, Qwen3VLVisionConfig
from encoder_service.models.qwen3_vl.loading import checkpoint_config

# The vision_config of Qwen/Qwen3-VL-8B-Instruct's config.json as published (its vision model_type
# is the old "qwen3_vl" spelling that transformers rewrites).
QWEN3_VL_8B_VISION = {
    "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304,
    "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096,
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
}


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_omitted_keys_take_transformers_defaults(model_type):
    ours = Qwen3VLVisionConfig.from_config({"model_type": model_type, "vision_config": {}})
    theirs = AutoConfig.for_model(model_type).vision_config
    assert ours.model_type == model_type
    for f in fields(ours):
        if f.name in ("model_type", "rope_theta", "deepstack_visual_indexes"):
            continue
        assert getattr(ours, f.name) == getattr(theirs, f.name), f.name
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    # Qwen3.5's tower has no deepstack mergers (its config class has no such field).
    expected = tuple(getattr(theirs, "deepstack_visual_indexes", ()))
    assert ours.deepstack_visual_indexes == expected
    assert ours.feature_levels == 1 + len(expected)


def test_published_qwen3_vl_config_reads_as_written():
    cfg = Qwen3VLVisionConfig.from_config({"model_type": "qwen3_vl", "vision_config": QWEN3_VL_8B_VISION})
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.out_hidden_size) == (27, 1152, 16, 72, 4096)
    assert cfg.deepstack_visual_indexes == (8, 16, 24) and cfg.num_grid_per_side == 48 and cfg.feature_levels == 4


def test_qwen3_5_ignores_deepstack_indexes_as_transformers_does():
    cfg = Qwen3VLVisionConfig.from_config({"model_type": "qwen3_5", "vision_config": QWEN3_VL_8B_VISION})
    assert cfg.deepstack_visual_indexes == () and cfg.feature_levels == 1


def test_transformers_aliases_and_legacy_rope_theta_are_read():
    cfg = Qwen3VLVisionConfig.from_config({"model_type": "qwen3_vl_moe", "vision_config": {
        "num_hidden_layers": 12, "num_attention_heads": 8, "hidden_size": 512, "rope_theta": 500.0,
        "deepstack_visual_indexes": [3]}})
    assert (cfg.depth, cfg.num_heads, cfg.rope_theta) == (12, 8, 500.0)
    cfg = Qwen3VLVisionConfig.from_config({"model_type": "qwen3_5", "vision_config": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}}})
    assert cfg.rope_theta == 20000.0


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_to_dict_reads_back_to_the_same_config(model_type):
    cfg = Qwen3VLVisionConfig.from_config({"model_type": model_type, "vision_config": QWEN3_VL_8B_VISION})
    assert Qwen3VLVisionConfig.from_config({"model_type": model_type, "vision_config": cfg.to_dict()}) == cfg


BAD_VISION = [
    ({"depth": 0}, "depth must be a positive integer, got 0"),
    ({"hidden_size": "1152"}, "hidden_size must be a positive integer, got '1152'"),
    ({"patch_size": [16, 16]}, r"patch_size must be a positive integer, got \[16, 16\]"),
    ({"num_heads": True}, "num_heads must be a positive integer, got True"),
    ({"num_heads": 7}, "hidden_size 1152 is not divisible by num_heads 7"),
    ({"num_heads": 64}, "head_dim 18, not a multiple of 4"),
    ({"num_position_embeddings": 2300}, "num_position_embeddings 2300 is not a square"),
    ({"hidden_act": "relu6"}, "hidden_act 'relu6' is not supported"),
    ({"deepstack_visual_indexes": [8, 27]}, r"deepstack_visual_indexes \[8, 27\] has \[27\], outside the 27 blocks"),
    ({"deepstack_visual_indexes": [16, 8]}, r"deepstack_visual_indexes \[16, 8\] must be strictly increasing"),
    ({"deepstack_visual_indexes": [8, 8]}, r"deepstack_visual_indexes \[8, 8\] must be strictly increasing"),
    ({"deepstack_visual_indexes": "8"}, "deepstack_visual_indexes must be a list of block indexes, got '8'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type 'yarn' is not supported"),
    ({"rope_parameters": {"rope_theta": -1}}, "rope_theta must be a positive number, got -1"),
]


@pytest.mark.parametrize(("change", "message"), BAD_VISION, ids=[json.dumps(c) for c, _ in BAD_VISION])
def test_bad_vision_config_names_the_key_and_value(change, message):
    with pytest.raises(InvalidInput, match=message):
        Qwen3VLVisionConfig.from_config({"model_type": "qwen3_vl", "vision_config": {**QWEN3_VL_8B_VISION, **change}})


def test_other_model_types_and_a_missing_vision_config_are_refused():
    with pytest.raises(InvalidInput, match=r"model_type 'qwen2_5_vl' is not a Qwen3-VL / Qwen3\.5 type"):
        Qwen3VLVisionConfig.from_config({"model_type": "qwen2_5_vl", "vision_config": {}})
    with pytest.raises(InvalidInput, match=r"config\.json of a qwen3_5 checkpoint has no vision_config"):
        Qwen3VLVisionConfig.from_config({"model_type": "qwen3_5"})


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_preset_config_loads_in_transformers_and_reads_back(tmp_path, model_type):
    vision = {"depth": 4, "hidden_size": 144, "num_heads": 2, "intermediate_size": 96,
              "num_position_embeddings": 64, "deepstack_visual_indexes": [1, 3]}
    config = checkpoint_config(model_type, vision, text_hidden_size=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded.model_type == model_type
    assert loaded.vision_config.depth == 4 and loaded.vision_config.out_hidden_size == 64
    assert loaded.text_config.hidden_size == 64
    ours = Qwen3VLVisionConfig.from_config(config)
    assert ours.deepstack_visual_indexes == tuple(getattr(loaded.vision_config, "deepstack_visual_indexes", ()))
    assert ours.out_hidden_size == 64


def test_preset_config_refuses_a_tower_narrower_than_the_llm():
    with pytest.raises(InvalidInput, match="out_hidden_size 48 differs from the LLM's hidden size 64"):
        checkpoint_config("qwen3_vl", {"out_hidden_size": 48}, text_hidden_size=64)
