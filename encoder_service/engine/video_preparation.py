"""A clip's CPU half: decode (a container in a decoder process of its own; frames as images), sample
the frames the model's reference would, and hand them over as the model's video processor would see
them: uint8 frames (``DecodedClip``) the device resizes (torch mode), normalizes and patchifies as it
does images, or, for a family without that split, the processor's float32 patches. The result is
queued like an image and batched with images.

The decoder is a large attack surface, so containers decode in ``VideoDecodePool``'s processes with
a wall-clock bound: a crash or a hang costs its own clip only. Sizes are checked before any decode:
the request's bytes here, the stream's frames, length and frame size from its header in the decoder.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from ..config import BatchingConfig, Placement, VideoConfig
from ..errors import Cancelled, DecodeTimeout, InvalidInput, ResourceExhausted
from ..models.base import ModelFront
from ..offload import run_to_the_end
from ..preprocess.decoders import video_decoder
from ..preprocess.interrupt import interrupt_when
from ..preprocess.staged import Grid, StagedInput, clip_budget
from ..preprocess.video_decode import VideoLimits
from ..preprocess.video_pool import SampledFrames, VideoDecodePool, child_memory_bytes
from ..preprocess.video_sampling import source_seconds
from .clip_parts import check_size
from .devices import gpu_indices
from .fair_slots import Caller, FairSlots
from .types import ClipFrames, VideoInput


def preload_modules(front: ModelFront) -> tuple[str, ...]:
    """The modules a clip's indices_fn is unpickled from in a decoder process: those of the family's
    video functions (partials unwrapped) and of ``VideoFront``, which a clip given as frames sends whole.
    A decoder imports them before it takes its first clip."""
    video = front.video_front
    modules = {type(video).__module__}
    for function in (video.sample, video.resize, video.process):
        while isinstance(function, functools.partial):
            function = function.func
        modules.add(function.__module__)
    return tuple(sorted(modules))


class VideoPreparer:
    """Every clip, whatever its form, goes through ``--video-decode-processes`` slots shared fairly
    between callers (``FairSlots``): a slot is held from the decode to the end of the family's
    ``resize`` (in pil mode, the frames' resize), which runs on a thread of the slot's own, never on the
    image decode threads; both under one time bound (--max-video-decode-seconds). A cancelled caller's
    clip stops: a waiting one never starts, a running one stops at its next frame or group of frames."""

    def __init__(self, video: VideoConfig, batching: BatchingConfig, placement: Placement,
                 observe: Callable[[str, float], None] | None = None) -> None:
        """``batching``: a clip's parts must each fit one forward; ``placement``: the GPUs nvdec decodes on;
        ``observe(stage, seconds)``: each stage's time (metrics.VIDEO_STAGES), where a clip's time goes."""
        self.video = video
        self._observe = observe
        self.batching = batching
        self.placement = placement
        self._limits: VideoLimits | None = None  # built once the frame size in force is known
        self._pool: VideoDecodePool | None = None  # started with the first clip
        processes = video.decode_processes
        self._slots = FairSlots(processes, what="video decoders", max_waiting=video.max_decodes_waiting,
                                flag="--max-video-decodes-waiting")
        # One resize thread per slot: a slot holder never waits for a thread.
        self._resizers = ThreadPoolExecutor(processes, thread_name_prefix="video-resize")

    def facts(self, front: ModelFront | None) -> dict[str, object]:
        """What ModelInfo says of video: the decoder and the references offered, and the limits."""
        v = self.video
        takes = front is not None and front.video_front is not None and v.max_bytes > 0
        decoder = v.decode
        described = f"{decoder}; frames; sampling {','.join(front.video_front.references)}" if takes else ""
        return {"video": described, "max_video_frames": v.max_frames if takes else 0,
                "max_video_seconds": v.max_seconds if takes else 0.0,
                "max_video_bytes": v.max_bytes if takes else 0}

    def limits(self, max_frame_pixels: int) -> VideoLimits:
        """The decoder's limits, built once: the frame size in force (--max-image-pixels) changes only
        when the engine learns its model, not from one clip to the next."""
        if self._limits is None or self._limits.max_frame_pixels != max_frame_pixels:
            v = self.video
            self._limits = VideoLimits(max_bytes=v.max_bytes, max_frames=v.max_frames, max_seconds=v.max_seconds,
                                       max_frame_pixels=max_frame_pixels, max_decode_seconds=v.max_decode_seconds,
                                       max_decoded_bytes=v.max_decoded_bytes,
                                       max_pixels_per_sample=v.max_pixels_per_sample)
        return self._limits

    @property
    def busy(self) -> bool:
        """Whether some clip holds a decoder slot (decoding or resizing, a cancelled one until it stops)."""
        return self._slots.free < self._slots.slots

    def _decoders(self, front: ModelFront, limits: VideoLimits) -> VideoDecodePool:
        if self._pool is None:
            # A decoder on a GPU gets the node's GPUs, its processes spread over them; PyAV none.
            gpus = gpu_indices(self.placement) if video_decoder(self.video.decode).needs_gpu else ()
            self._pool = VideoDecodePool(self.video.decode_processes, nvdec_gpus=gpus,
                                         memory_bytes=child_memory_bytes(limits), preload=preload_modules(front))
        return self._pool

    async def prepare(self, front: ModelFront, video: VideoInput, max_frame_pixels: int,
                      caller: Caller | None = None) -> tuple[StagedInput, ClipFrames]:
        if front.video_front is None:
            raise InvalidInput(f"{front.spec.model_type} takes no video on this server")
        if self.video.max_bytes == 0:
            raise InvalidInput("this server takes no video (--max-video-bytes 0)")
        if video.nbytes > self.video.max_bytes:
            raise ResourceExhausted(f"the clip has {video.nbytes} bytes; at most {self.video.max_bytes} "
                                    "(--max-video-bytes)")
        limits = self.limits(max_frame_pixels)
        async with contextlib.AsyncExitStack() as held:
            with self._stage("decoder_wait"):  # a wait refused (too many waiting) or cancelled is a wait too
                await held.enter_async_context(self._slots.slot(caller or Caller()))
            deadline = time.monotonic() + limits.max_decode_seconds  # decode and resize together
            pool = self._decoders(front, limits)
            with self._stage("decode"):
                if video.encoded:
                    sample = functools.partial(front.video_front.sample, sampling=video.sampling)
                    decoded = await pool.decode(video.encoded, sample, limits)
                else:
                    given = functools.partial(front.video_front.sample_frames, sampling=video.sampling)
                    decoded = await pool.decode_frames(list(video.frames), video.frames_fps, given, limits)
            stop = threading.Event()
            with self._stage("frames"):
                payload, used = await run_to_the_end(self._resizers, self._resized, front, video, decoded, deadline,
                                                     stop, stop=stop)
        timestamps = source_seconds(decoded.facts, used)
        return payload, ClipFrames(tuple(int(i) for i in used), tuple(float(t) for t in timestamps),
                                   tuple(int(i) for i in decoded.indices))

    @contextlib.contextmanager
    def _stage(self, stage: str) -> Iterator[None]:
        """Times the block as ``stage``, whether it ends well or raises."""
        start = time.monotonic()
        try:
            yield
        finally:
            if self._observe is not None:
                self._observe(stage, time.monotonic() - start)

    def _resized(self, front: ModelFront, video: VideoInput, decoded: SampledFrames, deadline: float,
                 stop: threading.Event) -> tuple[StagedInput, list[int]]:
        """The family's ``resize`` of the decoded frames (a resize thread), refused before any resize
        when the clip is over the budgets, stopped between groups of frames when cancelled or late."""
        limits = self.video.max_decode_seconds

        def interrupted() -> None:
            if stop.is_set():
                raise Cancelled("the clip's request was cancelled; its frames' resize stopped")
            if time.monotonic() > deadline:
                raise DecodeTimeout(f"decoding and resizing the clip took more than {limits:g} s, over the limit of "
                                    f"--max-video-decode-seconds {limits:g}")

        def fits(frames: int, size: tuple[int, int], grid: Grid) -> None:
            check_size(front, self.batching, self.video, grid, "video")
            if (nbytes := frames * size[0] * size[1] * 3) > self.video.max_decoded_bytes:
                raise ResourceExhausted(
                    f"the clip's {frames} frames resized to {size[1]}x{size[0]} take {nbytes} bytes, over the limit "
                    f"of --max-video-decoded-bytes {self.video.max_decoded_bytes}; ask for smaller frames")

        with interrupt_when(interrupted), clip_budget(fits):
            interrupted()
            return front.video_front.resize_frames(decoded.frames, decoded.indices, video.sampling, front.preprocess)

    def close(self) -> None:
        self._resizers.shutdown(wait=False, cancel_futures=True)
        if self._pool is not None:
            self._pool.close()
