"""The one table of wire dtypes: name, ``encoder.v1.DType`` enum value, numpy dtype, item size.

Client and server both read it; the server derives its torch dtypes from the names
(``encoder_service.dtypes``), so no other table of dtypes exists. numpy itself has no bfloat16, so
bf16 travels as its raw 2-byte pattern, held here in a ``uint16`` array; widening it to float32 is
exact (bf16 is the high half of a float32). The client hands it to the caller as ``ml_dtypes.bfloat16``
by default, a view of those bytes (``encoder_client.dtypes``: ``bf16_as``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from encoder_client.protocol.stubs import encoder_pb2


@dataclass(frozen=True)
class WireDType:
    """One wire dtype. ``numpy`` is the explicit little-endian dtype that holds one element on the
    wire (bf16: its ``<u2`` bit pattern); ``embedding`` says whether embeddings may be sent in it."""

    name: str
    enum: int
    numpy: np.dtype
    embedding: bool

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize


DTYPE_UNSPECIFIED: int = encoder_pb2.DTYPE_UNSPECIFIED

DTYPES: tuple[WireDType, ...] = (
    WireDType("float32", encoder_pb2.DTYPE_FLOAT32, np.dtype("<f4"), embedding=True),
    WireDType("float16", encoder_pb2.DTYPE_FLOAT16, np.dtype("<f2"), embedding=True),
    WireDType("bfloat16", encoder_pb2.DTYPE_BFLOAT16, np.dtype("<u2"), embedding=True),
    WireDType("uint8", encoder_pb2.DTYPE_UINT8, np.dtype("u1"), embedding=False),
)

BY_NAME: Mapping[str, WireDType] = MappingProxyType({d.name: d for d in DTYPES})
BY_ENUM: Mapping[int, WireDType] = MappingProxyType({d.enum: d for d in DTYPES})

# Patches may come in any wire dtype; embeddings (and a model's dtype) only in these.
PATCH_DTYPES: tuple[str, ...] = tuple(d.name for d in DTYPES)
OUTPUT_DTYPES: tuple[str, ...] = tuple(d.name for d in DTYPES if d.embedding)


def dtype_name(dtype: int) -> str:
    """Name of a wire dtype enum value ("float32", ...; "unspecified" for 0)."""
    if dtype == DTYPE_UNSPECIFIED:
        return "unspecified"
    try:
        return BY_ENUM[dtype].name
    except KeyError:
        raise ValueError(f"unknown wire dtype {dtype}") from None


def wire_numpy_dtype(dtype: int) -> np.dtype:
    """The little-endian numpy dtype that holds one element of a wire dtype (by enum value)."""
    try:
        return BY_ENUM[dtype].numpy
    except KeyError:
        raise ValueError(f"no numpy dtype for wire dtype {dtype}") from None


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen bf16 bit patterns (uint16) to float32, exactly: they become the high half of a uint32."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
