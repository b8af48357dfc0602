"""Checkpoint loading: vision tensors only, both prefixes, shards, clear errors."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from encoder_service.errors import BackendUnavailable, InvalidInput
from encoder_service.models import load_vision_model, make_checkpoint


def _split_into_shards_with_llm(src, dst, prefix="model.visual."):
    """The tiny checkpoint rewritten as a real one looks: vision + LLM tensors over 3 shards + index."""
    dst.mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        (dst / name).write_text((src / name).read_text())
    vision = {prefix + k.removeprefix("model.visual."): v for k, v in load_file(str(src / "model.safetensors")).items()}
    names = sorted(vision)
    half = len(names) // 2
    # The LLM shard is 64 MiB of weights that must never be read.
    llm = {"model.language_model.embed_tokens.weight": torch.ones(4096, 4096),
           "lm_head.weight": torch.ones(16, 4096)}
    shards = {
        "model-00001-of-00003.safetensors": {n: vision[n] for n in names[:half]},
        "model-00002-of-00003.safetensors": llm,
        "model-00003-of-00003.safetensors": {n: vision[n] for n in names[half:]},
    }
    weight_map = {}
    for fname, tensors in shards.items():
        save_file(tensors, str(dst / fname))
        weight_map.update(dict.fromkeys(tensors, fname))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint("tiny-qwen2.5-vl", tmp_path_factory.mktemp("tiny"), seed=1)


@pytest.mark.parametrize("prefix", ["model.visual.", "visual."])
def test_sharded_checkpoint_with_llm_weights_reads_only_vision_tensors(tiny, tmp_path, prefix, monkeypatch):
    ckpt = _split_into_shards_with_llm(tiny, tmp_path / "sharded", prefix)
    opened = []
    import encoder_service.models.loader as loader

    real_safe_open = loader.safe_open

    def recording_safe_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_safe_open(path, *args, **kwargs)

    monkeypatch.setattr(loader, "safe_open", recording_safe_open)
    model = load_vision_model(ckpt)
    assert all(name.startswith(prefix) for name in model.tensors_read)
    assert len(model.tensors_read) == len(load_file(str(tiny / "model.safetensors")))
    assert not any("00002" in p for p in opened), "the LLM-only shard must not be opened"

    reference = load_vision_model(tiny)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, model.patch_dim), dtype=np.float32)
    torch.testing.assert_close(model.encode(x, [[1, 8, 8]])[0], reference.encode(x, [[1, 8, 8]])[0])


def test_same_preset_and_seed_give_the_same_weights(tiny):
    a = load_vision_model(tiny)
    b = load_vision_model("tiny-qwen2.5-vl", seed=1)
    for (name, pa), (_, pb) in zip(a.module.state_dict().items(), b.module.state_dict().items()):
        assert torch.equal(pa, pb), name


def test_model_reports_its_shape_and_namespace(tiny):
    m = load_vision_model(tiny)
    assert (m.hidden_size, m.patch_dim, m.spec.spatial_merge_size) == (48, 1176, 2)
    assert m.num_tokens((2, 4, 6)) == 12
    assert m.cache_namespace.startswith("qwen2_5_vl:")
    assert m.cache_namespace != load_vision_model(tiny, dtype="bfloat16").cache_namespace
    assert m.attn_backend == "sdpa"


def test_missing_tensor_is_named(tiny, tmp_path):
    state = load_file(str(tiny / "model.safetensors"))
    del state["model.visual.blocks.2.mlp.up_proj.weight"]
    (tmp_path / "ck").mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        (tmp_path / "ck" / name).write_text((tiny / name).read_text())
    save_file(state, str(tmp_path / "ck" / "model.safetensors"))
    with pytest.raises(InvalidInput, match=r"blocks\.2\.mlp\.up_proj\.weight"):
        load_vision_model(tmp_path / "ck")


def test_unknown_model_type_lists_the_supported_ones(tiny, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(InvalidInput, match="unsupported model_type 'llava'; supported: qwen2_5_vl"):
        load_vision_model(tmp_path)


def test_neither_directory_nor_preset_is_a_clear_error():
    with pytest.raises(InvalidInput, match="neither a checkpoint directory nor a preset"):
        load_vision_model("/nonexistent/ckpt")


def test_unknown_attention_backend_lists_valid_names(tiny):
    with pytest.raises(BackendUnavailable, match="unknown attention backend 'flash'; valid names: auto, sdpa, varlen"):
        load_vision_model(tiny, attn_backend="flash")


def test_backend_that_cannot_run_here_fails_at_load_time_with_the_reason(tiny):
    with pytest.raises(BackendUnavailable, match="'varlen' cannot run here: device cpu is not supported"):
        load_vision_model(tiny, attn_backend="varlen")
