"""The service serves Kimi-K2.5 with no other change than --model (real server subprocess)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from encoder_client import EncoderClient
from PIL import Image

from encoder_service.models import load_vision_model

pytestmark = pytest.mark.timeout(120)


def test_kimi_preset_is_served_and_equals_direct_model_encode(start_encoder_server):
    server = start_encoder_server("--model", "tiny-kimi-k2.5")
    model = load_vision_model("tiny-kimi-k2.5", device="cpu", dtype=torch.float32)
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(7).integers(0, 256, (90, 130, 3), dtype=np.uint8)).save(out, "PNG")
    data = out.getvalue()
    patches = np.random.default_rng(8).standard_normal((2 * 6 * 8, model.patch_dim)).astype(np.float32)
    with EncoderClient(server.target, timeout_s=60) as client:
        info = client.model_info()
        encoded, video = client.encode([data, (patches, (2, 6, 8))])
        again = client.encode([data])[0]
    assert (info.model_type, info.patch_dim, info.hidden_size) == ("kimi_k25", 588, model.hidden_size)
    assert info.ops == "none"  # no fused operations: every layer is its own torch code and the backend
    pixels, grid = model.preprocess(data)
    for got, (x, g) in ((encoded, (pixels, grid)), (video, (patches, (2, 6, 8)))):
        (want,) = model.encode(x, [g])
        assert got.embedding.shape == tuple(want.shape)
        np.testing.assert_allclose(got.embedding, want.numpy(), rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    assert again.cache_hit and np.array_equal(again.embedding, encoded.embedding)
