"""Qwen3-VL on the GPU (pytest -m gpu on the GPU machine, which has torchvision): every CUDA backend
against sdpa with the whole forward under ``torch.cuda.set_sync_debug_mode("error")`` (no hidden
device sync), bf16 on the GPU against float32 on the CPU for every feature level, and the ``torch``
preprocessing mode equal to transformers' torchvision-backed processor. Skipped without CUDA."""

import io

import numpy as np
import pytest
import torch
from gpu_helpers import (
    DEVICE,
    cuda_backends,
    forward_matching_sdpa,
    gpu_marks,
    graph_replays_match_eager,
    random_patches,
    rel_err,
)
from PIL import Image
from qwen3_vl_tiny import PREPROCESSOR

from encoder_service.models.family import random_state
from encoder_service.models.qwen3_vl import FAMILY
from encoder_service.models.qwen3_vl.config import Qwen3VLVisionConfig
from encoder_service.models.qwen3_vl.loading import build, checkpoint_config

pytestmark = gpu_marks("needs a CUDA GPU, and torchvision for transformers' processors")

HEAD_DIM = 72
OUT_HIDDEN = 2048
# Sizes around the 48 x 48 table, a 3-frame clip beside images, the smallest grid, a long thin one.
GRIDS = [[1, 36, 36], [1, 10, 14], [3, 12, 8], [1, 2, 2], [1, 48, 48], [1, 16, 92]]


@pytest.fixture(scope="module")
def short_qwen3_vl():
    """Real Qwen3-VL vision sizes (head_dim 72, 48 x 48 table), 4 blocks with 2 deepstack levels."""
    vision = {"depth": 4, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
              "num_position_embeddings": 2304, "deepstack_visual_indexes": [1, 3]}
    cfg = Qwen3VLVisionConfig.from_config(checkpoint_config("qwen3_vl", vision, OUT_HIDDEN))
    return cfg, random_state(FAMILY, cfg, seed=0)


def _model(state, backend, device=DEVICE, dtype=torch.bfloat16):
    cfg, weights = state
    return build(cfg, {k: v.to(dtype) for k, v in weights.items()}, model_id="short-qwen3-vl",
                 preprocess_config=PREPROCESSOR, device=device, dtype=dtype, attn_backend=backend)


def _pixels():
    return random_patches(GRIDS, 1536)


def test_cuda_backends_are_available_here():
    assert "varlen" in cuda_backends(HEAD_DIM), cuda_backends(HEAD_DIM)


@pytest.mark.parametrize("name", ["sdpa", *cuda_backends(HEAD_DIM)])
def test_forward_has_no_device_sync_and_matches_sdpa(short_qwen3_vl, name):
    out = forward_matching_sdpa(lambda backend: _model(short_qwen3_vl, backend), name, _pixels(), GRIDS)
    assert [tuple(o.shape) for o in out] == [(t * h * w // 4, 3 * OUT_HIDDEN) for t, h, w in GRIDS]


def test_bf16_on_the_gpu_is_float32_on_the_cpu_within_bf16_rounding(short_qwen3_vl):
    pixels = _pixels()
    gpu = _model(short_qwen3_vl, "auto").encode(pixels, GRIDS)
    cpu = _model(short_qwen3_vl, "sdpa", torch.device("cpu"), torch.float32).encode(pixels, GRIDS)
    for i, (a, b) in enumerate(zip(gpu, cpu)):
        for level, (x, y) in enumerate(zip(a.float().cpu().split(OUT_HIDDEN, -1), b.split(OUT_HIDDEN, -1))):
            assert rel_err(x, y) <= 3e-2, f"image {i}, level {level}: relative error {rel_err(x, y):.2e}"


def _photo(height: int, width: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 / width, yy * 255 / height, (xx * yy) % 255], axis=-1)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)).save(buffer, "JPEG")
    return buffer.getvalue()


@pytest.mark.parametrize("size", [(61, 97), (1080, 1920), (333, 500), (2000, 37)])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_mode_equals_transformers_default_processor(short_qwen3_vl, size, device):
    # Exact, as for Qwen2.5-VL (test_gpu_preprocess.py): the same torch resize on the same device,
    # the normalisation a table of the same float32 operations, the patch order a permutation.
    pytest.importorskip("torchvision")
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    data = _photo(*size, seed=size[0])
    config = {k: v for k, v in PREPROCESSOR.items() if k != "image_processor_type"}
    out = Qwen2VLImageProcessor(**config)(Image.open(io.BytesIO(data)), return_tensors="pt", device=device)
    model = _model(short_qwen3_vl, "sdpa", torch.device(device), torch.float32)
    model.set_preprocess_mode("torch")
    item = model.decode(data)
    ours = model.pixel_values([item], dtype=torch.float32)
    assert [list(item.grid)] == out["image_grid_thw"].tolist()
    assert (ours - out["pixel_values"].to(ours.device)).abs().max().item() == 0.0


@pytest.mark.parametrize("name", ["sdpa", *cuda_backends(HEAD_DIM)])
def test_cuda_graph_replays_at_token_budgets_match_the_eager_forward(short_qwen3_vl, name):
    graph_replays_match_eager(lambda backend: _model(short_qwen3_vl, backend), name, 1536)


def test_fp8_cuda_graph_replays_match_the_eager_fp8_forward(short_qwen3_vl):
    # --quantization fp8 under the default CUDA graphs: the act_quant kernel and the split compiled graphs
    # inside a captured forward. 5e-2, not the bf16 bound: cuBLAS picks its FP8 kernel by token count, and
    # e4m3 rounding turns that last-bit difference into a step now and then (tests/gpu/test_fp8_gpu.py).
    if torch.cuda.get_device_capability(DEVICE) < (9, 0) or "flashinfer" not in cuda_backends(HEAD_DIM):
        pytest.skip("FP8 with the Triton act_quant kernel and flashinfer: a Hopper GPU")

    def make(backend):
        model = _model(short_qwen3_vl, backend)
        model.quantize("fp8")
        return model

    graph_replays_match_eager(make, "flashinfer", 1536, tolerance=5e-2)


def test_gelu_tanh_in_the_gemm_epilogue_equals_linear_then_gelu_tanh():
    # Qwen3-VL's fc1 on CUDA (ops.linear_activation: cuBLASLt's GELU epilogue) against the reference's
    # two steps, in float32 at fc1's widths: the tanh approximation, not erf's GELU.
    import torch.nn.functional as F

    from encoder_service.ops import linear_activation

    torch.manual_seed(0)
    x = torch.randn(300, 1152, device=DEVICE)
    w = torch.randn(4304, 1152, device=DEVICE) / 34
    b = torch.randn(4304, device=DEVICE)
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:  # float32 products, whatever another test of the process set
        ours = linear_activation(x, w, b, "gelu_pytorch_tanh")
        y = F.linear(x, w, b)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    err = (ours - F.gelu(y, approximate="tanh")).abs().max().item()
    assert err <= 1e-5, err
    assert (F.gelu(y) - F.gelu(y, approximate="tanh")).abs().max().item() > 20 * max(err, 1e-7)
