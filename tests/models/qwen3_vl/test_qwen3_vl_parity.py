"""Our Qwen3-VL / Qwen3.5 vision towers against transformers' (float32, CPU, same random weights):
relative error <= 1e-5 per image on the main embedding and on every deepstack level separately,
for each of the four model types, on every attention backend this CPU runs."""

import pytest
import torch
from qwen3_vl_tiny import (
    DEEPSTACK,
    MODEL_TYPES,
    OUT_HIDDEN,
    ours,
    pixels,
    reference,
    reference_levels,
    rel_err,
)

from encoder_service.attention.registry import BACKENDS, backend_class

# Position table 8 x 8 patches: grids smaller, equal and larger than it, square and not.
BATCHES = {
    "one_image_table_size": [[1, 8, 8]],
    "several_sizes": [[1, 16, 16], [1, 4, 6], [1, 12, 20]],
    "non_square": [[1, 6, 30]],
    "smallest_legal_image": [[1, 2, 2]],
    "two_frame_video": [[2, 12, 8]],
    "mixed_video_and_images": [[1, 2, 2], [3, 8, 10], [1, 16, 4]],
}
RELATIVE_TOLERANCE = 1e-5


def _available_backends():
    return [name for name in BACKENDS
            if backend_class(name).unsupported_reason(torch.device("cpu"), torch.float32, 72) is None]


@pytest.fixture(scope="module", params=MODEL_TYPES)
def model_type(request):
    return request.param


@pytest.fixture(scope="module")
def ref(model_type):
    return reference(model_type)


@pytest.fixture(scope="module", params=_available_backends())
def model(request, model_type):
    return ours(model_type, attn_backend=request.param)


def test_spec_counts_one_level_per_deepstack_merger(model, model_type):
    levels = 1 + len(DEEPSTACK.get(model_type, []))
    assert model.spec.model_type == model_type
    assert model.spec.feature_levels == levels
    assert model.spec.row_width == levels * OUT_HIDDEN
    assert model.spec.patch_dim == 3 * 2 * 16 * 16


@pytest.mark.parametrize("batch", list(BATCHES))
def test_every_level_equals_transformers(model, ref, batch):
    grids = BATCHES[batch]
    x = pixels(grids, model.patch_dim)
    ours_rows = model.encode(x, grids)
    tokens = [t * h * w // 4 for t, h, w in grids]
    ref_levels = [level.split(tokens) for level in reference_levels(ref, x, grids)]
    assert len(ref_levels) == model.spec.feature_levels
    assert len(ours_rows) == len(grids)
    for i, rows in enumerate(ours_rows):
        assert rows.shape == (tokens[i], model.spec.row_width)
        # The wire layout: the main embedding, then each deepstack level, along the row.
        for level, (a, b) in enumerate(zip(rows.split(OUT_HIDDEN, dim=-1), (r[i] for r in ref_levels))):
            err = rel_err(a, b)
            assert err <= RELATIVE_TOLERANCE, f"image {i}, level {level}: relative error {err:.2e}"


def test_each_image_is_encoded_as_if_alone(model):
    # Batching must not leak attention or position embeddings across images.
    a, b = pixels([[1, 8, 12]], model.patch_dim), pixels([[2, 4, 4]], model.patch_dim)
    alone = model.encode(a, [[1, 8, 12]])[0]
    together = model.encode(torch.cat([b, a]), [[2, 4, 4], [1, 8, 12]])[1]
    assert rel_err(together, alone) <= 1e-6


def test_frames_attend_only_within_themselves(model):
    # Attention is per frame (transformers' cu_seqlens): frame 2 of a clip is encoded as the same
    # patches would be as a one-frame image.
    clip = pixels([[2, 6, 8]], model.patch_dim)
    second = clip[48:]
    out_clip = model.encode(clip, [[2, 6, 8]])[0]
    out_alone = model.encode(second, [[1, 6, 8]])[0]
    assert rel_err(out_clip[12:], out_alone) <= 1e-6


@pytest.mark.parametrize("mistake", ["rotary_rows_and_columns_swapped", "position_table_transposed"])
def test_parity_would_catch_a_wrong_position_order(mistake):
    # Guards the parity test itself: with these random weights a rotary with row and column swapped,
    # or a position table read transposed, is far outside the tolerance on every level (the tower
    # is the same for the four types: one with deepstack levels is enough here).
    model, ref = ours("qwen3_vl"), reference("qwen3_vl")
    tower = model.module
    if mistake == "rotary_rows_and_columns_swapped":
        rotary = tower.rotary
        tower.rotary = lambda positions: rotary(positions.flip(-1))
    else:
        side = model.cfg.num_grid_per_side
        table = tower.pos_embed.weight
        table.data = table.data.view(side, side, -1).transpose(0, 1).reshape(side * side, -1)
    grids = BATCHES["several_sizes"]
    x = pixels(grids, model.patch_dim)
    wrong = model.encode_packed(x, grids)[0]
    for level, (a, b) in enumerate(zip(wrong.split(OUT_HIDDEN, dim=-1), reference_levels(ref, x, grids))):
        assert rel_err(a, b) > 1e-2, f"level {level}"
