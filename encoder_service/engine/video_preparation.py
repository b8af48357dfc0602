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

import asyncio
import functools
from concurrent.futures import Executor

import numpy as np

from ..config import ServiceConfig
from ..errors import InvalidInput, ResourceExhausted
from ..models.base import ModelFront
from ..preprocess.staged import StagedInput
from ..preprocess.video_decode import VideoLimits, decode_frame_list
from ..preprocess.video_pool import VideoDecodePool, child_memory_bytes
from ..preprocess.video_sampling import ClipFacts
from .devices import gpu_indices
from .types import ClipFrames, VideoInput


class VideoPreparer:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self._pool: VideoDecodePool | None = None  # started with the first clip

    def facts(self, front: ModelFront | None) -> dict[str, object]:
        """What ModelInfo says of video: the decoder and the references offered, and the limits."""
        c = self.config
        takes = front is not None and front.video_front is not None and c.max_video_bytes > 0
        decoder = c.video_decode
        described = f"{decoder}; frames; sampling {','.join(front.video_front.references)}" if takes else ""
        return {"video": described, "max_video_frames": c.max_video_frames if takes else 0,
                "max_video_seconds": c.max_video_seconds if takes else 0.0,
                "max_video_bytes": c.max_video_bytes if takes else 0}

    def limits(self, max_frame_pixels: int) -> VideoLimits:
        c = self.config
        return VideoLimits(max_bytes=c.max_video_bytes, max_frames=c.max_video_frames,
                           max_seconds=c.max_video_seconds, max_frame_pixels=max_frame_pixels,
                           max_decode_seconds=c.max_video_decode_seconds, max_decoded_bytes=c.max_video_decoded_bytes)

    async def prepare(self, front: ModelFront, video: VideoInput, max_frame_pixels: int,
                      executor: Executor) -> tuple[StagedInput, ClipFrames]:
        if front.video_front is None:
            raise InvalidInput(f"{front.spec.model_type} takes no video on this server")
        if self.config.max_video_bytes == 0:
            raise InvalidInput("this server takes no video (--max-video-bytes 0)")
        if video.nbytes > self.config.max_video_bytes:
            raise ResourceExhausted(f"the clip has {video.nbytes} bytes; at most {self.config.max_video_bytes} "
                                    "(--max-video-bytes)")
        limits = self.limits(max_frame_pixels)
        sample = functools.partial(front.video_front.sample, sampling=video.sampling)
        loop = asyncio.get_running_loop()
        if video.encoded:
            if self._pool is None:
                nvdec = self.config.video_decode == "nvdec"
                gpus = gpu_indices(self.config.devices, self.config.device) if nvdec else ()
                self._pool = VideoDecodePool(self.config.video_decode_processes, nvdec_gpus=gpus,
                                             memory_bytes=child_memory_bytes(limits))
            decoded = await self._pool.decode(video.encoded, sample, limits)
            clip, indices, frames = decoded.facts, decoded.indices, decoded.frames
        else:
            given = functools.partial(front.video_front.sample_frames, sampling=video.sampling)
            clip, indices, frames = await loop.run_in_executor(executor, _sampled_frames, video, given, limits)
        payload, used = await loop.run_in_executor(executor, front.video_front.staged, frames, indices,
                                                   video.sampling, front.preprocess)
        timestamps = front.video_front.timestamps(clip, used)
        return payload, ClipFrames(tuple(int(i) for i in used), tuple(float(t) for t in timestamps))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


def _sampled_frames(video: VideoInput, sample, limits: VideoLimits) -> tuple[ClipFacts, list[int], np.ndarray]:
    """A clip given as frames: the frames the reference samples, each decoded once (as an image, with
    the image checks)."""
    if len(video.frames) > limits.max_frames:
        raise ResourceExhausted(f"the clip has {len(video.frames)} frames; at most {limits.max_frames} "
                                "(--max-video-frames)")
    fps = video.frames_fps or None
    clip = ClipFacts(len(video.frames), fps, len(video.frames) / fps if fps else None)
    indices = [int(i) for i in sample(clip)]
    distinct = sorted(set(indices))
    decoded = decode_frame_list([video.frames[i] for i in distinct], limits)
    position = {index: n for n, index in enumerate(distinct)}
    return clip, indices, decoded[[position[i] for i in indices]]
