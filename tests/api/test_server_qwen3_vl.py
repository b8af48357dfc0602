"""Qwen3-VL through the real server process: each image's rows carry its deepstack levels, and the
client hands them back as separate arrays, equal to the model run in this process; the same through
a cache hit, a hash-first request and a worker process (``--devices cpu``)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from encoder_client import EncoderClient
from PIL import Image

from encoder_service.models import load_vision_model

pytestmark = pytest.mark.timeout(240)


def png(seed: int, height: int, width: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
        buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def model():
    return load_vision_model("tiny-qwen3-vl", attn_backend="sdpa")


@pytest.fixture(scope="module", params=["in-process", "worker-process"])
def server(request, start_encoder_server):
    flags = ("--devices", "cpu") if request.param == "worker-process" else ()
    return start_encoder_server("--model", "tiny-qwen3-vl", "--attn-backend", "sdpa", *flags)


def expected_levels(model, data: bytes) -> list[np.ndarray]:
    pixels, grid = model.preprocess(data)
    rows = model.encode(pixels, [grid])[0].numpy()
    return np.split(rows, model.spec.feature_levels, axis=1)


def test_model_info_describes_the_levels(server, model):
    with EncoderClient(server.target) as client:
        info = client.model_info()
    assert (info.model_type, info.hidden_size, info.feature_levels) == ("qwen3_vl", 48, 3)
    assert info.cache_namespace == model.cache_namespace


def test_streamed_cached_and_hash_first_images_carry_every_deepstack_level(server, model):
    images = [png(seed, 300 + 17 * seed, 260) for seed in range(3)]
    want = [expected_levels(model, data) for data in images]
    with EncoderClient(server.target) as client:
        first = client.encode(images, max_chunk_bytes=8192)  # several chunks of whole 3-level rows
        again = client.encode(images)
        hashed = client.encode(images, hash_first=True)
    for runs in (first, again, hashed):
        for got, levels in zip(runs, want, strict=True):
            assert len(got.deepstack) == 2
            for array, level in zip([got.embedding, *got.deepstack], levels, strict=True):
                np.testing.assert_allclose(array, level, rtol=1e-5, atol=1e-6)
    assert not any(r.cache_hit for r in first) and all(r.cache_hit for r in again)
