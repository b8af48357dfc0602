"""The content hash that keys the server's embedding cache.

The server computes it itself (a caller-supplied hash is only a reference to look up), and a
client can compute the same value locally to ask ``Lookup`` before sending pixels. It covers the
server's ``cache_namespace`` (model and preprocessing fingerprint), the kind of input, the grid
and dtype for patches, and the exact bytes. sha256 from the standard library, so the client
needs nothing beyond its three dependencies.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_VERSION = b"encoder.v1/content-hash/1"
KIND_ENCODED = b"encoded"
KIND_PATCHES = b"patches"
KIND_VIDEO = b"video"
KIND_VIDEO_FRAMES = b"video-frames"
DEFAULT_SAMPLING_REFERENCE = "transformers"


def _frame(h: hashlib._Hash, part: bytes) -> None:
    # Length-prefix every part so no two different inputs can concatenate to the same stream.
    h.update(struct.pack("<Q", len(part)))
    h.update(part)


# After the reference's name (validated: one of the known names, so no name ends with it).
ALL_FRAMES_SUFFIX = b"\x00all_frames"
CAP_PIXELS_SUFFIX = {False: b"\x00cap_pixels_per_frame=0", True: b"\x00cap_pixels_per_frame=1"}
# Then vLLM's processor-level settings, where any is given: fps (32-bit float), count, do_sample_frames
# (-1 unset, 0, 1), in a fixed layout.
PROCESSOR_SUFFIX = b"\x00processor="


def hash_encoded(cache_namespace: str, data: bytes) -> str:
    """Hash of an encoded image (JPEG/PNG/... bytes, exactly as sent)."""
    h = hashlib.sha256()
    for part in (HASH_VERSION, cache_namespace.encode(), KIND_ENCODED, data):
        _frame(h, part)
    return h.hexdigest()


def hash_patches(cache_namespace: str, grid_thw: Sequence[int], dtype: int, data: bytes) -> str:
    """Hash of preprocessed patches: the grid, the wire dtype enum value and the raw bytes."""
    h = hashlib.sha256()
    header = struct.pack("<4I", *(int(x) for x in grid_thw), int(dtype))
    for part in (HASH_VERSION, cache_namespace.encode(), KIND_PATCHES, header, data):
        _frame(h, part)
    return h.hexdigest()


def sampling_key(reference: str = "", fps: float = 0.0, num_frames: int = 0, min_frames: int = 0, max_frames: int = 0,
                 min_pixels: int = 0, max_pixels: int = 0, all_frames: bool = False,
                 cap_pixels_per_frame: bool | None = None, processor_fps: float = 0.0, processor_num_frames: int = 0,
                 processor_do_sample_frames: bool | None = None) -> bytes:
    """A clip's sampling settings as hashed (the VideoSampling message's fields; 0 = the model's
    default). fps is taken as the wire's 32-bit float, and an empty reference is the default one, so
    a caller and the server agree whatever they spelled. ``all_frames``, ``cap_pixels_per_frame`` and the
    processor-level settings add a suffix only when set, so the keys of every other request are the ones
    they were before the fields existed."""
    name = (reference or DEFAULT_SAMPLING_REFERENCE).encode()
    key = struct.pack("<fIIIQQ", float(fps), int(num_frames), int(min_frames), int(max_frames),
                      int(min_pixels), int(max_pixels)) + name + (ALL_FRAMES_SUFFIX if all_frames else b"") + (
        b"" if cap_pixels_per_frame is None else CAP_PIXELS_SUFFIX[bool(cap_pixels_per_frame)])
    if processor_fps or processor_num_frames or processor_do_sample_frames is not None:
        flag = -1 if processor_do_sample_frames is None else int(bool(processor_do_sample_frames))
        key += PROCESSOR_SUFFIX + struct.pack("<fIb", float(processor_fps), int(processor_num_frames), flag)
    return key


def wire_sampling_key(s) -> bytes:
    """``sampling_key`` of a ``VideoSampling`` message (the server's and the client's one reading of it)."""
    return sampling_key(s.reference, s.fps, s.num_frames, s.min_frames, s.max_frames, s.min_pixels, s.max_pixels,
                        s.all_frames, s.cap_pixels_per_frame if s.HasField("cap_pixels_per_frame") else None,
                        s.processor_fps, s.processor_num_frames,
                        s.processor_do_sample_frames if s.HasField("processor_do_sample_frames") else None)


def hash_video(cache_namespace: str, sampling: bytes, *, encoded: bytes = b"", frames: Sequence[bytes] = (),
               frames_fps: float = 0.0) -> str:
    """Hash of a clip: its container bytes exactly as sent, or its frames (count, then each frame's
    bytes, with the rate they were taken at), and its sampling settings (``sampling_key``): the same
    clip sampled otherwise is another entry."""
    h = hashlib.sha256()
    if frames:
        head = (KIND_VIDEO_FRAMES, sampling, struct.pack("<fQ", float(frames_fps), len(frames)))
        for part in (HASH_VERSION, cache_namespace.encode(), *head, *frames):
            _frame(h, part)
    else:
        for part in (HASH_VERSION, cache_namespace.encode(), KIND_VIDEO, sampling, encoded):
            _frame(h, part)
    return h.hexdigest()
