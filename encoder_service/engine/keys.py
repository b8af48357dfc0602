"""The cache keys of a request's images: the server computes every key itself (namespaced by the
served model and its preprocessing), so a caller cannot store under a key of its choosing."""

from __future__ import annotations

from collections.abc import Sequence

from encoder_client.protocol.hashing import hash_encoded, hash_patches, hash_video

from .types import ImageInput


def content_keys(namespace: str, images: Sequence[ImageInput]) -> list[str]:
    """Server-computed content hashes (called in a thread pool for large requests: hashing megabytes
    is CPU work, and sha256 releases the GIL)."""
    keys = []
    for image in images:
        if image.kind == "encoded":
            keys.append(hash_encoded(namespace, image.data))
        elif image.kind == "video":
            v = image.video
            keys.append(hash_video(namespace, v.sampling_key, encoded=v.encoded, frames=v.frames,
                                   frames_fps=v.frames_fps))
        elif image.kind == "patches":
            keys.append(hash_patches(namespace, image.grid, image.dtype_enum, image.data))
        else:  # a caller's hash is only a reference to look up, never a key we store under
            keys.append(image.content_hash)
    return keys
