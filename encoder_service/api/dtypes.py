"""The wire DType enum <-> the engine's dtype names."""

from __future__ import annotations

from encoder_client._proto.encoder.v1 import encoder_pb2

from ..errors import InvalidInput

ENUM_BY_NAME = {
    "float32": encoder_pb2.DTYPE_FLOAT32,
    "float16": encoder_pb2.DTYPE_FLOAT16,
    "bfloat16": encoder_pb2.DTYPE_BFLOAT16,
    "uint8": encoder_pb2.DTYPE_UINT8,
}
NAME_BY_ENUM = {v: k for k, v in ENUM_BY_NAME.items()}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1}


def enum_label(value: int) -> str:
    try:
        return encoder_pb2.DType.Name(value)
    except ValueError:
        return f"unknown DType value {value}"


def patch_dtype(value: int) -> str:
    if value == encoder_pb2.DTYPE_UNSPECIFIED:
        raise InvalidInput("patches dtype is not set: use DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16 or "
                           "DTYPE_UINT8")
    name = NAME_BY_ENUM.get(value)
    if name is None:
        raise InvalidInput(f"patches dtype: {enum_label(value)}; use DTYPE_FLOAT32, DTYPE_FLOAT16, "
                           "DTYPE_BFLOAT16 or DTYPE_UINT8")
    return name


def output_dtype(value: int) -> str | None:
    """None = the model's dtype."""
    if value == encoder_pb2.DTYPE_UNSPECIFIED:
        return None
    name = NAME_BY_ENUM.get(value)
    if name is None or name == "uint8":
        raise InvalidInput(f"output_dtype: {enum_label(value)} is not an embedding dtype; use "
                           "DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16 or DTYPE_UNSPECIFIED (the model's)")
    return name
