"""Host metadata of one Kimi-K2.5 (MoonViT) batch, built from the integer grids before device work:
all numpy (torch only for a CPU F.interpolate that builds resampling weights), beside the shared
``encoder_service.metadata``.

MoonViT keeps each frame's patches in raster order through the whole encoder and fuses the
kh x kw blocks only at the end, pooling them over the frames of a clip. Its extra host-side
arrays live here so that its forward, like Qwen's, never derives a shape from a device tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from ...metadata import AttentionMetadata, Grid, SpatialConfig, build_metadata, frame_position_ids


@dataclass(frozen=True)
class RasterBatchMetadata:
    """Host arrays of one batch for a raster-order tower (all numpy); built before any device work."""

    grids: tuple[Grid, ...]
    attention: AttentionMetadata  # one sequence per image, all its frames
    position_ids: np.ndarray  # int64 [patches, 2] raster (h, w)
    pool: TemporalPoolIndex
    tokens_per_image: tuple[int, ...]


def build_raster_metadata(grids: Sequence[Sequence[int]], spatial: SpatialConfig) -> RasterBatchMetadata:
    """Metadata of a batch for a tower that keeps raster order and pools each clip's frames into
    one set of ``merge_unit``-patch tokens at the end."""
    base = build_metadata(grids, spatial, merge_temporal=True)
    m = spatial.spatial_merge_size
    return RasterBatchMetadata(
        grids=base.grids, attention=base.full, position_ids=raster_position_ids(base.grids),
        pool=temporal_pool_index(base.grids, m, m),
        tokens_per_image=tuple(h * w // spatial.merge_unit for _, h, w in base.grids),
    )


def clip_chunks(grid: Sequence[int], frames_per_chunk: int) -> list[Grid]:
    """A grid of ``t`` frames -> its chunks of ``frames_per_chunk`` frames in order, the last possibly
    shorter (never padded), as ``Kimi_K25VideoProcessor`` cuts a clip: ``(frames in the chunk, h, w)``
    each. A grid of at most ``frames_per_chunk`` frames is one chunk: itself."""
    t, h, w = (int(v) for v in grid)
    return [(min(frames_per_chunk, t - start), h, w) for start in range(0, t, frames_per_chunk)]


def expand_clips(grids: Sequence[Sequence[int]], frames_per_chunk: int) -> tuple[list[Grid], list[int]]:
    """A batch's grids -> (every item's chunk grids, in order; how many chunks each item has)."""
    chunks = [clip_chunks(g, frames_per_chunk) for g in grids]
    return [c for item in chunks for c in item], [len(item) for item in chunks]


def raster_position_ids(grids: Sequence[Grid]) -> np.ndarray:
    """int64 [total_patches, 2]: (h, w) of every patch, raster order, repeated for each frame."""
    return np.concatenate([np.tile(frame_position_ids(h, w, 1), (t, 1)) for t, h, w in grids])


@lru_cache(maxsize=1024)
def bicubic_resample_matrix(out_size: int, in_size: int) -> np.ndarray:
    """float32 [out_size, in_size]: one axis of ``F.interpolate(mode="bicubic", align_corners=False)``.

    The weights are PyTorch's own: F.interpolate resizes an identity along one axis (float64, on
    the host), so column i is what source cell i adds to each output cell, border clamping and all.
    A matrix rather than F.interpolate on the table in the forward pass: bicubic resampling is
    separable, so a 2-D table resizes as ``Wh @ table @ Ww.T``, two small GEMMs per grid from
    matrices built once per size here; the model casts them to the table's dtype, as transformers'
    Kimi-K2.5 casts its (hand-computed, same formula) gather weights.
    """
    eye = torch.eye(in_size, dtype=torch.float64).view(1, 1, in_size, in_size)
    weights = F.interpolate(eye, size=(out_size, in_size), mode="bicubic", align_corners=False)[0, 0]
    result = weights.numpy().astype(np.float32)  # host: CPU preprocessing, a CPU tensor
    result.flags.writeable = False
    return result


@lru_cache(maxsize=1024)
def _temporal_pool_rows(t: int, h: int, w: int, kh: int, kw: int) -> np.ndarray:
    """int64 [(h/kh)*(w/kw)*kh*kw, t]: for each merged token's kh*kw slots, the patch of each frame."""
    idx = np.arange(t * h * w, dtype=np.int64).reshape(t, h // kh, kh, w // kw, kw)
    # (t, bh, kh, bw, kw) -> (bh, bw, kh, kw, t): one row per slot, frames along the last axis.
    rows = idx.transpose(1, 3, 2, 4, 0).reshape(-1, t)
    rows.flags.writeable = False
    return rows


@dataclass(frozen=True)
class TemporalPoolIndex:
    """Gather plan of a temporal-pooling patch merger over a batch in raster order.

    ``index[r, f]`` is the patch that slot ``r`` (merged token ``r // (kh*kw)``, kernel position
    ``r % (kh*kw)``, kh-major) takes from frame ``f``; images with fewer frames than the longest
    point their missing frames at ``total_patches`` (a zero row the model appends). Averaging
    over the frames divides by ``frames[r]``.
    """

    index: np.ndarray  # int64 [total_slots, max_frames]
    frames: np.ndarray  # float32 [total_slots]
    max_frames: int


def temporal_pool_index(grids: Sequence[Grid], kernel_h: int, kernel_w: int) -> TemporalPoolIndex:
    total = sum(t * h * w for t, h, w in grids)
    max_t = max(t for t, _, _ in grids)
    parts, frames = [], []
    base = 0
    for t, h, w in grids:
        rows = _temporal_pool_rows(t, h, w, kernel_h, kernel_w) + base
        if t < max_t:
            rows = np.concatenate([rows, np.full((len(rows), max_t - t), total, dtype=np.int64)], axis=1)
        parts.append(rows)
        frames.append(np.full(len(rows), t, dtype=np.float32))
        base += t * h * w
    return TemporalPoolIndex(np.concatenate(parts), np.concatenate(frames), max_t)
