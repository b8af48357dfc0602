"""``--video-decode nvdec`` on a machine without a GPU: the YUV -> RGB step it adds, measured against
FFmpeg's (PyAV's ``to_ndarray("rgb24")``, what the CPU path and transformers' read_video_pyav give) on the
same decoded planes; and the option refused clearly where it cannot run. NVDEC itself is a ``gpu`` test
(tests/gpu/test_gpu_video.py)."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch

from encoder_service.benchmarks.video import photo_clip
from encoder_service.errors import InvalidInput
from encoder_service.models import load_vision_model
from encoder_service.preprocess import video_nvdec


def _planes_and_rgb(clip: bytes, frames: int = 4):
    import av

    with av.open(io.BytesIO(clip)) as container:
        for i, frame in enumerate(container.decode(video=0)):
            if i == frames:
                return
            nv12 = frame.to_ndarray(format="nv12")  # the decoder's planes, chroma interleaved (lossless)
            height = frame.height
            uv = nv12[height:].reshape(height // 2, frame.width // 2, 2)
            yield torch.from_numpy(nv12[:height].copy()), torch.from_numpy(uv.copy()), frame.to_ndarray(format="rgb24")


@pytest.mark.parametrize(("width", "height"), [(448, 448), (1280, 720)])
def test_nv12_to_rgb_lands_within_a_level_of_ffmpegs_conversion(width, height):
    diffs = []
    for y, uv, want in _planes_and_rgb(photo_clip(3, 0.2, width, height, 30)):
        got = video_nvdec.nv12_to_rgb(y, uv, *video_nvdec.color_matrix(2, 0)).numpy()  # untagged: BT.601
        diffs.append(np.abs(got.astype(int) - want.astype(int)))
    diff = np.stack(diffs)
    print(f"{width}x{height}: max {diff.max()}, mean {diff.mean():.3f} levels against FFmpeg's rgb24")
    assert diff.max() <= 2 and diff.mean() < 0.5


def test_the_streams_tags_choose_the_matrix_as_swscale_does():
    assert video_nvdec.color_matrix(1, 1) == (709, False)  # BT.709, limited range
    assert video_nvdec.color_matrix(2, 0) == (601, False)  # unspecified: BT.601
    assert video_nvdec.color_matrix(6, 2) == (601, True)  # SMPTE 170M, full range
    with pytest.raises(InvalidInput, match="AVColorSpace 9"):  # BT.2020: refused, not converted otherwise
        video_nvdec.color_matrix(9, 1)


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
