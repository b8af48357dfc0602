"""Attention metadata for a batch of images, computed on the host from integer grids.

Grids arrive as Python ints and everything here is numpy: nothing touches a device tensor, so the
forward pass never has to ask the GPU for a sequence length (each such question is a hidden sync).
The model copies the arrays to the device once per batch (pinned, non-blocking).

Token order conventions (those of Qwen2-VL / Qwen2.5-VL):
- Patches of one image are laid out frame by frame; inside a frame, in *merge-block order*: the
  ``m x m`` patches that the merger later fuses into one token are adjacent.
- Qwen2.5-VL additionally permutes merge blocks into *window order* before the blocks run; windows
  never cross a frame or an image, so each frame stays one contiguous range in either order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .errors import InvalidInput

Grid = tuple[int, int, int]


def bucket_batch_size(n: int) -> int:
    """Padded sequence count for kernels that build a graph per batch size (cuDNN).

    Powers of two keep the number of distinct graphs logarithmic in the batch size.
    """
    if n < 1:
        return 1
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class AttentionMetadata:
    """One attention pattern over packed tokens: which contiguous ranges attend to each other."""

    cu_seqlens: np.ndarray  # int32 [num_sequences + 1], starts at 0
    max_seqlen: int
    # int32 [bucket_batch_size(num_sequences)], the tail padded with zeros (cuDNN-style kernels).
    sequence_lengths: np.ndarray

    @property
    def num_sequences(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def total_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def split_points(self) -> list[int]:
        """Host ints for per-sequence loops (the SDPA reference)."""
        return self.cu_seqlens.tolist()  # host: numpy array, not a device tensor

    def batch_offsets(self, num_heads: int, head_dim: int) -> np.ndarray:
        """Element offsets of each sequence in a packed [tokens, heads, head_dim] tensor, padded like
        ``sequence_lengths`` (+1 entry) with the total: what cuDNN's ragged layout asks for."""
        offsets = np.zeros(len(self.sequence_lengths) + 1, dtype=np.int64)  # caller narrows after a range check
        n = self.num_sequences
        offsets[: n + 1] = self.cu_seqlens.astype(np.int64) * num_heads * head_dim
        offsets[n + 1 :] = offsets[n]
        return offsets


def pad_attention(meta: AttentionMetadata, capacity: int, max_seqlen: int) -> AttentionMetadata:
    """The pattern at a fixed shape: ``capacity`` sequences (zero-length ones appended, holding no
    token) and ``max_seqlen`` as its longest, for kernels launched at one shape whatever the batch (a
    CUDA graph, models/cuda_graphs.py). ValueError where the pattern has more sequences or a longer one."""
    n = meta.num_sequences
    if n > capacity or meta.max_seqlen > max_seqlen:
        raise ValueError(f"{n} sequences of up to {meta.max_seqlen} tokens do not fit {capacity} of up to {max_seqlen}")
    cu = np.full(capacity + 1, meta.cu_seqlens[-1], dtype=np.int32)
    cu[: n + 1] = meta.cu_seqlens
    lengths = np.zeros(bucket_batch_size(capacity), dtype=np.int32)
    lengths[:n] = meta.sequence_lengths[:n]
    return AttentionMetadata(cu_seqlens=cu, max_seqlen=max_seqlen, sequence_lengths=lengths)


def attention_metadata(seqlens: Sequence[int] | np.ndarray) -> AttentionMetadata:
    lengths = np.asarray(seqlens, dtype=np.int32)
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    padded = np.zeros(bucket_batch_size(len(lengths)), dtype=np.int32)
    padded[: len(lengths)] = lengths
    return AttentionMetadata(cu_seqlens=cu, max_seqlen=int(lengths.max(initial=0)), sequence_lengths=padded)


@dataclass(frozen=True)
class SpatialConfig:
    """The model's spatial settings that shape the metadata."""

    spatial_merge_size: int
    patch_size: int
    window_size: int | None = None  # pixels (Qwen2.5-VL: 112); None = no window attention

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size * self.spatial_merge_size

    @property
    def window_blocks(self) -> int:
        """Window side in merge blocks (Qwen2.5-VL-7B: 112 // 2 // 14 = 4)."""
        assert self.window_size is not None
        return self.window_size // self.spatial_merge_size // self.patch_size


def check_grids(grids: Sequence[Sequence[int]], spatial_merge_size: int) -> list[Grid]:
    """Python-int grids, validated: t >= 1, h and w positive multiples of the merge size."""
    if len(grids) == 0:
        raise InvalidInput("empty batch: no grids")
    out = []
    m = spatial_merge_size
    for i, g in enumerate(grids):
        t, h, w = (int(x) for x in g)
        if t < 1 or h < m or w < m or h % m or w % m:
            raise InvalidInput(
                f"grid [{t}, {h}, {w}] is not legal: t must be >= 1 and h, w positive multiples of {m}",
                image_index=i,
            )
        out.append((t, h, w))
    return out


# --- per-image pieces, cached: a service sees the same few grid sizes over and over -------------


@lru_cache(maxsize=1024)
def frame_position_ids(h: int, w: int, m: int) -> np.ndarray:
    """(h, w) rotary position of each patch of one frame, in merge-block order. int64 [h*w, 2]."""
    hpos = np.broadcast_to(np.arange(h)[:, None], (h, w))
    wpos = np.broadcast_to(np.arange(w)[None, :], (h, w))
    # [h/m, m, w/m, m] -> [h/m, w/m, m, m]: the m x m patches of one merge block become adjacent.
    hpos = hpos.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)
    wpos = wpos.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)
    out = np.stack([hpos, wpos], axis=-1).astype(np.int64)
    out.flags.writeable = False
    return out


@lru_cache(maxsize=1024)
def _window_layout(t: int, llm_h: int, llm_w: int, win: int) -> tuple[np.ndarray, np.ndarray]:
    """Window order of one image's merge blocks and the block count of each non-empty window.

    Windows tile each frame's (llm_h x llm_w) block grid in win x win squares, row-major; the last
    row/column of windows is partial when a side is not a multiple of ``win``.
    """
    idx = np.arange(t * llm_h * llm_w, dtype=np.int64).reshape(t, llm_h, llm_w)
    nwh = -(-llm_h // win)
    nww = -(-llm_w // win)
    padded = np.full((t, nwh * win, nww * win), -1, dtype=np.int64)
    padded[:, :llm_h, :llm_w] = idx
    # [t, nwh, win, nww, win] -> [t, nwh, nww, win, win]: each window's blocks become adjacent.
    padded = padded.reshape(t, nwh, win, nww, win).transpose(0, 1, 3, 2, 4).reshape(t * nwh * nww, win * win)
    valid = padded >= 0
    order = padded[valid]
    counts = valid.sum(axis=1)
    counts = counts[counts > 0]
    order.flags.writeable = False
    counts.flags.writeable = False
    return order, counts


@dataclass(frozen=True)
class BatchMetadata:
    """Everything a forward needs about the shape of its batch; one object per batch."""

    grids: tuple[Grid, ...]
    total_patches: int
    tokens_per_image: tuple[int, ...]  # merged (output) tokens of each image
    full: AttentionMetadata  # one sequence per frame of each image
    # int64 [total_patches, 2], (h, w) rotary positions in the order the blocks see the tokens
    # (window order when window attention is on, else merge-block order).
    position_ids: np.ndarray
    window: AttentionMetadata | None = None  # one sequence per non-empty window
    window_index: np.ndarray | None = None  # int64 [total_patches / unit]: window slot -> merge block
    reverse_window_index: np.ndarray | None = None  # int64: merge block -> window slot

    @property
    def num_images(self) -> int:
        return len(self.grids)


def build_metadata(grids: Sequence[Sequence[int]], spatial: SpatialConfig,
                   merge_temporal: bool = False) -> BatchMetadata:
    """Metadata of a batch of images.

    ``merge_temporal``: one attention sequence per image covering all its frames (Kimi-K2.5)
    instead of one per frame (Qwen2.5-VL).
    """
    checked = check_grids(grids, spatial.spatial_merge_size)
    m = spatial.spatial_merge_size
    unit = spatial.merge_unit

    full_lengths: list[int] = []
    for t, h, w in checked:
        full_lengths.extend([t * h * w] if merge_temporal else [h * w] * t)
    full = attention_metadata(full_lengths)
    total = full.total_tokens

    pos = np.concatenate([np.tile(frame_position_ids(h, w, m), (t, 1)) for t, h, w in checked])
    tokens = tuple(t * h * w // unit for t, h, w in checked)

    if spatial.window_size is None:
        return BatchMetadata(tuple(checked), total, tokens, full, pos)

    win = spatial.window_blocks
    orders, window_counts = [], []
    base = 0
    for t, h, w in checked:
        order, counts = _window_layout(t, h // m, w // m, win)
        orders.append(order + base)
        window_counts.append(counts)
        base += t * (h // m) * (w // m)
    window_index = np.concatenate(orders)
    reverse = np.empty_like(window_index)
    reverse[window_index] = np.arange(len(window_index), dtype=np.int64)
    window = attention_metadata(np.concatenate(window_counts) * unit)
    pos = pos.reshape(-1, unit, 2)[window_index].reshape(-1, 2)
    return BatchMetadata(tuple(checked), total, tokens, full, pos, window, window_index, reverse)
