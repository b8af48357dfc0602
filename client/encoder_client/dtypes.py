"""Wire dtypes: names, proto enum values, numpy dtypes, and the bf16 bit-pattern conversion.

numpy has no bfloat16, so bf16 travels (and may be returned) as its raw 2-byte pattern in a
``uint16`` array; widening it to float32 is exact (bf16 is the high half of a float32).
"""

from __future__ import annotations

import numpy as np

from encoder_client._proto.encoder.v1 import encoder_pb2

# Name <-> enum. "bfloat16" maps to the same enum whatever the caller's array library calls it.
DTYPE_BY_NAME: dict[str, int] = {
    "float32": encoder_pb2.DTYPE_FLOAT32,
    "float16": encoder_pb2.DTYPE_FLOAT16,
    "bfloat16": encoder_pb2.DTYPE_BFLOAT16,
    "uint8": encoder_pb2.DTYPE_UINT8,
}
NAME_BY_DTYPE: dict[int, str] = {v: k for k, v in DTYPE_BY_NAME.items()}

# Explicit little-endian numpy dtypes: the wire is little-endian whatever the host is.
# bf16 is carried as uint16 bit patterns.
_WIRE_NUMPY: dict[int, np.dtype] = {
    encoder_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
    encoder_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
    encoder_pb2.DTYPE_BFLOAT16: np.dtype("<u2"),
    encoder_pb2.DTYPE_UINT8: np.dtype("u1"),
}

OUTPUT_DTYPES = ("float32", "float16", "bfloat16")
BF16_AS = ("float32", "uint16")


def dtype_name(dtype: int) -> str:
    """Name of a wire dtype enum value ("float32", ...; "unspecified" for 0)."""
    if dtype == encoder_pb2.DTYPE_UNSPECIFIED:
        return "unspecified"
    try:
        return NAME_BY_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"unknown wire dtype {dtype}") from None


def output_dtype_enum(name: str | None) -> int:
    """The EncodeRequest.output_dtype for a requested output dtype (None = the model's dtype)."""
    if name is None:
        return encoder_pb2.DTYPE_UNSPECIFIED
    if name not in OUTPUT_DTYPES:
        raise ValueError(f"output_dtype must be one of {', '.join(OUTPUT_DTYPES)} or None, got {name!r}")
    return DTYPE_BY_NAME[name]


def wire_numpy_dtype(dtype: int) -> np.dtype:
    """The little-endian numpy dtype that holds one element of a wire dtype."""
    try:
        return _WIRE_NUMPY[dtype]
    except KeyError:
        raise ValueError(f"no numpy dtype for wire dtype {dtype}") from None


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen bf16 bit patterns (uint16) to float32, exactly: they become the high half of a uint32."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
