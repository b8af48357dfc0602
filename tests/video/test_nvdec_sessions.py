"""A decoder process keeps its NVDEC decoder from clip to clip (preprocess/video_nvdec.py): the next clip of
the same codec whose frames fit goes to the kept decoder (``reconfigure_decoder``), any other clip gets a new
one, and after a failure the next clip starts afresh. NVDEC itself needs a GPU (tests/gpu/test_gpu_video.py
runs the same sequence through PyNvVideoCodec); here a stand-in of its SimpleDecoder, which reads the file it
is given and hands over each frame's NV12 planes as FFmpeg decodes them, checks the session logic: which
clips reuse, rebuild or recover, that every clip's frames equal the CPU decode's, and that the memory files
the decoder reads are closed when it moves on.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import types
from typing import ClassVar

import numpy as np
import pytest
import torch

from encoder_service.benchmarks.reliability.video_inputs import make_clip
from encoder_service.errors import InvalidInput
from encoder_service.preprocess import video_decode, video_nvdec

LIMITS = video_decode.VideoLimits(max_bytes=1 << 24, max_frames=1000, max_seconds=100.0,
                                  max_frame_pixels=1 << 20, max_decode_seconds=60.0)
BROKEN = b"stand-in: refuse this clip's frames"


class StandInDecoder:
    """PyNvVideoCodec's SimpleDecoder as this module uses it: frames decoded by PyAV, as NV12 tensors."""

    events: ClassVar[list[tuple]] = []
    refuse_reconfigure = False

    def __init__(self, path: str, *, gpu_id: int, max_width: int, max_height: int, **_options) -> None:
        self.events.append(("new", gpu_id, max_width, max_height))
        self.max_size = (max_width, max_height)
        self._read(path)

    def _read(self, path: str) -> None:
        import av

        assert path.startswith("/proc/self/fd/")
        with open(path, "rb") as source:
            data = source.read()
        self.broken = data.endswith(BROKEN)
        with av.open(io.BytesIO(data)) as container:
            frames = [frame.to_ndarray(format="nv12") for frame in container.decode(video=0)]
        height, width = frames[0].shape[0] * 2 // 3, frames[0].shape[1]
        assert width <= self.max_size[0] and height <= self.max_size[1], "a clip larger than the decoder"
        self.frames = [torch.from_numpy(f) for f in frames]

    def reconfigure_decoder(self, path: str) -> None:
        self.events.append(("reconfigure",))
        if self.refuse_reconfigure:
            raise RuntimeError("stand-in: reconfigure refused")
        self._read(path)

    def __len__(self) -> int:
        return len(self.frames)

    def get_batch_frames_by_index(self, indices: list[int]) -> list[torch.Tensor]:
        if self.broken:
            raise RuntimeError("stand-in: corrupt bitstream")
        return [self.frames[i] for i in indices]

    def stop(self) -> None:
        self.events.append(("stop",))


@pytest.fixture
def nvdec(monkeypatch):
    stand_in = types.SimpleNamespace(SimpleDecoder=StandInDecoder, OutputColorType=types.SimpleNamespace(NATIVE=0),
                                     Pixel_Format=types.SimpleNamespace(NV12=0))
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", stand_in)
    monkeypatch.setattr(torch.cuda, "device", lambda gpu: contextlib.nullcontext())
    monkeypatch.setattr(StandInDecoder, "events", [])
    monkeypatch.setattr(StandInDecoder, "refuse_reconfigure", False)
    video_nvdec.drop_session()
    yield StandInDecoder.events
    video_nvdec.drop_session()


def clip(codec: str = "libx264", width: int = 64, height: int = 48, seed: int = 0) -> bytes:
    container = "webm" if codec == "libvpx-vp9" else "mp4"
    return make_clip(container, codec, frames=12 + seed, width=width, height=height, fps=12)


def every_third(facts) -> list[int]:
    return list(range(0, facts.total_frames, 3))


def decoded_equal_to_the_cpus(data: bytes) -> None:
    _, want_indices, want = video_decode.probe_and_decode(data, every_third, LIMITS)
    _, got_indices, got = video_decode.probe_and_decode(data, every_third, LIMITS, nvdec_gpu=0)
    assert got_indices == want_indices
    np.testing.assert_array_equal(got, want)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_clips_that_fit_the_kept_decoder_reuse_it_and_others_get_a_new_one(nvdec):
    before = open_descriptors()
    decoded_equal_to_the_cpus(clip())
    decoded_equal_to_the_cpus(clip(seed=1))  # same codec and size: the kept decoder
    decoded_equal_to_the_cpus(clip(width=32, height=32, seed=2))  # smaller: fits the kept surfaces
    decoded_equal_to_the_cpus(clip("libvpx-vp9"))  # another codec: a new decoder
    decoded_equal_to_the_cpus(clip("libvpx-vp9", 96, 64))  # larger frames: a new decoder, sized for them
    assert nvdec == [("new", 0, 64, 48), ("reconfigure",), ("reconfigure",),
                     ("stop",), ("new", 0, 64, 48), ("stop",), ("new", 0, 96, 64)]
    assert open_descriptors() == before + 1  # the memory file of the clip the kept decoder reads
    video_nvdec.drop_session()
    assert open_descriptors() == before and nvdec[-1] == ("stop",)


def test_after_a_failed_clip_the_next_one_gets_a_new_decoder(nvdec):
    decoded_equal_to_the_cpus(clip())
    before = open_descriptors()
    with pytest.raises(InvalidInput, match="not decodable by nvdec: RuntimeError: stand-in: corrupt bitstream"):
        video_decode.probe_and_decode(clip(seed=1) + BROKEN, every_third, LIMITS, nvdec_gpu=0)
    assert nvdec[-2:] == [("reconfigure",), ("stop",)]  # nothing of the failed clip's decoder is kept
    assert open_descriptors() == before - 1
    decoded_equal_to_the_cpus(clip(seed=2))
    assert nvdec[-1] == ("new", 0, 64, 48)


@pytest.mark.parametrize("pix_fmt", ["yuv420p10le", "yuv444p"])
def test_a_clip_whose_header_says_a_format_nvdec_does_not_hand_over_as_nv12_is_decoded_by_ffmpeg(nvdec, pix_fmt):
    """A phone's 10-bit HDR clip, a 4:4:4 one: FFmpeg decodes it in the decoder process, the frames the pyav path
    gives, and the process's NVDEC decoder is neither used nor dropped."""
    decoded_equal_to_the_cpus(clip())
    codec = "libx265" if pix_fmt.endswith("10le") else "libx264"
    decoded_equal_to_the_cpus(make_clip("mp4", codec, frames=9, width=64, height=48, fps=12, pix_fmt=pix_fmt))
    assert nvdec == [("new", 0, 64, 48)]
    decoded_equal_to_the_cpus(clip(seed=1))
    assert nvdec == [("new", 0, 64, 48), ("reconfigure",)]


def test_a_reconfigure_the_decoder_refuses_falls_back_to_a_new_decoder(nvdec):
    decoded_equal_to_the_cpus(clip())
    StandInDecoder.refuse_reconfigure = True
    decoded_equal_to_the_cpus(clip(seed=1))
    assert nvdec == [("new", 0, 64, 48), ("reconfigure",), ("stop",), ("new", 0, 64, 48)]


def test_a_clip_on_another_gpu_gets_a_decoder_there(nvdec):
    data = clip()
    header: dict = {}
    facts = video_decode._probe(data, LIMITS, video_decode._deadline(LIMITS), header)
    for gpu in (0, 1):
        video_nvdec.decode_frames(data, [0], facts.total_frames, *header["size"], header["color"], header["codec"],
                                  gpu, video_decode._deadline(LIMITS), LIMITS.max_decode_seconds)
    assert nvdec == [("new", 0, 64, 48), ("stop",), ("new", 1, 64, 48)]
