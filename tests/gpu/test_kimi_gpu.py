"""Kimi-K2.5 on the GPU (pytest -m gpu on the GPU machine): every CUDA backend against sdpa, with the
whole forward under ``torch.cuda.set_sync_debug_mode("error")`` (no hidden device sync). Skipped
without CUDA."""

import pytest
import torch
from gpu_helpers import (
    DEVICE,
    cuda_backends,
    forward_matching_sdpa,
    gpu_marks,
    graph_replays_match_eager,
    random_patches,
)

from encoder_service.models.family import random_state
from encoder_service.models.kimi_k25 import FAMILY
from encoder_service.models.kimi_k25.loading import build, checkpoint_config
from encoder_service.models.kimi_k25.model import KimiK25VisionConfig
from encoder_service.models.presets import PRESETS

pytestmark = gpu_marks("needs a CUDA GPU")

HEAD_DIM = 72
# Several sizes, a clip of 3 frames next to images, the table's own size (64 x 64), a long thin grid.
GRIDS = [[1, 36, 36], [1, 10, 14], [3, 12, 8], [1, 2, 2], [1, 64, 64], [1, 16, 44]]


@pytest.fixture(scope="module")
def short_k25():
    """Real Kimi-K2.5 vision sizes (head_dim 72, 64 x 64 table), 4 blocks, so the forward is quick."""
    preset = PRESETS["kimi-k2.5"]
    config = checkpoint_config({**preset.vision_config, "num_hidden_layers": 4}, preset.text_hidden_size)
    cfg = KimiK25VisionConfig.from_config(config)
    return cfg, random_state(FAMILY, cfg, seed=0)


def _model(state, backend):
    cfg, weights = state
    return build(cfg, {k: v.to(torch.bfloat16) for k, v in weights.items()}, model_id="short-k25",
                 preprocess_config=None, device=DEVICE, dtype=torch.bfloat16, attn_backend=backend)


def _pixels():
    return random_patches(GRIDS, 588)


def test_cuda_backends_are_available_here():
    assert "varlen" in cuda_backends(HEAD_DIM), cuda_backends(HEAD_DIM)


@pytest.mark.parametrize("name", ["sdpa", *cuda_backends(HEAD_DIM)])
def test_forward_has_no_device_sync_and_matches_sdpa(short_k25, name):
    out = forward_matching_sdpa(lambda backend: _model(short_k25, backend), name, _pixels(), GRIDS)
    assert [o.shape[0] for o in out] == [h * w // 4 for _, h, w in GRIDS]


@pytest.mark.parametrize("name", ["sdpa", *cuda_backends(HEAD_DIM)])
def test_cuda_graph_replays_at_token_budgets_match_the_eager_forward(short_k25, name):
    graph_replays_match_eager(lambda backend: _model(short_k25, backend), name, 588, clips_replay=False)
