"""The Qwen3-VL host metadata equals what transformers' helpers compute on the device (its
``vision_utils``), bit for bit: attention sequences, rotary positions, position-table taps and
their float32 weights."""

import numpy as np
import pytest
import torch
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
)

from encoder_service.models.qwen3_vl.metadata import (
    INDEX_COLUMNS,
    POSITION_COLUMNS,
    WEIGHT_COLUMNS,
    build_qwen3_vl_metadata,
)

GRIDS = {
    "table_size": [[1, 48, 48]],
    "smaller_and_larger_than_the_table": [[1, 16, 16], [1, 4, 6], [1, 100, 62]],
    "smallest": [[1, 2, 2]],
    "video_and_images": [[2, 12, 8], [1, 2, 2], [3, 8, 10]],
    "long_thin": [[1, 2, 512], [1, 510, 2]],
}


@pytest.mark.parametrize("side", [48, 8, 7, 2, 1])
@pytest.mark.parametrize("name", list(GRIDS))
def test_metadata_equals_transformers_helpers(name, side):
    grids = GRIDS[name]
    meta = build_qwen3_vl_metadata(grids, spatial_merge_size=2, patch_size=16, num_grid_per_side=side)
    grid_thw = torch.tensor(grids)
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid_thw, side, mode="bilinear", align_corners=True, spatial_merge_size=2)
    assert np.array_equal(meta.interp_indices, indices.numpy())
    # Bit-identical float32: the same operations in the same order.
    assert meta.interp_weights.dtype == np.float32
    assert np.array_equal(meta.interp_weights.view(np.int32), weights.numpy().view(np.int32))
    assert np.array_equal(meta.position_ids, get_vision_position_ids(grid_thw, 2).numpy())
    # Full attention within each frame, not across a clip's frames.
    assert np.array_equal(meta.attention.cu_seqlens, get_vision_cu_seqlens(grid_thw, merge_temporal=False).numpy())
    assert meta.tokens_per_image == tuple(t * h * w // 4 for t, h, w in grids)


def test_packed_array_carries_every_column_exactly():
    meta = build_qwen3_vl_metadata([[2, 12, 8], [1, 100, 62]], 2, 16, 48)
    packed = meta.packed()
    assert packed.dtype == np.float32 and packed.shape == (meta.total_patches, 10)
    assert np.array_equal(packed[:, POSITION_COLUMNS].astype(np.int64), meta.position_ids)
    assert np.array_equal(packed[:, INDEX_COLUMNS].astype(np.int64), meta.interp_indices)
    assert np.array_equal(packed[:, WEIGHT_COLUMNS], meta.interp_weights)


def test_weights_of_each_patch_sum_to_one():
    meta = build_qwen3_vl_metadata([[1, 14, 38]], 2, 16, 48)
    np.testing.assert_allclose(meta.interp_weights.sum(axis=1), 1.0, rtol=0, atol=1e-6)
