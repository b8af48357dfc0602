"""``encoder-service bench profile`` (encoder_service/benchmarks/op_profile.py): the op classes of a tower's
forward. The GPU run profiles kernels; here the parsing and the classes are checked on what the profiler
gives on the CPU for the tiny towers, and on kernel names as the GPU profiles of bench/RESULTS.md show them."""

from __future__ import annotations

import json

import pytest

from encoder_service.benchmarks import op_profile
from encoder_service.benchmarks.op_profile import OpTime, classify, summarize
from encoder_service.cli import main

# Kernel names as torch.profiler reports them on an H100 (cuBLAS/nvjet, cuDNN's attention, FlashAttention,
# torch.compile's Triton kernels, PyTorch's own), each with the class it belongs to.
KERNELS = {
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1": "gemm",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0": "attention",
    "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<80, 128, 64, 4, false, false, cutlass::bfloat16_t>>":
        "attention",
    "_window_attention_fwd_kernel": "attention",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3": "norm",
    "triton_poi_fused_add_cat_cos_mul_neg_sin_slice_2": "rotary",
    "triton_poi_fused_mul_silu_5": "activation",
    "triton_poi_fused_gelu_4": "activation",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>":
        "reorder",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2>>":
        "reorder",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "std::array<char*, 3ul>>": "elementwise",
    "void at::native::elementwise_kernel<128, 2, "
    "at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda>>": "copy",
    "Memcpy HtoD (Pageable -> Device)": "memcpy",
    # the fused gate/up GEMM with SwiGLU in its epilogue, and the FP8 path's kernels (H200 run)
    "_gate_up_swiglu": "gemm",
    "_gate_up_swiglu_fp8": "gemm",
    "_rms_quant": "norm",
    "nvjet_sm90_tst_320x128_64x3_1x2_h_badd_coopB_TNT": "gemm",
    "void cudnn::ops::nchwToNhwcKernel<float, float, float, false, true>": "other",
}


@pytest.mark.parametrize("name, cls", KERNELS.items())
def test_kernel_names_are_sorted_into_their_op_class(name, cls):
    assert classify(name) == cls


def test_compiled_graph_ranges_are_not_counted_as_kernels():
    # torch.compile's wrapper range carries its kernels' device time (63 ms of a 124 ms forward in
    # the first H200 profile): it must not count twice.
    assert op_profile.is_annotation("## Call CompiledFxGraph fgcubtiju6ssbqelq2h4uj7srtgz4fonc6tiex3eswn ##")
    assert not op_profile.is_annotation("triton_poi_fused_gelu_1")


def test_classes_sum_to_the_whole_and_flops_give_achieved_tflops():
    ops = [OpTime("nvjet_gemm", 600.0, 6), OpTime("aten::addmm", 0.0, 0, 6e9), OpTime("flash_fwd", 300.0, 3),
           OpTime("triton_poi_fused_add_1", 100.0, 12)]
    classes = {c.name: c for c in summarize(ops, ceiling_tflops=100.0, forwards=3)}
    assert set(classes) == {"gemm", "attention", "elementwise"}
    assert sum(c.share for c in classes.values()) == pytest.approx(1.0)
    assert classes["gemm"].us == pytest.approx(200.0) and classes["gemm"].count == 2
    # 6e9 FLOPs in 600 us: 10 TFLOP/s, a tenth of the ceiling; no FLOPs, no figure
    assert classes["gemm"].tflops == pytest.approx(10.0) and classes["gemm"].share_of_ceiling == pytest.approx(0.1)
    assert classes["attention"].tflops is None


@pytest.mark.parametrize("preset", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_a_tiny_towers_cpu_profile_has_its_matrix_products_attention_and_norms(preset, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["bench", "profile", "--presets", preset, "--device", "cpu", "--dtype", "float32", "--images", "2",
                 "--side", "112", "--iters", "1", "--out", str(out)]) == 0
    (tower,) = json.loads(out.read_text())["towers"]
    classes = {c["name"]: c for c in tower["classes"]}
    assert {"gemm", "attention", "norm", "activation"} <= set(classes), classes
    assert sum(c["share"] for c in classes.values()) == pytest.approx(1.0)
    assert classes["gemm"]["flops"] > 0 and classes["gemm"]["tflops"] > 0  # the profiler counted addmm's FLOPs
    assert f"=== {preset}: 2 x 112x112" in capsys.readouterr().out


def test_the_cases_are_the_throughput_cases():
    assert op_profile.CASES["qwen2.5-vl-7b"] == ("qwen2.5-vl-7b", 8, 1008)
    assert op_profile.CASES["qwen3-vl-8b"] == ("qwen3-vl-8b", 8, 1024)


def test_gemm_kernels_whose_flops_the_profiler_does_not_count_are_known():
    # The fused gate/up GEMM (Triton) and cuBLAS's FP8 kernels: the class's rate is then marked as low.
    uncounted = op_profile._UNCOUNTED
    assert uncounted.search("_gate_up_swiglu_fp8") and uncounted.search("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz")
    assert not uncounted.search("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopb_bias_tnn")
