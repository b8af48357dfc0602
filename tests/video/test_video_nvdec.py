"""``--video-decode nvdec`` on a machine without a GPU: the YUV -> RGB step it adds, against FFmpeg's
(PyAV's ``to_ndarray("rgb24")``, what the CPU path and transformers' read_video_pyav give) on the same
decoded planes; and the option refused clearly where it cannot run. NVDEC itself is a ``gpu`` test
(tests/gpu/test_gpu_video.py)."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch

from encoder_service.benchmarks.reliability.video_inputs import make_clip
from encoder_service.benchmarks.video import photo_clip
from encoder_service.errors import InvalidInput
from encoder_service.models import load_vision_model
from encoder_service.preprocess import video_nvdec


def _planes_tags_and_rgb(clip: bytes, frames: int = 3):
    """Each of the first frames as NVDEC hands it over (luma, chroma interleaved: NV12), the stream's
    tags as the nvdec path reads them (from the header, before any decode), and FFmpeg's rgb24."""
    import av

    with av.open(io.BytesIO(clip)) as container:
        context = container.streams.video[0].codec_context
        tags = (int(context.colorspace), int(context.color_range))
        for i, frame in enumerate(container.decode(video=0)):
            if i == frames:
                return
            nv12 = frame.to_ndarray(format="nv12")  # the decoder's planes, chroma interleaved (lossless)
            height = frame.height
            uv = nv12[height:].reshape(height // 2, frame.width // 2, 2)
            yield nv12[:height], uv, tags, frame.to_ndarray(format="rgb24")


def _tagged(width: int, height: int, params: str, pix_fmt: str = "yuv420p") -> bytes:
    return make_clip("mp4", "libx264", frames=3, width=width, height=height, fps=10, pix_fmt=pix_fmt,
                     options={"x264-params": params})


@pytest.mark.parametrize("clip", [
    pytest.param(lambda: photo_clip(3, 0.1, 448, 448, 30), id="untagged-448"),
    pytest.param(lambda: photo_clip(3, 0.1, 1280, 720, 30), id="untagged-720p"),
    pytest.param(lambda: _tagged(66, 50, "colormatrix=bt709:range=tv"), id="bt709"),
    pytest.param(lambda: _tagged(66, 50, "colormatrix=bt709:range=pc", "yuvj420p"), id="bt709-full-range"),
    pytest.param(lambda: _tagged(64, 48, "colormatrix=bt2020nc"), id="bt2020"),
    pytest.param(lambda: _tagged(64, 48, "colormatrix=smpte170m:range=pc", "yuvj420p"), id="bt601-full-range"),
])
def test_nvdecs_planes_become_exactly_ffmpegs_rgb(clip):
    # What the nvdec path does with each surface: its planes converted by swscale with the stream's tags,
    # as PyAV converts the frames FFmpeg decodes. Equal, bit for bit, whatever the matrix and range.
    for luma, uv, tags, want in _planes_tags_and_rgb(clip()):
        got = video_nvdec.yuv420p_to_rgb(luma, uv[..., 0], uv[..., 1], *tags)
        assert got.dtype == np.uint8 and np.array_equal(got, want), (tags, np.abs(got.astype(int) - want).max())


def test_a_plane_that_does_not_fit_the_frame_is_refused():
    luma = np.zeros((48, 64), np.uint8)
    with pytest.raises(InvalidInput, match=r"a plane of \[24, 31\] for a 64x48 frame's 32x24 plane"):
        video_nvdec.yuv420p_to_rgb(luma, np.zeros((24, 31), np.uint8), np.zeros((24, 32), np.uint8), 2, 0)


def test_nvdec_without_a_cuda_device_is_refused_naming_what_it_needs():
    model = load_vision_model("tiny-qwen2.5-vl", device="cpu", dtype=torch.float32)
    with pytest.raises(InvalidInput, match="needs a CUDA device"):
        model.set_video_decode("nvdec")
    namespace = model.cache_namespace
    model.set_video_decode("pyav")
    assert model.cache_namespace == namespace  # the default leaves the namespace as it was


def test_a_cpu_server_with_nvdec_does_not_start_and_says_why():
    proc = subprocess.run([sys.executable, "-m", "encoder_service", "serve", "--video-decode", "nvdec", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "video decode nvdec needs a CUDA device" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize(("width", "height", "surface"), [
    (64, 48, (72, 64)),  # even: luma rows then chroma rows
    (64, 49, (74, 64)),  # odd height, luma rows as tall as the frame
    (64, 49, (75, 64)),  # odd height, luma rows padded to whole chroma samples
    (65, 48, (72, 66)),  # odd width: each row as wide as the interleaved chroma
])
def test_an_nv12_surface_splits_into_the_frames_luma_and_chroma(width, height, surface):
    rows, cols = (height + 1) // 2, (width + 1) // 2
    plane = torch.zeros(surface, dtype=torch.uint8)
    plane[surface[0] - rows:, :2 * cols] = torch.arange(2 * cols, dtype=torch.uint8) + 1  # the chroma rows
    luma, chroma = video_nvdec._planes(plane, height, width)
    assert tuple(luma.shape) == (height, width) and not luma.any()
    assert tuple(chroma.shape) == (rows, cols, 2) and (chroma[..., 0] % 2 == 1).all() and chroma.min() > 0


@pytest.mark.parametrize("surface", [(72, 65), (70, 64), (80, 64)])
def test_a_surface_of_another_size_is_refused(surface):
    with pytest.raises(InvalidInput, match="NV12 surface for the header's"):
        video_nvdec._planes(torch.zeros(surface, dtype=torch.uint8), 48, 65 if surface[1] == 65 else 64)


def test_a_surface_of_more_than_8_bits_is_refused_not_read_as_bytes():
    # A 10-bit stream's P016 surface handed over as 16-bit words has NV12's shape: its dtype tells it apart.
    with pytest.raises(InvalidInput, match=r"torch\.int16 surface; only 8-bit NV12"):
        video_nvdec._planes(torch.zeros((72, 64), dtype=torch.int16), 48, 64)
