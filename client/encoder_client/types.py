"""Values the client takes and returns."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np

from encoder_client.protocol import ModelInfo, encoder_pb2

__all__ = ["EncodedImage", "HashRef", "ImageInput", "ModelInfo", "Video"]  # ModelInfo: encoder_client.protocol's

# The server states the rule in these words too (encoder_service/preprocess/video_sampling.py): a caller reads
# one wording whether the client refuses the clip before sending it or the server does.
FPS_XOR_NUM_FRAMES = "fps and num_frames are exclusive; give one of them"
ALL_FRAMES_ALONE = "all_frames takes every frame; it goes with none of fps, num_frames, min_frames, max_frames"
# Whose frame sampling a clip can equal, the first the default: the server's REFERENCES
# (encoder_service/preprocess/video_sampling.py), repeated because this package never imports the server;
# tests/client/test_client_cli.py holds the two equal.
SAMPLING_REFERENCES = ("transformers", "vllm")
# The settings that sample a clip (all_frames goes with none of them).
SAMPLES = ("fps", "num_frames", "min_frames", "max_frames")


@dataclass(frozen=True)
class HashRef:
    """A reference to an embedding the server already caches, by its content hash.

    The server never trusts a caller's hash as a cache key for new data; a HashRef only looks up
    an existing entry (NOT_FOUND if it was never computed or has been evicted).
    """

    content_hash: str


@dataclass(frozen=True)
class Video:
    """A clip, taken wherever an image is: ``Video("clip.mp4")`` or ``Video(mp4_bytes, fps=1)`` for a
    container (MP4, MOV, MKV, WebM, AVI), or ``Video(frames=[jpeg, ...], frames_fps=30)`` for frames already
    decoded to JPEG/PNG, in order.

    The server samples frames as ``reference`` does ("transformers", the default: transformers' video
    processor; "vllm": what vLLM does, which an encoder feeding vLLM must use), with these settings
    (None: the model's default; ``fps`` and ``num_frames`` are exclusive), processes them as the
    model's video processor does and returns one embedding for the clip, with the frame indices it
    used (``EncodedImage.frame_indices``). The settings are part of the content hash.
    """

    data_or_path: bytes | bytearray | memoryview | str | os.PathLike | None = None
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    reference: str = SAMPLING_REFERENCES[0]
    frames: tuple[bytes, ...] | list[bytes] | None = None
    frames_fps: float | None = None
    all_frames: bool = False  # every frame, none sampled (transformers' do_sample_frames=False)
    cap_pixels_per_frame: bool | None = None  # the processor's per-frame pixel cap; None: the model's setting
    # With reference="vllm" only: vLLM's HF-processor level, a request's mm_processor_kwargs (fps,
    # num_frames, do_sample_frames), which samples again from the frames vLLM's loader kept (the settings
    # above are the loader's); None: not given.
    processor_fps: float | None = None
    processor_num_frames: int | None = None
    processor_do_sample_frames: bool | None = None

    def to_proto(self) -> encoder_pb2.Video:
        if (self.data_or_path is None) == (self.frames is None):
            raise ValueError("Video takes a container (data_or_path) or frames, exactly one of them")
        if self.fps is not None and self.num_frames is not None:
            raise ValueError(f"Video: {FPS_XOR_NUM_FRAMES}")
        if self.all_frames and any(getattr(self, n) is not None for n in SAMPLES):
            raise ValueError(f"Video: {ALL_FRAMES_ALONE}")
        for name in ("fps", "num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels", "frames_fps",
                     "processor_fps", "processor_num_frames"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"Video: {name} must be > 0, got {value!r}")
        sampling = encoder_pb2.VideoSampling(
            reference=self.reference, fps=self.fps or 0.0, num_frames=self.num_frames or 0,
            min_frames=self.min_frames or 0, max_frames=self.max_frames or 0,
            min_pixels=self.min_pixels or 0, max_pixels=self.max_pixels or 0, all_frames=bool(self.all_frames))
        if self.cap_pixels_per_frame is not None:
            sampling.cap_pixels_per_frame = bool(self.cap_pixels_per_frame)
        sampling.processor_fps = self.processor_fps or 0.0
        sampling.processor_num_frames = self.processor_num_frames or 0
        if self.processor_do_sample_frames is not None:
            sampling.processor_do_sample_frames = bool(self.processor_do_sample_frames)
        if self.frames is not None:
            return encoder_pb2.Video(frames=[bytes(f) for f in self.frames], sampling=sampling,
                                     frames_fps=self.frames_fps or 0.0)
        data = self.data_or_path
        encoded = bytes(data) if isinstance(data, (bytes, bytearray, memoryview)) else Path(data).read_bytes()
        return encoder_pb2.Video(encoded=encoded, sampling=sampling)


# bytes: an encoded image (JPEG/PNG/...); str/PathLike: a file holding one; (patches, grid):
# preprocessed patches [t*h*w, patch_dim] with their grid (t, h, w); HashRef: a cached entry;
# an encoder_pb2.Image is passed through as is.
ImageInput = Union[
    bytes, bytearray, memoryview, str, "os.PathLike[str]",
    tuple[np.ndarray, tuple[int, int, int]], HashRef, Video, encoder_pb2.Image,
]


@dataclass
class EncodedImage:
    """One image's embedding, reassembled from its chunks.

    ``dtype`` is the wire dtype the server produced ("float32", "float16" or "bfloat16");
    ``embedding.dtype`` is the numpy dtype returned: the same, bf16 included, which comes back as
    ``ml_dtypes.bfloat16`` (a view of the received bytes, no conversion; ``.astype(np.float32)``
    widens it exactly), or as float32 with ``bf16_as="float32"`` (widened by the client, exactly) or
    as raw bit patterns with ``bf16_as="uint16"``. ``timing`` is the
    server's account (``queue_ms``, ``preprocess_ms``, ``forward_ms``) when it sent one;
    ``latency_ms`` is what the client observed, from the start of the request (first attempt)
    until this image's last chunk.

    ``embedding`` is the main embedding [num_tokens, hidden_size]. A model with extra feature levels
    (Qwen3-VL's deepstack: intermediate vision layers the LLM injects into its first layers) also
    fills ``deepstack``, one [num_tokens, hidden_size] array per extra level in order; it is empty
    for other models. All of them are contiguous views of one buffer (nothing copied per level).
    """

    index: int
    embedding: np.ndarray
    content_hash: str
    grid_thw: tuple[int, ...]
    num_tokens: int
    hidden_size: int
    cache_hit: bool
    dtype: str
    timing: dict[str, float] | None
    latency_ms: float = 0.0
    deepstack: tuple[np.ndarray, ...] = ()
    # A clip: the source frames the server sampled (in order, the padding frame repeated) and, where
    # the source states its fps, their timestamps in seconds; empty for an image.
    frame_indices: tuple[int, ...] = ()
    frame_timestamps_s: tuple[float, ...] = ()
    # A clip: the frames its sampling reference lists (transformers' metadata, vLLM's loader), which is
    # frame_indices without the padding frame.
    sampled_frame_indices: tuple[int, ...] = ()

    @property
    def feature_levels(self) -> int:
        """Levels of this embedding: the main one plus the deepstack levels."""
        return 1 + len(self.deepstack)

    @property
    def nbytes(self) -> int:
        """Bytes held by every level."""
        return self.embedding.nbytes + sum(level.nbytes for level in self.deepstack)
