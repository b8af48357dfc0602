"""What a vision model adds for video: ``VideoFront`` (a family's CPU half for clips, which the front
end holds), ``FamilyVideo`` (all a family supplies for clips, declared once in its package) and
``VideoHooks``, the video side of ``VisionModel`` (its video path, where clips decode, the device half's
clip hooks, the cache-namespace entry, and ``preprocess_video``, both halves in this process), derived
from the family's ``FamilyVideo``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import InvalidInput
from ..preprocess import video_decode
from ..preprocess.decoders import VIDEO_DEFAULT, video_decoder
from ..preprocess.settings import check_patch_layout
from ..preprocess.staged import DecodedClip
from ..preprocess.video_decode import VideoLimits
from ..preprocess.video_sampling import PROCESSOR_SAMPLES, REFERENCES, SAMPLES, ClipFacts, VideoSampling
from .spec import Grid


@dataclass(frozen=True)
class VideoFront:
    """A family's video path, CPU half, bound to its settings: picklable like ``Decoder`` (module-level
    functions, partials of them), since ``sample`` runs in a decoder process.

    ``sample(clip, sampling)``: the source frame indices the caller's reference samples (ClipFacts,
    VideoSampling of preprocess/video_sampling.py); raises InvalidInput where the reference fails.
    ``resize(frames, indices, sampling, mode)``: sampled uint8 frames [T, H, W, 3] -> (``DecodedClip``,
    the indices used: padding repeats the last frame), the family's video processor split as images are:
    uint8 frames at their target size (resized here on the CPU in pil mode; in torch mode the device
    resizes), which the device normalizes and patchifies in every mode.
    ``process(frames, indices, sampling)``: what ``resize`` and the device half compute together, on the
    CPU: (pixel values float32 [t*h*w, patch_dim], grid (t, h, w), the indices used), exactly as the
    family's video processor computes ``pixel_values_videos`` / ``video_grid_thw``: the reference that
    ``resize`` is held to (it gives these values in pil mode).
    A response's ``frame_timestamps_s`` are the source's times of the frames used, the same for every
    family (``video_sampling.source_seconds``): no hook.
    """

    sample: Callable[..., Sequence[int]]
    resize: Callable[..., tuple[DecodedClip, Sequence[int]]]
    process: Callable[..., tuple[np.ndarray, Grid, Sequence[int]]]
    references: tuple[str, ...] = REFERENCES
    pixel_bounds: bool = True  # whether a request's min_pixels / max_pixels apply (Kimi-K2.5: no)
    # whether vLLM's processor-level settings apply (``sample`` then takes ``frames_given``; Kimi-K2.5: no,
    # vLLM has no video path for it)
    processor_level: bool = True

    def sample_frames(self, clip: ClipFacts, sampling: VideoSampling) -> list[int]:
        """The indices of a clip given as its frames: what ``sample`` picks, except for the ``vllm``
        reference, which takes such frames as they come. vLLM has no loader for them (a ``video/jpeg`` data
        URL, or decoded arrays with their metadata) and calls its processor with ``do_sample_frames``
        False, so every frame is kept, and a loader setting, which vLLM would ignore, is refused. The
        processor-level settings (vLLM's ``mm_processor_kwargs``) are that call's, as for a container: the
        family's ``sample`` with ``frames_given``."""
        if sampling.reference != "vllm":
            return [int(i) for i in self.sample(clip, sampling)]
        names = SAMPLES + (() if self.pixel_bounds else ("min_pixels", "max_pixels")) + (
            () if self.processor_level else PROCESSOR_SAMPLES)
        asked = [name for name in names if getattr(sampling, name) is not None]
        if asked:
            raise InvalidInput(f"a clip given as frames with the vllm reference is taken as it is (vLLM does not "
                               f"sample frames it is given; this model's video processor takes no pixel bounds "
                               f"nor, where vLLM has no video path for it, processor settings); "
                               f"{', '.join(asked)} does not apply: leave it out")
        if sampling.processor_settings():
            return [int(i) for i in self.sample(clip, sampling, frames_given=True)]
        return list(range(clip.total_frames))

    def resize_frames(self, frames: np.ndarray, indices: Sequence[int], sampling: VideoSampling, mode: str
                      ) -> tuple[DecodedClip, list[int]]:
        """The sampled frames as the device takes them (``resize``), with the indices used as ints."""
        clip, used = self.resize(frames, indices, sampling, mode)
        return clip, [int(i) for i in used]


def check_patch_layouts(tower: Any, image: Any, video: Any, model_id: str) -> None:
    """``FamilyVideo.check``'s default: the image and the video processors' patches (``patch_size``,
    ``temporal_patch_size``, ``merge_size``) are the tower's, the image processor's named first."""
    check_patch_layout(image, tower, model_id, "image processor")
    check_patch_layout(video, tower, model_id, "video processor")


@dataclass(frozen=True)
class FamilyVideo:
    """A family's video in one place: what its package declares (``VIDEO`` in its ``video.py``) and its
    model names (``VIDEO = video.VIDEO``); ``VideoHooks`` derives the rest from it. ``settings`` stands for
    the family's video processor settings (a frozen dataclass with ``fingerprint()``).

    ``baseline(tower, image_file, image)``: the settings a model has without video settings of its own
    (``tower``: the family's vision config; ``image_file``: the image processor's file as given, None for
    none; ``image``: the settings parsed from it). A model whose settings equal it keeps the cache
    namespace it had before video existed; others add a ``video`` entry to the fingerprint. Each family
    says which baseline its checkpoints had then (its ``video.py``).
    ``read(file, image)``: the settings of a video processor file (``loader.processor_configs``'s, or a
    preset's ``video_processor_config``; ``loader.FromImageFile`` where it is the image processor's file).
    ``check(tower, image, video, model_id)``: the processors' patches against the tower's, at load (every
    request would fail later otherwise): InvalidInput naming the file's setting.
    ``front(settings)``: the CPU half (``VideoFront``: sampling, ``resize``, ``process``, timestamps).
    ``value_table(settings)``: float32 [3, 256] on the CPU, the rescale + normalize of a clip's bytes.
    ``patchify(frames, settings)``: [T, C, H, W] normalized frames -> [num_patches, patch_dim] in the
    model's video patch order (temporal padding included)."""

    baseline: Callable[[Any, Mapping[str, Any] | None, Any], Any]
    read: Callable[[Mapping[str, Any], Any], Any]
    front: Callable[[Any], VideoFront]
    value_table: Callable[[Any], torch.Tensor]
    patchify: Callable[[torch.Tensor, Any], torch.Tensor]
    check: Callable[[Any, Any, Any, str], None] = check_patch_layouts


class VideoHooks:
    """Mixed into ``VisionModel``: its video side, derived from the family's ``VIDEO`` (None: the family
    takes no video). The model calls ``_bind_video`` at load and puts ``_video_fingerprint`` in its
    ``ModelSpec.fingerprint``; ``video_config`` holds its settings (tests may replace them)."""

    VIDEO: FamilyVideo | None = None
    video_config: Any = None
    _video_baseline: Any = None

    # pyav: clips decode with FFmpeg on the CPU; nvdec: on a GPU's video decoder (preprocess/video_nvdec.py).
    # The names and what each needs: preprocess/decoders.py.
    video_decode: str = VIDEO_DEFAULT

    def set_video_decode(self, name: str) -> None:
        """``pyav`` (the default) or ``nvdec``: clips' frames decode on a CUDA device's video decoder
        (preprocess/video_nvdec.py), which must be this model's kind of device."""
        video_decoder(name).require(self.device)
        self.video_decode = name

    def _bind_video(self, file: Mapping[str, Any] | None, tower: Any, model_id: str, *,
                    image_file: Mapping[str, Any] | None) -> None:
        """Reads the video settings at load (``file``: ``ModelFamily.build``'s ``video_config``; None: the
        family's baseline) and checks both processors' patches against ``tower``. The model has set
        ``preprocess_config`` (its image settings, parsed from ``image_file``)."""
        video, image = self.VIDEO, self.preprocess_config
        self._video_baseline = video.baseline(tower, image_file, image)
        self.video_config = self._video_baseline if file is None else video.read(file, image)
        video.check(tower, image, self.video_config, model_id)

    def _video_fingerprint(self) -> dict[str, Any]:
        """The ``ModelSpec.fingerprint`` entry of the video settings: none where they are the family's
        baseline, so that such a model keeps its cache namespace (``FamilyVideo.baseline``)."""
        if self.VIDEO is None or self.video_config == self._video_baseline:
            return {}
        return {"video": self.video_config.fingerprint()}

    def video_front(self) -> VideoFront | None:
        """The family's video path bound to this model's settings; None: the family takes no video."""
        return None if self.VIDEO is None else self.VIDEO.front(self.video_config)

    def _clip_value_table(self) -> torch.Tensor | None:
        """float32 [3, 256] on the CPU for a clip's frames (the video processor's rescale + normalize);
        None: the family takes no video."""
        return None if self.VIDEO is None else self.VIDEO.value_table(self.video_config)

    def _patchify_clip(self, frames: torch.Tensor) -> torch.Tensor:
        """[T, C, H, W] normalized frames -> [num_patches, patch_dim] in the model's video patch order
        (temporal padding included)."""
        if self.VIDEO is None:
            raise NotImplementedError
        return self.VIDEO.patchify(frames, self.video_config)

    def preprocess_video(self, video: bytes | Sequence[bytes], *, frames_fps: float | None = None,
                         **sampling) -> tuple[np.ndarray, Grid, list[int]]:
        """A clip -> (pixel values [t*h*w, patch_dim] float32, (t, h, w), the source frame indices
        used), exactly as the family's video processor returns ``pixel_values_videos`` and
        ``video_grid_thw``, with the frames its reference samples. ``video``: a container's bytes,
        or its frames as encoded images (``frames_fps``: their rate, if known). ``sampling``: the
        fields of ``VideoSampling`` (reference="transformers" or "vllm", fps, num_frames, ...).
        Decodes in this process, without the server's decoder processes or size limits."""
        front = self.video_front()
        if front is None:
            raise InvalidInput(f"{self.spec.model_type} takes no video")
        wanted = VideoSampling(**sampling)
        limits = VideoLimits(max_bytes=1 << 40, max_frames=1 << 31, max_seconds=float("inf"),
                             max_frame_pixels=(1 << 31) - 1, max_decode_seconds=float("inf"))  # FFmpeg: an int
        if isinstance(video, (bytes, bytearray, memoryview)):
            clip = video_decode.probe(bytes(video), limits)
            indices = [int(i) for i in front.sample(clip, wanted)]
            frames = video_decode.decode_frames(bytes(video), indices, limits)
        else:
            clip = ClipFacts(len(video), frames_fps, len(video) / frames_fps if frames_fps else None)
            indices = front.sample_frames(clip, wanted)
            frames = video_decode.decode_frame_list([video[i] for i in indices], limits)
        # The service's path: the CPU half, then the device half, here on the CPU.
        payload, used = front.resize_frames(frames, indices, wanted, self.preprocess_mode)
        pixel_values = self.pixel_values([payload], torch.device("cpu"), torch.float32).numpy()  # host: on the CPU
        return np.ascontiguousarray(pixel_values, dtype=np.float32), tuple(payload.grid), used

