"""Sampled frames -> patches equal transformers' video processors: ``pixel_values_videos`` and
``video_grid_thw`` of Qwen2VLVideoProcessor, Qwen3VLVideoProcessor and Kimi_K25VideoProcessor (the
torchvision-backed processors, run in a subprocess: tests/video_references.py) on small generated frames.

Tolerance: none. transformers resizes the uint8 frames with ``tvF.resize`` (on the CPU PyTorch's uint8
bicubic antialiased kernel, which ours calls too) and rescales/normalizes them in float32 in an order the
value table reproduces per byte, so the patches are bit for bit the processor's.
"""

from __future__ import annotations

import numpy as np
import pytest
from video_reference_driver import frames
from video_references import run_references

from encoder_service.errors import InvalidInput
from encoder_service.models.kimi_k25 import video as kimi
from encoder_service.models.qwen2_5_vl import video as qwen2
from encoder_service.models.qwen3_vl import video as qwen3
from encoder_service.preprocess.video_sampling import ClipFacts, VideoSampling

CONFIGS = {"qwen2_5_vl": qwen2.Qwen2VLVideoConfig, "qwen3_vl": qwen3.Qwen3VLVideoConfig,
           "kimi_k25": kimi.KimiK25VideoConfig}
MODULES = {"qwen2_5_vl": qwen2, "qwen3_vl": qwen3, "kimi_k25": kimi}

# (family, processor config, frames [T, H, W]); an odd T checks the padding by the last frame.
CASES = [
    ("qwen2_5_vl", {}, (3, 60, 90)),  # the class defaults: frames grow to min_pixels
    ("qwen2_5_vl", {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16}, (5, 120, 200)),  # they shrink
    ("qwen2_5_vl", {"cap_pixels_per_frame": True, "max_video_tokens": 64, "min_pixels": 56 * 56,
                    "max_pixels": 28 * 28 * 64}, (6, 100, 150)),
    ("qwen2_5_vl", {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}, (2, 64, 96)),
    ("qwen3_vl", {}, (5, 100, 140)),
    ("qwen3_vl", {"size": {"shortest_edge": 4096, "longest_edge": 32 * 32 * 12}}, (4, 150, 210)),  # per video
    ("qwen3_vl", {"cap_pixels_per_frame": True, "max_video_tokens": 4}, (7, 90, 120)),
    ("qwen3_vl", {}, (2, 20, 30)),  # under one factor per side: scaled up first
    ("kimi_k25", {}, (6, 100, 150)),  # chunks of 4 and 2 frames
    ("kimi_k25", {"max_patches": 64}, (5, 200, 300)),  # shrunk, then padded to a multiple of 28
]


def _reference_case(family: str, init: dict, shape: tuple[int, int, int], seed: int) -> dict:
    # No call kwargs: where a config leaves cap_pixels_per_frame unset, transformers 5.24 takes False (with
    # a warning), which is the value pinned here.
    return {"family": family, "init": init, "shape": shape, "seed": seed}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cases = [_reference_case(f, init, shape, seed) for seed, (f, init, shape) in enumerate(CASES)]
    return run_references({"processing": cases}, tmp_path_factory.mktemp("video-processing"))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{f}-{'x'.join(map(str, s))}-{i}"
                                                         for i, (f, _, s) in enumerate(CASES)])
def test_patches_equal_the_video_processor(references, index):
    results, arrays = references
    family, init, shape = CASES[index]
    cfg = CONFIGS[family].from_dict(init)
    pixels, grid = MODULES[family].preprocess_video(frames(index, *shape), cfg)
    expected = arrays[f"pixels_{index}"].reshape(len(pixels), -1)
    grids = [grid] if family != "kimi_k25" else grid
    assert [list(g) for g in grids] == results["processing"][index]["grid"]
    assert pixels.dtype == np.float32 and pixels.shape == expected.shape
    assert np.array_equal(pixels, expected), float(np.abs(pixels - expected).max())
    if family == "kimi_k25":
        assert results["processing"][index]["num_chunks"] == [len(grid)]
        assert grids == kimi.chunk_grids(*shape, cfg)
    else:
        assert pixels.shape[1] == cfg.patch_dim


def test_pinned_cap_pixels_per_frame_is_false():
    # Pinned explicitly (transformers warns that its unset default will change); Qwen3-VL's config files
    # as published do not set it. A config that sets it is honoured (the cases above).
    assert qwen2.Qwen2VLVideoConfig().cap_pixels_per_frame is False
    assert qwen3.Qwen3VLVideoConfig().cap_pixels_per_frame is False
    assert qwen3.Qwen3VLVideoConfig.from_dict({"cap_pixels_per_frame": True}).cap_pixels_per_frame is True


def test_request_pixel_bounds_replace_the_configs():
    sampling = VideoSampling(min_pixels=28 * 28, max_pixels=28 * 28 * 4)
    cfg = qwen2.Qwen2VLVideoConfig().for_request(sampling)
    assert (cfg.min_pixels, cfg.max_pixels) == (28 * 28, 28 * 28 * 4)
    _, grid = qwen2.preprocess_video(frames(0, 2, 200, 200), cfg)
    assert grid == (1, 4, 4)
    cfg3 = qwen3.Qwen3VLVideoConfig().for_request(VideoSampling(max_pixels=32 * 32 * 256, min_frames=2))
    assert (cfg3.max_pixels, cfg3.min_frames) == (32 * 32 * 256, 2)
    for cap in (True, False):  # the request's cap over the config's, either way
        capped = VideoSampling(cap_pixels_per_frame=cap)
        assert qwen2.Qwen2VLVideoConfig(cap_pixels_per_frame=not cap).for_request(capped).cap_pixels_per_frame is cap
        assert qwen3.Qwen3VLVideoConfig(cap_pixels_per_frame=not cap).for_request(capped).cap_pixels_per_frame is cap
    with pytest.raises(InvalidInput, match="no cap_pixels_per_frame setting"):
        kimi.sample_frame_indices(ClipFacts(20, 10.0, None), VideoSampling(cap_pixels_per_frame=False))


# A request's pixel bounds and per-frame cap as transformers takes them (issue 40): a max_pixels alone
# under the config's min_pixels (which stays), both given the wrong way round, the cap on and off.
# (family, request bounds, transformers' call for the same, frames [T, H, W]).
DEFAULT_QWEN3_MIN = qwen3.Qwen3VLVideoConfig().min_pixels
REQUEST_BOUNDS = [
    ("qwen2_5_vl", {"max_pixels": 50176}, {"max_pixels": 50176}, (4, 240, 400)),
    # the per-frame cap asked by the request, as a processor call asks it (issue 40; for Qwen2.5-VL the
    # cap bites only past ~300 frames at its max_video_tokens: CASES holds it with a small one)
    ("qwen3_vl", {"cap_pixels_per_frame": True}, {"cap_pixels_per_frame": True}, (8, 360, 480)),
    ("qwen3_vl", {"cap_pixels_per_frame": False}, {"cap_pixels_per_frame": False}, (8, 360, 480)),
    ("qwen2_5_vl", {"min_pixels": 200704, "max_pixels": 50176}, {"min_pixels": 200704, "max_pixels": 50176},
     (3, 300, 200)),
    ("qwen3_vl", {"max_pixels": 32 * 32 * 8},
     {"size": {"shortest_edge": DEFAULT_QWEN3_MIN, "longest_edge": 32 * 32 * 8}}, (4, 240, 400)),
]


@pytest.fixture(scope="module")
def bound_references(tmp_path_factory):
    cases = [{"family": f, "init": {}, "call": call, "shape": shape, "seed": 100 + i}
             for i, (f, _, call, shape) in enumerate(REQUEST_BOUNDS)]
    return run_references({"processing": cases}, tmp_path_factory.mktemp("video-bounds"))


@pytest.mark.parametrize("index", range(len(REQUEST_BOUNDS)))
def test_request_pixel_bounds_are_taken_as_transformers_takes_them(bound_references, index):
    results, arrays = bound_references
    family, request, _, shape = REQUEST_BOUNDS[index]
    cfg = CONFIGS[family]().for_request(VideoSampling(**request))
    pixels, grid = MODULES[family].preprocess_video(frames(100 + index, *shape), cfg)
    assert [list(grid)] == results["processing"][index]["grid"]
    assert np.array_equal(pixels, arrays[f"pixels_{index}"].reshape(len(pixels), -1))


def test_bad_frames_are_invalid_input():
    with pytest.raises(InvalidInput, match="temporal_patch_size"):
        qwen3.preprocess_video(frames(0, 1, 64, 64))  # transformers' Qwen3-VL smart_resize refuses 1 frame
    with pytest.raises(InvalidInput, match="uint8"):
        qwen2.preprocess_video(np.zeros((2, 28, 28, 3), dtype=np.float32))
    with pytest.raises(InvalidInput, match="aspect ratio"):
        qwen2.preprocess_video(frames(0, 2, 2, 500))
    with pytest.raises(InvalidInput, match="uint8"):
        kimi.preprocess_video(np.zeros((0, 28, 28, 3), dtype=np.uint8))


# The service's split of the same work (VideoFront.resize: uint8 frames on the CPU, then the model's device
# half) against the processor's values (VideoFront.process), in both preprocess modes: pil resizes on the
# CPU before staging, torch on the device (here the CPU, whose uint8 kernel is the reference's).
STAGED = [("tiny-qwen2.5-vl", (3, 60, 90)), ("tiny-qwen2.5-vl", (4, 56, 56)), ("tiny-qwen3-vl", (5, 100, 140)),
          ("tiny-kimi-k2.5", (6, 100, 150)), ("tiny-kimi-k2.5", (5, 56, 84))]  # Kimi: resized, then padded


@pytest.mark.parametrize("mode", ["pil", "torch"])
@pytest.mark.parametrize(("name", "shape"), STAGED, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in STAGED])
def test_staged_clip_equals_the_processor_values(name, shape, mode):
    import torch

    from encoder_service.models import load_vision_model
    from encoder_service.preprocess.staged import DecodedClip

    model = load_vision_model(name, device="cpu", dtype=torch.float32, preprocess=mode)
    front = model.video_front()
    clip = frames(7, *shape)
    indices = list(range(shape[0]))
    want, want_grid, want_used = front.process(clip, indices, VideoSampling())
    staged, used = front.resize(clip, indices, VideoSampling(), mode)
    assert isinstance(staged, DecodedClip) and staged.frames.dtype == np.uint8
    # Only the torch mode leaves the resize to the device.
    assert staged.frames.shape[1:3] == (shape[1:] if mode == "torch" else staged.resize_to)
    got = model.pixel_values([staged], torch.device("cpu"), torch.float32).numpy()
    assert staged.grid == tuple(want_grid) and list(used) == list(want_used)
    np.testing.assert_array_equal(got, want)
