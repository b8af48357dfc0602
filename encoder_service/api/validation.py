"""An EncodeRequest (protobuf) -> the engine's plain inputs, checked before anything is queued.

Wire-level checks live here (oneof set, dtype enums, byte lengths against the grid, options);
model-level checks (grid rules, batch limit) are asked of the engine, which knows the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from encoder_client.protocol import BY_NAME, encoder_pb2, wire_sampling_key

from ..config import chunk_budget
from ..engine import Engine, ImageInput
from ..engine.types import VideoInput, VideoSampling
from ..errors import EncoderError, InvalidInput, PermissionDenied
from ..preprocess.video_sampling import REFERENCES, check_fps_xor_num_frames
from ..sink_allowlist import SinkAllowlist, parse_target
from . import dtypes

MAX_HASH_CHARS = 256
# Both ids are repeated in every chunk: unbounded, they would multiply the response's size.
MAX_REQUEST_ID_CHARS = 256


@dataclass(frozen=True)
class SinkSpec:
    target: str  # host:port, matched by --allowed-sinks
    request_id: str  # tags every pushed chunk
    pattern: str = ""  # the --allowed-sinks pattern that admitted it (the metrics' label)


@dataclass(frozen=True)
class EncodePlan:
    images: list[ImageInput]
    output_dtype: str | None  # None = the model's dtype
    max_chunk_bytes: int
    sink: SinkSpec | None = None  # push the embeddings there; the caller's stream gets headers


def check_sink(request: encoder_pb2.EncodeRequest, allowed_sinks: SinkAllowlist) -> SinkSpec | None:
    """The request's sink if it names one that --allowed-sinks permits (checked before any connection)."""
    if not request.HasField("sink") or not (request.sink.target or request.sink.request_id):
        return None
    if not allowed_sinks:
        raise PermissionDenied("sinks are not enabled on this server (--allowed-sinks is empty); "
                               "leave sink unset to receive the embeddings on the stream")
    target = parse_target(request.sink.target)
    pattern = allowed_sinks.match(target)
    if pattern is None:
        raise PermissionDenied(f"sink {target.text!r} is not in this server's --allowed-sinks")
    request_id = request.sink.request_id or request.request_id
    if not request_id:
        raise InvalidInput("sink.request_id is empty (and so is request_id): the sink needs an id "
                           "to file the embeddings under")
    _check_id("sink.request_id", request_id)
    return SinkSpec(target.text, request_id, pattern)


def _check_id(field: str, value: str) -> None:
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidInput(f"{field} has {len(value)} characters; at most {MAX_REQUEST_ID_CHARS}")


def parse_encode_request(request: encoder_pb2.EncodeRequest, engine: Engine, default_chunk_bytes: int,
                         allowed_sinks: SinkAllowlist | None = None, max_images: int = 256) -> EncodePlan:
    _check_id("request_id", request.request_id)
    sink = check_sink(request, allowed_sinks or SinkAllowlist(()))
    if sink is not None and request.HasField("output_region"):
        raise InvalidInput("output_region and sink are both set: the embeddings go either to the sink "
                           "or into the region")
    if request.cache_only and (sink is not None or request.HasField("output_region")):
        raise InvalidInput("cache_only returns no rows: it takes neither a sink nor an output_region")
    if len(request.images) == 0:
        raise InvalidInput("no images in the request (images is empty)")
    if len(request.images) > max_images:
        raise InvalidInput(f"{len(request.images)} images in one request; at most {max_images} "
                           "(--max-images-per-request): split it into several requests")
    out_dtype = dtypes.output_dtype(request.output_dtype)
    chunk = chunk_budget(request.max_chunk_bytes, default_chunk_bytes)
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
    if source == "video":
        return _parse_video(index, image.video)
    if source == "content_hash":
        h = image.content_hash
        if not h or len(h) > MAX_HASH_CHARS:
            raise InvalidInput(f"content_hash must be 1..{MAX_HASH_CHARS} characters, got {len(h)}")
        return ImageInput(index=index, kind="content_hash", content_hash=h)
    raise InvalidInput("no source set: give encoded, patches, video or content_hash")


def _parse_video(index: int, video: encoder_pb2.Video) -> ImageInput:
    """A clip's wire form checked: a container or frames (one of them), sampling settings that make
    sense; what the clip holds is checked when it is decoded."""
    if bool(video.encoded) == bool(video.frames):
        raise InvalidInput("video needs a container (encoded) or its frames, exactly one of them")
    if any(not frame for frame in video.frames):
        raise InvalidInput("video.frames holds an empty frame")
    s = video.sampling
    reference = s.reference or REFERENCES[0]
    if reference not in REFERENCES:
        raise InvalidInput(f"video.sampling.reference {s.reference!r} is not one of {', '.join(REFERENCES)}")
    check_fps_xor_num_frames(s.fps or None, s.num_frames or None, "video.sampling")  # the wire's 0: not given
    for name in ("fps", "frames_fps"):
        value = getattr(s, name) if name == "fps" else video.frames_fps
        if not math.isfinite(value) or value < 0:
            raise InvalidInput(f"video {name} must be a finite number >= 0 (0: the default), got {value}")
    if s.min_frames and s.max_frames and s.min_frames > s.max_frames:
        raise InvalidInput(f"video.sampling.min_frames {s.min_frames} is above max_frames {s.max_frames}")
    if not math.isfinite(s.processor_fps) or s.processor_fps < 0:
        raise InvalidInput(f"video processor_fps must be a finite number >= 0 (0: not given), got {s.processor_fps}")
    cap = s.cap_pixels_per_frame if s.HasField("cap_pixels_per_frame") else None
    sampling = VideoSampling(reference=reference, fps=s.fps or None, num_frames=s.num_frames or None,
                             min_frames=s.min_frames or None, max_frames=s.max_frames or None,
                             min_pixels=s.min_pixels or None, max_pixels=s.max_pixels or None,
                             all_frames=s.all_frames, cap_pixels_per_frame=cap,
                             processor_fps=s.processor_fps or None,
                             processor_num_frames=s.processor_num_frames or None,
                             processor_do_sample_frames=(s.processor_do_sample_frames
                                                         if s.HasField("processor_do_sample_frames") else None))
    key = wire_sampling_key(s)
    clip = VideoInput(sampling=sampling, sampling_key=key, encoded=video.encoded, frames=tuple(video.frames),
                      frames_fps=video.frames_fps if video.frames else 0.0)
    return ImageInput(index=index, kind="video", video=clip)


def _parse_patches(index: int, patches: encoder_pb2.Patches, engine: Engine) -> ImageInput:
    grid = engine.check_grid(list(patches.grid_thw))
    dtype = dtypes.patch_dtype(patches.dtype)
    patch_dim = engine.describe().patch_dim
    itemsize = BY_NAME[dtype].itemsize
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
