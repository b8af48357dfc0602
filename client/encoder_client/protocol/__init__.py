"""The encoder.v1 protocol, shared by the client and the server: the one thing either imports for it.

- ``encoder_pb2``, ``encoder_pb2_grpc``: the generated messages and service stubs
  (``protos/encoder/v1/encoder.proto``; ``encoder_client._proto`` is where the generator writes
  them and is private).
- ``DTYPES`` and its lookups (``encoder_client.protocol.dtypes``): the one table of wire dtypes,
  name <-> enum value <-> numpy dtype <-> item size.
- ``hash_encoded``, ``hash_patches`` (``encoder_client.protocol.hashing``): the content hash that
  keys the server's cache, which a client computes locally.
- ``ModelInfo``: GetModelInfo's answer.

Needs only grpcio, protobuf and numpy (no torch).
"""

from encoder_client.protocol.dtypes import (
    BY_ENUM,
    BY_NAME,
    DTYPE_UNSPECIFIED,
    DTYPES,
    OUTPUT_DTYPES,
    PATCH_DTYPES,
    WireDType,
    bf16_bits_to_float32,
    dtype_name,
    wire_numpy_dtype,
)
from encoder_client.protocol.hashing import (
    HASH_VERSION,
    hash_encoded,
    hash_patches,
    hash_video,
    sampling_key,
    wire_sampling_key,
)
from encoder_client.protocol.model_info import ModelInfo
from encoder_client.protocol.stubs import encoder_pb2, encoder_pb2_grpc

__all__ = [
    "BY_ENUM",
    "BY_NAME",
    "DTYPES",
    "DTYPE_UNSPECIFIED",
    "HASH_VERSION",
    "OUTPUT_DTYPES",
    "PATCH_DTYPES",
    "ModelInfo",
    "WireDType",
    "bf16_bits_to_float32",
    "dtype_name",
    "encoder_pb2",
    "encoder_pb2_grpc",
    "hash_encoded",
    "hash_patches",
    "hash_video",
    "sampling_key",
    "wire_numpy_dtype",
    "wire_sampling_key",
]
