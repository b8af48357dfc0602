"""A stand-in of PyNvVideoCodec's SimpleDecoder as preprocess/video_nvdec.py uses it (NVDEC itself needs a GPU:
tests/gpu/test_gpu_video.py runs the real one): it reads the file it is given, decodes it with PyAV and hands
over each frame's NV12 planes, so the frames are FFmpeg's. A clip ending in ``BROKEN`` is refused as a corrupt
bitstream; one ending in ``BREAKS_CONTEXT`` fails as a sticky CUDA error does, after which every decoder of the
process fails and ``device_works`` says no, until the process ends."""

from __future__ import annotations

import io
import time
import types
from typing import ClassVar

import torch

BROKEN = b"stand-in: refuse this clip's frames"
BREAKS_CONTEXT = b"stand-in: break this process's GPU context"
CONTEXT_ERROR = "stand-in: CUDA error: an illegal memory access was encountered"


class StandInDecoder:
    events: ClassVar[list[tuple]] = []
    refuse_reconfigure = False
    context_broken = False  # the process's, as a sticky CUDA error is
    break_after_s = 0.0  # how long the clip that breaks the context decodes first
    broken_stop_s = 0.0  # how long closing a decoder takes once the context is broken (a slow teardown)

    def __init__(self, path: str, *, gpu_id: int, max_width: int, max_height: int, **_options) -> None:
        if StandInDecoder.context_broken:
            raise RuntimeError(CONTEXT_ERROR)
        self.events.append(("new", gpu_id, max_width, max_height))
        self.max_size = (max_width, max_height)
        self._read(path)

    def _read(self, path: str) -> None:
        import av

        assert path.startswith("/proc/self/fd/")
        with open(path, "rb") as source:
            data = source.read()
        self.broken, self.breaks_context = data.endswith(BROKEN), data.endswith(BREAKS_CONTEXT)
        with av.open(io.BytesIO(data)) as container:
            frames = [frame.to_ndarray(format="nv12") for frame in container.decode(video=0)]
        height, width = frames[0].shape[0] * 2 // 3, frames[0].shape[1]
        assert width <= self.max_size[0] and height <= self.max_size[1], "a clip larger than the decoder"
        self.frames = [torch.from_numpy(f) for f in frames]

    def reconfigure_decoder(self, path: str) -> None:
        self.events.append(("reconfigure",))
        if self.refuse_reconfigure or StandInDecoder.context_broken:
            raise RuntimeError("stand-in: reconfigure refused")
        self._read(path)

    def __len__(self) -> int:
        return len(self.frames)

    def get_batch_frames_by_index(self, indices: list[int]) -> list[torch.Tensor]:
        if self.breaks_context:
            time.sleep(self.break_after_s)
            StandInDecoder.context_broken = True
        if StandInDecoder.context_broken:
            raise RuntimeError(CONTEXT_ERROR)
        if self.broken:
            raise RuntimeError("stand-in: corrupt bitstream")
        return [self.frames[i] for i in indices]

    def stop(self) -> None:
        self.events.append(("stop",))
        if StandInDecoder.context_broken:
            time.sleep(self.broken_stop_s)


def device_works(gpu: int) -> bool:
    """video_nvdec._device_works's stand-in: this process's GPU context runs work until a clip broke it."""
    return not StandInDecoder.context_broken


MODULE = types.SimpleNamespace(SimpleDecoder=StandInDecoder, OutputColorType=types.SimpleNamespace(NATIVE=0),
                               Pixel_Format=types.SimpleNamespace(NV12=0))
