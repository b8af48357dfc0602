"""Host metadata of one Qwen3-VL batch, all numpy, built from the integer grids before device work.

- Attention: full attention within each frame (one sequence per frame of each image, as
  transformers' ``get_vision_attention_seqlens`` without ``merge_temporal``).
- Rotary positions: (row, col) of each patch in merge-block order, repeated for each frame
  (``encoder_service.metadata``, shared with Qwen2.5-VL).
- Position embedding: the learned square table resampled to each (h, w) grid bilinearly with
  ``align_corners=True``, as 4 table rows and 4 weights per patch, in the same order as the patches
  (transformers' ``get_vision_interpolation_indices_and_weights``). The weights are computed with
  the reference's float32 operations in the same order, so they are bit-identical to its.

``packed()`` puts what the device needs into one float32 array: the batch's single host-to-device
copy. Positions and table indices are integers below 2**24 (config.check), exact in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...metadata import AttentionMetadata, SpatialConfig, build_metadata

Grid = tuple[int, int, int]

# Columns of the packed array: 2 rotary positions (row, col), 4 table rows, 4 weights.
POSITION_COLUMNS = slice(0, 2)
INDEX_COLUMNS = slice(2, 6)
WEIGHT_COLUMNS = slice(6, 10)
PACKED_WIDTH = 10


@dataclass(frozen=True)
class Qwen3VLBatchMetadata:
    grids: tuple[Grid, ...]
    tokens_per_image: tuple[int, ...]  # merged (output) rows of each image
    attention: AttentionMetadata  # one sequence per frame
    position_ids: np.ndarray  # int64 [patches, 2]: (row, col) for the rotary embedding
    interp_indices: np.ndarray  # int64 [patches, 4]: rows of the flattened position table
    interp_weights: np.ndarray  # float32 [patches, 4]: their bilinear weights

    @property
    def total_patches(self) -> int:
        return self.attention.total_tokens

    def packed(self) -> np.ndarray:
        """float32 [patches, PACKED_WIDTH]: positions, table rows and weights side by side."""
        out = np.empty((self.total_patches, PACKED_WIDTH), dtype=np.float32)
        out[:, POSITION_COLUMNS] = self.position_ids
        out[:, INDEX_COLUMNS] = self.interp_indices
        out[:, WEIGHT_COLUMNS] = self.interp_weights
        return out


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """The two taps into a ``side``-long table axis and their weights, for positions ``index`` on
    axes of ``size`` (per element): ``F.interpolate(mode="bilinear", align_corners=True)`` along one
    axis, the endpoints on the table's first and last entries."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    distance = np.abs(src[:, None] - floor[:, None] - offsets)
    weights = np.maximum(np.float32(1) - distance, np.float32(0))
    return taps, weights


def interpolation(position_ids: np.ndarray, sizes: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear resampling of a ``side x side`` table at each patch's (row, col) on its (h, w) grid.

    ``position_ids`` and ``sizes`` are int64 [patches, 2]. Returns int64 table rows and float32
    weights, [patches, 4], taps ordered (top-left, top-right, bottom-left, bottom-right).
    """
    row_taps, row_weights = _axis_taps(position_ids[:, 0], sizes[:, 0], side)
    col_taps, col_weights = _axis_taps(position_ids[:, 1], sizes[:, 1], side)
    indices = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


def build_qwen3_vl_metadata(grids: Sequence[Sequence[int]], spatial_merge_size: int, patch_size: int,
                            num_grid_per_side: int) -> Qwen3VLBatchMetadata:
    base = build_metadata(grids, SpatialConfig(spatial_merge_size, patch_size))
    patches = [t * h * w for t, h, w in base.grids]
    sizes = np.repeat(np.asarray([(h, w) for _, h, w in base.grids], dtype=np.int64), patches, axis=0)
    indices, weights = interpolation(base.position_ids, sizes, num_grid_per_side)
    return Qwen3VLBatchMetadata(base.grids, base.tokens_per_image, base.full, base.position_ids, indices, weights)
