"""Kimi-K2.5 clips as one item (the convention of ``ModelSpec.frames_per_chunk``): a grid ``(t, h, w)``
with ``t`` over the chunk length (the video processor's ``temporal_patch_size``, 4) is a clip of
consecutive chunks of 4 frames (the last possibly shorter), each encoded as one chunk grid, their rows
concatenated in order; ``t <= 4`` keeps its meaning. The clip's embedding against transformers' video
path is in tests/video/test_video_parity.py, through a server in tests/video/test_server_video.py."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from encoder_service.errors import InvalidInput
from encoder_service.models import load_vision_model, make_checkpoint
from encoder_service.models.kimi_k25 import video as kimi
from encoder_service.models.kimi_k25.metadata import clip_chunks, expand_clips
from encoder_service.preprocess.video_sampling import ClipFacts, VideoSampling, source_seconds


@pytest.fixture(scope="module")
def model():
    return load_vision_model("tiny-kimi-k2.5", device="cpu", dtype=torch.float32)


def _pixels(grids, seed=0):
    n = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(seed).standard_normal((n, 588)).astype(np.float32)


def test_the_chunk_length_is_the_video_processors_temporal_patch_size(model):
    assert model.spec.frames_per_chunk == model.video_config.temporal_patch_size == 4
    assert model.spec.frames_per_chunk <= model.cfg.pos_emb_time


@pytest.mark.parametrize(("t", "chunks"), [(1, 1), (2, 1), (4, 1), (5, 2), (6, 2), (8, 2), (9, 3), (13, 4)])
def test_num_tokens_of_a_clip_is_one_set_per_chunk(model, t, chunks):
    assert model.spec.num_tokens((t, 4, 6)) == chunks * 6
    assert model.front().num_tokens((t, 4, 6)) == chunks * 6


def test_num_tokens_of_the_qwen_families_is_unchanged():
    for preset in ("tiny-qwen2.5-vl", "tiny-qwen3-vl"):
        spec = load_vision_model(preset).spec
        assert (spec.frames_merged, spec.frames_per_chunk) == (False, 0)
        assert spec.num_tokens((6, 4, 6)) == 6 * 4 * 6 // spec.merge_unit


def test_clip_chunks_cut_as_the_video_processor_does():
    assert clip_chunks((6, 4, 6), 4) == [(4, 4, 6), (2, 4, 6)]
    assert clip_chunks((3, 4, 6), 4) == [(3, 4, 6)]
    assert clip_chunks((8, 2, 2), 4) == [(4, 2, 2), (4, 2, 2)]
    assert expand_clips([(1, 2, 2), (9, 2, 4)], 4) == ([(1, 2, 2), (4, 2, 4), (4, 2, 4), (1, 2, 4)], [1, 3])
    assert kimi.chunk_grids(9, 100, 150) == clip_chunks((9, *kimi.chunk_grids(1, 100, 150)[0][1:]), 4)


@pytest.mark.parametrize("t", [5, 6, 9])
def test_a_clip_is_its_chunks_encoded_alone_in_order(model, t):
    grid = (t, 4, 6)
    pixels = _pixels([grid], seed=t)
    (clip,) = model.encode(pixels, [grid])
    chunks = clip_chunks(grid, 4)
    alone, start = [], 0
    for c in chunks:
        n = c[0] * c[1] * c[2]
        alone.append(model.encode(pixels[start:start + n], [c])[0])
        start += n
    assert clip.shape == (len(chunks) * 6, 64)
    torch.testing.assert_close(clip, torch.cat(alone), rtol=1e-6, atol=1e-6)


def test_a_batch_mixing_images_and_clips_encodes_each_as_if_alone(model):
    grids = [(1, 8, 12), (6, 4, 6), (2, 2, 4), (9, 2, 2)]
    pixels = _pixels(grids, seed=7)
    together = model.encode(pixels, grids)
    start = 0
    for grid, got in zip(grids, together):
        n = grid[0] * grid[1] * grid[2]
        (alone,) = model.encode(pixels[start:start + n], [grid])
        start += n
        assert got.shape == (model.num_tokens(grid), 64)
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


def test_video_front_gives_one_grid_for_the_clip_and_no_padding(model):
    front = model.video_front()
    frames = np.random.default_rng(1).integers(0, 256, (6, 60, 90, 3), dtype=np.uint8)
    indices = [0, 5, 10, 15, 20, 25]
    pixels, grid, used = front.process(frames, indices, VideoSampling())
    want, chunk_grids = kimi.preprocess_video(frames, model.video_config)
    assert np.array_equal(pixels, want) and pixels.dtype == np.float32
    assert grid == (6, *chunk_grids[0][1:]) and clip_chunks(grid, 4) == chunk_grids
    assert used == indices  # nothing padded
    clip = ClipFacts(30, 10.0, 3.0)
    assert source_seconds(clip, used)[::4] == kimi.chunk_timestamps(clip, used)  # a chunk's time: its first frame's
    assert source_seconds(ClipFacts(30, None, None), used) == []


def test_pixel_bounds_are_refused_for_kimi_which_has_none(model):
    for sampling in (VideoSampling(num_frames=4, max_pixels=10_000), VideoSampling(num_frames=4, min_pixels=784)):
        with pytest.raises(InvalidInput, match="pixels setting"):
            model.video_front().sample(ClipFacts(30, 10.0, 3.0), sampling)


def test_preprocess_video_returns_the_clip_grid(model):
    frames = [np.random.default_rng(i).integers(0, 256, (40, 60, 3), dtype=np.uint8) for i in range(10)]
    encoded = []
    for frame in frames:
        out = io.BytesIO()
        Image.fromarray(frame).save(out, "PNG")
        encoded.append(out.getvalue())
    pixels, grid, used = model.preprocess_video(encoded, frames_fps=5, num_frames=6)
    assert grid[0] == 6 and len(used) == 6 and pixels.shape[0] == 6 * grid[1] * grid[2]
    assert model.encode(pixels, [grid])[0].shape == (2 * grid[1] * grid[2] // 4, 64)


def _with_media_proc(tmp_path, media: dict, pos_emb_time: int = 4):
    path = make_checkpoint("tiny-kimi-k2.5", tmp_path, seed=1)
    config = json.loads((path / "config.json").read_text())
    config["vision_config"]["pos_emb_time"] = pos_emb_time
    (path / "config.json").write_text(json.dumps(config))
    pre = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps(pre | {"media_proc_cfg": media}))
    (path / "video_preprocessor_config.json").unlink()  # a remote-code checkpoint has none
    return path


def test_the_original_media_proc_cfg_sets_the_chunk_length_and_the_namespace(tmp_path):
    m = load_vision_model(_with_media_proc(tmp_path, {"temporal_merge_kernel_size": 2,
                                                      "in_patch_limit_each_frame": 512, "sample_fps": 1.0}))
    assert (m.video_config.temporal_patch_size, m.video_config.max_patches, m.video_config.fps) == (2, 512, 1.0)
    assert m.spec.frames_per_chunk == 2 and m.num_tokens((3, 4, 6)) == 12
    # The remote code's keys are what set the namespace's video settings: the same folder without them
    # has others.
    plain = json.loads((tmp_path / "preprocessor_config.json").read_text())
    del plain["media_proc_cfg"]
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(plain))
    assert load_vision_model(tmp_path).spec.fingerprint.get("video") != m.spec.fingerprint["video"]


def test_chunks_longer_than_the_temporal_position_embedding_are_refused_at_load(tmp_path):
    with pytest.raises(InvalidInput, match=r"chunks of 4 frames .* exceed the 2 frames .*pos_emb_time"):
        load_vision_model(_with_media_proc(tmp_path, {}, pos_emb_time=2))
