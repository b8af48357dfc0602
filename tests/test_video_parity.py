"""A clip's embedding against transformers' whole video path, from the same frames: transformers'
video processor (``pixel_values_videos``, ``video_grid_thw``; torchvision-backed, in a subprocess:
tests/video_references.py) then transformers' vision tower, against our processing (the family's
``video.py``) then our tower. float32 on the CPU, relative error <= 1e-5 per level, for Qwen2.5-VL and
every Qwen3-VL / Qwen3.5 model type (main embedding and each deepstack level). Kimi-K2.5's clips are not
served yet."""

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
from encoder_service.preprocess.video_sampling import VideoSampling

RELATIVE_TOLERANCE = 1e-5
CLIPS = [(4, 60, 90), (3, 100, 70)]  # frames [T, H, W]; 3 frames: padded with the last


def _processor_init(family: str, cfg) -> dict:
    """transformers' video processor set up as our model's video config."""
    fields = dataclasses.asdict(cfg)
    init = {k: fields[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")}
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
def hf_pixels(tmp_path_factory, qwen2):
    # Every Qwen3-VL / Qwen3.5 type has the same video processor (and the same tiny patch geometry).
    qwen3_config = ours("qwen3_vl").video_config
    cases = [{"family": family, "init": _processor_init(family, config), "shape": shape, "seed": i}
             for family, config in (("qwen2_5_vl", qwen2[0].video_config), ("qwen3_vl", qwen3_config))
             for i, shape in enumerate(CLIPS)]
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
