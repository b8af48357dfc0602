"""``--quantization fp8`` on the GPU (pytest -m gpu): the Triton kernels of the FP8 path against their
torch providers, each family's FP8 tower against its unquantised one and against the same FP8
arithmetic on the CPU, and CUDA graph replays against the eager FP8 forward."""

import numpy as np
import pytest
import torch
from gpu_helpers import graph_replays_match_eager

from encoder_service.models import load_vision_model
from encoder_service.models.presets import PRESETS, Preset, random_vision_state
from encoder_service.models.qwen2_5_vl.loading import build
from encoder_service.models.qwen2_5_vl.model import Qwen2_5_VisionConfig
from encoder_service.ops import fp8, torch_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.allow_skip_on_cpu("needs a CUDA GPU")]

DEVICE = torch.device("cuda")
# Two FP8 forwards that differ only in bf16 rounding upstream, on a random-weight tower: e4m3's 3
# mantissa bits turn a tiny difference into a 6% step where a value sits on a rounding boundary.
FP8_TOLERANCE = 5e-2


def fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(DEVICE) >= (9, 0)


needs_hopper = pytest.mark.skipif(not fp8_gpu(), reason="the FP8 Triton kernels need a Hopper GPU")


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@needs_hopper
@pytest.mark.parametrize("tokens", [41472, 1000, 7])
def test_the_triton_rms_quant_writes_what_the_torch_provider_writes(tokens):
    from encoder_service.ops._rms_kernel import rms_quant

    x = (torch.randn(tokens, 1280, device=DEVICE) * 3).to(torch.bfloat16)
    pending = torch.randn(1280, device=DEVICE) * 0.1
    q, s = rms_quant(x, pending, 1e-6)
    q_ref, s_ref = torch_ops.rms_quant(x, pending, 1e-6)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=0)
    # The same e4m3 value, or its neighbour where float32 rounding put a value on the other side of a
    # rounding boundary.
    diff = (q.float() - q_ref.float()).abs()
    assert (diff <= q_ref.float().abs() * 0.13 + 1e-6).all()
    assert (diff == 0).float().mean() > 0.999


@needs_hopper
@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu", "silu"])
@pytest.mark.parametrize("shape", [(32768, 4304), (37, 1152), (5, 96)])
def test_the_triton_act_quant_writes_what_the_torch_provider_writes(act, shape):
    from encoder_service.ops._quant_kernel import act_quant

    y = (torch.randn(*shape, device=DEVICE) * 2).to(torch.bfloat16)
    q, s = act_quant(y, act)
    q_ref, s_ref = torch_ops.act_quant(y, act)
    # The activation's bf16 output may differ in its last bit (exp2-based tanh against torch's): the
    # scale by that much, and a value by its e4m3 neighbour.
    torch.testing.assert_close(s, s_ref, rtol=1e-2, atol=0)
    diff = (q.float() - q_ref.float()).abs()
    assert (diff <= q_ref.float().abs() * 0.13 + 2.0 ** -9).all()
    assert (diff == 0).float().mean() > 0.99


@needs_hopper
@pytest.mark.parametrize("m", [41472, 300, 5])
def test_the_fused_fp8_swiglu_gemm_equals_scaled_mm_then_swiglu(m):
    from encoder_service.ops._swiglu_gemm import gate_up_swiglu_fp8

    k, inter = 1280, 3456
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    w = (torch.randn(2 * inter, k, device=DEVICE) / k ** 0.5).to(torch.bfloat16)
    w[2 * 3420:] = 0  # padded rows, as the 7B tower's
    bias = (torch.randn(2 * inter, device=DEVICE) * 0.02).to(torch.bfloat16)
    bias[2 * 3420:] = 0
    xq, xs = fp8.quantize_rows(x)
    wq, ws = fp8.quantize_weight(w)
    out = gate_up_swiglu_fp8(xq, xs, wq, ws, bias)
    ref = torch_ops.swiglu_pairs(fp8.scaled_linear(xq, xs, wq, ws, bias, torch.bfloat16), "silu")
    # One bf16 rounding of the projection apart (the accumulation order differs).
    assert rel_err(out, ref) < 1e-2, rel_err(out, ref)
    assert out[:, 3420:].abs().max() == 0


def short_7b(backend="auto", quantization=None):
    vc = {**PRESETS["qwen2.5-vl-7b"].vision_config, "depth": 4, "fullatt_block_indexes": [1, 3]}
    preset = Preset("short-7b", "qwen2_5_vl", vc, PRESETS["qwen2.5-vl-7b"].preprocessor_config, 3584)
    cfg, weights = Qwen2_5_VisionConfig.from_dict(vc), random_vision_state(preset, seed=0)
    model = build(cfg, {k: v.to(torch.bfloat16) for k, v in weights.items()}, model_id="short-7b",
                  preprocess_config=None, device=DEVICE, dtype=torch.bfloat16, attn_backend=backend)
    model.quantize(quantization)
    return model


@needs_hopper
@pytest.mark.parametrize("preset", ["qwen2.5-vl-7b", "qwen3-vl-8b"])
def test_an_fp8_tower_stays_near_its_bf16_forward_and_uses_the_fp8_kernels(preset):
    bf16 = load_vision_model(preset, device="cuda", dtype=torch.bfloat16)
    quant = load_vision_model(preset, device="cuda", dtype=torch.bfloat16, quantization="fp8")
    if preset.startswith("qwen2.5"):
        assert "rms_quant=triton" in quant.ops.describe() and "fp8_gated_mlp=triton" in quant.ops.describe()
    else:
        assert quant.ops.describe() == "act_quant=triton"
    side = 28 * 32  # 64 x 64 patches at 14, 56 x 56 at 16
    cells = side // quant.spec.patch_size
    grids = [(1, cells, cells), (1, cells // 2, cells)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), quant.spec.patch_dim, device=DEVICE)
    a = bf16.encode_packed(pixels.bfloat16(), grids)[0]
    b = quant.encode_packed(pixels.bfloat16(), grids)[0]
    err = rel_err(b, a)
    print(f"{preset}: fp8 against bf16 {100 * err:.2f}%")
    assert 1e-3 < err < 0.25, err  # quantised (not the bf16 path), and not garbage


@needs_hopper
def test_the_fp8_kernels_compute_what_the_torch_providers_compute_in_the_whole_tower():
    triton = short_7b(quantization="fp8")
    plain = build_with_ops("torch")
    grids = [(1, 36, 36), (1, 10, 14)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 1176, device=DEVICE).bfloat16()
    err = rel_err(triton.encode_packed(pixels, grids)[0], plain.encode_packed(pixels, grids)[0])
    # Wider than bf16's 2e-2: a bf16 difference upstream (the window kernel against the backend) moves
    # a value across an e4m3 rounding boundary now and then, a 6% step in that value (2.6e-2 measured).
    assert err < FP8_TOLERANCE, err


def build_with_ops(ops):
    vc = {**PRESETS["qwen2.5-vl-7b"].vision_config, "depth": 4, "fullatt_block_indexes": [1, 3]}
    preset = Preset("short-7b", "qwen2_5_vl", vc, PRESETS["qwen2.5-vl-7b"].preprocessor_config, 3584)
    cfg, weights = Qwen2_5_VisionConfig.from_dict(vc), random_vision_state(preset, seed=0)
    model = build(cfg, {k: v.to(torch.bfloat16) for k, v in weights.items()}, model_id="short-7b",
                  preprocess_config=None, device=DEVICE, dtype=torch.bfloat16, attn_backend="auto", ops=ops)
    model.quantize("fp8")
    return model


@needs_hopper
def test_fp8_cuda_graph_replays_match_the_eager_fp8_forward():
    # The FP8 GEMM's kernel is cuBLAS's choice for the token count, which differs between a padded
    # budget and the eager batch (bf16 replays were bit-exact; FP8's measured 2.0e-2 apart).
    graph_replays_match_eager(lambda backend: short_7b(backend, "fp8"), "flashinfer", 1176, tolerance=FP8_TOLERANCE)


@needs_hopper
def test_the_gpu_fp8_tower_equals_the_cpu_fp8_arithmetic_within_bf16_rounding():
    cpu = load_vision_model("tiny-qwen3-vl", device="cpu", dtype=torch.bfloat16, quantization="fp8")
    gpu = load_vision_model("tiny-qwen3-vl", device="cuda", dtype=torch.bfloat16, quantization="fp8")
    grids = [(1, 8, 8), (1, 4, 6)]
    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.standard_normal((sum(t * h * w for t, h, w in grids), cpu.spec.patch_dim),
                                                  dtype=np.float32)).bfloat16()
    a = cpu.encode_packed(pixels, grids)[0]
    b = gpu.encode_packed(pixels.cuda(), grids)[0].cpu()
    assert rel_err(b, a) < 5e-2, rel_err(b, a)


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp8_on_a_gpu_other_than_in_bf16_is_refused_by_name(dtype):
    from encoder_service.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="needs --dtype bfloat16"):
        load_vision_model("tiny-qwen2.5-vl", device="cuda", dtype=dtype, quantization="fp8")
