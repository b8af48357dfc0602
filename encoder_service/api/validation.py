"""An EncodeRequest (protobuf) -> the engine's plain inputs, checked before anything is queued.

Wire-level checks live here (oneof set, dtype enums, byte lengths against the grid, options);
model-level checks (grid rules, batch limit) are asked of the engine, which knows the model.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass

from encoder_client._proto.encoder.v1 import encoder_pb2

from ..engine import Engine, ImageInput
from ..errors import EncoderError, InvalidInput, PermissionDenied
from . import dtypes

MAX_HASH_CHARS = 256
MAX_SINK_REQUEST_ID_CHARS = 256
# host:port only: a scheme (dns:, unix:, ipv4:...) or a path would let a target escape the patterns.
_SINK_TARGET = re.compile(r"^(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}$")


@dataclass(frozen=True)
class SinkSpec:
    target: str  # host:port, matched by --allowed-sinks
    request_id: str  # tags every pushed chunk


@dataclass(frozen=True)
class EncodePlan:
    images: list[ImageInput]
    output_dtype: str | None  # None = the model's dtype
    max_chunk_bytes: int
    sink: SinkSpec | None = None  # push the embeddings there; the caller's stream gets headers


def check_sink(request: encoder_pb2.EncodeRequest, allowed_sinks: Sequence[str]) -> SinkSpec | None:
    """The request's sink if it names one that --allowed-sinks permits (checked before any connection)."""
    if not request.HasField("sink") or not (request.sink.target or request.sink.request_id):
        return None
    target = request.sink.target
    if not allowed_sinks:
        raise PermissionDenied("sinks are not enabled on this server (--allowed-sinks is empty); "
                               "leave sink unset to receive the embeddings on the stream")
    if not _SINK_TARGET.match(target):
        raise InvalidInput(f"sink.target {target[:200]!r} must be host:port (no scheme, no path)")
    if not any(fnmatch.fnmatchcase(target.lower(), p.lower()) for p in allowed_sinks):
        raise PermissionDenied(f"sink {target!r} is not in this server's --allowed-sinks")
    request_id = request.sink.request_id or request.request_id
    if not request_id:
        raise InvalidInput("sink.request_id is empty (and so is request_id): the sink needs an id "
                           "to file the embeddings under")
    if len(request_id) > MAX_SINK_REQUEST_ID_CHARS:
        raise InvalidInput(f"sink.request_id has {len(request_id)} characters; at most "
                           f"{MAX_SINK_REQUEST_ID_CHARS}")
    return SinkSpec(target, request_id)


def parse_encode_request(request: encoder_pb2.EncodeRequest, engine: Engine,
                         default_chunk_bytes: int, allowed_sinks: Sequence[str] = ()) -> EncodePlan:
    sink = check_sink(request, allowed_sinks)
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
    return EncodePlan(images, out_dtype, chunk, sink)


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
