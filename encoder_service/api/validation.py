"""An EncodeRequest (protobuf) -> the engine's plain inputs, checked before anything is queued.

Wire-level checks live here (oneof set, dtype enums, byte lengths against the grid, options);
model-level checks (grid rules, batch limit) are asked of the engine, which knows the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from encoder_client._proto.encoder.v1 import encoder_pb2

from ..engine import Engine, ImageInput
from ..errors import EncoderError, InvalidInput, PermissionDenied
from . import dtypes

MAX_HASH_CHARS = 256


@dataclass(frozen=True)
class EncodePlan:
    images: list[ImageInput]
    output_dtype: str | None  # None = the model's dtype
    max_chunk_bytes: int


def parse_encode_request(request: encoder_pb2.EncodeRequest, engine: Engine,
                         default_chunk_bytes: int) -> EncodePlan:
    if request.HasField("sink") and (request.sink.target or request.sink.request_id):
        raise PermissionDenied("sinks are not enabled on this server (--allowed-sinks is empty); "
                               "leave sink unset to receive the embeddings on the stream")
    if len(request.images) == 0:
        raise InvalidInput("no images in the request (images is empty)")
    out_dtype = dtypes.output_dtype(request.output_dtype)
    chunk = request.max_chunk_bytes or default_chunk_bytes
    # The server's setting is also the ceiling, so a chunk always fits in one gRPC message.
    chunk = min(chunk, default_chunk_bytes)
    images = []
    for index, image in enumerate(request.images):
        try:
            images.append(_parse_image(index, image, engine))
        except EncoderError as exc:
            raise exc.with_image(index) from None
    return EncodePlan(images, out_dtype, chunk)


def _parse_image(index: int, image: encoder_pb2.Image, engine: Engine) -> ImageInput:
    source = image.WhichOneof("source")
    if source == "encoded":
        return ImageInput(index=index, kind="encoded", data=image.encoded)
    if source == "patches":
        return _parse_patches(index, image.patches, engine)
    if source == "content_hash":
        h = image.content_hash
        if not h or len(h) > MAX_HASH_CHARS:
            raise InvalidInput(f"content_hash must be 1..{MAX_HASH_CHARS} characters, got {len(h)}")
        return ImageInput(index=index, kind="content_hash", content_hash=h)
    raise InvalidInput("no source set: give encoded, patches or content_hash")


def _parse_patches(index: int, patches: encoder_pb2.Patches, engine: Engine) -> ImageInput:
    grid = engine.check_grid(list(patches.grid_thw))
    dtype = dtypes.patch_dtype(patches.dtype)
    patch_dim = engine.describe().patch_dim
    itemsize = dtypes.ITEMSIZE[dtype]
    t, h, w = grid
    num_patches = t * h * w
    expected = num_patches * patch_dim * itemsize
    got = len(patches.data)
    if got != expected:
        row_bytes = patch_dim * itemsize
        if got % row_bytes == 0:
            hint = f": that is {got // row_bytes} patches of width {patch_dim}, the grid has {num_patches}"
        elif got % (num_patches * itemsize) == 0:
            hint = (f": that is {got // (num_patches * itemsize)} values per patch, "
                    f"the model's patch width is {patch_dim}")
        else:
            hint = ""
        raise InvalidInput(
            f"patches data has {got} bytes; grid {list(grid)} x patch width {patch_dim} x {itemsize} bytes "
            f"({dtype}) needs {expected}{hint}")
    return ImageInput(index=index, kind="patches", data=patches.data, grid=grid, patch_dtype=dtype,
                      dtype_enum=int(patches.dtype))
