"""The client's dtype arguments, checked against the protocol's one table of wire dtypes
(``encoder_client.protocol.dtypes``, whose names this module also re-exports for older imports)."""

from __future__ import annotations

from encoder_client.protocol.dtypes import (
    BY_NAME,
    DTYPE_UNSPECIFIED,
    OUTPUT_DTYPES,
    bf16_bits_to_float32,
    dtype_name,
    wire_numpy_dtype,
)

__all__ = ["BF16_AS", "OUTPUT_DTYPES", "bf16_bits_to_float32", "dtype_name", "output_dtype_enum",
           "wire_numpy_dtype"]

# How a bf16 embedding is returned: widened to float32 (exact) or as its raw uint16 bit patterns.
BF16_AS = ("float32", "uint16")


def output_dtype_enum(name: str | None) -> int:
    """The EncodeRequest.output_dtype for a requested output dtype (None = the model's dtype)."""
    if name is None:
        return DTYPE_UNSPECIFIED
    if name not in OUTPUT_DTYPES:
        raise ValueError(f"output_dtype must be one of {', '.join(OUTPUT_DTYPES)} or None, got {name!r}")
    return BY_NAME[name].enum
