"""Turning the caller's images into EncodeRequest messages (and hashing them like the server)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from encoder_client.dtypes import output_dtype_enum
from encoder_client.protocol import BY_NAME, DTYPES, encoder_pb2, hashing
from encoder_client.types import HashRef, ImageInput, Video

MAX_UINT32 = 2**32 - 1

# numpy dtypes sent as patches as they are. float64 (numpy's default) is narrowed to float32, the
# dtype image processors return; anything else is refused rather than guessed at.
# numpy has no bfloat16 of its own: it is handled apart (below).
_PATCH_WIRE_DTYPE = {np.dtype(d.name): d.enum for d in DTYPES if d.name != "bfloat16"}


def _patches_to_proto(index: int, patches: object, grid: object) -> encoder_pb2.Patches:
    if not isinstance(patches, np.ndarray):
        raise TypeError(f"image {index}: patches must be a numpy array, got {type(patches).__name__}")
    if patches.ndim != 2:
        raise ValueError(f"image {index}: patches must be 2-D [t*h*w, patch_dim], got shape {patches.shape}")
    try:
        grid_thw = tuple(int(x) for x in grid)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise TypeError(f"image {index}: grid must be three integers (t, h, w), got {grid!r}") from None
    if len(grid_thw) != 3 or any(x <= 0 or x > MAX_UINT32 for x in grid_thw):
        raise ValueError(f"image {index}: grid must be three positive integers (t, h, w), got {grid!r}")
    t, h, w = grid_thw
    if patches.shape[0] != t * h * w:
        raise ValueError(
            f"image {index}: patches have {patches.shape[0]} rows "
            f"but grid {grid_thw} needs t*h*w = {t * h * w}"
        )
    if patches.dtype == np.float64:
        patches = patches.astype(np.float32)
    if patches.dtype.name == "bfloat16":
        # e.g. ml_dtypes.bfloat16: same 2-byte pattern as the wire's bf16.
        wire_dtype, array = BY_NAME["bfloat16"].enum, patches.view(np.uint16)
    else:
        wire_dtype = _PATCH_WIRE_DTYPE.get(patches.dtype.newbyteorder("="))
        if wire_dtype is None:
            raise TypeError(
                f"image {index}: patches dtype {patches.dtype} is not supported "
                "(float32, float16, bfloat16, uint8; float64 is sent as float32)"
            )
        array = patches
    # Row-major little-endian bytes whatever the array's layout or the host's byte order.
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return encoder_pb2.Patches(grid_thw=grid_thw, dtype=wire_dtype, data=data)


def image_to_proto(index: int, image: ImageInput) -> encoder_pb2.Image:
    """One caller image as an encoder_pb2.Image; paths are read here."""
    if isinstance(image, encoder_pb2.Image):
        return image
    if isinstance(image, HashRef):
        if not image.content_hash:
            raise ValueError(f"image {index}: HashRef with an empty content_hash")
        return encoder_pb2.Image(content_hash=image.content_hash)
    if isinstance(image, Video):
        return encoder_pb2.Image(video=image.to_proto())
    if isinstance(image, (bytes, bytearray, memoryview)):
        return encoder_pb2.Image(encoded=bytes(image))
    if isinstance(image, (str, os.PathLike)):
        return encoder_pb2.Image(encoded=Path(image).read_bytes())
    if isinstance(image, tuple) and len(image) == 2:
        return encoder_pb2.Image(patches=_patches_to_proto(index, image[0], image[1]))
    raise TypeError(
        f"image {index}: expected bytes, a path, (patches, grid), Video or HashRef, got {type(image).__name__}"
    )


def check_images_sequence(images: object) -> None:
    """Refuse a single image passed where a list is expected (bytes would iterate as ints)."""
    single = (bytes, bytearray, memoryview, str, os.PathLike, HashRef, Video, encoder_pb2.Image)
    if isinstance(images, single) or (
        isinstance(images, tuple) and len(images) == 2 and isinstance(images[0], np.ndarray)
    ):
        raise TypeError("images must be a list of images; wrap a single image in a list")


def build_request(
    images: Sequence[ImageInput],
    *,
    output_dtype: str | None,
    max_chunk_bytes: int | None,
    request_id: str | None,
) -> encoder_pb2.EncodeRequest:
    """The EncodeRequest for images, in order (image_index i in the response is images[i])."""
    check_images_sequence(images)
    if max_chunk_bytes is not None and not 0 < max_chunk_bytes <= MAX_UINT32:
        raise ValueError(f"max_chunk_bytes must be in 1..{MAX_UINT32}, got {max_chunk_bytes}")
    return encoder_pb2.EncodeRequest(
        request_id=request_id if request_id is not None else uuid.uuid4().hex,
        images=[image_to_proto(i, image) for i, image in enumerate(images)],
        output_dtype=output_dtype_enum(output_dtype),
        max_chunk_bytes=max_chunk_bytes or 0,
    )


def content_hash(image: ImageInput, cache_namespace: str) -> str:
    """The content hash the server will compute for image (cache_namespace from model_info()).

    Lets a caller ask ``lookup`` before sending pixels; a HashRef is returned as is.
    """
    msg = image_to_proto(0, image)
    source = msg.WhichOneof("source")
    if source == "encoded":
        return hashing.hash_encoded(cache_namespace, msg.encoded)
    if source == "patches":
        p = msg.patches
        return hashing.hash_patches(cache_namespace, p.grid_thw, p.dtype, p.data)
    if source == "content_hash":
        return msg.content_hash
    if source == "video":
        return video_hash(cache_namespace, msg.video)
    raise ValueError("image has no source set")


def video_hash(cache_namespace: str, video: encoder_pb2.Video) -> str:
    """The content hash of a clip as the server computes it (``hashing.hash_video``)."""
    return hashing.hash_video(cache_namespace, hashing.wire_sampling_key(video.sampling), encoded=video.encoded,
                              frames=list(video.frames), frames_fps=video.frames_fps)
