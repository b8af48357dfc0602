"""What a loaded model is, as plain facts (``ModelSpec``), and the checks of a batch against them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InvalidInput

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class ModelSpec:
    """Static facts about a loaded model that the API reports and the engine plans with."""

    model_id: str
    model_type: str
    hidden_size: int  # output (LLM) hidden size of each embedding row
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    # Feature levels per embedding row: the main embedding, then any extra levels the LLM injects
    # elsewhere (Qwen3-VL's deepstack), each ``hidden_size`` wide and concatenated along the row.
    feature_levels: int = 1
    # Whether the merger folds a group of frames into one set of tokens (Kimi-K2.5 averages them).
    frames_merged: bool = False
    # With frames_merged, the frames of one group (Kimi-K2.5: its video processor's temporal_patch_size,
    # at most the tower's pos_emb_time): a grid of more frames is a clip, its frames consecutive groups
    # of this many (the last possibly shorter), each merged on its own, their tokens in order. A grid of
    # at most this many frames is one group. 0: any grid is one group.
    frames_per_chunk: int = 0
    # Fingerprint inputs for cache_namespace: anything that changes the embedding of the same bytes.
    fingerprint: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size * self.spatial_merge_size

    @property
    def split_unit(self) -> int:
        """Grid ``t`` steps of a clip that encode independently of the rest of it, so a clip too large
        for one forward may be cut into parts of whole steps, encoded in separate forwards and their
        rows concatenated: 1 where no frame attends across time slices (Qwen: attention sequences and
        positions are per temporal patch), ``frames_per_chunk`` where frames are merged per chunk
        (Kimi-K2.5: a chunk attends within itself); 0 (never) where a grid is one merged group."""
        if self.frames_merged:
            return self.frames_per_chunk
        return 1

    def num_tokens(self, grid: Sequence[int]) -> int:
        """Embedding rows of one image (or clip) of ``grid`` [t, h, w] (in patches): ``t`` sets of
        ``h*w/merge_unit`` rows, or with ``frames_merged`` one set per group of frames
        (``ceil(t / frames_per_chunk)``, one where that is 0)."""
        t, h, w = (int(v) for v in grid)
        return self.temporal_groups(t) * h * w // self.merge_unit

    def temporal_groups(self, t: int) -> int:
        """How many sets of merged tokens ``t`` frames give."""
        if not self.frames_merged:
            return t
        return -(-t // self.frames_per_chunk) if self.frames_per_chunk else 1

    @property
    def row_width(self) -> int:
        """Values in one embedding row: ``hidden_size`` for each feature level."""
        return self.hidden_size * self.feature_levels


def validate_grid(grid: Sequence[int], spec: ModelSpec) -> Grid:
    """Checks one [t, h, w] grid (Python ints) against the model's merge rules."""
    if isinstance(grid, (str, bytes)) or len(grid) != 3:
        raise InvalidInput(f"grid_thw must be [t, h, w], got {list(grid) if not isinstance(grid, str) else grid!r}")
    try:
        t, h, w = (int(x) for x in grid)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"grid_thw must hold integers, got {list(grid)!r}") from exc
    if t < 1:
        raise InvalidInput(f"grid t must be >= 1, got t={t}")
    m = spec.spatial_merge_size
    if h < m or w < m or h % m or w % m:
        raise InvalidInput(
            f"grid h and w must be positive multiples of the spatial merge size {m}, got h={h}, w={w}"
        )
    return t, h, w


def validate_batch(pixel_values: torch.Tensor | np.ndarray, grids: Sequence[Sequence[int]],
                   spec: ModelSpec) -> list[Grid]:
    """Checks a batch before any device work: grids legal, patch count and width matching."""
    if len(grids) == 0:
        raise InvalidInput("empty batch: no images (grid_thw is empty)")
    checked = []
    for i, g in enumerate(grids):
        try:
            checked.append(validate_grid(g, spec))
        except InvalidInput as exc:
            raise exc.with_image(i) from None
    if pixel_values.ndim != 2:
        raise InvalidInput(f"pixel_values must be 2-D [patches, {spec.patch_dim}], got shape "
                           f"{tuple(pixel_values.shape)}")
    if pixel_values.shape[1] != spec.patch_dim:
        raise InvalidInput(f"wrong patch width: pixel_values has {pixel_values.shape[1]} values per patch, "
                           f"the model needs {spec.patch_dim}")
    expected = sum(t * h * w for t, h, w in checked)
    if pixel_values.shape[0] != expected:
        raise InvalidInput(f"patch count does not match the grids: pixel_values has {pixel_values.shape[0]} "
                           f"patches, grids {[list(g) for g in checked]} need {expected}")
    return checked
