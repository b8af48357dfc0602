"""Values the client takes and returns."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Union

import numpy as np

from encoder_client.protocol import ModelInfo, encoder_pb2

__all__ = ["EncodedImage", "HashRef", "ImageInput", "ModelInfo"]  # ModelInfo: encoder_client.protocol's


@dataclass(frozen=True)
class HashRef:
    """A reference to an embedding the server already caches, by its content hash.

    The server never trusts a caller's hash as a cache key for new data; a HashRef only looks up
    an existing entry (NOT_FOUND if it was never computed or has been evicted).
    """

    content_hash: str


# bytes: an encoded image (JPEG/PNG/...); str/PathLike: a file holding one; (patches, grid):
# preprocessed patches [t*h*w, patch_dim] with their grid (t, h, w); HashRef: a cached entry;
# an encoder_pb2.Image is passed through as is.
ImageInput = Union[
    bytes, bytearray, memoryview, str, "os.PathLike[str]",
    tuple[np.ndarray, tuple[int, int, int]], HashRef, encoder_pb2.Image,
]


@dataclass
class EncodedImage:
    """One image's embedding, reassembled from its chunks.

    ``dtype`` is the wire dtype the server produced ("float32", "float16" or "bfloat16");
    ``embedding.dtype`` is the numpy dtype returned: the same, except bf16, which comes back as
    float32 (exact widening) or, with ``bf16_as="uint16"``, as raw bit patterns. ``timing`` is the
    server's account (``queue_ms``, ``preprocess_ms``, ``forward_ms``) when it sent one;
    ``latency_ms`` is what the client observed, from the start of the request (first attempt)
    until this image's last chunk.

    ``embedding`` is the main embedding [num_tokens, hidden_size]. A model with extra feature levels
    (Qwen3-VL's deepstack: intermediate vision layers the LLM injects into its first layers) also
    fills ``deepstack``, one [num_tokens, hidden_size] array per extra level in order; it is empty
    for other models. All of them are contiguous views of one buffer (nothing copied per level).
    """

    index: int
    embedding: np.ndarray
    content_hash: str
    grid_thw: tuple[int, ...]
    num_tokens: int
    hidden_size: int
    cache_hit: bool
    dtype: str
    timing: dict[str, float] | None
    latency_ms: float = 0.0
    deepstack: tuple[np.ndarray, ...] = ()

    @property
    def feature_levels(self) -> int:
        """Levels of this embedding: the main one plus the deepstack levels."""
        return 1 + len(self.deepstack)

    @property
    def nbytes(self) -> int:
        """Bytes held by every level."""
        return self.embedding.nbytes + sum(level.nbytes for level in self.deepstack)
