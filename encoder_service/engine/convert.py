"""Raw little-endian bytes <-> arrays: incoming patches to float32, embeddings to output bytes."""

from __future__ import annotations

import numpy as np
import torch

_PATCH_NUMPY = {"float32": "<f4", "float16": "<f2", "uint8": "u1"}
_OUTPUT_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1}


def patches_to_float32(data: bytes, patch_dtype: str, patch_dim: int) -> np.ndarray:
    """Wire patches -> a writable float32 array [n, patch_dim] (the model's input dtype)."""
    if patch_dtype == "bfloat16":
        # bf16 is the top half of a float32: widen the 16-bit pattern and shift it into place.
        raw = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        flat = raw.view(np.float32)
    else:
        flat = np.frombuffer(data, dtype=_PATCH_NUMPY[patch_dtype]).astype(np.float32)  # copies
    return flat.reshape(-1, patch_dim)


def output_dtype(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if name is None else _OUTPUT_TORCH[name]


def torch_dtype(name: str) -> torch.dtype:
    """"bfloat16" -> torch.bfloat16 (the embedding dtypes)."""
    return _OUTPUT_TORCH[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
