"""Loading a Qwen3-VL / Qwen3.5 checkpoint: only the tower's tensors are read (under either prefix,
from one file or shards), the set is checked strictly, and the preprocessor config must fit."""

import json

import pytest
import torch
from qwen3_vl_tiny import MODEL_TYPES, PREPROCESSOR, ours, pixels, tiny_config, tiny_state, write_checkpoint
from safetensors.torch import save_file

from encoder_service.errors import InvalidInput
from encoder_service.models import load_vision_model
from encoder_service.models.loader import INDEX_FILE
from encoder_service.models.qwen3_vl import FAMILY

# Tensors of the LLM (and Qwen3.5's multi-token-prediction head) beside the tower: never read.
LLM_TENSORS = {
    "model.language_model.embed_tokens.weight": torch.zeros(16, 48),
    "model.language_model.layers.0.mlp.gate_proj.weight": torch.zeros(8, 48),
    "lm_head.weight": torch.zeros(16, 48),
    "mtp.fc.weight": torch.zeros(48, 96),
}


def _load(root, dtype=torch.float32):
    return load_vision_model(root, dtype=dtype, attn_backend="sdpa")


# Every type under the hub's prefix; the bare prefix (save_pretrained of the *Model classes) once.
HUB, BARE = FAMILY.vision_prefixes


@pytest.mark.parametrize(("model_type", "prefix"), [(t, HUB) for t in MODEL_TYPES] + [("qwen3_5", BARE)])
def test_loads_only_the_tower_and_encodes_as_built_from_its_state(tmp_path, model_type, prefix):
    state = tiny_state(model_type, seed=5)
    write_checkpoint(tmp_path, tiny_config(model_type), PREPROCESSOR, state, prefix, LLM_TENSORS)
    model = _load(tmp_path)
    assert sorted(model.tensors_read) == sorted(prefix + name for name in state)
    assert model.spec.model_type == model_type
    grids = [[1, 4, 6], [2, 2, 4]]
    x = pixels(grids, model.patch_dim)
    assert torch.equal(model.encode_packed(x, grids)[0], ours(model_type, seed=5).encode_packed(x, grids)[0])


def test_shards_without_tower_tensors_are_never_opened(tmp_path):
    state = tiny_state("qwen3_vl")
    write_checkpoint(tmp_path, tiny_config("qwen3_vl"), PREPROCESSOR, {})
    (tmp_path / "model.safetensors").unlink()
    save_file({"model.visual." + k: v for k, v in state.items()}, str(tmp_path / "vision.safetensors"))
    (tmp_path / "llm.safetensors").write_bytes(b"not a safetensors file: opening it would fail")
    weight_map = {"model.visual." + k: "vision.safetensors" for k in state}
    weight_map.update(dict.fromkeys(LLM_TENSORS, "llm.safetensors"))
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    model = _load(tmp_path)
    assert len(model.tensors_read) == len(state)


def _checkpoint_with(tmp_path, model_type, change):
    state = tiny_state(model_type)
    change(state)
    return write_checkpoint(tmp_path, tiny_config(model_type), PREPROCESSOR, state)


@pytest.mark.parametrize(("model_type", "change", "message"), [
    ("qwen3_vl", lambda s: s.pop("blocks.1.mlp.linear_fc2.bias"), "lacks vision tensors: blocks.1.mlp.linear_fc2.bias"),
    ("qwen3_vl", lambda s: s.pop("deepstack_merger_list.1.norm.weight"),
     "lacks vision tensors: deepstack_merger_list.1.norm.weight"),
    ("qwen3_vl", lambda s: s.update({"blocks.3.norm1.weight": torch.ones(144)}),
     "does not know: blocks.3.norm1.weight"),
    # A Qwen3.5 tower has no deepstack mergers: a checkpoint that has them is not one.
    ("qwen3_5", lambda s: s.update({"deepstack_merger_list.0.norm.weight": torch.ones(576)}),
     "does not know: deepstack_merger_list.0.norm.weight"),
    ("qwen3_5_moe", lambda s: s.update({"pos_embed.weight": torch.zeros(256, 144)}),
     r"tensor pos_embed.weight of .* has shape \(256, 144\), config implies \(64, 144\)"),
])
def test_strict_check_names_the_missing_extra_or_misshapen_tensor(tmp_path, model_type, change, message):
    with pytest.raises(InvalidInput, match=message):
        _load(_checkpoint_with(tmp_path, model_type, change))


def test_checkpoint_without_tower_tensors_is_refused(tmp_path):
    write_checkpoint(tmp_path, tiny_config("qwen3_vl"), PREPROCESSOR, {}, extra=LLM_TENSORS)
    with pytest.raises(InvalidInput, match="holds no vision tensors"):
        _load(tmp_path)


def test_preprocessor_patches_must_be_the_towers(tmp_path):
    # A config without patch_size gets transformers' class default, 14: the tower's is 16.
    pre = {k: v for k, v in PREPROCESSOR.items() if k != "patch_size"}
    write_checkpoint(tmp_path, tiny_config("qwen3_vl"), pre, tiny_state("qwen3_vl"))
    with pytest.raises(InvalidInput, match="image processor config's patch_size 14 differs from the vision_config's "
                                           "patch_size 16"):
        _load(tmp_path)


def test_without_a_preprocessor_config_the_published_one_is_used(tmp_path):
    write_checkpoint(tmp_path, tiny_config("qwen3_5"), None, tiny_state("qwen3_5"))
    pre = _load(tmp_path).preprocess_config
    assert (pre.patch_size, pre.merge_size, pre.min_pixels, pre.max_pixels) == (16, 2, 65536, 16777216)
    assert pre.image_mean == pre.image_std == (0.5, 0.5, 0.5)


def test_loads_in_bfloat16(tmp_path):
    write_checkpoint(tmp_path, tiny_config("qwen3_vl"), PREPROCESSOR, tiny_state("qwen3_vl"))
    model = _load(tmp_path, torch.bfloat16)
    grids = [[1, 4, 6]]
    out = model.encode_packed(pixels(grids, model.patch_dim), grids)[0]
    assert out.dtype == torch.bfloat16 and out.shape == (6, 3 * 48) and torch.isfinite(out).all()
    assert model.module.inv_freq.dtype == torch.float32  # rotary angles stay full precision
