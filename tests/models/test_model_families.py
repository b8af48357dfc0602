"""The model-family contract, for every registered family: its tiny preset loads, writes a
checkpoint in each of its layouts, and that checkpoint loads back to the same model."""

import numpy as np
import pytest
import torch

from encoder_service.errors import InvalidInput
from encoder_service.models import load_vision_model, make_checkpoint
from encoder_service.models.registry import families, family_for
from encoder_service.models.served import ServedModel

TINY = [p.name for f in families() for p in f.presets if p.name.startswith("tiny-")]
LAYOUTS = [(p.name, layout) for f in families() for p in f.presets if p.name.startswith("tiny-")
           for layout in f.layouts]


def _pixels(model, grids, seed=0):
    n = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(seed).standard_normal((n, model.spec.patch_dim)).astype(np.float32)


def test_every_family_has_a_tiny_preset_for_the_cpu_tests():
    for family in families():
        assert any(p.name.startswith("tiny-") for p in family.presets), family.model_types


@pytest.mark.parametrize("preset", TINY)
def test_a_tiny_preset_is_what_the_engine_can_serve(preset):
    model = load_vision_model(preset)
    assert isinstance(model, ServedModel)
    grids = [[1, 4, 6], [2, 4, 4]]
    out = model.encode(_pixels(model, grids), grids)
    assert [tuple(e.shape) for e in out] == [(model.front().num_tokens(g), model.spec.row_width) for g in grids]


@pytest.mark.parametrize(("preset", "layout"), LAYOUTS)
def test_a_written_checkpoint_loads_back_to_the_preset(tmp_path, preset, layout):
    path = make_checkpoint(preset, tmp_path / layout, seed=2, layout=layout)
    loaded = load_vision_model(path)
    reference = load_vision_model(preset, seed=2)
    grids = [[1, 4, 4]]
    pixels = _pixels(reference, grids)
    torch.testing.assert_close(loaded.encode(pixels, grids)[0], reference.encode(pixels, grids)[0], rtol=0, atol=0)


def test_an_unknown_layout_names_the_family_layouts(tmp_path):
    with pytest.raises(InvalidInput, match=r"unknown checkpoint layout 'gguf' for tiny-qwen2.5-vl; layouts: "):
        make_checkpoint("tiny-qwen2.5-vl", tmp_path, layout="gguf")


def test_an_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(InvalidInput, match=r"unsupported model_type 'llava'; supported: .*qwen2_5_vl.*kimi_k25"):
        family_for("llava")
