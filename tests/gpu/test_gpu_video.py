"""GPU checks of the video path (pytest -m gpu on the GPU machine, which has torchvision): in the ``torch``
mode a clip's frames resized (padded), normalized and patchified on CUDA equal transformers'
torchvision-backed video processors run on CUDA (``device="cuda"``), Qwen's and Kimi-K2.5's; the forward
of a batch holding a clip stays free of host syncs; a clip through a real CUDA server equals the model's
own video path; NVDEC's frames against PyAV's.

Tolerance held: exact, as for images (tests/gpu/test_gpu_preprocess.py). transformers resizes the frames with
``tvF.resize`` on CUDA, which computes ``F.interpolate(bicubic, antialias=True)`` in float32 and rounds
back to uint8, the op ours runs on the same device, then rescales and normalizes in float32 in the order
the value table reproduces per byte; the patch order is a permutation.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gpu_helpers import no_device_sync

from encoder_service.models import load_vision_model
from encoder_service.preprocess.staged import DecodedClip, RawPatches
from encoder_service.preprocess.video_sampling import VideoSampling

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.allow_skip_on_cpu("needs a CUDA GPU, and torchvision for transformers' processors")]

# Frames [T, H, W]: shrunk, grown, odd T (padded with the last frame), 720p.
CLIPS = [(4, 448, 448), (5, 61, 97), (3, 333, 500), (8, 720, 1280)]


def _frames(seed: int, t: int, h: int, w: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / w, yy * 255 / h, (xx * yy) % 255], axis=-1)[None]
    base = base + 9 * np.arange(t)[:, None, None, None]  # frames that differ
    return np.clip(base + rng.normal(0, 20, (t, h, w, 3)), 0, 255).astype(np.uint8)


def _processor(model):
    pytest.importorskip("torchvision")
    cfg = model.video_config
    init = {k: getattr(cfg, k) for k in ("patch_size", "temporal_patch_size", "merge_size")}
    init |= {"image_mean": list(cfg.image_mean), "image_std": list(cfg.image_std),
             "size": {"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels}}
    if model.spec.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor as cls
    else:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as cls
    return cls(**init)


@pytest.mark.parametrize("shape", CLIPS, ids=["x".join(map(str, s)) for s in CLIPS])
@pytest.mark.parametrize("preset", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_torch_mode_clip_equals_transformers_video_processor_on_cuda(preset, shape):
    model = load_vision_model(preset, device="cuda", preprocess="torch")
    if preset == "tiny-qwen2.5-vl":  # pixel bounds that make the 720p frames shrink and the small ones grow
        model.video_config = dataclasses.replace(model.video_config, min_pixels=56 * 56, max_pixels=28 * 28 * 300)
    frames = _frames(shape[0], *shape)
    out = _processor(model)(frames, do_sample_frames=False, return_tensors="pt", device="cuda")
    ref, ref_grid = out["pixel_values_videos"], out["video_grid_thw"][0].tolist()
    front = model.video_front()
    clip, used = front.resize(frames, list(range(shape[0])), VideoSampling(), "torch")
    assert isinstance(clip, DecodedClip) and clip.frames.shape == frames.shape  # resized on the device
    ours = model.pixel_values([clip], dtype=torch.float32)
    assert list(clip.grid) == ref_grid
    assert len(used) % model.video_config.temporal_patch_size == 0
    diff = (ours - ref.to(ours.device)).abs().max().item()
    print(f"{preset} clip {shape}: torch mode on CUDA vs transformers on CUDA, max abs diff {diff}")
    assert diff == 0.0


@pytest.mark.parametrize("shape", CLIPS, ids=["x".join(map(str, s)) for s in CLIPS])
def test_kimi_torch_mode_clip_equals_transformers_video_processor_on_cuda(shape):
    pytest.importorskip("torchvision")
    from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor

    from encoder_service.models.kimi_k25.video import KimiK25VideoConfig

    model = load_vision_model("tiny-kimi-k2.5", device="cuda", preprocess="torch")
    model.video_config = KimiK25VideoConfig()  # the processor's class defaults, as the reference below
    frames = _frames(shape[0] + 1, *shape)
    out = Kimi_K25VideoProcessor()(frames, do_sample_frames=False, return_tensors="pt", device="cuda")
    clip, _ = model.video_front().resize(frames, list(range(shape[0])), VideoSampling(), "torch")
    ours = model.pixel_values([clip], dtype=torch.float32)
    ref = out["pixel_values_videos"].reshape(ours.shape).to(ours.device)
    assert sum(g[0] for g in out["video_grid_thw"].tolist()) == clip.grid[0] == shape[0]
    diff = (ours - ref).abs().max().item()
    print(f"kimi clip {shape}: torch mode on CUDA vs transformers on CUDA, max abs diff {diff}")
    assert diff == 0.0


@pytest.mark.parametrize("mode", ["torch", "pil"])
def test_forward_of_a_batch_with_a_clip_has_no_host_sync(mode):
    model = load_vision_model("tiny-qwen2.5-vl", device="cuda", dtype=torch.bfloat16, preprocess=mode)
    front = model.video_front()
    clip, _ = front.resize(_frames(1, 6, 200, 300), list(range(6)), VideoSampling(), mode)
    g = clip.grid
    raw = np.random.default_rng(0).standard_normal((g[0] * g[1] * g[2], model.patch_dim)).astype(np.float16)
    inputs = [clip, RawPatches(raw.tobytes(), "float16", g)]
    model.encode_inputs_async(inputs).wait()  # warm: first calls compile and plan
    with no_device_sync():
        pending = model.encode_inputs_async(inputs)
    out = pending.wait()
    assert [e.shape[0] for e in out] == [model.num_tokens(i.grid) for i in inputs]


def test_a_clip_through_a_cuda_server_equals_the_models_video_path(start_encoder_server):
    pytest.importorskip("av", reason="PyAV is not installed on this machine")
    from encoder_client import EncoderClient, Video

    from encoder_service.benchmarks.reliability.video_inputs import make_clip

    data = make_clip("mp4", "libx264", frames=24, width=320, height=240, fps=12)
    server = start_encoder_server("--device", "cuda", "--dtype", "float32", "--max-video-bytes", str(1 << 22))
    with EncoderClient(server.target) as client:
        assert client.model_info().preprocess == "torch"
        (got,) = client.encode([Video(data, fps=2.0)], output_dtype="float32")
    model = load_vision_model("tiny-qwen2.5-vl", device="cuda", dtype=torch.float32, preprocess="torch")
    pixels, grid, used = model.preprocess_video(data, fps=2.0)  # both halves on the CPU
    (want,) = model.encode(pixels, [grid])
    assert list(got.frame_indices) == used and list(got.grid_thw) == list(grid)
    want = want.float().cpu().numpy()
    rel = float(np.linalg.norm(np.asarray(got.embedding) - want) / np.linalg.norm(want))
    print(f"clip through the CUDA server vs the CPU video path, float32: rel err {rel:.2e}")
    assert rel < 1e-3  # the resize on CUDA in float32 may round a pixel differently from the CPU's uint8 kernel


@pytest.mark.parametrize(("width", "height"), [(448, 448), (1280, 720)])
def test_nvdec_frames_equal_ffmpegs(width, height):
    from encoder_service.benchmarks.video import photo_clip
    from encoder_service.preprocess import video_decode, video_nvdec

    if not video_nvdec.available():
        pytest.skip("needs PyNvVideoCodec")
    clip = photo_clip(5, 4, width, height, 30)
    limits = video_decode.VideoLimits(1 << 30, 100_000, 1000, 1 << 30, 60)
    def indices(facts):
        return [int(i) for i in np.linspace(0, facts.total_frames - 1, 9).round()] + [0]  # unordered, repeated
    _, want_indices, want = video_decode.probe_and_decode(clip, indices, limits)
    _, got_indices, got = video_decode.probe_and_decode(clip, indices, limits, nvdec_gpu=0)
    assert got_indices == want_indices and got.shape == want.shape and got.dtype == np.uint8
    diff = np.abs(got.astype(int) - want.astype(int))
    print(f"nvdec vs PyAV {width}x{height}: max {diff.max()}, mean {diff.mean():.3f} levels")
    assert np.array_equal(got, want)  # NVDEC's planes are the standard's; swscale converts them as for FFmpeg's


def test_nvdec_clips_in_turn_reuse_one_decoder_where_they_fit_and_equal_ffmpegs_frames(monkeypatch):
    """A decoder process keeps its NVDEC decoder from clip to clip (video_nvdec.py): clips that fit it are
    decoded after ``reconfigure_decoder`` (the same decoder object), others by a new decoder
    (tests/video/test_nvdec_sessions.py checks which, and the recovery after a failure, with a stand-in);
    a 10-bit clip goes to FFmpeg by its header and leaves the decoder alone. Every clip's frames equal
    FFmpeg's; FFmpeg is barred from the 8-bit clips' decodes, so none passes on the CPU path. Each clip's
    time is printed (the reason for keeping the decoder)."""
    import time

    from encoder_service.benchmarks.reliability.video_inputs import make_clip
    from encoder_service.benchmarks.video import photo_clip
    from encoder_service.preprocess import video_decode, video_nvdec

    if not video_nvdec.available():
        pytest.skip("needs PyNvVideoCodec")
    limits = video_decode.VideoLimits(1 << 30, 100_000, 1000, 1 << 30, 60)
    def indices(facts):
        return [int(i) for i in np.linspace(0, facts.total_frames - 1, 8).round()]
    # (name, clip, the decoder after it: (codec, width, height), and whether it is the one before)
    clips = [("448 h264", photo_clip(1, 4, 448, 448, 30), ("h264", 448, 448), False),
             ("448 h264 again", photo_clip(2, 4, 448, 448, 30), ("h264", 448, 448), True),
             ("320x240 h264", photo_clip(3, 2, 320, 240, 30), ("h264", 448, 448), True),
             ("448 hevc", make_clip("mp4", "libx265", frames=40, width=448, height=448, fps=30),
              ("hevc", 448, 448), False),
             ("448 hevc 10-bit", make_clip("mp4", "libx265", frames=40, width=448, height=448, fps=30,
                                           pix_fmt="yuv420p10le"), ("hevc", 448, 448), True),
             ("720p h264", photo_clip(5, 4, 1280, 720, 30), ("h264", 1280, 720), False),
             ("448 h264 last", photo_clip(6, 4, 448, 448, 30), ("h264", 1280, 720), True),
             # Matroska gives no frame count in its header: PyNvVideoCodec scans the file on a thread of its
             # own, and a decoder that has seen such a clip scans every later one; then an MP4 on the same
             # decoder, then a clip that closes it (its demuxer seeks its last file as it is destroyed).
             ("448 h264 in matroska", make_clip("matroska", "libx264", frames=40, width=448, height=448, fps=30),
              ("h264", 1280, 720), True),
             ("448 h264 after matroska", photo_clip(7, 4, 448, 448, 30), ("h264", 1280, 720), True),
             ("448 hevc after matroska", make_clip("mp4", "libx265", frames=40, width=448, height=448, fps=30),
              ("hevc", 448, 448), False)]
    wants = {name: video_decode.probe_and_decode(clip, indices, limits)[1:] for name, clip, _, _ in clips}
    cpu_decode = video_decode._decode
    video_nvdec.drop_session()
    try:
        before = None
        for name, clip, (codec, width, height), same in clips:
            ten_bit = name.endswith("10-bit")
            def barred(*args):
                raise AssertionError("an 8-bit clip decoded by FFmpeg")
            monkeypatch.setattr(video_decode, "_decode", cpu_decode if ten_bit else barred)
            started = time.perf_counter()
            _, got_indices, got = video_decode.probe_and_decode(clip, indices, limits, nvdec_gpu=0)
            seconds = time.perf_counter() - started
            kept = video_nvdec._kept
            print(f"{name}: {seconds * 1000:.0f} ms, decoder for {kept.codec} {kept.width}x{kept.height}")
            want_indices, want = wants[name]
            assert got_indices == want_indices and np.array_equal(got, want), name
            assert (kept.codec, kept.width, kept.height) == (codec, width, height), name
            assert (kept.decoder is before) is same, name
            before = kept.decoder
    finally:
        video_nvdec.drop_session()


def test_a_clip_through_an_nvdec_server_equals_the_cpu_decode(start_encoder_server):
    from encoder_client import EncoderClient, Video

    from encoder_service.benchmarks.video import photo_clip
    from encoder_service.preprocess import video_nvdec

    if not video_nvdec.available():
        pytest.skip("needs PyNvVideoCodec")
    data = photo_clip(6, 3, 320, 240, 24)
    runs = {}
    for decode in ("pyav", "nvdec"):
        server = start_encoder_server("--device", "cuda", "--dtype", "float32", "--video-decode", decode)
        with EncoderClient(server.target) as client:
            info = client.model_info()
            assert info.video.startswith(decode)
            runs[decode] = (client.encode([Video(data, fps=2.0)], output_dtype="float32")[0], info.cache_namespace)
        server.stop()
    (cpu, cpu_ns), (gpu, gpu_ns) = runs["pyav"], runs["nvdec"]
    assert cpu_ns != gpu_ns  # other pixels, another namespace
    assert list(gpu.frame_indices) == list(cpu.frame_indices) and list(gpu.grid_thw) == list(cpu.grid_thw)
    want = np.asarray(cpu.embedding)
    rel = float(np.linalg.norm(np.asarray(gpu.embedding) - want) / np.linalg.norm(want))
    print(f"clip embedding, nvdec vs PyAV decode (float32, tiny model): rel err {rel:.2e}")
    # The same frames, so the same forward: only a nondeterministic reduction could tell them apart.
    assert rel < 1e-6
