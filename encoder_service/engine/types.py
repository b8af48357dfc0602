"""What goes into the engine and what comes out: plain Python, numpy and torch; no protobuf."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..preprocess.video_sampling import VideoSampling
from ..torch_dtypes import torch_dtype
from .convert import rows_to_bytes, wire_view

Grid = tuple[int, int, int]
InputKind = Literal["encoded", "patches", "content_hash", "video"]


@dataclass(frozen=True)
class VideoInput:
    """A clip as the API checked it: a container's bytes, or its frames (JPEG/PNG) in order with the
    rate they were taken at (0: unknown), and how the caller asked it to be sampled."""

    sampling: VideoSampling
    sampling_key: bytes  # the settings as hashed (encoder_client.protocol.hashing.sampling_key)
    encoded: bytes = b""
    frames: tuple[bytes, ...] = ()
    frames_fps: float = 0.0

    @property
    def nbytes(self) -> int:
        return len(self.encoded) + sum(len(f) for f in self.frames)


@dataclass(frozen=True)
class ClipFrames:
    """Which source frames a clip's embedding was computed from (the padding frame repeated where
    the model pads to its temporal patch size) and their timestamps in seconds (empty: unknown)."""

    indices: tuple[int, ...]
    timestamps_s: tuple[float, ...] = ()
    sampled: tuple[int, ...] = ()  # the frames the reference lists: ``indices`` without the padding


@dataclass(frozen=True)
class ImageInput:
    """One image of a request, after the API checked its wire form.

    ``encoded``: ``data`` holds the encoded file bytes.
    ``patches``: ``data`` holds raw little-endian patches [t*h*w, patch_dim] in ``patch_dtype``,
    ``grid`` the (t, h, w) and ``dtype_enum`` the wire enum value (part of the content hash).
    ``content_hash``: ``content_hash`` names an entry the cache should hold.
    ``video``: ``video`` holds the clip (``data`` stays empty).
    """

    index: int
    kind: InputKind
    data: bytes = b""
    grid: Grid | None = None
    patch_dtype: str = "float32"
    dtype_enum: int = 0
    content_hash: str = ""
    video: VideoInput | None = None

    @property
    def nbytes(self) -> int:
        return self.video.nbytes if self.video is not None else len(self.data)


@dataclass
class Timing:
    queue_ms: float = 0.0
    preprocess_ms: float = 0.0
    forward_ms: float = 0.0


@dataclass(frozen=True)
class ImageResult:
    """One image's embedding, ready to stream: a CPU tensor [num_tokens, row_width] in the model dtype,
    each row ``feature_levels`` levels of ``hidden_size`` values (the main embedding first)."""

    index: int
    content_hash: str
    grid: Grid
    embedding: torch.Tensor
    cache_hit: bool
    timing: Timing = field(default_factory=Timing)
    feature_levels: int = 1  # ModelSpec.feature_levels of the model that made it
    # The cache entry's rows in other wire dtypes, and how to keep a new one there (None: not cached).
    conversions: dict[str, bytes] | None = None
    keep_conversion: Callable[[str, bytes], object] | None = None
    clip: ClipFrames | None = None  # a clip's frames; None for an image

    @property
    def num_tokens(self) -> int:
        return int(self.embedding.shape[0])

    @property
    def row_width(self) -> int:
        return int(self.embedding.shape[1])

    @property
    def hidden_size(self) -> int:
        """One level's width (what the wire's hidden_size says)."""
        return self.row_width // self.feature_levels

    def wire_bytes(self, dtype_name: str) -> memoryview:
        """The rows as raw little-endian bytes in ``dtype_name``, flat: what the API streams, with no
        torch on its side. A view of the embedding's own memory in the model dtype; in another
        dtype, the bytes the cache kept from an earlier request, or one conversion, which the cache
        then keeps (on the event loop, like every cache call)."""
        view = wire_view(self.embedding, dtype_name)
        if view is not None:
            return view
        data = self.conversions.get(dtype_name) if self.conversions is not None else None
        if data is None:
            data = rows_to_bytes(self.embedding, torch_dtype(dtype_name), 0, self.num_tokens)
            if self.keep_conversion is not None:
                self.keep_conversion(dtype_name, data)
        return memoryview(data)
