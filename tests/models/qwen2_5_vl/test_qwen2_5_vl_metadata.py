"""CPU metadata against the formulas of transformers' vision_utils (the Qwen2.5-VL reference)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import vision_utils as ref

from encoder_service.errors import InvalidInput
from encoder_service.metadata import SpatialConfig, bucket_batch_size, build_metadata

QWEN = SpatialConfig(spatial_merge_size=2, patch_size=14, window_size=112)

even_side = st.integers(1, 40).map(lambda x: 2 * x)
grid = st.tuples(st.integers(1, 4), even_side, even_side)
grids = st.lists(grid, min_size=1, max_size=4)


def _ref_metadata(grids):
    g = torch.tensor(grids, dtype=torch.int64)
    cu = ref.get_vision_cu_seqlens(g)
    pos = ref.get_vision_position_ids(g, 2)
    win_idx, cu_win = ref.get_vision_window_index(g, spatial_merge_size=2, window_size=112, patch_size=14)
    return cu.numpy(), pos.numpy(), win_idx.numpy(), cu_win.numpy()


@settings(max_examples=150, deadline=None)
@given(grids)
def test_metadata_matches_transformers_formulas(grids):
    cu, pos, win_idx, cu_win = _ref_metadata(grids)
    meta = build_metadata(grids, QWEN)

    np.testing.assert_array_equal(meta.full.cu_seqlens, cu)
    assert meta.full.cu_seqlens.dtype == np.int32
    assert meta.full.max_seqlen == int(np.diff(cu).max())
    np.testing.assert_array_equal(meta.window_index, win_idx)
    np.testing.assert_array_equal(meta.window.cu_seqlens, cu_win)
    assert meta.window.max_seqlen == int(np.diff(cu_win).max())
    # transformers permutes positions into window order inside the model; we do it on the host.
    unit = 4
    np.testing.assert_array_equal(meta.position_ids, pos.reshape(-1, unit, 2)[win_idx].reshape(-1, 2))
    np.testing.assert_array_equal(meta.window_index[meta.reverse_window_index], np.arange(len(win_idx)))
    np.testing.assert_array_equal(meta.reverse_window_index, np.argsort(win_idx))


@settings(max_examples=100, deadline=None)
@given(grids)
def test_sequence_lengths_are_padded_to_a_bucketed_batch(grids):
    meta = build_metadata(grids, QWEN)
    for pattern in (meta.full, meta.window):
        n = pattern.num_sequences
        assert len(pattern.sequence_lengths) == bucket_batch_size(n) >= n
        np.testing.assert_array_equal(pattern.sequence_lengths[:n], np.diff(pattern.cu_seqlens))
        assert not pattern.sequence_lengths[n:].any()
        assert (np.diff(pattern.cu_seqlens) > 0).all(), "empty windows must be dropped"
        offsets = pattern.batch_offsets(num_heads=3, head_dim=5)
        assert offsets[n] == pattern.total_tokens * 15 and offsets[-1] == offsets[n]


def test_sides_not_multiple_of_the_window_give_partial_windows():
    # 10x6 merge blocks with 4x4 windows: columns 4+2 and rows 4+4+2 -> 6 windows.
    meta = build_metadata([[1, 20, 12]], QWEN)
    assert np.diff(meta.window.cu_seqlens).tolist() == [64, 32, 64, 32, 32, 16]


def test_merge_temporal_makes_one_sequence_per_image():
    meta = build_metadata([[3, 4, 6], [1, 2, 2]], SpatialConfig(2, 14), merge_temporal=True)
    assert meta.full.cu_seqlens.tolist() == [0, 72, 76]
    assert meta.window is None
    assert meta.tokens_per_image == (18, 1)


def test_bucket_batch_size_is_the_next_power_of_two():
    assert [bucket_batch_size(n) for n in (0, 1, 2, 3, 4, 5, 17)] == [1, 1, 2, 4, 4, 8, 32]


@pytest.mark.parametrize("bad", [[[0, 4, 4]], [[1, 3, 4]], [[1, 4, 0]], []])
def test_illegal_grids_raise_a_typed_error(bad):
    with pytest.raises(InvalidInput):
        build_metadata(bad, QWEN)
