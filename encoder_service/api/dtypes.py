"""The request's DType enum values -> the engine's dtype names, checked (the table itself is the
protocol's, ``encoder_client.protocol.dtypes``)."""

from __future__ import annotations

from encoder_client.protocol import BY_ENUM, encoder_pb2

from ..errors import InvalidInput


def enum_label(value: int) -> str:
    try:
        return encoder_pb2.DType.Name(value)
    except ValueError:
        return f"unknown DType value {value}"


def patch_dtype(value: int) -> str:
    if value == encoder_pb2.DTYPE_UNSPECIFIED:
        raise InvalidInput("patches dtype is not set: use DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16 or "
                           "DTYPE_UINT8")
    wire = BY_ENUM.get(value)
    if wire is None:
        raise InvalidInput(f"patches dtype: {enum_label(value)}; use DTYPE_FLOAT32, DTYPE_FLOAT16, "
                           "DTYPE_BFLOAT16 or DTYPE_UINT8")
    return wire.name


def output_dtype(value: int) -> str | None:
    """None = the model's dtype."""
    if value == encoder_pb2.DTYPE_UNSPECIFIED:
        return None
    wire = BY_ENUM.get(value)
    if wire is None or not wire.embedding:
        raise InvalidInput(f"output_dtype: {enum_label(value)} is not an embedding dtype; use "
                           "DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16 or DTYPE_UNSPECIFIED (the model's)")
    return wire.name
