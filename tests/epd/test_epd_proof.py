"""EPD equals the monolithic model: three processes (encoder service, decode sink, this driver).

A tiny random Qwen2.5-VL, and a tiny Qwen3-VL with two deepstack levels, built with transformers,
are each run two ways. Monolithic: ``pixel_values`` and ``image_grid_thw`` into the
``*ForConditionalGeneration`` model. EPD: the encoder service (its own process) loads the same
checkpoint and pushes the image embeddings (with Qwen3-VL's deepstack levels in each row) to the
decode server (``examples/epd_decode_server.py``, another process, no vision tower), which splices
them into ``inputs_embeds``, adds the deepstack levels in the LLM's first layers, and runs the same
LLM. Same logits (float32, relative error <= 1e-5) and the same greedy tokens.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch
from encoder_client import EncoderClient
from repo_paths import REPO_ROOT

from encoder_service.benchmarks.service import stop_process

IMAGE_TOKEN, VISION_START, VISION_END = 100, 102, 103
MAX_NEW_TOKENS = 4
PROMPTS = {
    "one_image": [(1, 4, 6)],
    "several_images": [(1, 4, 4), (1, 6, 8), (1, 8, 4), (1, 4, 4)],  # the last repeats the first's grid
}


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


TEXT = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
TOKENS = {"image_token_id": IMAGE_TOKEN, "video_token_id": 101, "vision_start_token_id": VISION_START,
          "vision_end_token_id": VISION_END}


def _qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "in_channels": 3,
              "out_hidden_size": 32, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
              "window_size": 56, "fullatt_block_indexes": [1], "hidden_act": "silu", "initializer_range": 0.2}
    text = {**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}}
    return Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig(vision_config=vision, text_config=text, **TOKENS)


def _qwen3_vl():
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    # Deepstack after both blocks, into LLM layers 0 and 1; a 4 x 4 position table, smaller than
    # some grids, so its interpolation matters.
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "in_channels": 3,
              "out_hidden_size": 32, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
              "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1], "initializer_range": 0.2}
    text = {**TEXT, "head_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                       "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
    return Qwen3VLForConditionalGeneration, Qwen3VLConfig(vision_config=vision, text_config=text, **TOKENS)


FAMILIES = {"qwen2.5-vl": _qwen2_5_vl, "qwen3-vl": _qwen3_vl}


@pytest.fixture(scope="module", params=list(FAMILIES))
def qwen_checkpoint(request, tmp_path_factory):
    """A tiny random *ForConditionalGeneration saved with save_pretrained, and the model."""
    model_class, config = FAMILIES[request.param]()
    torch.manual_seed(7)
    model = model_class(config).eval()
    path = tmp_path_factory.mktemp(f"tiny-{request.param}-full")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def epd_encoder(start_encoder_server, qwen_checkpoint):
    path, _ = qwen_checkpoint
    return start_encoder_server("--model", str(path), "--dtype", "float32", "--attn-backend", "sdpa",
                                "--allowed-sinks", "127.0.0.1:*")


@pytest.fixture(scope="module")
def decode_server(qwen_checkpoint):
    """examples/epd_decode_server.py as its own process; yields its host:port."""
    path, _ = qwen_checkpoint
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "examples" / "epd_decode_server.py"),
                             "--model", str(path), "--port", "0"], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("decode server listening on "):
                break
        else:
            raise RuntimeError("decode server exited:\n" + "".join(lines))
        yield line.split()[-1]
    finally:
        stop_process(proc, 10)


def make_prompt(grids) -> list[int]:
    rng = np.random.default_rng(len(grids))
    ids = [int(x) for x in rng.integers(3, 90, 5)]
    for t, h, w in grids:
        ids += [VISION_START] + [IMAGE_TOKEN] * (t * h * w // 4) + [VISION_END]
        ids += [int(x) for x in rng.integers(3, 90, 3)]
    return ids


def make_patches(model, grids, seed: int = 0) -> list[np.ndarray]:
    """pixel_values per image, as Qwen2VLImageProcessor returns them ([t*h*w, 3*2*p*p] float32)."""
    vision = model.config.vision_config
    dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    rng = np.random.default_rng(seed)
    first = rng.standard_normal((int(np.prod(grids[0])), dim), dtype=np.float32)
    out = [first]
    for i, grid in enumerate(grids[1:], start=1):
        # The last "several_images" image is the first one again: a cache hit on the way to the sink.
        same = i == len(grids) - 1 and tuple(grid) == tuple(grids[0])
        out.append(first if same else rng.standard_normal((int(np.prod(grid)), dim), dtype=np.float32))
    return out


@torch.no_grad()
def monolithic(model, input_ids: list[int], grids, patches) -> dict[str, np.ndarray]:
    """pixel_values + image_grid_thw into the whole model, greedy, as the decode server loops."""
    ids = torch.tensor([input_ids])
    grid_thw = torch.tensor(grids)
    pixel_values = torch.from_numpy(np.concatenate(patches))
    prefill, steps, tokens = None, [], []
    for _ in range(MAX_NEW_TOKENS):
        mm_token_type_ids = (ids == IMAGE_TOKEN).int()
        position_ids, _ = model.model.get_rope_index(ids, mm_token_type_ids, image_grid_thw=grid_thw)
        logits = model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid_thw,
                       position_ids=position_ids).logits[0]
        if prefill is None:
            prefill = logits.numpy().copy()
        steps.append(logits[-1].numpy().copy())
        tokens.append(int(logits[-1].argmax()))
        ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return {"prefill_logits": prefill, "step_logits": np.stack(steps), "tokens": np.array(tokens)}


def epd(encoder_target: str, decode_target: str, input_ids, grids, patches) -> tuple[dict, list]:
    """Driver: the prompt to the decode server, the images to the encoder with the decode server as sink."""
    import grpc

    request_id = f"proof-{uuid.uuid4().hex[:8]}"
    with grpc.insecure_channel(decode_target) as channel:
        generate = channel.unary_unary("/epd.example.Decode/Generate")
        body = json.dumps({"request_id": request_id, "input_ids": input_ids,
                           "image_grid_thw": [list(g) for g in grids], "max_new_tokens": MAX_NEW_TOKENS,
                           "timeout_s": 60}).encode()
        pending = generate.future(body, timeout=120)  # waits on the decode side for the pushed images
        with EncoderClient(encoder_target) as client:
            headers = client.encode_to_sink(list(zip(patches, grids, strict=True)), decode_target,
                                            sink_request_id=request_id)
        out = np.load(io.BytesIO(pending.result()))
        return {k: out[k] for k in out.files}, headers


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_epd_logits_and_greedy_tokens_equal_the_monolithic_model(prompt, qwen_checkpoint, epd_encoder,
                                                                   decode_server):
    _, model = qwen_checkpoint
    grids = PROMPTS[prompt]
    patches = make_patches(model, grids)
    input_ids = make_prompt(grids)

    reference = monolithic(model, input_ids, grids, patches)
    got, headers = epd(epd_encoder.target, decode_server, input_ids, grids, patches)

    assert [h.num_tokens for h in headers] == [t * h * w // 4 for t, h, w in grids]
    assert rel_err(got["prefill_logits"], reference["prefill_logits"]) <= 1e-5
    for step in range(MAX_NEW_TOKENS):
        assert rel_err(got["step_logits"][step], reference["step_logits"][step]) <= 1e-5
    assert got["tokens"].tolist() == reference["tokens"].tolist()


def test_images_change_the_logits(qwen_checkpoint):
    """Guards the proof against a vision path too weak to matter (a splice bug would then pass)."""
    _, model = qwen_checkpoint
    grids = PROMPTS["several_images"]
    input_ids = make_prompt(grids)
    a = monolithic(model, input_ids, grids, make_patches(model, grids, seed=0))
    b = monolithic(model, input_ids, grids, make_patches(model, grids, seed=1))
    assert rel_err(a["prefill_logits"], b["prefill_logits"]) > 1e-2


@pytest.mark.parametrize("qwen_checkpoint", ["qwen3-vl"], indirect=True)
def test_deepstack_levels_change_the_logits(qwen_checkpoint):
    """Guards the Qwen3-VL proof against deepstack too weak to matter: the decode server's own path
    without the extra levels must give other logits (a lost level would then fail the proof)."""
    import dataclasses

    from encoder_service.models import load_vision_model

    path, model = qwen_checkpoint
    sys.path.insert(0, str(REPO_ROOT / "examples"))
    from encoder_client import EncodedImage
    from epd_decode_server import greedy_decode

    grids = PROMPTS["several_images"]
    encoder = load_vision_model(path, attn_backend="sdpa")
    images = []
    for i, (pixels, grid) in enumerate(zip(make_patches(model, grids), grids, strict=True)):
        rows = encoder.encode(pixels, [grid])[0].numpy()
        levels = np.split(rows, encoder.spec.feature_levels, axis=1)
        images.append(EncodedImage(index=i, embedding=levels[0], content_hash=str(i), grid_thw=tuple(grid),
                                   num_tokens=rows.shape[0], hidden_size=levels[0].shape[1], cache_hit=False,
                                   dtype="float32", timing=None, deepstack=tuple(levels[1:])))
    input_ids = make_prompt(grids)
    with_levels = greedy_decode(model, input_ids, [list(g) for g in grids], images, 1)
    without = greedy_decode(model, input_ids, [list(g) for g in grids],
                            [dataclasses.replace(im, deepstack=()) for im in images], 1)
    assert len(images[0].deepstack) == 2
    assert rel_err(without["prefill_logits"], with_levels["prefill_logits"]) > 1e-2
