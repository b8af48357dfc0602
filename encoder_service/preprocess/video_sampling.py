"""Video frame sampling: what every family's sampler shares (each family's own rules live in its package,
``models/<family>/video.py``).

Two small value types cross the layers: ``ClipFacts``, what the container decoder learned of a clip, and
``VideoSampling``, what the caller asked for, including the reference to be equal to (``transformers``,
the default for direct callers, or ``vllm``, what vLLM does end to end: its video loader, then its call of
the HF processor). vLLM applies a request's sampling at two levels: its loader's (``media_io_kwargs``, or
the server's ``--media-io-kwargs``: ``fps``, ``min_frames``, ``max_frames`` here) and its HF processor's
(``mm_processor_kwargs``: ``processor_fps``, ``processor_num_frames``, ``processor_do_sample_frames``
here, with the ``vllm`` reference only), which samples again from the frames the loader kept. Both are
part of the content hash (``VideoSampling.fingerprint``). The index helpers
below reproduce the two index formulas the references use, in the references' own arithmetic: a float32
``torch.arange`` stepping ``total / n`` (which can emit an index one past the end), and a rounded
``numpy.linspace`` over ``[0, total - 1]`` (which repeats frames when ``n > total``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..errors import InvalidInput, ResourceExhausted

# The references a clip can be sampled as; the first is the default (a request that names none).
REFERENCES = ("transformers", "vllm")
# The settings that sample a clip: ``all_frames`` goes with none of them.
SAMPLES = ("fps", "num_frames", "min_frames", "max_frames")
# vLLM's HF-processor level (a request's ``mm_processor_kwargs``: fps, num_frames, do_sample_frames), which
# samples again from what its loader kept: only with the ``vllm`` reference (transformers' processor is
# the one level the other reference has, and the four above are its settings).
PROCESSOR_SAMPLES = ("processor_fps", "processor_num_frames", "processor_do_sample_frames")


@dataclass(frozen=True)
class ClipFacts:
    """What the decoder learned of the clip."""

    total_frames: int  # frames in the stream (counted when the container header says 0)
    fps: float | None  # the source's average fps; None/0 when unknown
    duration_s: float | None

    def __post_init__(self) -> None:
        if isinstance(self.total_frames, bool) or not isinstance(self.total_frames, int) or self.total_frames < 1:
            raise InvalidInput(f"video has no decodable frames (total_frames={self.total_frames!r})")

    @property
    def known_fps(self) -> float | None:
        """The source fps, or None where the container does not know it (None, 0, negative, NaN, inf)."""
        fps = self.fps
        if fps is None or not math.isfinite(fps) or fps <= 0:
            return None
        return float(fps)


@dataclass(frozen=True)
class VideoSampling:
    """What the caller asked (None = the family reference's default)."""

    reference: str = "transformers"  # "transformers" or "vllm"
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    # per-frame (Qwen2.5-VL) or per-video (Qwen3-VL) pixel bounds, as the family's video processor means them
    min_pixels: int | None = None
    max_pixels: int | None = None
    # Every frame, none sampled (transformers' do_sample_frames=False); alone of the four that sample.
    all_frames: bool = False
    # The processor's per-frame pixel cap (transformers' cap_pixels_per_frame); None: the model's setting.
    cap_pixels_per_frame: bool | None = None
    # vLLM's processor level (mm_processor_kwargs' fps, num_frames, do_sample_frames); None: not given,
    # the processor's own (do_sample_frames: what vLLM's model sets from the loader's metadata).
    processor_fps: float | None = None
    processor_num_frames: int | None = None
    processor_do_sample_frames: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.all_frames, bool):
            raise InvalidInput(f"video sampling all_frames must be a bool, got {self.all_frames!r}")
        if self.cap_pixels_per_frame is not None and not isinstance(self.cap_pixels_per_frame, bool):
            raise InvalidInput(f"video sampling cap_pixels_per_frame must be a bool, got {self.cap_pixels_per_frame!r}")
        if self.all_frames and any(getattr(self, name) is not None for name in SAMPLES):
            from encoder_client.types import ALL_FRAMES_ALONE  # see check_fps_xor_num_frames

            raise InvalidInput(f"video sampling: {ALL_FRAMES_ALONE}")
        if self.reference not in REFERENCES:
            raise InvalidInput(f"video sampling reference {self.reference!r} is not one of {', '.join(REFERENCES)}")
        if self.processor_do_sample_frames is not None and not isinstance(self.processor_do_sample_frames, bool):
            raise InvalidInput("video sampling processor_do_sample_frames must be a bool, got "
                               f"{self.processor_do_sample_frames!r}")
        if self.reference != "vllm" and (asked := self.processor_settings()):
            raise InvalidInput(f"video sampling {', '.join(asked)}: vLLM's processor-level settings (its "
                               "mm_processor_kwargs) go with the vllm reference only; with transformers, fps, "
                               "num_frames and all_frames are the processor's")
        for name in ("fps", "processor_fps"):
            fps = getattr(self, name)
            if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float))
                                    or not math.isfinite(fps) or fps <= 0):
                raise InvalidInput(f"video sampling {name} must be a positive number, got {fps!r}")
        for name in ("num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels", "processor_num_frames"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise InvalidInput(f"video sampling {name} must be a positive int, got {value!r}")
        # Not min_pixels <= max_pixels: transformers' video processors take them in any order.
        if self.min_frames is not None and self.max_frames is not None and self.min_frames > self.max_frames:
            raise InvalidInput(f"video sampling min_frames {self.min_frames} > max_frames {self.max_frames}")

    def fingerprint(self) -> dict[str, object]:
        """Every field, JSON-ready: part of the content hash (the same clip sampled differently is another
        entry). fps as a float so that 2 and 2.0 hash alike."""
        fields = asdict(self)
        if not fields["all_frames"]:  # absent unless set: every other request keeps the key it had
            del fields["all_frames"]
        for name in ("cap_pixels_per_frame", *PROCESSOR_SAMPLES):  # likewise
            if fields[name] is None:
                del fields[name]
        for name in ("fps", "processor_fps"):
            if fields.get(name) is not None:
                fields[name] = float(fields[name])
        return fields

    def processor_settings(self) -> list[str]:
        """The names of the processor-level settings the request gives (``PROCESSOR_SAMPLES``)."""
        return [name for name in PROCESSOR_SAMPLES if getattr(self, name) is not None]


def check_fps_xor_num_frames(fps: float | None, num_frames: int | None, what: str) -> None:
    """An ``InvalidInput`` naming ``what`` where both ``fps`` and ``num_frames`` are given, in the client's
    wording: the wire refuses the pair whatever the reference, a family's sampler where its reference does
    (transformers' video processors; vLLM's Qwen loaders ignore the count)."""
    if fps is not None and num_frames is not None:
        # Imported here, not above: the decoder processes import this module, and the client's package would
        # bring its gRPC stack into each of them.
        from encoder_client.types import FPS_XOR_NUM_FRAMES

        raise InvalidInput(f"{what}: {FPS_XOR_NUM_FRAMES}")


# The most frame indices a sampling may ask for, checked before any list of them is made: a caller's
# num_frames of 2**31 would otherwise have numpy allocate 16 GiB for the indices alone, before any limit
# on the clip's frames, patches or bytes is reached. Above --max-video-frames' default (18,000), so a
# count any real clip needs passes here and meets those limits.
MAX_SAMPLED_FRAMES = 1 << 16


def _check_count(count: int) -> None:
    if count > MAX_SAMPLED_FRAMES:
        raise ResourceExhausted(f"video sampling asks for {count} frames, over the limit of {MAX_SAMPLED_FRAMES} "
                                "frames sampled from one clip")


def arange_indices(total: int, count: int) -> list[int]:
    """``torch.arange(0, total, total / count).int()``: float32 steps of ``total / count`` from 0, truncated.

    Written with torch, not numpy: the references compute it in float32 and numpy's float64 differs by a
    frame on some inputs; the float32 step can also emit one more index than ``count``, the last equal to
    ``total``. ``count`` must be positive (the caller names the failing setting).
    """
    _check_count(count)
    return torch.arange(0, total, total / count).int().tolist()


def linspace_indices(total: int, count: int) -> list[int]:
    """``np.linspace(0, total - 1, count).round().astype(int)``: ``count`` indices spread over the clip,
    rounded half to even; with ``count > total`` some frames repeat."""
    _check_count(count)
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


def pad_to_multiple(indices: list[int], multiple: int) -> list[int]:
    """``indices`` with its last entry repeated up to a multiple of ``multiple`` (how the references pad an
    odd frame count to the temporal patch size)."""
    return indices + [indices[-1]] * (-len(indices) % multiple)


def check_indices(indices: list[int], clip: ClipFacts, what: str) -> list[int]:
    """``indices`` when all lie in the clip; an ``InvalidInput`` naming ``what`` (the reference and the
    request) where one does not, which is where the reference itself raises IndexError."""
    if not indices:
        raise InvalidInput(f"{what}: samples no frame of a {clip.total_frames}-frame clip")
    bad = [i for i in indices if not 0 <= i < clip.total_frames]
    if bad:
        raise InvalidInput(f"{what}: the reference picks frame {bad[0]} of a {clip.total_frames}-frame clip "
                           "(it fails there with IndexError); ask for another fps or num_frames")
    return indices


def describe(sampling: VideoSampling, clip: ClipFacts) -> str:
    """The request and the clip in words, for error messages."""
    asked = [f"{name}={value}" for name in SAMPLES + PROCESSOR_SAMPLES
             if (value := getattr(sampling, name)) is not None]
    if sampling.all_frames:
        asked.append("all_frames")
    fps = f"{clip.known_fps:g} fps" if clip.known_fps else "unknown fps"
    return (f"video sampling ({sampling.reference} reference, {', '.join(asked) or 'defaults'}; "
            f"clip of {clip.total_frames} frames at {fps})")


def processor_samples(sampling: VideoSampling, default: bool) -> bool:
    """Whether vLLM's HF-processor call samples again: the request's ``do_sample_frames``
    (mm_processor_kwargs) where it gives one, else ``default``, what happens without it (Qwen3-VL: vLLM
    sets it from the loader's metadata, on where the loader kept every frame; Qwen2.5-VL: the processor's
    own setting)."""
    if sampling.processor_do_sample_frames is not None:
        return sampling.processor_do_sample_frames
    return default


def pick_loaded(loaded: list[int], picks: list[int], what: str) -> list[int]:
    """The clip's indices of the processor's ``picks`` among the frames vLLM's loader kept (``loaded``).

    vLLM hands its HF processor the loaded frames with the clip's metadata (its total frame count and
    fps), so the processor's picks, computed over the whole clip, index the loaded frames: where the
    loader kept every frame they are clip indices; where it did not, a pick past the loaded frames is
    the reference's IndexError, here an ``InvalidInput``."""
    if any(not 0 <= i < len(loaded) for i in picks):
        raise InvalidInput(f"{what}: vLLM's processor picks frame {max(picks)} of the {len(loaded)} its loader "
                           "kept (it samples over the whole clip, and fails there with IndexError); leave "
                           "processor_do_sample_frames to vLLM, or have the loader keep every frame")
    return [loaded[i] for i in picks]


def every_frame(clip: ClipFacts) -> list[int]:
    """Every frame of the clip in order: what a video processor sees with ``do_sample_frames=False``."""
    return list(range(clip.total_frames))


def refuse_all_frames(sampling: VideoSampling, clip: ClipFacts, why: str) -> None:
    """An ``InvalidInput`` where ``all_frames`` is asked of a reference that always samples (``why``)."""
    if sampling.all_frames:
        raise InvalidInput(f"{describe(sampling, clip)}: all_frames is not available here: {why}")


def source_seconds(clip: ClipFacts, indices: list[int]) -> list[float]:
    """Each frame's time in the source, in seconds (index / fps); empty where the clip's fps is unknown
    (what a response says: a reference's assumed fps is not the source's)."""
    fps = clip.known_fps
    return [i / fps for i in indices] if fps else []
