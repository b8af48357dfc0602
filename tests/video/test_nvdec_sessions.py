"""A decoder process keeps its NVDEC decoder from clip to clip (preprocess/video_nvdec.py): the next clip of
the same codec whose frames fit goes to the kept decoder (``reconfigure_decoder``), any other clip gets a new
one, and after a failure the next clip starts afresh. NVDEC itself needs a GPU (tests/gpu/test_gpu_video.py
runs the same sequence through PyNvVideoCodec); here a stand-in of its SimpleDecoder, which reads the file it
is given and hands over each frame's NV12 planes as FFmpeg decodes them, checks the session logic: which
clips reuse, rebuild or recover, that every clip's frames equal the CPU decode's, and that the memory files
the decoder reads are closed when it moves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

import numpy as np
import nvdec_stand_in
import pytest
import torch
from nvdec_stand_in import BREAKS_CONTEXT, BROKEN, CONTEXT_ERROR, StandInDecoder

from encoder_service.benchmarks.reliability.video_inputs import make_clip
from encoder_service.errors import DecoderUnusable, InvalidInput
from encoder_service.preprocess import video_decode, video_nvdec
from encoder_service.preprocess.video_pool import VideoDecodePool

LIMITS = video_decode.VideoLimits(max_bytes=1 << 24, max_frames=1000, max_seconds=100.0,
                                  max_frame_pixels=1 << 20, max_decode_seconds=60.0)


@pytest.fixture
def nvdec(monkeypatch):
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", nvdec_stand_in.MODULE)
    monkeypatch.setattr(torch.cuda, "device", lambda gpu: contextlib.nullcontext())
    monkeypatch.setattr(video_nvdec, "_device_works", nvdec_stand_in.device_works)
    monkeypatch.setattr(StandInDecoder, "events", [])
    monkeypatch.setattr(StandInDecoder, "refuse_reconfigure", False)
    monkeypatch.setattr(StandInDecoder, "context_broken", False)
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


def test_the_context_check_tells_a_broken_context_from_a_full_gpu(monkeypatch):
    """video_nvdec._device_works itself: a sticky CUDA error (here raised by synchronize) is a broken context; a
    full GPU (an allocation's OutOfMemoryError) is not, since a new process would find the GPU as full."""
    monkeypatch.setattr(torch.cuda, "device", lambda gpu: contextlib.nullcontext())

    def sticky_error():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", sticky_error)
    assert not video_nvdec._device_works(0)

    def full(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch, "ones", full)
    assert video_nvdec._device_works(0)


def test_a_failure_that_leaves_the_gpu_context_unusable_says_the_process_must_go(nvdec):
    """A corrupt clip is refused as such (InvalidInput, and the process decodes on); a failure after which the
    process's CUDA context runs nothing (a sticky CUDA error) is DecoderUnusable, which ends the process."""
    with pytest.raises(InvalidInput) as refused:
        video_decode.probe_and_decode(clip() + BROKEN, every_third, LIMITS, nvdec_gpu=0)
    assert not isinstance(refused.value, DecoderUnusable)
    with pytest.raises(DecoderUnusable, match=f"{CONTEXT_ERROR}.*GPU context unusable.*replaced"):
        video_decode.probe_and_decode(clip(seed=1) + BREAKS_CONTEXT, every_third, LIMITS, nvdec_gpu=0)


def test_a_decoder_process_whose_gpu_context_broke_is_replaced_and_the_next_clip_decodes():
    """Through real decoder processes: the clip that broke its process's GPU context gets its error, the process
    is replaced at once, and the next clips decode, on the new process, the CPU decode's frames. Kept, the broken
    process would refuse every clip it was given, each as if corrupt."""
    data = clip()
    _, _, want = video_decode.probe_and_decode(data, every_third, LIMITS)
    with VideoDecodePool(1, nvdec_gpus=(0,), preload=("nvdec_stand_in_child",)) as pool:
        assert run(pool.decode(data, every_third, LIMITS)).frames.tolist() == want.tolist()
        (first,) = pool._children
        with pytest.raises(DecoderUnusable, match="GPU context unusable"):
            run(pool.decode(clip(seed=1) + BREAKS_CONTEXT, every_third, LIMITS))
        assert pool.replaced == 1 and first.stopped
        for _ in range(2):
            assert run(pool.decode(data, every_third, LIMITS)).frames.tolist() == want.tolist()
        assert pool.replaced == 1 and first not in pool._children


def test_a_cancelled_clip_that_broke_its_decoders_gpu_context_does_not_leave_the_process_to_the_next_clip(
        monkeypatch):
    """The caller goes away while its clip breaks the process's GPU context: the answer the cancel waits for says
    the process is leaving, so it is replaced then, not put back for the next clip, which would otherwise find a
    process still closing its decoder (slow here, as a broken context's teardown can be) and be told its clip
    crashed the decoder."""
    monkeypatch.setenv("NVDEC_STAND_IN_BREAK_AFTER_S", "0.5")
    monkeypatch.setenv("NVDEC_STAND_IN_BROKEN_STOP_S", "3")
    data = clip()
    _, _, want = video_decode.probe_and_decode(data, every_third, LIMITS)

    async def cancel_while_it_breaks(pool):
        task = asyncio.ensure_future(pool.decode(clip(seed=1) + BREAKS_CONTEXT, every_third, LIMITS))
        await asyncio.sleep(0.25)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with VideoDecodePool(1, nvdec_gpus=(0,), preload=("nvdec_stand_in_child",), cancel_grace_s=5.0) as pool:
        assert run(pool.decode(data, every_third, LIMITS)).frames.tolist() == want.tolist()
        run(cancel_while_it_breaks(pool))
        assert run(pool.decode(data, every_third, LIMITS)).frames.tolist() == want.tolist()
        assert pool.replaced == 1


def run(coroutine):
    return asyncio.run(coroutine)


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
