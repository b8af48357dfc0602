"""FP8 (e4m3) linears for ``--quantization fp8``: weights quantised once at load time with one scale
per output channel, activations quantised per token as they are produced (dynamic scales, nothing
calibrated), the product in ``torch._scaled_mm`` (cuBLAS/CUTLASS FP8 on Hopper and Ada; a reference
kernel on the CPU, so the tests run the same arithmetic).

Why per token and per channel rather than one scale per tensor: a ViT's residual stream has a few
channels far larger than the rest, and one scale for the whole tensor spends e4m3's range on them.
At the towers' shapes both measured the same speed on an H200 (bench/fp8_gemm.py).

What a user gives up: e4m3 keeps 3 mantissa bits, so each quantised GEMM's output is about 3.6%
off the float32 product of the same inputs, where bf16's is 0.17% (bench/RESULTS.md gives the
whole tower's error and the LLM's logprob drift).
"""

from __future__ import annotations

import torch

from ..errors import BackendUnavailable

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# A row of zeros (padding rows of a weight, a zero token) gets this scale: its values quantise to 0.
_TINY = 1e-12


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [out, in] -> (e4m3 [out, in], float32 scales [1, out]): one scale per output channel."""
    if w.is_cuda and (w.shape[0] % 16 or w.shape[1] % 16):
        # cuBLAS's FP8 GEMMs take only 16-aligned sizes; every tower this serves has them.
        raise BackendUnavailable(f"--quantization fp8: a linear of {w.shape[1]} -> {w.shape[0]} features; FP8 "
                                 "GEMMs on CUDA need both to be multiples of 16")
    w32 = w.float()
    scale = w32.abs().amax(dim=1, keepdim=True).clamp(min=_TINY) / E4M3_MAX
    q = (w32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale.t().contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [tokens, in] -> (e4m3 rows, float32 scales [tokens, 1]): one scale per token."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY)
    return (x32 * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), amax / E4M3_MAX


def scaled_linear(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``(x_scale * w_scale) * (xq @ wq.T) + bias`` rounded to ``out_dtype``: x_scale [tokens, 1],
    w_scale [1, out], both float32; bias in ``out_dtype`` (the FP8 GEMM's epilogue adds it). On the CPU
    the dequantised operands' float32 product: torch's CPU ``_scaled_mm`` takes per-row scales only
    from 2.13 on (tests/ops/test_fp8.py holds the two equal there)."""
    if not xq.is_cuda:
        out = (xq.float() * x_scale) @ (wq.float() * w_scale.t()).t()
        return (out if bias is None else out + bias.float()).to(out_dtype)
    return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=True)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` with x quantised per token and w as ``quantize_weight`` made it. Inside a
    compiled graph the quantisation fuses into the op that produced x (a LayerNorm, an activation)."""
    xq, x_scale = quantize_rows(x)
    return scaled_linear(xq, x_scale, wq, w_scale, bias, x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor | tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor | None
           ) -> torch.Tensor:
    """``F.linear``, or ``fp8_linear`` where the weight is an FP8 pair ``(e4m3 weight, scales)``: a model
    hands its blocks one or the other and the same code runs both."""
    if isinstance(w, tuple):
        return fp8_linear(x, w[0], w[1], bias)
    return torch.nn.functional.linear(x, w, bias)
