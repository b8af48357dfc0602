"""GPU checks (run on the GPU machine: pytest -m gpu). Skipped without CUDA."""

import itertools

import numpy as np
import pytest
import torch
from gpu_helpers import GRAPH_BUDGETS, graph_replays_match_eager

from encoder_service.attention.registry import BACKENDS, backend_class
from encoder_service.metadata import attention_metadata
from encoder_service.models import load_vision_model
from encoder_service.models.presets import PRESETS, Preset, random_vision_state
from encoder_service.models.qwen2_5_vl.loading import build
from encoder_service.models.qwen2_5_vl.model import Qwen2_5_VisionConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.allow_skip_on_cpu("needs a CUDA GPU; backends a GPU cannot run skip there")]

DEVICE = torch.device("cuda")
GRIDS = [[1, 36, 36], [1, 10, 14], [2, 12, 8], [1, 2, 2], [1, 16, 44]]


def cuda_backends(head_dim=80):
    if not torch.cuda.is_available():
        return []
    return [n for n in BACKENDS if n != "sdpa"
            and backend_class(n).unsupported_reason(DEVICE, torch.bfloat16, head_dim) is None]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def short_7b_state():
    """Real Qwen2.5-VL-7B vision sizes (head_dim 80), 4 blocks, so the forward is quick."""
    vc = {**PRESETS["qwen2.5-vl-7b"].vision_config, "depth": 4, "fullatt_block_indexes": [1, 3]}
    preset = Preset("short-7b", "qwen2_5_vl", vc, PRESETS["qwen2.5-vl-7b"].preprocessor_config, 3584)
    return Qwen2_5_VisionConfig.from_dict(vc), random_vision_state(preset, seed=0)


def short_7b(state, backend, ops="auto"):
    cfg, weights = state
    return build(cfg, {k: v.to(torch.bfloat16) for k, v in weights.items()}, model_id="short-7b",
                 preprocess_config=None, device=DEVICE, dtype=torch.bfloat16, attn_backend=backend, ops=ops)


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(DEVICE) >= (9, 0)


def test_cuda_backends_are_available_here():
    # A GPU run that silently tested nothing would look green.
    assert "varlen" in cuda_backends(), cuda_backends()


@pytest.mark.parametrize("name", cuda_backends())
@pytest.mark.parametrize("head_dim", [80, 72, 64])
def test_backend_matches_sdpa_on_random_inputs(name, head_dim):
    cls = backend_class(name)
    if cls.unsupported_reason(DEVICE, torch.bfloat16, head_dim):
        pytest.skip(cls.unsupported_reason(DEVICE, torch.bfloat16, head_dim))
    torch.manual_seed(0)
    lengths = [64, 1, 5184, 37, 256, 1024, 3]  # 7 sequences: bucketed to 8 for cuDNN
    heads = 16
    q, k, v = (torch.randn(sum(lengths), heads, head_dim, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    meta = attention_metadata(lengths)
    ref_backend = backend_class("sdpa")(heads, head_dim, DEVICE, torch.bfloat16)
    ref = ref_backend.forward(q, k, v, ref_backend.prepare(meta))
    backend = cls(heads, head_dim, DEVICE, torch.bfloat16)
    out = backend.forward(q, k, v, backend.prepare(meta))
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= 2e-2


def test_auto_selects_the_kernels_and_a_named_backend_keeps_the_window_layers():
    # Hopper: every Triton provider; a named backend runs the window layers (--ops can still ask).
    model = load_vision_model("tiny-qwen2.5-vl", device="cuda", dtype="bfloat16")
    want = "window_attention=triton,rms_scale=triton,gated_mlp=" + ("triton" if hopper() else "torch")
    assert model.ops.describe() == want
    named = load_vision_model("tiny-qwen2.5-vl", device="cuda", dtype="bfloat16", attn_backend="sdpa")
    assert named.ops.describe() == want.replace("window_attention=triton", "window_attention=torch")
    asked = load_vision_model("tiny-qwen2.5-vl", device="cuda", dtype="bfloat16", attn_backend="sdpa",
                              ops="window_attention=triton")
    assert asked.ops.describe() == want


def forward_cases() -> list:
    """(backend, graphs): every backend eager and with CUDA graphs at token budgets (a backend whose
    plans are not static replays through varlen's: graph_backend)."""
    return [pytest.param(name, graphs, id=f"{name}-{'graphs' if graphs else 'eager'}")
            for name in ["sdpa", *cuda_backends()] for graphs in (True, False)]


@pytest.mark.parametrize("ops", ["auto", "window_attention=triton"])
@pytest.mark.parametrize("name,graphs", forward_cases())
def test_full_forward_runs_without_a_host_sync_and_matches_sdpa(name, graphs, ops, short_7b_state):
    rng = np.random.default_rng(0)
    n = sum(t * h * w for t, h, w in GRIDS)
    pixels = rng.standard_normal((n, 1176), dtype=np.float32)
    # The reference runs every fused operation in plain torch and every attention layer through sdpa
    # (no Triton kernel, no CUDA graphs); the models under test run the GPU's providers: under auto
    # with a named backend the window layers go through it (rms_scale and gated_mlp still Triton),
    # with window_attention=triton through the fused window kernel.
    ref_model = short_7b(short_7b_state, "sdpa", ops="torch")
    ref = [e.float() for e in ref_model.encode_async(pixels, GRIDS).wait()]
    model = short_7b(short_7b_state, name, ops=ops)
    assert model.ops.describe().startswith(
        "window_attention=triton," if ops != "auto" else "window_attention=torch,rms_scale=triton,")
    if graphs:
        model.set_cuda_graphs(GRAPH_BUDGETS)
        assert model.graphs is not None, f"graphs asked for with {name}, none kept"
        assert model.capture_cuda_graphs().budgets == GRAPH_BUDGETS
    else:
        assert model.graphs is None  # build() keeps none: the server's loading sets --cuda-graphs
    # Warm-up: kernel compilation, cuDNN graphs, plans.
    model.encode_async(pixels, GRIDS).wait()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = model.encode_async(pixels, GRIDS)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out = pending.wait()
    if graphs:
        assert model.graphs.replays == 2, "the checked call should have been a graph replay"
    assert [tuple(o.shape) for o in out] == [(t * h * w // 4, 3584) for t, h, w in GRIDS]
    for i, (a, b) in enumerate(zip(out, ref)):
        assert torch.isfinite(a.float()).all()
        assert rel_err(a, b) <= 2e-2, f"{name} image {i}: {rel_err(a, b):.3e}"


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("head_dim", [80, 72, 64])
def test_fused_window_kernel_matches_rotary_then_attention_per_window(head_dim, affine):
    from encoder_service.ops import apply_rotary
    from encoder_service.ops import triton_window as fused_window

    torch.manual_seed(0)
    heads, lengths = 16, [64, 1, 37, 64, 16, 63, 2, 64]
    tokens = sum(lengths)
    qkv = torch.randn(tokens, 3 * heads * head_dim, device=DEVICE, dtype=torch.bfloat16) * 3
    angles = torch.rand(tokens, head_dim // 2, device=DEVICE) * 40
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    plan = fused_window.plan(cu, max(lengths), DEVICE)
    if affine:  # output of a GEMM with a folded RMSNorm: row scale, then bias
        scale = torch.rand(tokens, device=DEVICE) + 0.5
        bias = torch.randn(3 * heads * head_dim, device=DEVICE)
        out = fused_window.window_attention_rotary(qkv, cos, sin, plan, heads, (scale, bias))
        qkv = (scale[:, None] * qkv.float() + bias).to(qkv.dtype)
    else:
        out = fused_window.window_attention_rotary(qkv, cos, sin, plan, heads)

    q, k, v = qkv.view(tokens, 3, heads, head_dim).unbind(1)
    q, k = apply_rotary(q, k, cos, sin)
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(x[a:b].transpose(0, 1).float() for x in (q, k, v))).transpose(0, 1) for a, b in itertools.pairwise(cu)])
    assert out.shape == (tokens, heads, head_dim)
    assert rel_err(out, ref) <= 1e-2


def test_tiny_preset_bf16_forward_under_sync_debug_mode():
    model = load_vision_model("tiny-qwen2.5-vl", device="cuda", dtype="bfloat16", attn_backend="auto")
    pixels = np.random.default_rng(1).standard_normal((64 + 96, 1176), dtype=np.float32)
    model.encode_async(pixels, [[1, 8, 8], [1, 8, 12]]).wait()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = model.encode_async(pixels, [[1, 8, 8], [1, 8, 12]])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [tuple(o.shape) for o in pending.wait()] == [(16, 48), (24, 48)]


def test_rstd_kernel_matches_the_reference_reduction():
    from encoder_service.ops._rms_kernel import rms_scale as triton_rms
    from encoder_service.ops.torch_ops import rms_scale

    torch.manual_seed(0)
    for tokens, dim in ((41472, 1280), (37, 1152), (1, 80)):
        x = torch.randn(tokens, dim, device=DEVICE, dtype=torch.bfloat16) * 4
        pending = torch.randn(dim, device=DEVICE)
        torch.testing.assert_close(triton_rms(x, pending, 1e-6), rms_scale(x, pending, 1e-6), rtol=1e-5, atol=0)


@pytest.mark.parametrize("m,k,n_inter", [(41472, 1280, 3456), (1000, 1280, 3456), (37, 136, 200), (1, 32, 64)])
def test_fused_swiglu_gemm_matches_gemm_then_swiglu(m, k, n_inter):
    # Ragged m, k and n_inter against the tiles (128 x 2*128 x 64) exercise the TMA edges.
    from encoder_service.ops._swiglu_gemm import gate_up_swiglu, unavailable_reason
    from encoder_service.ops.torch_ops import swiglu

    torch.manual_seed(0)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(2 * n_inter, k, device=DEVICE, dtype=torch.bfloat16) * k**-0.5
    shift = (torch.randn(2 * n_inter, device=DEVICE) * 0.1).to(torch.bfloat16)
    scale = torch.rand(m, device=DEVICE) + 0.5
    bias = torch.randn(2 * n_inter, device=DEVICE) * 0.1
    assert unavailable_reason(x, w, "silu") is None
    out = gate_up_swiglu(x, w, shift, scale, bias)
    ref = swiglu(torch.nn.functional.linear(x, w, shift), scale, bias, "silu")
    assert out.shape == (m, n_inter)
    assert rel_err(out, ref) <= 1e-2


def test_fused_swiglu_gemm_declines_what_it_cannot_take():
    from encoder_service.ops._swiglu_gemm import unavailable_reason

    x = torch.randn(8, 64, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(128, 64, device=DEVICE, dtype=torch.bfloat16)
    assert "gelu" in unavailable_reason(x, w, "gelu_pytorch_tanh")
    assert "dtype" in unavailable_reason(x.float(), w.float(), "silu")
    assert "intermediate" in unavailable_reason(x, w[:68], "silu")
    assert "not on CUDA" in unavailable_reason(x.cpu(), w.cpu(), "silu")


@pytest.mark.parametrize("name", ["sdpa", "varlen", "flashinfer", "flashinfer-fa3"])
def test_cuda_graph_replays_at_token_budgets_match_the_eager_forward(name, short_7b_state):
    if name not in ("sdpa", *cuda_backends()):
        pytest.skip(f"{name} does not run here")
    graph_replays_match_eager(lambda backend: short_7b(short_7b_state, backend), name, 1176)


