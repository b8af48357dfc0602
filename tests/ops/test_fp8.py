"""``--quantization fp8`` on the CPU: the e4m3 arithmetic (ops/fp8.py) against its definition, each
Qwen family's FP8 tower against the float32 tower and transformers, what the option refuses, and a
real server process serving FP8 embeddings under their own cache namespace.

The CPU runs the same arithmetic as the GPU (``torch._scaled_mm`` has a CPU kernel); the GPU's own
kernels are checked against these providers in tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from encoder_client import EncoderClient
from PIL import Image

from encoder_service.errors import BackendUnavailable
from encoder_service.models import load_vision_model
from encoder_service.ops import fp8, torch_ops

E4M3_STEP = 2.0 ** -3  # e4m3 keeps 3 mantissa bits: a value rounds to within half a step of 1/8 of its octave


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_a_quantised_weight_dequantises_to_itself_within_e4m3_rounding():
    torch.manual_seed(0)
    w = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different sizes
    q, scale = fp8.quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (1, 48)
    back = q.float() * scale.t()
    # Per channel: every row uses e4m3's whole range, so its error is relative to the row itself.
    assert ((back - w).abs() <= w.abs() * E4M3_STEP / 2 + scale.t() * 2.0 ** -9 + 1e-12).all()
    assert (q.float().abs().amax(dim=1) == 448).all()


def test_a_zero_row_quantises_to_zero_rather_than_nan():
    w = torch.zeros(16, 32)
    w[3] = 1.0
    q, scale = fp8.quantize_weight(w)
    assert torch.isfinite(q.float()).all() and q.float()[0].abs().sum() == 0 and torch.isfinite(scale).all()


def test_fp8_linear_on_the_cpu_is_what_torchs_own_scaled_mm_computes():
    torch.manual_seed(1)
    x, w, b = torch.randn(40, 64), torch.randn(32, 64) / 8, torch.randn(32) / 10
    wq, ws = fp8.quantize_weight(w)
    xq, xs = fp8.quantize_rows(x)
    # torch's CPU kernel (per-row scales from torch 2.13, the pinned version) as the reference.
    want = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, bias=b, out_dtype=torch.float32)
    torch.testing.assert_close(fp8.fp8_linear(x, wq, ws, b), want, rtol=1e-5, atol=1e-5)
    # ... and about e4m3's precision away from the exact product, far from bf16's.
    assert 0.005 < rel_err(fp8.fp8_linear(x, wq, ws, b), torch.nn.functional.linear(x, w, b)) < 0.06


def test_rms_quant_is_the_rstd_scaled_residual_in_e4m3():
    torch.manual_seed(2)
    x, pending = torch.randn(50, 64) * 4, torch.randn(64) / 10
    q, scale = torch_ops.rms_quant(x, pending, 1e-6)
    true = x + pending
    rstd = torch.rsqrt(true.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (50, 1)
    assert rel_err(q.float() * scale, rstd * true) < E4M3_STEP / 2
    assert (q.float().abs().amax(dim=1) == 448).all()


@pytest.mark.parametrize("preset", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_an_fp8_tower_is_near_the_float32_tower_and_not_equal_to_it(preset):
    plain = load_vision_model(preset)
    quant = load_vision_model(preset, quantization="fp8")
    grids = [(1, 8, 12), (1, 4, 4), (2, 4, 4)]
    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.standard_normal((sum(t * h * w for t, h, w in grids), plain.spec.patch_dim),
                                                  dtype=np.float32))
    want, _ = plain.encode_packed(pixels, grids)
    got, _ = quant.encode_packed(pixels, grids)
    err = rel_err(got, want)
    # Measured 6.2% (Qwen2.5-VL) and 4.0% (Qwen3-VL) on these tiny towers; the full-size towers'
    # figures are in bench/RESULTS.md. Above 1e-3: the FP8 path ran, not the float32 one.
    assert 1e-3 < err < 0.12, err
    assert quant.quantization == "fp8" and plain.quantization is None


def test_fp8_embeddings_have_their_own_cache_namespace_and_unquantised_ones_keep_theirs():
    plain = load_vision_model("tiny-qwen2.5-vl")
    none = load_vision_model("tiny-qwen2.5-vl", quantization="none")
    quant = load_vision_model("tiny-qwen2.5-vl", quantization="fp8")
    assert plain.cache_namespace == none.cache_namespace != quant.cache_namespace


def test_fp8_asks_the_fused_operations_it_runs_for_and_the_cpu_gets_the_torch_ones():
    quant = load_vision_model("tiny-qwen2.5-vl", quantization="fp8")
    assert quant.ops.describe() == ("window_attention=torch,rms_scale=torch,gated_mlp=torch,rms_quant=torch,"
                                    "fp8_gated_mlp=torch")
    assert load_vision_model("tiny-qwen2.5-vl").ops.describe() == \
        "window_attention=torch,rms_scale=torch,gated_mlp=torch"
    assert load_vision_model("tiny-qwen3-vl", quantization="fp8").ops.describe() == "act_quant=torch"
    assert load_vision_model("tiny-qwen3-vl").ops.describe() == "none"


def test_ops_may_name_the_fp8_operations_with_fp8_and_not_without():
    quant = load_vision_model("tiny-qwen2.5-vl", ops="rms_quant=torch", quantization="fp8")
    assert "rms_quant=torch" in quant.ops.describe()
    assert load_vision_model("tiny-qwen3-vl", ops="act_quant=torch", quantization="fp8").ops.describe() == \
        "act_quant=torch"
    with pytest.raises(BackendUnavailable, match="names act_quant, which runs only with --quantization fp8"):
        load_vision_model("tiny-qwen3-vl", ops="act_quant=torch")
    with pytest.raises(BackendUnavailable, match="names rms_scale, but this model uses"):
        load_vision_model("tiny-qwen3-vl", ops="rms_scale=torch", quantization="fp8")


def test_quantising_after_the_cuda_graphs_are_set_is_refused():
    model = load_vision_model("tiny-qwen2.5-vl")
    model.graphs = object()  # what set_cuda_graphs leaves on a GPU (the CPU keeps None)
    with pytest.raises(BackendUnavailable, match="before its CUDA graphs"):
        model.quantize("fp8")


def test_a_family_without_an_fp8_path_and_an_unknown_method_are_refused_by_name():
    with pytest.raises(BackendUnavailable, match="not supported for kimi_k25"):
        load_vision_model("tiny-kimi-k2.5", quantization="fp8")
    with pytest.raises(BackendUnavailable, match="'int4': unknown; methods: none, fp8"):
        load_vision_model("tiny-qwen2.5-vl", quantization="int4")


def test_a_server_started_with_fp8_serves_quantised_embeddings_under_their_own_namespace(start_encoder_server):
    plain_server = start_encoder_server()
    fp8_server = start_encoder_server("--quantization", "fp8")
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (56, 84, 3), dtype=np.uint8)).save(buffer, "PNG")
    image = buffer.getvalue()
    with EncoderClient(plain_server.target, timeout_s=60) as plain, EncoderClient(fp8_server.target, timeout_s=60) as q:
        (want,), (got,) = plain.encode([image]), q.encode([image])
        assert q.model_info().cache_namespace != plain.model_info().cache_namespace
        assert (q.model_info().quantization, plain.model_info().quantization) == ("fp8", "none")
    assert got.embedding.shape == want.embedding.shape
    assert 1e-3 < rel_err(torch.from_numpy(got.embedding), torch.from_numpy(want.embedding)) < 0.12
    assert "quantization fp8" in fp8_server.log_text()
    plain_server.stop()
    fp8_server.stop()


def test_the_server_refuses_an_fp8_family_it_cannot_quantise_at_start_up(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "encoder_service", "serve", "--model", "tiny-kimi-k2.5",
                           "--quantization", "fp8", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--quantization fp8 is not supported for kimi_k25" in proc.stderr + proc.stdout
