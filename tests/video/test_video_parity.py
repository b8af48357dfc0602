"""A clip's embedding against transformers' whole video path, from the same frames: transformers'
video processor (``pixel_values_videos``, ``video_grid_thw``; torchvision-backed, in a subprocess:
tests/video_references.py) then transformers' vision tower, against our processing (the family's
``video.py``, through ``video_front().process`` as the server runs it) then our tower. float32 on the
CPU, relative error <= 1e-5 per level, for Qwen2.5-VL and every Qwen3-VL / Qwen3.5 model type (main
embedding and each deepstack level).

Kimi-K2.5: transformers' processor cuts the clip into chunks of ``temporal_patch_size`` (4) frames, the
last shorter and not padded, one ``video_grid_thw`` row per chunk, and ``get_video_features`` (which is
``get_image_features``: the vision tower on all chunk grids, the projector, split per chunk) gives one
embedding per chunk. Ours is one item of grid ``(T, h, w)`` (``ModelSpec.frames_per_chunk``), its
embedding the chunks' embeddings concatenated in order: compared with transformers' chunks concatenated,
max absolute error <= 1e-5, on clips of one chunk, of a shorter last chunk (6 frames: 4 + 2) and of a
single-frame last chunk (9 frames: 4 + 4 + 1, which gets no temporal embedding in either)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from qwen3_vl_tiny import MODEL_TYPES, OUT_HIDDEN, ours, reference, reference_levels, rel_err
from safetensors.torch import load_file
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from video_reference_driver import frames
from video_references import run_references

from encoder_service.models import load_vision_model, make_checkpoint
from encoder_service.models.kimi_k25.loading import original_to_split
from encoder_service.models.kimi_k25.metadata import clip_chunks
from encoder_service.models.kimi_k25.model import KimiK25VisionConfig
from encoder_service.models.kimi_k25.reference import transformers_reference
from encoder_service.models.presets import PRESETS, random_vision_state
from encoder_service.preprocess.video_sampling import VideoSampling

RELATIVE_TOLERANCE = 1e-5
ABSOLUTE_TOLERANCE = 1e-5  # Kimi-K2.5: the largest difference of any value
CLIPS = [(4, 60, 90), (3, 100, 70)]  # frames [T, H, W]; 3 frames: padded with the last
# Kimi-K2.5 clips: 6 frames (chunks of 4 and 2), 9 (4, 4 and 1), 4 (one chunk).
KIMI_CLIPS = [(6, 60, 90), (9, 100, 70), (4, 56, 56)]
KIMI_SEED = 4


def _processor_init(family: str, cfg) -> dict:
    """transformers' video processor set up as our model's video config."""
    fields = dataclasses.asdict(cfg)
    init = {k: fields[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")}
    if family == "kimi_k25":
        side = cfg.max_side_patches
        return init | {"max_patches": cfg.max_patches, "size": {"max_height": side, "max_width": side}}
    init["size"] = {"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels}
    return init


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    checkpoint = make_checkpoint("tiny-qwen2.5-vl", tmp_path_factory.mktemp("ckpt"), seed=5)
    model = load_vision_model(str(checkpoint), device="cpu", dtype=torch.float32, attn_backend="sdpa")
    vision = json.loads((checkpoint / "config.json").read_text())["vision_config"]
    cfg = Qwen2_5_VLVisionConfig(**vision)
    cfg._attn_implementation = "sdpa"
    ref = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg).eval()
    state = load_file(str(checkpoint / "model.safetensors"))
    ref.load_state_dict({k.removeprefix("model.visual."): v for k, v in state.items()}, strict=True)
    return model, ref


@pytest.fixture(scope="module", params=MODEL_TYPES)
def qwen3(request):
    return ours(request.param), reference(request.param)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(our tiny Kimi-K2.5, transformers' tower, transformers' projector), the same random weights."""
    checkpoint = make_checkpoint("tiny-kimi-k2.5", tmp_path_factory.mktemp("kimi"), seed=KIMI_SEED)
    model = load_vision_model(str(checkpoint), device="cpu", dtype=torch.float32, attn_backend="sdpa")
    config = json.loads((checkpoint / "config.json").read_text())
    split = original_to_split(random_vision_state(PRESETS["tiny-kimi-k2.5"], KIMI_SEED),
                              KimiK25VisionConfig.from_config(config), prefix="")
    return (model, *transformers_reference(config, split))


@pytest.fixture(scope="module")
def hf_pixels(tmp_path_factory, qwen2, kimi):
    # Every Qwen3-VL / Qwen3.5 type has the same video processor (and the same tiny patch geometry).
    qwen3_config = ours("qwen3_vl").video_config
    cases = [{"family": family, "init": _processor_init(family, config), "shape": shape, "seed": i}
             for family, config, clips in (("qwen2_5_vl", qwen2[0].video_config, CLIPS),
                                           ("qwen3_vl", qwen3_config, CLIPS),
                                           ("kimi_k25", kimi[0].video_config, KIMI_CLIPS))
             for i, shape in enumerate(clips)]
    results, arrays = run_references({"processing": cases}, tmp_path_factory.mktemp("video-parity"))
    return {(c["family"], c["seed"]): (torch.from_numpy(arrays[f"pixels_{n}"]), results["processing"][n]["grid"])
            for n, c in enumerate(cases)}


def _ours(model, seed: int, shape) -> torch.Tensor:
    front = model.video_front()
    clip = frames(seed, *shape)
    pixels, grid, _ = front.process(clip, list(range(len(clip))), VideoSampling())
    (rows,) = model.encode(pixels, [grid])
    return rows


@pytest.mark.parametrize("seed", range(len(CLIPS)))
def test_qwen2_5_vl_clip_equals_transformers_video_path(qwen2, hf_pixels, seed):
    model, ref = qwen2
    pixels, grids = hf_pixels[("qwen2_5_vl", seed)]
    with torch.no_grad():
        want = ref(pixels.reshape(-1, model.patch_dim), grid_thw=torch.tensor(grids)).pooler_output
    got = _ours(model, seed, CLIPS[seed])
    assert got.shape == want.shape
    assert rel_err(got, want) <= RELATIVE_TOLERANCE


@pytest.mark.parametrize("seed", range(len(CLIPS)))
def test_qwen3_vl_clip_equals_transformers_video_path_on_every_level(qwen3, hf_pixels, seed):
    model, ref = qwen3
    pixels, grids = hf_pixels[("qwen3_vl", seed)]
    want_levels = reference_levels(ref, pixels.reshape(-1, model.patch_dim), grids)
    got = _ours(model, seed, CLIPS[seed])
    assert len(want_levels) == model.spec.feature_levels
    for level, (a, b) in enumerate(zip(got.split(OUT_HIDDEN, dim=-1), want_levels)):
        assert a.shape == b.shape and rel_err(a, b) <= RELATIVE_TOLERANCE, f"level {level}"


def _kimi_video_features(tower, projector, pixels: torch.Tensor, grids: list[list[int]]) -> list[torch.Tensor]:
    """transformers' ``Kimi_K25Model.get_video_features`` (= ``get_image_features``) with this tower and
    projector: one embedding per chunk grid."""
    with torch.no_grad():
        pooled = tower(pixels.view(-1, 3, 14, 14), grid_thw=torch.tensor(grids)).pooler_output
        embeds = projector(pooled).squeeze(1)
    return list(embeds.split([h * w // 4 for _, h, w in grids]))


@pytest.mark.parametrize("seed", range(len(KIMI_CLIPS)))
def test_kimi_k25_clip_is_transformers_chunks_concatenated(kimi, hf_pixels, seed):
    model, tower, projector = kimi
    pixels, chunk_grids = hf_pixels[("kimi_k25", seed)]
    want = torch.cat(_kimi_video_features(tower, projector, pixels, chunk_grids))
    frames_count = KIMI_CLIPS[seed][0]
    clip = frames(seed, *KIMI_CLIPS[seed])
    ours_pixels, grid, used = model.video_front().process(clip, list(range(frames_count)), VideoSampling())
    assert grid[0] == frames_count and used == list(range(frames_count))  # one grid, nothing padded
    assert [list(c) for c in clip_chunks(grid, model.spec.frames_per_chunk)] == chunk_grids
    assert len(chunk_grids) == -(-frames_count // 4)
    (got,) = model.encode(ours_pixels, [grid])
    assert got.shape == want.shape == (model.num_tokens(grid), model.hidden_size)
    assert (got - want).abs().max().item() <= ABSOLUTE_TOLERANCE
