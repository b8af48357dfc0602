"""The client's dtype arguments, checked against the protocol's one table of wire dtypes
(``encoder_client.protocol.dtypes``, whose names this module also re-exports for older imports),
and what a bf16 embedding is handed to the caller as (``bf16_as``)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from encoder_client.protocol.dtypes import (
    BY_NAME,
    DTYPE_UNSPECIFIED,
    OUTPUT_DTYPES,
    bf16_bits_to_float32,
    dtype_name,
    wire_numpy_dtype,
)

__all__ = ["BF16_AS", "BFLOAT16", "DEFAULT_BF16_AS", "OUTPUT_DTYPES", "bf16_bits_to_float32", "bf16_rows_as",
           "dtype_name", "output_dtype_enum", "wire_numpy_dtype"]

# numpy's bfloat16: ml_dtypes' extension type (the JAX team's; what JAX and TensorFlow hand numpy).
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# How a bf16 embedding is returned:
# - "bfloat16" (the default): as is, an array of dtype ml_dtypes.bfloat16, a view of the rows the client
#   received (no copy, no conversion); numpy ufuncs take it, ``.astype(np.float32)`` widens it exactly;
# - "float32": widened to float32 (exact: bf16 is the high half of a float32), a copy of twice the bytes;
# - "uint16": the raw bit patterns, a view as for "bfloat16" (for code that hands the bytes on, e.g. to
#   torch.frombuffer(..., dtype=torch.bfloat16)).
BF16_AS = ("bfloat16", "float32", "uint16")
DEFAULT_BF16_AS = "bfloat16"


def bf16_rows_as(bits: np.ndarray, bf16_as: str) -> np.ndarray:
    """bf16 rows held as their native-order uint16 bit patterns, as ``bf16_as`` asks: a view of
    ``bits`` ("bfloat16", "uint16") or its exact float32 widening ("float32")."""
    if bf16_as == "bfloat16":
        return bits.view(BFLOAT16)
    if bf16_as == "float32":
        return bf16_bits_to_float32(bits)
    if bf16_as == "uint16":
        return bits
    raise ValueError(f"bf16_as must be one of {', '.join(BF16_AS)}, got {bf16_as!r}")


def output_dtype_enum(name: str | None) -> int:
    """The EncodeRequest.output_dtype for a requested output dtype (None = the model's dtype)."""
    if name is None:
        return DTYPE_UNSPECIFIED
    if name not in OUTPUT_DTYPES:
        raise ValueError(f"output_dtype must be one of {', '.join(OUTPUT_DTYPES)} or None, got {name!r}")
    return BY_NAME[name].enum
