"""Raw little-endian bytes <-> arrays: incoming patches to float32, embeddings to output bytes."""

from __future__ import annotations

import sys

import numpy as np
import torch
from encoder_client.protocol.dtypes import BY_NAME

from ..torch_dtypes import torch_dtype


def patches_to_float32(data: bytes, patch_dtype: str, patch_dim: int) -> np.ndarray:
    """Wire patches -> a writable float32 array [n, patch_dim] (the model's input dtype)."""
    if patch_dtype == "bfloat16":
        # bf16 is the top half of a float32: widen the 16-bit pattern and shift it into place.
        raw = np.frombuffer(data, dtype=BY_NAME["bfloat16"].numpy).astype(np.uint32) << 16
        flat = raw.view(np.float32)
    else:
        flat = np.frombuffer(data, dtype=BY_NAME[patch_dtype].numpy).astype(np.float32)  # copies
    return flat.reshape(-1, patch_dim)


def wire_view(embedding: torch.Tensor, dtype_name: str) -> memoryview | None:
    """A CPU embedding as flat raw little-endian bytes in ``dtype_name`` when that is a view of its
    own memory (already in that dtype); None where it takes a conversion (``rows_to_bytes``)."""
    if embedding.dtype != torch_dtype(dtype_name) or not embedding.is_contiguous() or sys.byteorder != "little":
        return None
    return memoryview(embedding.view(torch.uint8).numpy()).cast("B")


def rows_to_bytes(embedding: torch.Tensor, out_dtype: torch.dtype, start: int, stop: int) -> bytes:
    """Rows [start, stop) of a CPU embedding as raw little-endian bytes in ``out_dtype``."""
    rows = embedding[start:stop]
    if rows.dtype != out_dtype:
        rows = rows.to(out_dtype)
    if out_dtype == torch.bfloat16:  # numpy has no bf16: ship its 2-byte pattern
        array = rows.contiguous().view(torch.int16).numpy().astype("<i2", copy=False)
    else:
        array = rows.contiguous().numpy()
        array = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return array.tobytes()
